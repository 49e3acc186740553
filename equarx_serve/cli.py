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
    equarx-serve serve [--host H] [--port P] [--model NAME] [--tp N] [--all-reduce METHOD]
                       [--max-batch B] [--max-queue Q] [--max-prompt-tokens N]

Commands import JAX only when they run, so `equarx-serve --help` starts fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from equarx_serve import demo, generate_command, serve_command
from equarx_serve.bench import allreduce, compare, prefill
from eval import command as eval_command


def _bench_allreduce(args: argparse.Namespace) -> int:
    return allreduce.run(allreduce.config_from_args(args))


def _bench_prefill(args: argparse.Namespace) -> int:
    return prefill.run(prefill.config_from_args(args))


def _bench_compare(args: argparse.Namespace) -> int:
    return compare.run(compare.config_from_args(args))


def _demo(args: argparse.Namespace) -> int:
    return demo.run(args.out_dir)


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
    bench_allreduce = benchmarks.add_parser(
        "allreduce",
        help="all-reduce methods side by side: time, wire bytes, error",
        description=allreduce.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    allreduce.add_arguments(bench_allreduce)
    bench_allreduce.set_defaults(handler=_bench_allreduce, command_parser=bench_allreduce)
    bench_prefill = benchmarks.add_parser(
        "prefill",
        help="tensor-parallel Gemma 3 prefill latency per all-reduce method",
        description=prefill.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prefill.add_arguments(bench_prefill)
    bench_prefill.set_defaults(handler=_bench_prefill, command_parser=bench_prefill)
    bench_compare = benchmarks.add_parser(
        "compare",
        help="this project beside llama.cpp on the same GGUF: prefill and decode, with this "
        "machine's limits",
        description=compare.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.add_arguments(bench_compare)
    bench_compare.set_defaults(handler=_bench_compare, command_parser=bench_compare)

    demo_parser = commands.add_parser(
        "demo",
        help="the main job: 270M at TP=2 served with psum and equarx-int8 side by side, a "
        "short quality eval, the all-reduce benchmark",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo_parser.add_argument(
        "--out-dir", type=Path, default=demo.DEMO_DIR, help="default: %(default)s"
    )
    demo_parser.set_defaults(handler=_demo, command_parser=demo_parser)

    evaluate = commands.add_parser(
        "eval",
        help="quality of each all-reduce against BF16 psum (perplexity, KL, top-1, per-layer "
        "error), with a regression gate",
        description=eval_command.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    eval_command.add_arguments(evaluate)
    evaluate.set_defaults(handler=eval_command.run, command_parser=evaluate)

    generate = commands.add_parser(
        "generate",
        help="generate text (streamed) with the tensor-parallel model, with timings",
        description=generate_command.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    generate_command.add_arguments(generate)
    generate.set_defaults(handler=generate_command.run, command_parser=generate)

    serve = commands.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
        description=serve_command.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve_command.add_arguments(serve)
    serve.set_defaults(handler=serve_command.run, command_parser=serve)
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
    except allreduce.UsageError as e:
        args.command_parser.error(str(e))  # exits with code 2


if __name__ == "__main__":
    sys.exit(main())
