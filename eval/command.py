"""`equarx-serve eval`: quality of every all-reduce against BF16 `psum`, and a regression gate.

    equarx-serve eval [--model gemma3-270m] [--tp 2] [--methods ...]
                      [--corpus python-reference | --text PATH]
                      [--seq-len 512] [--num-seqs 16] [--batch-size B]
                      [--greedy-prompts 32] [--greedy-tokens 32]
                      [--json PATH] [--report PATH] [--plot PATH] [--check THRESHOLDS]

Runs in one process on TP host CPU devices. The reference (`psum`, BF16 model) and the
compute floor (the same model in float32, `psum`) always run; `--methods` adds to them
(default: equarx-int8; each NAME or NAME:key=value,...). Quantized methods run
with their size gate off (min_size_bytes=0) unless the spec sets it. Prints the table;
--json, --report (Markdown) and --plot (PNG, per-layer all-reduce error) write the rest
(default: all three under eval-results/). --check FILE also evaluates the methods the file
names and exits 1 when a limit fails (see eval/gate.py; eval/thresholds.toml is the repo's
gate for the default run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from equarx_serve.arguments import UsageError, argument_type, int_at_least
from equarx_serve.collectives.registry import parse_method
from equarx_serve.generation.model_args import (
    add_model_arguments,
    check_model_arguments,
    resolved_weights,
)
from eval import harness
from eval.corpus import CORPORA, DEFAULT_CORPUS
from models.config import DEFAULT_MAX_LENGTH, has_gguf_blocks

OUT_DIR = Path("eval-results")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `eval`."""
    # bf16 by default: "gguf" adds the decode steps' scoring (`eval.decode_weights`)
    add_model_arguments(
        parser.add_argument_group("model"), all_reduce=False, dtype=False, weights="bf16"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        type=argument_type(parse_method),
        default=[parse_method(m) for m in harness.DEFAULT_METHODS],
        metavar="METHOD",
        help="all-reduces, NAME or NAME:key=value,... (default: "
        f"{' '.join(harness.DEFAULT_METHODS)}; the psum reference and the float32 compute "
        "floor always run)",
    )
    _add_data_arguments(parser.add_argument_group("data"))
    _add_output_arguments(parser.add_argument_group("output"))


def _add_data_arguments(data: argparse._ArgumentGroup) -> None:
    """What is scored: the text, the windows, and the greedy-agreement prompts."""
    text = data.add_mutually_exclusive_group()
    text.add_argument(
        "--corpus",
        choices=CORPORA,
        default=DEFAULT_CORPUS,
        help="a built-in corpus: CPython's reference topics (English technical prose) or its "
        "standard library's source code (default: %(default)s; see eval/corpus.py)",
    )
    text.add_argument(
        "--text",
        type=Path,
        metavar="PATH",
        help='your own text: a text file, a JSON-lines file ({"text": ...} a line) or a '
        "folder of them",
    )
    data.add_argument(
        "--seq-len",
        type=argument_type(int_at_least(2)),
        default=harness.DEFAULT_SEQ_LEN,
        metavar="L",
        help="tokens per window, BOS included (default: %(default)s)",
    )
    data.add_argument(
        "--num-seqs",
        type=argument_type(int_at_least(1)),
        default=harness.DEFAULT_NUM_SEQS,
        metavar="K",
        help="windows scored (default: %(default)s)",
    )
    data.add_argument(
        "--batch-size",
        type=argument_type(int_at_least(1)),
        metavar="B",
        help="windows per forward pass (default: 2 at TP <= 2, else 1: the logits are "
        "replicated on every device)",
    )
    data.add_argument(
        "--greedy-prompts",
        type=argument_type(int_at_least(0)),
        default=harness.DEFAULT_GREEDY_PROMPTS,
        metavar="N",
        help="prompts for greedy agreement, 0 to skip (default: %(default)s)",
    )
    data.add_argument(
        "--greedy-tokens",
        type=argument_type(int_at_least(1)),
        default=harness.DEFAULT_GREEDY_TOKENS,
        metavar="N",
        help="tokens generated per prompt (default: %(default)s)",
    )


def _add_output_arguments(output: argparse._ArgumentGroup) -> None:
    """Where the results go, and the limits they are checked against."""
    output.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        help=f"every number and the settings (default: {OUT_DIR}/eval.json)",
    )
    output.add_argument(
        "--report", type=Path, metavar="PATH", help=f"Markdown report (default: {OUT_DIR}/eval.md)"
    )
    output.add_argument(
        "--plot",
        type=Path,
        metavar="PATH",
        help=f"per-layer error plot, PNG (default: {OUT_DIR}/eval.png)",
    )
    output.add_argument(
        "--check",
        type=Path,
        metavar="THRESHOLDS",
        help="limits (TOML) to check; exit 1 if one fails",
    )


def config_from_args(args: argparse.Namespace, extra_methods: list[str]) -> harness.EvalConfig:
    check_model_arguments(args)
    if args.seq_len > DEFAULT_MAX_LENGTH:
        raise UsageError(
            f"--seq-len {args.seq_len} is longer than Gemma 3's context of {DEFAULT_MAX_LENGTH}"
        )
    if args.text is not None and not args.text.exists():
        raise UsageError(f"--text: no such file or folder: {args.text}")
    if resolved_weights(args) == "gguf" and not has_gguf_blocks(args.model, args.checkpoint):
        raise UsageError("--weights gguf scores the packaged gemma3-270m GGUF's blocks only")
    labels = [m.label for m in args.methods]
    if duplicates := sorted({label for label in labels if labels.count(label) > 1}):
        raise UsageError(f"method(s) given more than once: {', '.join(duplicates)}")
    methods = list(args.methods)
    methods += [parse_method(m) for m in extra_methods if m not in labels]
    return harness.EvalConfig(
        model=args.model,
        tp=args.tp,
        methods=tuple(methods),
        corpus=args.corpus,
        text=args.text,
        seq_len=args.seq_len,
        num_seqs=args.num_seqs,
        batch_size=args.batch_size,
        weights=resolved_weights(args),
        greedy_prompts=args.greedy_prompts,
        greedy_tokens=args.greedy_tokens,
        greedy_prompt_len=min(harness.DEFAULT_GREEDY_PROMPT_LEN, args.seq_len),
        checkpoint=args.checkpoint,
        tokenizer=args.tokenizer,
    )


def run(args: argparse.Namespace) -> int:
    """0 when the run (and --check, if given) passes, 1 when a limit fails."""
    from eval import gate

    limits = None
    if args.check is not None:
        try:
            limits = gate.load_thresholds(args.check)
        except ValueError as e:
            raise UsageError(f"--check: {e}") from None
    config = config_from_args(args, gate.methods_named(limits) if limits else [])

    from equarx_serve.distributed.devices import set_host_device_count

    set_host_device_count(config.tp)
    from tqdm import tqdm

    from equarx_serve.bench.allreduce import resolve_methods
    from eval import report as report_lib

    resolve_methods(config.all_methods())  # UsageError for unknown names or options
    with tqdm(unit="seq", desc="eval", file=sys.stderr) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done)

        try:
            report = harness.run_eval(config, progress=progress, log=bar.write)
        except ValueError as e:
            raise UsageError(str(e)) from None
    print(report_lib.format_table(report))
    json_path = args.json or OUT_DIR / "eval.json"
    plot_path = args.plot or OUT_DIR / "eval.png"
    markdown_path = args.report or OUT_DIR / "eval.md"
    report_lib.write_json(report, json_path)
    report_lib.write_plot(report, plot_path)
    report_lib.write_markdown(report, markdown_path, plot_path)
    print(f"wrote {json_path}, {markdown_path}, {plot_path}")
    if limits is None:
        return 0
    checks = gate.check(report, limits)
    print(f"\nchecks from {args.check}:")
    for c in checks:
        print(c.describe())
    failed = [c for c in checks if not c.passed]
    print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0
