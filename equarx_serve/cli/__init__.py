"""The `equarx-serve` command line.

    equarx-serve bench allreduce [--devices N ... | --processes N ...] [--sizes ...]
                                 [--methods ...] [--repeats R] [--json PATH] [--plot PATH]
    equarx-serve bench prefill [--model NAME] [--tp N | --processes N] [--batch B]
                               [--seq-lens ...] [--methods ...] [--repeats R]
                               [--checkpoint PATH --tokenizer PATH] [--json PATH] [--plot PATH]
    equarx-serve bench compare [--seq-lens ...] [--batches ...] [--max-tokens N] [--repeats R]
                               [--threads N] [--model NAME] [--tp N] [--all-reduce METHOD]
                               [--dtype D] [--json PATH]
    equarx-serve demo [--out-dir DIR]
    equarx-serve generate --prompt TEXT [--prompt-file PATH] [--chat] [--model NAME] [--tp N]
                          [--all-reduce METHOD] [--max-tokens N] [--temperature T] [--top-k K]
                          [--top-p P] [--seed S] [--stop STR] [--json]
    equarx-serve eval [--model NAME] [--tp N] [--methods ...] [--text PATH] [--seq-len L]
                      [--num-seqs K] [--json PATH] [--report PATH] [--check THRESHOLDS]
    equarx-serve report [RESULTS] [--update FILE ... | --check FILE ...]
    equarx-serve serve [--host H] [--port P] [--model NAME] [--tp N] [--all-reduce METHOD]
                       [--max-batch B] [--max-queue Q] [--max-prompt-tokens N]

Commands import JAX only when they run, so `equarx-serve --help` starts fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from equarx_serve.arguments import UsageError
from equarx_serve.bench import allreduce, compare, prefill, report
from equarx_serve.cli import demo, generate, serve
from eval import command as eval_command


def _bench_allreduce(args: argparse.Namespace) -> int:
    return allreduce.run(allreduce.config_from_args(args))


def _bench_prefill(args: argparse.Namespace) -> int:
    return prefill.run(prefill.config_from_args(args))


def _bench_compare(args: argparse.Namespace) -> int:
    return compare.run(compare.config_from_args(args))


def _demo(args: argparse.Namespace) -> int:
    return demo.run(args.out_dir)


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", type=Path, default=demo.DEMO_DIR, help="default: %(default)s")


def _add_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    help: str,
    module: ModuleType,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    handler: Callable[[argparse.Namespace], int],
) -> None:
    """A (sub)command described by `module`'s docstring, with its flags and handler."""
    command = subparsers.add_parser(
        name,
        help=help,
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(command)
    command.set_defaults(handler=handler, command_parser=command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="equarx-serve",
        description="Tensor-parallel Gemma 3 prefill on a pluggable, int8-quantized (EQuARX) "
        "all-reduce in JAX.",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    bench = commands.add_parser("bench", help="benchmarks")
    benchmarks = bench.add_subparsers(title="benchmarks", metavar="BENCHMARK")
    bench.set_defaults(handler=None, command_parser=bench)
    _add_command(
        benchmarks, "allreduce", "all-reduce methods side by side: time, wire bytes, error",
        allreduce, allreduce.add_arguments, _bench_allreduce,
    )  # fmt: skip
    _add_command(
        benchmarks, "prefill", "tensor-parallel Gemma 3 prefill latency per all-reduce method",
        prefill, prefill.add_arguments, _bench_prefill,
    )  # fmt: skip
    _add_command(
        benchmarks, "compare", "this project beside llama.cpp on the same GGUF: prefill and "
        "decode, with this machine's limits", compare, compare.add_arguments, _bench_compare,
    )  # fmt: skip
    _add_command(
        commands, "demo", "the main job: 270M at TP=2 served with psum and equarx-int8 side by "
        "side, a short quality eval, the all-reduce benchmark", demo, _demo_arguments, _demo,
    )  # fmt: skip
    _add_command(
        commands, "eval", "quality of each all-reduce against BF16 psum (perplexity, KL, top-1, "
        "per-layer error), with a regression gate", eval_command, eval_command.add_arguments,
        eval_command.run,
    )  # fmt: skip
    _add_command(
        commands, "generate", "generate text (streamed) with the tensor-parallel model, with "
        "timings", generate, generate.add_arguments, generate.run,
    )  # fmt: skip
    _add_command(
        commands, "report", "the docs' tables from a folder of results JSON; --update or "
        "--check the generated blocks in Markdown files", report, report.add_arguments, report.run,
    )  # fmt: skip
    _add_command(
        commands, "serve", "OpenAI-compatible HTTP server (completions, chat, streaming, "
        "/metrics)", serve, serve.add_arguments, serve.run,
    )  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        # No command (or `bench` without a benchmark): help for the deepest parser reached.
        getattr(args, "command_parser", parser).print_help()
        return 0
    try:
        return args.handler(args)
    except UsageError as e:
        args.command_parser.error(str(e))  # exits with code 2


if __name__ == "__main__":
    sys.exit(main())
