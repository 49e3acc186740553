"""The model flags `generate`, `serve` and `eval` share, and the engine they describe.

No JAX at import: the commands stay fast to start and set the host device count first.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from equarx_serve.arguments import UsageError, argument_type, chunks_or_auto, int_at_least
from equarx_serve.collectives.registry import parse_method
from models.config import has_gguf_blocks

DEFAULT_MODEL = "gemma3-270m"
DEFAULT_ALL_REDUCE = "equarx-int8"
DEFAULT_TP = 2
DTYPES = ("bfloat16", "float32")
WEIGHTS = ("bf16", "gguf")  # generation.prefill.WEIGHTS but AUTO (no JAX at import)
# "auto": the GGUF's blocks for decode steps of one row where the weights come from one (the
# packaged 270M), else bf16 (generation.prefill.AUTO_GGUF_DECODE_MAX_ROWS).
# Measured on the 270M, TP = 2 (docs/benchmarks.md): faster decode at batch 1, closer to the
# exact checkpoint than the bf16 decode, and a served single stream at `generate`'s rate.
AUTO = "auto"
DEFAULT_WEIGHTS = AUTO


def add_model_arguments(
    group: argparse._ActionsContainer,
    *,
    all_reduce: bool = True,
    dtype: bool = True,
    weights: str = DEFAULT_WEIGHTS,
) -> None:
    """--model, --tp, --weights (default `weights`), --checkpoint/--tokenizer, and unless
    turned off --all-reduce, --dtype."""
    group.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="config name (default: %(default)s, real weights; other names are random-init)",
    )
    group.add_argument(
        "--tp",
        type=argument_type(int_at_least(1)),
        default=DEFAULT_TP,
        metavar="N",
        help="tensor-parallel degree: N host CPU devices (default: %(default)s)",
    )
    if all_reduce:
        group.add_argument(
            "--all-reduce",
            type=argument_type(parse_method),
            default=DEFAULT_ALL_REDUCE,
            metavar="METHOD",
            help="NAME or NAME:key=value,... (default: %(default)s; see bench allreduce)",
        )
    group.add_argument(
        "--weights",
        choices=(AUTO, *WEIGHTS),
        default=weights,
        help="decode steps on the checkpoint widened to bf16, or on the GGUF file's own "
        "quantized blocks (int8 form; the real 270M only); auto: the blocks for steps of one "
        "row where the weights come from the GGUF, bf16 for larger steps and elsewhere "
        "(default: %(default)s)",
    )
    group.add_argument("--checkpoint", type=Path, metavar="PATH", help="orbax checkpoint folder")
    group.add_argument("--tokenizer", type=Path, metavar="PATH", help="its tokenizer.model")
    if dtype:
        group.add_argument(
            "--dtype",
            choices=DTYPES,
            default="bfloat16",
            help="parameter dtype (default: %(default)s)",
        )


def add_overlap_argument(group: argparse._ActionsContainer) -> None:
    """--overlap-chunks of the engine `engine_from_args` builds."""
    group.add_argument(
        "--overlap-chunks",
        type=argument_type(chunks_or_auto),
        default="auto",
        metavar="K",
        help="run a prefill's layers on K token chunks, so that one chunk's all-reduces travel "
        "while the next one computes; auto (default): chunks where they were measured to pay "
        "(collectives.overlap.auto_chunks: 2 CPU processes, a slow link, a long prompt), else 1",
    )


def check_model_arguments(args: argparse.Namespace) -> None:
    """UsageError for model flags that cannot go together (before anything loads)."""
    if (args.checkpoint is None) != (args.tokenizer is None):
        raise UsageError("--checkpoint and --tokenizer go together")


def resolved_weights(args: argparse.Namespace) -> str:
    """--weights with "auto" resolved: "gguf" for the packaged 270M, else "bf16"."""
    if args.weights != AUTO:
        return args.weights
    return "gguf" if has_gguf_blocks(args.model, args.checkpoint) else "bf16"


def engine_from_args(args: argparse.Namespace, *, max_length: int) -> Any:
    """The `PrefillEngine` the flags of `add_model_arguments` and `add_overlap_argument`
    describe (imports JAX: set the host device count first); UsageError for an unknown
    all-reduce, a model that cannot be split TP ways, too few devices or unreadable weights."""
    import jax.numpy as jnp

    from equarx_serve.collectives import get_all_reduce
    from equarx_serve.generation.prefill import PrefillEngine

    spec = args.all_reduce
    try:
        all_reduce = get_all_reduce(spec.name, **spec.options)
    except ValueError as e:
        raise UsageError(f"method {spec.label!r}: {e}") from None
    try:
        return PrefillEngine.from_name(
            args.model,
            args.tp,
            all_reduce,
            checkpoint=args.checkpoint,
            tokenizer=args.tokenizer,
            max_length=max_length,
            dtype=jnp.dtype(args.dtype),
            weights=args.weights,
            overlap_chunks=args.overlap_chunks,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
