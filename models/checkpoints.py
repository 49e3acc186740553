"""Gemma 3 weights from an official (orbax) Gemma checkpoint, with its SentencePiece tokenizer.

For the checkpoints a user downloads (e.g. `gemma3-1b-it/` with `tokenizer.model` beside it):

    params = load_orbax_params("/ckpts/gemma3-1b-it", expected=expected_shapes)
    tokenizer = load_tokenizer("/ckpts/tokenizer.model")

Restoring goes through the `gemma` library's `gm.ckpts.load_params`, which understands every
layout Google released (nested, flat, stacked, Kauldron) and returns the tree of
`gm.nn.Gemma3_*().init(...)["params"]`. `gemma` is imported only when a checkpoint is loaded
(it pulls in TensorFlow).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from models.tokenizer import Tokenizer

__all__ = ["check_param_shapes", "load_checkpoint", "load_orbax_params", "load_tokenizer"]


def _shape_of(leaf: Any) -> tuple[int, ...]:
    shape = getattr(leaf, "shape", leaf)
    return tuple(int(d) for d in shape)


def _is_shape_leaf(x: Any) -> bool:
    return hasattr(x, "shape") or (isinstance(x, tuple) and all(isinstance(d, int) for d in x))


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(tree, dict) or (hasattr(tree, "items") and not _is_shape_leaf(tree)):
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}/"))
    else:
        out[prefix.rstrip("/")] = tree
    return out


def check_param_shapes(params: Any, expected: Any, *, source: str = "params") -> None:
    """Raise ValueError unless `params` has exactly the keys and shapes of `expected`.

    `expected` is a nested dict whose leaves are shape tuples or anything with `.shape`
    (arrays, `jax.ShapeDtypeStruct`, e.g. `jax.eval_shape(model.init, ...)["params"]`).
    """
    got = {k: _shape_of(v) for k, v in _flatten(params).items()}
    want = {k: _shape_of(v) for k, v in _flatten(expected).items()}
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    wrong = [f"{k}: {got[k]} (expected {want[k]})" for k in sorted(want) if k in got
             and got[k] != want[k]]  # fmt: skip
    if missing or extra or wrong:
        parts = []
        for label, items in (("missing", missing), ("unexpected", extra), ("wrong shape", wrong)):
            if items:
                more = f" ... ({len(items)} in all)" if len(items) > 6 else ""
                parts.append(f"{label}: {', '.join(items[:6])}{more}")
        raise ValueError(
            f"{source}: parameters do not match the expected model: " + "; ".join(parts)
        )


def load_orbax_params(
    path: str | os.PathLike[str],
    *,
    expected: Any | None = None,
    text_only: bool = True,
    to_numpy: bool = False,
) -> dict[str, Any]:
    """Restore the parameter tree of a Gemma (orbax) checkpoint folder.

    Args:
      path: The checkpoint folder (the one holding `_METADATA` / `_CHECKPOINT_METADATA`).
      expected: Optional tree of shapes the params must match exactly (see
        `check_param_shapes`); e.g. `models.gguf.expected_param_shapes()` or
        `jax.eval_shape(lambda: gm.nn.Gemma3_1B().init(...))["params"]`.
      text_only: Drop the vision encoder of multimodal checkpoints (Gemma 3 4B and up).
      to_numpy: Return numpy arrays rather than the restored `jax.Array`s.

    Raises:
      FileNotFoundError: `path` does not exist.
      ValueError: `path` is not a readable checkpoint, or its params do not match `expected`.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if not path.is_dir():
        raise ValueError(f"{path}: an orbax checkpoint is a folder, this is a file")
    from gemma import gm  # heavy (TensorFlow): only when a checkpoint is loaded

    try:
        params = gm.ckpts.load_params(path, text_only=text_only)
    except Exception as e:  # orbax raises many types for a missing/bad checkpoint
        raise ValueError(f"{path}: cannot restore a Gemma checkpoint: {e}") from e
    if expected is not None:
        check_param_shapes(params, expected, source=str(path))
    if to_numpy:
        params = _map(lambda a: np.asarray(a), params)
    return params


def _map(fn: Any, tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    return fn(tree)


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The SentencePiece tokenizer of a checkpoint (`tokenizer.model`); FileNotFoundError if
    missing, ValueError if it is not a SentencePiece model."""
    return Tokenizer.from_file(path)


def load_checkpoint(
    ckpt_path: str | os.PathLike[str],
    tokenizer_path: str | os.PathLike[str],
    *,
    expected: Any | None = None,
    text_only: bool = True,
) -> tuple[dict[str, Any], Tokenizer]:
    """`(params, tokenizer)` of a downloaded Gemma checkpoint and its `tokenizer.model`.

    The tokenizer is read first: it is cheap, and a wrong path fails before the restore.
    """
    tokenizer = load_tokenizer(tokenizer_path)
    params = load_orbax_params(ckpt_path, expected=expected, text_only=text_only)
    return params, tokenizer
