"""`equarx-serve generate`: text generation from the command line.

    equarx-serve generate --prompt "The quick brown fox" [--prompt ...] [--prompt-file PATH]
                          [--chat] [--model gemma3-270m] [--tp 2] [--all-reduce equarx-int8]
                          [--max-tokens 64] [--temperature 0] [--top-k K] [--top-p 1]
                          [--seed 0] [--stop STR ...] [--json]
                          [--processes N | --coordinator HOST:PORT --num-processes N
                           --process-id I [--control-port PORT]]

The model is sharded over TP host CPU devices (XLA_FLAGS
--xla_force_host_platform_device_count=TP, set before JAX is imported) and the prompts run as
one `Generator.generate` call (batches of up to --max-batch, see `generation/generator.py`).
A first, short run of the same prompts compiles the programs (its time is reported as
warm-up; --no-warmup skips it, and the timings then include compilation). One prompt streams
its text as it is generated; several print at the end. Then: prefill ms, time to first token,
decode tokens/s, and which all-reduce each phase used (equarx-int8's size gate sends small
messages, and every decode step's, to psum). --json prints one JSON object instead.

--prompt-file: one prompt a line, or JSON lines {"prompt": "..."}; blank lines are skipped.
--chat wraps each prompt as a user turn of the Gemma 3 chat template. Random-init models
("tiny") have no tokenizer: a byte-level one of their vocabulary size is used.

Across processes, as `serve` (`equarx_serve/cli/processes.py`): `--processes N` runs N local
processes joined by gloo (TP / N devices each), or one command per host with its own
`--process-id`; process 0 decides every step and prints, the others run the same steps.

This module imports JAX only when the command runs, so `--help` is fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from equarx_serve.arguments import UsageError, argument_type, int_at_least
from equarx_serve.cli import processes
from equarx_serve.generation.model_args import (
    add_model_arguments,
    add_overlap_argument,
    check_model_arguments,
    engine_from_args,
)

if TYPE_CHECKING:
    from equarx_serve.generation.batching import AllReduceUsage
    from equarx_serve.generation.events import Completion
    from equarx_serve.generation.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 64
DEFAULT_MAX_LENGTH = 4096  # prompt + completion tokens; the engine's last length bucket


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"invalid number {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `generate`."""
    inputs = parser.add_argument_group("prompts")
    inputs.add_argument(
        "--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)"
    )
    inputs.add_argument(
        "--prompt-file",
        type=Path,
        metavar="PATH",
        help='one prompt a line, or JSON lines {"prompt": ...}',
    )
    inputs.add_argument(
        "--chat", action="store_true", help="wrap each prompt in the Gemma 3 chat template"
    )
    model = parser.add_argument_group("model")
    add_model_arguments(model)
    add_overlap_argument(model)
    model.add_argument(
        "--max-length",
        type=argument_type(int_at_least(16)),
        default=DEFAULT_MAX_LENGTH,
        metavar="N",
        help="longest prompt + completion (default: %(default)s)",
    )
    model.add_argument(
        "--max-batch",
        type=argument_type(int_at_least(1)),
        default=8,
        metavar="B",
        help="prompts decoded together (default: %(default)s)",
    )
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument(
        "--max-tokens",
        type=argument_type(int_at_least(1)),
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help="default: %(default)s",
    )
    sampling.add_argument(
        "--temperature",
        type=argument_type(_float),
        default=0.0,
        metavar="T",
        help="0 (default) is greedy",
    )
    sampling.add_argument("--top-k", type=argument_type(int_at_least(1)), metavar="K")
    sampling.add_argument("--top-p", type=argument_type(_float), default=1.0, metavar="P")
    sampling.add_argument("--seed", type=int, default=0, metavar="S")
    sampling.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STR",
        help="stop before this text (repeatable)",
    )
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print one JSON object")
    output.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the compiling run (timings include compiling)",
    )
    processes.add_process_arguments(parser)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of --prompt and --prompt-file, in that order; UsageError if none or empty."""
    prompts = list(args.prompt)
    if args.prompt_file is not None:
        try:
            lines = args.prompt_file.read_text().splitlines()
        except OSError as e:
            raise UsageError(f"--prompt-file: {e.strerror}: {args.prompt_file}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    record = json.loads(line)
                    prompts.append(record["prompt"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise UsageError(
                        f'--prompt-file line {n}: a JSON line must be {{"prompt": "..."}}'
                    ) from None
            else:
                prompts.append(line)
    if not prompts:
        raise UsageError("give at least one --prompt or a --prompt-file")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise UsageError(f"prompt {i} is empty")
    return prompts


def _usage_line(usage: AllReduceUsage) -> str:
    gate = usage.min_size_bytes
    parts = [f"all-reduce {usage.all_reduce}" + ("" if gate is None else f" (gate {gate} B)")]
    for phase, traffic in (("prefill", usage.prefill), ("decode", usage.decode)):
        shape = "x".join(map(str, traffic.shape))
        parts.append(f"{phase} [{shape}] {traffic.message_bytes} B -> {traffic.uses}")
    return "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    """Loads the model, generates, prints; 0 on success."""
    jax_fresh = "jax" not in sys.modules  # this command sets up its devices (not under tests)
    prompts = read_prompts(args)
    check_model_arguments(args)
    cluster = processes.cluster_from_args(args)
    params = _sampling_params(args)
    if cluster.launch:
        return processes.launch_local("generate", cluster.launch, args)
    if jax_fresh or cluster.member:
        processes.set_up_devices(cluster, args.tp)
    started = time.perf_counter()
    engine = engine_from_args(args, max_length=args.max_length)
    load_s = time.perf_counter() - started
    if not cluster.leader:
        return processes.run_follower(cluster, engine)
    leader = processes.start_leader(cluster)
    try:
        return _generate(args, prompts, params, engine, leader, load_s)
    finally:
        if leader is not None:
            leader.stop()


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from equarx_serve.generation.sampling import SamplingParams

    try:
        return SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=tuple(args.stop),
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


def _generate(
    args: argparse.Namespace,
    prompts: list[str],
    params: SamplingParams,
    engine: Any,
    leader: Any,
    load_s: float,
) -> int:
    """Process 0 (or the only one): generate and print."""
    from equarx_serve.generation.generator import Generator, chat_prompt
    from equarx_serve.generation.replicated import ReplicatedRunner
    from equarx_serve.generation.runner import DeviceRunner

    runner = DeviceRunner(engine)
    generator = Generator(
        engine,
        max_batch=args.max_batch,
        runner=runner if leader is None else ReplicatedRunner(runner, leader),
    )
    texts = [chat_prompt([{"role": "user", "content": p}]) if args.chat else p for p in prompts]
    token_lists = [generator.tokenizer.encode(t) for t in texts]
    for i, tokens in enumerate(token_lists):
        try:
            generator.check(tokens, params)
        except ValueError as e:
            raise UsageError(f"prompt {i}: {e}") from None

    warmup_s = 0.0 if args.no_warmup else generator.warm_up(token_lists, params)

    stream = len(prompts) == 1 and not args.json

    def on_token(i: int, token: int, delta: str) -> None:
        if delta:
            print(delta, end="", flush=True)

    started = time.perf_counter()
    completions = generator.generate(token_lists, params, on_token=on_token if stream else None)
    total_s = time.perf_counter() - started
    usage = generator.all_reduce_usage(
        min(len(token_lists), args.max_batch), max(len(t) for t in token_lists)
    )
    timings = {"load_s": load_s, "warmup_s": warmup_s, "total_s": total_s}
    if args.json:
        print(
            json.dumps(
                _record(args, engine, prompts, params, completions, usage, timings), indent=1
            )
        )
        return 0
    if stream:
        print()
    else:
        for i, (prompt, c) in enumerate(zip(prompts, completions, strict=True)):
            print(f"=== {i}: {prompt}\n{c.text}\n")
    print(
        f"-- {args.model}, TP={args.tp} over {jax_processes()} process(es), {engine.dtype}; "
        f"load {load_s:.1f} s, warm-up (compile) {warmup_s:.1f} s, generate {total_s:.2f} s"
    )
    for i, c in enumerate(completions):
        print(
            f"[{i}] {len(c.prompt_tokens)} prompt + {len(c.tokens)} tokens ({c.finish_reason}): "
            f"prefill {c.prefill_ms:.1f} ms, time to first token "
            f"{c.time_to_first_token_ms:.1f} ms, decode {c.decode_tokens_per_s:.1f} tokens/s"
        )
    print(f"-- {_usage_line(usage)}")
    return 0


def jax_processes() -> int:
    import jax

    return jax.process_count()


def _record(
    args: argparse.Namespace,
    engine: Any,
    prompts: list[str],
    params: SamplingParams,
    completions: list[Completion],
    usage: AllReduceUsage,
    timings: dict[str, float],
) -> dict[str, Any]:
    """The --json output."""
    return {
        "model": args.model,
        "model_info": engine.info,
        "dtype": str(engine.dtype),
        "tp": args.tp,
        "processes": jax_processes(),
        "all_reduce": args.all_reduce.label,
        "all_reduce_usage": usage.as_dict(),
        "sampling": {
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_k": params.top_k,
            "top_p": params.top_p,
            "seed": params.seed,
            "stop": list(params.stop),
        },
        "chat": args.chat,
        "max_batch": args.max_batch,
        **timings,
        "completions": [
            {
                "prompt": prompt,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "prompt_tokens": len(c.prompt_tokens),
                "completion_tokens": len(c.tokens),
                "tokens": c.tokens,
                "prefill_ms": c.prefill_ms,
                "time_to_first_token_ms": c.time_to_first_token_ms,
                "decode_ms": c.decode_ms,
                "decode_tokens_per_s": c.decode_tokens_per_s,
            }
            for prompt, c in zip(prompts, completions, strict=True)
        ],
    }
