"""A few rows times an int8 per-block table, the table read once: a native XLA:CPU kernel.

    out = block_gemv.matmul(x, values, scales, offsets)  # x [B, I] bf16 -> [B, O] float32
    # the table: weight[o, i] = scales[o, i // G] * values[o, i] - offsets[o, i // G]

The decode step's matmuls on a GGUF checkpoint's own quantized blocks: every type the file
holds (Q8_0, Q5_0, Q4_K, Q6_K, ...) is written exactly in this one form by
`models/gguf_blocks.py` (int8 values, an f32 scale and, for the K-quants with minima, an f32
offset per group of G = 16 or 32 weights along the reduced axis I). At batch 1 to 8 a decode
matmul is memory-bound, and this form reads 1 + 4 / G bytes a weight (1.125 at G = 32) where
the bf16 table reads 2: llama.cpp's Q8_0 is 1.0625, its 4- and 5-bit types less, so those cost
more here than in the file (one kernel for every type, kept simple). The algorithm and its cost
are in `block_gemv.cc`.

On CPU, `matmul` is a custom call into `block_gemv.cc`, compiled on first use (`native.py`).
Elsewhere (TPU, GPU), with `EQUARX_SERVE_NATIVE_KERNELS=0`, where the compiler fails, or with a
group size that is not a multiple of 16, it is `reference`: XLA's f32 dot with the table
dequantized (`dequantize`).

Numerics: `reference` dequantizes each weight to the f32 that gguf.quants' dequantize gives (the
checkpoint's exact value for Q8_0, Q5_0 and Q6_K, whose scale times integer is exact in f32;
Q4_K's minimum is subtracted in f32 as gguf does) and sums its products with x (bf16, widened)
in f32; the kernel sums each group's integer-valued weights times x first and scales the sum
once (the minima's part from the group sums of x: `block_gemv.cc`). The two differ from each
other, and from the exact (f64) product of x and the dequantized table, in the last bits of the
f32 sums (tested against that exact product).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

from equarx_serve.kernels.native import NativeKernel

__all__ = ["LANES", "MAX_ROWS", "dequantize", "matmul", "native_available", "reference"]

MAX_ROWS = 8  # rows per pass over the table (more take one pass per MAX_ROWS)
LANES = 16  # the kernel's group sizes are multiples of this
KERNEL = NativeKernel(
    Path(__file__).with_suffix(".cc"), "EquarxBlockGemv", "equarx_block_gemv", "the einsums"
)


def _check(x: jax.Array, values: jax.Array, scales: jax.Array, offsets: jax.Array | None):
    rows_ok = x.ndim == values.ndim == scales.ndim == 2 and x.shape[1] == values.shape[1]
    groups_ok = (
        scales.shape[0] == values.shape[0]
        and scales.shape[1] > 0
        and values.shape[1] % scales.shape[1] == 0
    )
    if not (rows_ok and groups_ok):
        raise ValueError(
            "want x [B, I], values [O, I] and scales [O, I / G], got "
            f"{x.shape}, {values.shape} and {scales.shape}"
        )
    if offsets is not None and offsets.shape != scales.shape:
        raise ValueError(f"offsets {offsets.shape} must have the scales' shape {scales.shape}")
    if values.dtype != jnp.int8:
        raise ValueError(f"values must be int8, got {values.dtype}")


def dequantize(values: jax.Array, scales: jax.Array, offsets: jax.Array | None) -> jax.Array:
    """The table [O, I] in float32: values * scales - offsets, group by group, in the f32
    operations of gguf.quants' dequantize (so the same bits)."""
    group = values.shape[1] // scales.shape[1]
    weight = values.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), group, 1)
    if offsets is not None:
        weight = weight - jnp.repeat(offsets.astype(jnp.float32), group, 1)
    return weight


def reference(
    x: jax.Array, values: jax.Array, scales: jax.Array, offsets: jax.Array | None = None
) -> jax.Array:
    """x [B, I] times the dequantized table [O, I] (`dequantize`) -> [B, O] float32: XLA's
    f32 dot (on a float32 copy of the table, 4 bytes a weight)."""
    _check(x, values, scales, offsets)
    x32 = x.astype(jnp.bfloat16).astype(jnp.float32)
    weight = dequantize(values, scales, offsets)
    return jnp.einsum("BI,OI->BO", x32, weight, precision=lax.Precision.HIGHEST)


def native_available() -> bool:
    """Whether the CPU kernel is registered (compiling it on the first call), unless
    `EQUARX_SERVE_NATIVE_KERNELS=0`."""
    return KERNEL.available()


def _native(x, values, scales, offsets):
    out = jax.ShapeDtypeStruct((x.shape[0], values.shape[0]), jnp.float32)
    empty = jnp.zeros((0,), jnp.float32)
    operands = (x.astype(jnp.bfloat16), values, scales, empty if offsets is None else offsets)
    result = jax.ffi.ffi_call(KERNEL.target, out)(*operands)
    # Inside shard_map the result varies over the mesh axes its operands vary over.
    varying = set()
    for operand in (x, values, scales):
        varying |= jax.typeof(operand).mat.varying
    return lax.pcast(result, tuple(varying), to="varying") if varying else result


def matmul(
    x: jax.Array, values: jax.Array, scales: jax.Array, offsets: jax.Array | None = None
) -> jax.Array:
    """x [B, I] (bf16, or another float rounded to it) times the table scales * values -
    offsets -> [B, O] float32: the native kernel on CPU where it is available and the group
    size is a multiple of `LANES`, else `reference` (see the module doc)."""
    _check(x, values, scales, offsets)
    group = values.shape[1] // scales.shape[1]
    if group % LANES or x.shape[0] == 0 or not native_available():
        return reference(x, values, scales, offsets)

    def native(x, values, scales, *offsets):
        return _native(x, values, scales, offsets[0] if offsets else None)

    def fallback(x, values, scales, *offsets):
        return reference(x, values, scales, offsets[0] if offsets else None)

    operands = (x, values, scales) if offsets is None else (x, values, scales, offsets)
    return lax.platform_dependent(*operands, cpu=native, default=fallback)
