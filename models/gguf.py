"""Gemma 3 weights from a llama.cpp GGUF file, as the `gemma` library's parameter tree.

`load_gguf_params(path)` returns exactly the tree `gm.nn.Gemma3_270M().init(...)["params"]`
has (same keys, shapes and layout), as nested dicts of float32 numpy arrays, dequantized with
the `gguf` package (`gguf.GGUFReader` + `gguf.quants.dequantize`).

How the GGUF tensors map onto gemma's tree (D = embed_dim, N = heads, K = kv heads,
H = head_dim, F = hidden_dim, V = vocab). `gguf` hands every tensor back with its GGUF shape
reversed, i.e. as the numpy/PyTorch (out_features, in_features) matrix:

  GGUF tensor (numpy shape)           gemma param                     transform
  token_embd        (V, D)            embedder/input_embedding (V, D)  none (tied with logits)
  blk.i.attn_q      (N*H, D)          attn/q_einsum/w (N, D, H)        reshape (N, H, D), T(0,2,1)
  blk.i.attn_k      (K*H, D)          attn/kv_einsum/w[0] (K, D, H)    reshape (K, H, D), T(0,2,1)
  blk.i.attn_v      (K*H, D)          attn/kv_einsum/w[1] (K, D, H)    reshape (K, H, D), T(0,2,1)
  blk.i.attn_output (D, N*H)          attn/attn_vec_einsum/w (N, H, D) transpose, reshape (N, H, D)
  blk.i.ffn_gate    (F, D)            mlp/gating_einsum[0] (F, D)      none (the gelu branch)
  blk.i.ffn_up      (F, D)            mlp/gating_einsum[1] (F, D)      none
  blk.i.ffn_down    (D, F)            mlp/linear (F, D)                transpose
  blk.i.attn_q_norm (H,)              attn/_query_norm/scale           - 1
  blk.i.attn_k_norm (H,)              attn/_key_norm/scale             - 1
  blk.i.attn_norm   (D,)              pre_attention_norm/scale         - 1
  blk.i.post_attention_norm (D,)      post_attention_norm/scale        - 1
  blk.i.ffn_norm    (D,)              pre_ffw_norm/scale               - 1
  blk.i.post_ffw_norm (D,)            post_ffw_norm/scale              - 1
  output_norm       (D,)              final_norm/scale                 - 1

Notes on the file format (checked against this model's file):
- Gemma uses half-split ("NEOX") rotary embeddings and llama.cpp does not permute q/k rows
  for the gemma3 architecture, so no rotary un-permutation is needed.
- gemma's RMSNorm computes `x * (1 + scale)`; llama.cpp's converter stores `scale + 1`, so
  1 is subtracted here. Gemma's norm scales are not small (the pre-attention norms average
  ~5-13 after the shift), so their size proves nothing; what does: after the shift every
  scale is exactly a bf16 number (the released weights are bf16), and without it the model's
  perplexity explodes (tests/loading_test.py).
- `Gemma3_270M.config.transpose_gating_einsum` is True: gating_einsum is (2, F, D), slot 0 is
  the gate that goes through gelu, slot 1 the linear "up" branch.
- The file has no separate `output.weight`: logits use the embedding table (tied).
- The local (sliding-window) RoPE base is not stored in the file; it is gemma's default
  10,000. `gemma3.rope.freq_base` is the global layers' base (1,000,000).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from models.config import get_config

__all__ = [
    "GEMMA3_270M",
    "GGUF_MAGIC",
    "Gemma3Hparams",
    "expected_param_shapes",
    "hparams_mismatch",
    "load_gguf_blocks",
    "load_gguf_params",
    "open_gguf",
    "read_gguf_hparams",
]

GGUF_MAGIC = b"GGUF"
ARCHITECTURE = "gemma3"


@dataclasses.dataclass(frozen=True)
class Gemma3Hparams:
    """The hyper-parameters of a Gemma 3 text model that a weights file must agree with."""

    num_layers: int
    embed_dim: int
    hidden_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    sliding_window: int
    global_rope_base: float
    local_rope_base: float
    rms_norm_eps: float


# Gemma 3 270M: the architecture from models/config.py (checked against the gemma library by
# the tests), plus what only the file and the model card give.
_CONFIG_270M = get_config("gemma3-270m")
GEMMA3_270M = Gemma3Hparams(
    num_layers=_CONFIG_270M.num_layers,
    embed_dim=_CONFIG_270M.embed_dim,
    hidden_dim=_CONFIG_270M.hidden_dim,
    num_heads=_CONFIG_270M.num_heads,
    num_kv_heads=_CONFIG_270M.num_kv_heads,
    head_dim=_CONFIG_270M.head_dim,
    vocab_size=_CONFIG_270M.vocab_size,
    context_length=32_768,
    sliding_window=_CONFIG_270M.sliding_window_size,
    global_rope_base=float(_CONFIG_270M.global_base_frequency),
    local_rope_base=float(_CONFIG_270M.local_base_frequency),  # not in the GGUF file
    rms_norm_eps=1e-6,
)

# GGUF metadata key (after the "gemma3." prefix) -> Gemma3Hparams field.
_HPARAM_KEYS = {
    "block_count": "num_layers",
    "embedding_length": "embed_dim",
    "feed_forward_length": "hidden_dim",
    "attention.head_count": "num_heads",
    "attention.head_count_kv": "num_kv_heads",
    "attention.key_length": "head_dim",
    "attention.value_length": "head_dim",
    "context_length": "context_length",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "global_rope_base",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}

_FLOAT_HPARAMS = frozenset({"global_rope_base", "local_rope_base", "rms_norm_eps"})

# gemma param (inside layer_{i}) -> the GGUF norm tensor (inside blk.{i}).
_LAYER_NORMS = {
    ("attn", "_query_norm"): "attn_q_norm",
    ("attn", "_key_norm"): "attn_k_norm",
    ("pre_attention_norm",): "attn_norm",
    ("post_attention_norm",): "post_attention_norm",
    ("pre_ffw_norm",): "ffn_norm",
    ("post_ffw_norm",): "post_ffw_norm",
}
_LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _err(path: Path, what: str) -> ValueError:
    return ValueError(f"{path}: {what}")


def open_gguf(path: str | os.PathLike[str]) -> Any:
    """A `gguf.GGUFReader` over `path`, after checking that it is a complete GGUF file.

    Raises FileNotFoundError for a missing path and ValueError (naming the file) for a file
    that is not GGUF, is truncated or corrupt.
    """
    import gguf  # a heavy import: only when a file is read

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise _err(path, "not a regular file")
    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise _err(path, f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises IndexError/ValueError/... on short files
        raise _err(
            path, f"cannot parse the GGUF file ({size} bytes; truncated or corrupt?): {e!r}"
        ) from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise _err(
                path,
                f"truncated: tensor {t.name!r} needs bytes up to {end} but the file has {size}",
            )
    return reader


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _as_reader(path_or_reader: Any) -> tuple[Any, Path]:
    if isinstance(path_or_reader, (str, os.PathLike)):
        return open_gguf(path_or_reader), Path(path_or_reader)
    return path_or_reader, Path(str(getattr(path_or_reader.data, "filename", "<gguf>")))


def read_gguf_hparams(
    path_or_reader: Any, expected: Gemma3Hparams | None = GEMMA3_270M
) -> Gemma3Hparams:
    """The model hyper-parameters in a GGUF file's metadata.

    Raises ValueError when the architecture is not gemma3, a key is missing, or (unless
    `expected` is None) a value differs from `expected`.
    """
    reader, path = _as_reader(path_or_reader)
    arch = _field(reader, "general.architecture")
    if arch != ARCHITECTURE:
        raise _err(path, f"architecture is {arch!r}, expected {ARCHITECTURE!r} (Gemma 3)")
    values: dict[str, Any] = {}
    for key, name in _HPARAM_KEYS.items():
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise _err(path, f"metadata key {arch}.{key} is missing")
        if name in values and values[name] != value:
            raise _err(path, f"{arch}.{key} = {value} differs from {name} = {values[name]}")
        values[name] = value
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise _err(path, "metadata key tokenizer.ggml.tokens is missing")
    values["vocab_size"] = len(tokens.data)
    # Not stored by llama.cpp for gemma3: gemma's default.
    values["local_rope_base"] = GEMMA3_270M.local_rope_base
    scaling = _field(reader, f"{arch}.rope.scaling.factor")
    hp = Gemma3Hparams(
        **{
            f.name: (float if f.name in _FLOAT_HPARAMS else int)(values[f.name])
            for f in dataclasses.fields(Gemma3Hparams)
        }
    )
    if expected is None:
        return hp
    wrong = hparams_mismatch(hp, expected)
    if scaling is not None and float(scaling) != 1.0:
        wrong.append(f"rope.scaling.factor={scaling} (expected none)")
    if wrong:
        raise _err(path, "hyper-parameters differ from the expected model: " + ", ".join(wrong))
    return hp


def hparams_mismatch(got: Gemma3Hparams, expected: Gemma3Hparams) -> list[str]:
    """`"name=value (expected value)"` for every field that differs (floats to 1e-4)."""
    wrong = []
    for f in dataclasses.fields(Gemma3Hparams):
        a, b = getattr(got, f.name), getattr(expected, f.name)
        if not math.isclose(a, b, rel_tol=1e-4):
            wrong.append(f"{f.name}={a} (expected {b})")
    return wrong


def expected_param_shapes(hp: Gemma3Hparams = GEMMA3_270M) -> dict[str, Any]:
    """The gemma parameter tree for `hp` with shape tuples as leaves."""
    d, f, n, k, h = hp.embed_dim, hp.hidden_dim, hp.num_heads, hp.num_kv_heads, hp.head_dim

    def layer() -> dict[str, Any]:
        return {
            "attn": {
                "q_einsum": {"w": (n, d, h)},
                "kv_einsum": {"w": (2, k, d, h)},
                "attn_vec_einsum": {"w": (n, h, d)},
                "_query_norm": {"scale": (h,)},
                "_key_norm": {"scale": (h,)},
            },
            "mlp": {"gating_einsum": (2, f, d), "linear": (f, d)},
            "pre_attention_norm": {"scale": (d,)},
            "post_attention_norm": {"scale": (d,)},
            "pre_ffw_norm": {"scale": (d,)},
            "post_ffw_norm": {"scale": (d,)},
        }

    tree: dict[str, Any] = {"embedder": {"input_embedding": (hp.vocab_size, d)}}
    for i in range(hp.num_layers):
        tree[f"layer_{i}"] = layer()
    tree["final_norm"] = {"scale": (d,)}
    return tree


def _expected_gguf_shapes(hp: Gemma3Hparams) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape (GGUF's own dims reversed)."""
    d, f, n, k, h = hp.embed_dim, hp.hidden_dim, hp.num_heads, hp.num_kv_heads, hp.head_dim
    shapes = {"token_embd.weight": (hp.vocab_size, d), "output_norm.weight": (d,)}
    per_layer = {
        "attn_q": (n * h, d),
        "attn_k": (k * h, d),
        "attn_v": (k * h, d),
        "attn_output": (d, n * h),
        "ffn_gate": (f, d),
        "ffn_up": (f, d),
        "ffn_down": (d, f),
        "attn_q_norm": (h,),
        "attn_k_norm": (h,),
        "attn_norm": (d,),
        "post_attention_norm": (d,),
        "ffn_norm": (d,),
        "post_ffw_norm": (d,),
    }
    for i in range(hp.num_layers):
        for name, shape in per_layer.items():
            shapes[f"blk.{i}.{name}.weight"] = shape
    return shapes


class _Gemma3Tensors(NamedTuple):
    path: Path
    hparams: Gemma3Hparams
    shapes: dict[str, tuple[int, ...]]  # each tensor's expected (dequantized) shape
    tensors: dict[str, Any]  # name -> the reader's tensor


def _gemma3_tensors(
    path_or_reader: str | os.PathLike[str] | Any, expected: Gemma3Hparams
) -> _Gemma3Tensors:
    """The file's tensors by name, once its hyper-parameters equal `expected` and its tensor
    names are exactly a Gemma 3's of that shape (ValueError naming the file otherwise)."""
    reader, path = _as_reader(path_or_reader)
    hp = read_gguf_hparams(reader, expected)
    want = _expected_gguf_shapes(hp)
    tensors = {t.name: t for t in reader.tensors}
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise _err(
            path,
            f"tensor names differ from a {hp.num_layers}-layer Gemma 3: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''} ({len(missing)}), "
            f"unexpected {extra[:8]}{'...' if len(extra) > 8 else ''} ({len(extra)})",
        )
    return _Gemma3Tensors(path, hp, want, tensors)


def load_gguf_params(
    path_or_reader: str | os.PathLike[str] | Any,
    expected: Gemma3Hparams = GEMMA3_270M,
) -> dict[str, Any]:
    """The gemma parameter tree (nested dicts of float32 numpy arrays) of a Gemma 3 GGUF file.

    `path_or_reader` is a path or a reader from `open_gguf`. The file's hyper-parameters must
    equal `expected` and its tensors must be exactly those of that model; otherwise
    ValueError (FileNotFoundError for a missing file) naming the file and the problem.
    """
    import gguf

    path, hp, want, tensors = _gemma3_tensors(path_or_reader, expected)

    def get(name: str) -> np.ndarray:
        t = tensors[name]
        try:
            a = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise _err(path, f"tensor {name!r}: unsupported type {t.tensor_type.name}") from e
        if tuple(a.shape) != want[name]:
            raise _err(path, f"tensor {name!r} has shape {tuple(a.shape)}, expected {want[name]}")
        a = np.asarray(a, dtype=np.float32)
        if not np.isfinite(a).all():
            raise _err(path, f"tensor {name!r} has non-finite values")
        return a

    def norm(name: str) -> np.ndarray:
        return get(name) - np.float32(1.0)  # llama.cpp stores gemma's (1 + scale)

    d, n, k, h = hp.embed_dim, hp.num_heads, hp.num_kv_heads, hp.head_dim
    params: dict[str, Any] = {"embedder": {"input_embedding": get("token_embd.weight")}}
    for i in range(hp.num_layers):
        b = f"blk.{i}."
        m = {name: get(f"{b}{name}.weight") for name in _LAYER_MATRICES}
        q = m["attn_q"].reshape(n, h, d).transpose(0, 2, 1)
        kk = m["attn_k"].reshape(k, h, d).transpose(0, 2, 1)
        v = m["attn_v"].reshape(k, h, d).transpose(0, 2, 1)
        layer: dict[str, Any] = {
            "attn": {
                "q_einsum": {"w": np.ascontiguousarray(q)},
                "kv_einsum": {"w": np.ascontiguousarray(np.stack([kk, v]))},
                "attn_vec_einsum": {"w": np.ascontiguousarray(m["attn_output"].T.reshape(n, h, d))},
            },
            "mlp": {
                "gating_einsum": np.stack([m["ffn_gate"], m["ffn_up"]]),
                "linear": np.ascontiguousarray(m["ffn_down"].T),
            },
        }
        for dest, src in _LAYER_NORMS.items():
            node = layer
            for part in dest:
                node = node.setdefault(part, {})
            node["scale"] = norm(f"{b}{src}.weight")
        params[f"layer_{i}"] = layer
    params["final_norm"] = {"scale": norm("output_norm.weight")}
    _check_tree(params, expected_param_shapes(hp), path)
    return params


# The decode weights in int8 blocks (`models.gemma3.BLOCKS`) and the GGUF tensors they are.
_BLOCK_WEIGHTS = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "attn_out": "attn_output",
    "linear": "ffn_down",
}


def load_gguf_blocks(
    path_or_reader: str | os.PathLike[str] | Any,
    expected: Gemma3Hparams = GEMMA3_270M,
) -> dict[str, Any]:
    """The decode weights of a Gemma 3 GGUF file in int8 blocks, as stored (each type written
    exactly, `models.gguf_blocks`): the tree `models.gemma3.block_partition_specs` names, of
    {"values", "scales"[, "offsets"]} numpy arrays, each [..., O, I] as the file's (out, in)
    matrix; "gating" stacks ffn_gate and ffn_up ([2, F, D], zero offsets for one that has none
    where the other has some). ValueError naming the file for a file `load_gguf_params` would
    reject, or a tensor of a type with no int8 form (`gguf_blocks.SUPPORTED`)."""
    from models.gguf_blocks import int8_blocks

    path, hp, want, tensors = _gemma3_tensors(path_or_reader, expected)

    def get(name: str) -> dict[str, np.ndarray]:
        try:
            blocks = int8_blocks(tensors[name])
        except ValueError as e:
            raise _err(path, str(e)) from e
        if tuple(blocks.values.shape) != want[name]:
            shape = blocks.values.shape
            raise _err(path, f"tensor {name!r} has shape {shape}, expected {want[name]}")
        arrays = {"values": blocks.values, "scales": blocks.scales}
        if blocks.offsets is not None:
            arrays["offsets"] = blocks.offsets
        if not all(np.isfinite(a).all() for k, a in arrays.items() if k != "values"):
            raise _err(path, f"tensor {name!r} has non-finite scales or offsets")
        return arrays

    tree: dict[str, Any] = {"head": get("token_embd.weight")}
    for i in range(hp.num_layers):
        b = f"blk.{i}."
        layer = {name: get(f"{b}{source}.weight") for name, source in _BLOCK_WEIGHTS.items()}
        layer["gating"] = _stacked(get(f"{b}ffn_gate.weight"), get(f"{b}ffn_up.weight"), path=path)
        tree[f"layer_{i}"] = layer
    return tree


def _stacked(*weights: dict[str, np.ndarray], path: Path) -> dict[str, np.ndarray]:
    """Weights in int8 blocks of one shape and group size stacked on a new leading axis."""
    if len({w["scales"].shape for w in weights}) != 1:
        raise _err(path, "ffn_gate and ffn_up have different group sizes")
    if any("offsets" in w for w in weights):
        weights = tuple(
            {**w, "offsets": w.get("offsets", np.zeros_like(w["scales"]))} for w in weights
        )
    return {key: np.stack([w[key] for w in weights]) for key in weights[0]}


def _check_tree(params: dict[str, Any], shapes: dict[str, Any], path: Path) -> None:
    got, want = _flatten(params), _flatten(shapes)
    if set(got) != set(want):
        raise _err(path, f"internal: key sets differ: {sorted(set(got) ^ set(want))[:8]}")
    for key, shape in want.items():
        if tuple(got[key].shape) != tuple(shape):
            raise _err(path, f"internal: {key} has shape {got[key].shape}, expected {shape}")


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "/"))
        else:
            out[name] = value
    return out
