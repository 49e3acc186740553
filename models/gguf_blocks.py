"""A GGUF checkpoint's quantized tensors in one exact form: int8 values and f32 per-group scales.

    blocks = int8_blocks(reader.tensors[i])  # a `gguf.GGUFReader` tensor
    # weight[o, i] = blocks.scales[o, i // G] * blocks.values[o, i] - blocks.offsets[o, i // G]

O x I is the numpy (out, in) matrix: the GGUF shape reversed, as `gguf.quants.dequantize`
returns it (the reader's `tensor.data` of a quantized type is uint8 [O, bytes per row]; leading
dimensions of a tensor of more than 2 are folded into O). G groups consecutive weights of a row
along I. Each type's blocks are unpacked bit for bit as the installed `gguf` package's
`gguf/quants.py` unpacks them, and the scales and offsets are computed with the same f32
operations, so `Int8Blocks.dequantize()` is bit-identical to `gguf.quants.dequantize`:

  type  G   values             scales             offsets    GGUF bits/w  here bytes/w (bits)
  Q8_0  32  q (-128..127)      d                  none       8.5          1.125 (9)
  Q5_0  32  q - 16 (-16..15)   d                  none       5.5          1.125 (9)
  Q4_0  32  q - 8 (-8..7)      d                  none       4.5          1.125 (9)
  Q6_K  16  q - 32 (-32..31)   d * scale (int8)   none       6.5625       1.25 (10)
  Q5_K  32  q (0..31)          d * sc             dmin * m   5.5          1.25 (10)
  Q4_K  32  q (0..15)          d * sc             dmin * m   4.5          1.25 (10)

(d, dmin: the block's f16 scales, made f32; sc, m: the 6-bit sub-block scales and minima that
`gguf.quants.Q4_K.get_scale_min` unpacks, each product rounded to f32 once, as gguf does.) A
weight costs 1 + 4 / G bytes here, 4 / G more with offsets.

Why int8 for every type: one fast kernel (`equarx_serve/kernels/block_gemv.py`) multiplies all
of them, dequantizing each weight in registers to the f32 gguf's dequantize gives. The price
is memory: the 4-bit types take 2x their stored bytes here (Q4_0 9 / 4.5 bits, Q4_K 10 / 4.5),
Q5_0 1.6x, Q6_K 1.5x, Q5_K 1.8x, Q8_0 1.06x; all under bf16's 16 bits. Other types (F32,
F16, BF16, Q4_1, Q2_K, IQ*, ...) raise ValueError.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

__all__ = ["SUPPORTED_TYPES", "Int8Blocks", "int8_blocks"]


@dataclasses.dataclass(frozen=True)
class Int8Blocks:
    """weight[o, i] = scales[o, i // G] * values[o, i] - offsets[o, i // G]  (exactly, in f32)"""

    values: np.ndarray  # int8 [O, I]
    scales: np.ndarray  # float32 [O, I // G]
    offsets: np.ndarray | None  # float32 [O, I // G], or None where the type has no offset

    def __post_init__(self) -> None:
        v, s, m = self.values, self.scales, self.offsets
        ok = (
            v.dtype == np.int8
            and s.dtype == np.float32
            and v.ndim == s.ndim == 2
            and s.shape[0] == v.shape[0]
            and s.shape[1] > 0
            and v.shape[1] % s.shape[1] == 0
            and (m is None or (m.dtype == np.float32 and m.shape == s.shape))
        )
        if not ok:
            offsets = None if m is None else (m.dtype, m.shape)
            raise ValueError(
                f"not an int8-block table: values {v.dtype} {v.shape}, scales {s.dtype} "
                f"{s.shape}, offsets {offsets}"
            )

    @property
    def group_size(self) -> int:
        """G: the weights of a row that share one scale (and offset)."""
        return self.values.shape[1] // self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the three arrays together."""
        return sum(a.nbytes for a in (self.values, self.scales, self.offsets) if a is not None)

    def dequantize(self) -> np.ndarray:
        """The float32 [O, I] weights: scales * values - offsets, in f32 (bit-identical to
        `gguf.quants.dequantize` of the blocks this came from)."""
        rows, cols = self.values.shape
        group = self.group_size
        out = self.values.reshape(rows, cols // group, group).astype(np.float32)
        out *= self.scales[:, :, None]
        if self.offsets is not None:
            out -= self.offsets[:, :, None]
        return out.reshape(rows, cols)


# One GGUF block [n, type_size] uint8 -> values [n, block] int8, scales and offsets [n, groups].
Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _f32_of_f16(raw: np.ndarray) -> np.ndarray:
    """[n, 2] little-endian f16 bytes -> [n, 1] float32."""
    return raw.view(np.float16).astype(np.float32)


def _fields(packed: np.ndarray, chunk: int, bits: int) -> np.ndarray:
    """Each byte of `packed` [n, k * chunk] split into its 8 // bits fields, low bits first, in
    gguf's order: field j of byte p in chunk c is element (c * 8 // bits + j) * chunk + p."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(1, 1, -1, 1)
    fields = packed.reshape(packed.shape[0], -1, 1, chunk) >> shifts
    return (fields & np.uint8((1 << bits) - 1)).reshape(packed.shape[0], -1)


def _q8_0(blocks: np.ndarray) -> Unpacked:
    d, qs = np.hsplit(blocks, [2])
    return qs.view(np.int8), _f32_of_f16(d), None


def _q4_0(blocks: np.ndarray) -> Unpacked:
    d, qs = np.hsplit(blocks, [2])
    return _fields(qs, 16, 4).astype(np.int8) - np.int8(8), _f32_of_f16(d), None


def _q5_0(blocks: np.ndarray) -> Unpacked:
    d, qh, qs = np.hsplit(blocks, [2, 6])  # qh: bit k of the little-endian uint32 is q[k]'s 5th
    q = _fields(qs, 16, 4) | (_fields(qh, 1, 1) << np.uint8(4))
    return q.astype(np.int8) - np.int8(16), _f32_of_f16(d), None


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's head: (d * sc, dmin * m) [n, 8] float32, and the rest of the block."""
    d, dmin, packed, rest = np.hsplit(blocks, [2, 4, 4 + Q4_K.K_SCALE_SIZE])
    sc, m = Q4_K.get_scale_min(packed)
    return _f32_of_f16(d) * sc.astype(np.float32), _f32_of_f16(dmin) * m.astype(np.float32), rest


def _q4_k(blocks: np.ndarray) -> Unpacked:
    scales, offsets, qs = _k_scales(blocks)
    return _fields(qs, 32, 4).astype(np.int8), scales, offsets


def _q5_k(blocks: np.ndarray) -> Unpacked:
    scales, offsets, rest = _k_scales(blocks)
    qh, qs = np.hsplit(rest, [32])  # qh: bit j of byte p is the 5th bit of sub-block j's q[p]
    q = _fields(qs, 32, 4) | (_fields(qh, 32, 1) << np.uint8(4))
    return q.astype(np.int8), scales, offsets


def _q6_k(blocks: np.ndarray) -> Unpacked:
    ql, qh, sc, d = np.hsplit(blocks, [128, 192, 208])
    q = _fields(ql, 64, 4) | (_fields(qh, 32, 2) << np.uint8(4))
    scales = _f32_of_f16(d) * sc.view(np.int8).astype(np.float32)
    return q.astype(np.int8) - np.int8(32), scales, None


_UNPACK: dict[GGMLQuantizationType, Callable[[np.ndarray], Unpacked]] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
SUPPORTED_TYPES: tuple[str, ...] = tuple(t.name for t in _UNPACK)


def _rows(tensor: Any, qtype: GGMLQuantizationType) -> tuple[np.ndarray, int]:
    """The tensor's bytes as [O, bytes per row] uint8, and I (checked against its GGUF shape)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    data = np.asarray(tensor.data).view(np.uint8)
    rows = data.reshape(-1, data.shape[-1]) if data.ndim else data.reshape(1, -1)
    cols = rows.shape[1] // type_size * block
    shape = [int(n) for n in tensor.shape]  # GGUF order: the row length first
    if rows.shape[1] % type_size or (math.prod(shape[1:]), *shape[:1]) != (rows.shape[0], cols):
        raise ValueError(
            f"tensor {tensor.name!r}: {qtype.name} data of {rows.shape[0]} rows of "
            f"{rows.shape[1]} bytes ({type_size} a block of {block}) does not hold GGUF "
            f"shape {shape}"
        )
    return rows, cols


def int8_blocks(tensor: Any) -> Int8Blocks:
    """From a `gguf.GGUFReader` tensor (`reader.tensors[i]`: .tensor_type, .data, .shape, .name).

    Raises ValueError, naming the tensor and its type, for a type without this form."""
    qtype = tensor.tensor_type
    unpack = _UNPACK.get(qtype)
    if unpack is None:
        name = getattr(qtype, "name", repr(qtype))
        raise ValueError(
            f"tensor {tensor.name!r} is {name}, which has no int8-block form "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    qtype = GGMLQuantizationType(qtype)
    rows, cols = _rows(tensor, qtype)
    values, scales, offsets = unpack(rows.reshape(-1, GGML_QUANT_SIZES[qtype][1]))
    n = rows.shape[0]
    return Int8Blocks(
        values.reshape(n, cols),
        scales.reshape(n, -1),
        None if offsets is None else offsets.reshape(n, -1),
    )
