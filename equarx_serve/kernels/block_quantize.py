"""Block-wise int8 quantization with fused dequantize-accumulate, as a Pallas kernel.

Data is laid out as rows of one quantization block each: `[rows, block_size]`. Every row gets
one scale (symmetric absmax), float32 or bfloat16 (`scale_dtype`):

    scale = max(absmax(row) / 127, FLOAT32_TINY)      # the floor keeps zero rows finite
    scale = round_up_to_bfloat16(scale)                # bfloat16 scales only: never below
    q     = clip(round_half_to_even(row * (1 / scale)), -127, 127)
    row  ~= q * scale

A bfloat16 scale halves the scale bytes (2 per block instead of 4); it is rounded up, never to
nearest, so no element leaves [-127, 127]: the step grows by at most 2^-8 of itself.

`accumulate_quantize` is the one step of every quantized all-reduce hop, fused so that the f32
sum never leaves registers/VMEM:

    acc = float32(local) + sum_k dequantize(q_k, scale_k)       # K received payloads, in order
    return quantize(acc)

Non-finite values: the int8 code -128 (outside the [-127, 127] range used for numbers) marks an
element that was NaN or +-Inf. It is excluded from the row's absmax, so it does not spoil its
neighbours, and dequantizes to NaN, so it can never turn into a finite number downstream.

Cost per row of B elements, K received payloads, input itemsize s, scale itemsize c:
  bytes read  B*s + K*(B + c), bytes written B + c;
  FLOPs about (3 + 2K) * B (dequantize-add, absmax, scale, round) plus one divide.

Block shapes: a grid over row tiles of `block_rows` rows (a power of two in [32, 512], or all
rows when there are at most 32), each `[block_rows, block_size]`, with scales `[block_rows, 1]`.
32 rows is the int8 sublane tile on TPU; powers of two keep the Triton (GPU) lowering legal.

Lowering: Mosaic on TPU, Triton on NVIDIA GPUs (Pallas' default GPU lowering; it runs on every
GPU generation JAX supports, where Mosaic GPU needs Hopper or newer), interpreted on CPU, chosen
per lowering platform (`lax.platform_dependent`), so one traced program lowers for each. The
kernel body and the reference share every line of the math, and that math uses only operations
each lowering has and computes exactly (no platform's own `round`: Triton has none), so all
paths give the same bits. `tests/aot_lowering_test.py` lowers it for TPU v5e and H100 here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

INT8_MAX = 127
NONFINITE_CODE = -128
FLOAT32_TINY = float(jnp.finfo(jnp.float32).tiny)  # a power of two: exact in bfloat16 too
SCALE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
MIN_ROW_TILE = 32  # int8 sublane tiling on TPU
MAX_ROW_TILE = 512  # 512 x 256 f32 accumulator = 512 KiB of VMEM


def padded_rows(rows: int) -> int:
    """The row count to pad a buffer to so that `row_tile` divides it (waste < 32 rows)."""
    if rows <= MIN_ROW_TILE:
        return 1 << (rows - 1).bit_length()
    return -(-rows // MIN_ROW_TILE) * MIN_ROW_TILE


def row_tile(rows: int) -> int:
    """The largest power-of-two tile in [32, 512] that divides `rows` (all rows if <= 32)."""
    if rows <= MIN_ROW_TILE:
        return rows
    tile = MAX_ROW_TILE
    while rows % tile:
        tile //= 2
    if tile < MIN_ROW_TILE:
        raise ValueError(f"rows must be <= {MIN_ROW_TILE} or a multiple of it, got {rows}")
    return tile


# --- the math, shared by the kernel body and the reference ----------------------------------


def check_scale_dtype(scale_dtype: jnp.dtype) -> jnp.dtype:
    """The scale dtype as a numpy dtype; ValueError unless float32 or bfloat16."""
    try:
        dtype = jnp.dtype(scale_dtype)
    except TypeError:
        dtype = None
    if dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be float32 or bfloat16, got {scale_dtype!r}")
    return dtype


def round_up_to_bfloat16(x: jax.Array) -> jax.Array:
    """Positive finite f32 -> the smallest bfloat16 value >= x, as f32 (exact in bfloat16)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + jnp.uint32(0xFFFF)) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def round_half_to_even(x: jax.Array) -> jax.Array:
    """f32 -> the nearest integer, ties to the even one (IEEE roundTiesToEven), as f32.

    Written with `floor` and exact comparisons rather than `jnp.round`, which Pallas' Triton
    lowering does not implement; every step is exact in f32, so it equals `jnp.round` bit for
    bit on every platform (tests). Non-finite inputs give non-finite results."""
    down = jnp.floor(x)
    fraction = x - down  # exact: x and floor(x) share their exponent range
    odd = down - 2.0 * jnp.floor(down * 0.5) == 1.0
    up = (fraction > 0.5) | ((fraction == 0.5) & odd)
    rounded = jnp.where(up, down + 1.0, down)
    return jnp.where(rounded == 0.0, x * 0.0, rounded)  # -0.5 rounds to -0.0, as round does


def _quantize_with_absmax(
    acc: jax.Array, absmax: jax.Array, scale_dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """f32 [R, B] and its per-row absmax over finite values [R, 1] -> (int8 [R, B],
    scales [R, 1] in scale_dtype)."""
    # A multiply, not a divide: XLA rewrites x / 127 so, Mosaic does not; all paths must agree.
    scale = jnp.maximum(absmax * (1.0 / INT8_MAX), FLOAT32_TINY)
    if jnp.dtype(scale_dtype) == jnp.bfloat16:
        scale = round_up_to_bfloat16(scale)
    q = jnp.clip(round_half_to_even(acc * (1.0 / scale)), -INT8_MAX, INT8_MAX)
    q = jnp.where(jnp.isfinite(acc), q, NONFINITE_CODE).astype(jnp.int8)
    return q, scale.astype(scale_dtype)


def _quantize_rows(acc: jax.Array, scale_dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """f32 [R, B] -> (int8 [R, B], scales [R, 1] in scale_dtype)."""
    absmax = jnp.max(jnp.where(jnp.isfinite(acc), jnp.abs(acc), 0.0), axis=-1, keepdims=True)
    return _quantize_with_absmax(acc, absmax, scale_dtype)


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """(int8 [..., R, B], scales [..., R, 1]) -> f32 [..., R, B]; the non-finite code gives
    NaN."""
    values = q.astype(jnp.float32) * scale.astype(jnp.float32)
    return jnp.where(q == NONFINITE_CODE, jnp.nan, values)


Payload = tuple[jax.Array, jax.Array]  # (int8 [R, B], scales [R, 1] in the scale dtype)


def accumulate_quantize_reference(
    local: jax.Array, received: tuple[Payload, ...] = (), *, scale_dtype: jnp.dtype = jnp.float32
) -> Payload:
    """Pure-jnp reference: local [R, B] (any float dtype) plus K received payloads."""
    acc = local.astype(jnp.float32)
    for q, scale in received:
        acc = acc + dequantize(q, scale)
    return _quantize_rows(acc, scale_dtype)


def accumulate_quantize_xla(
    local: jax.Array, received: tuple[Payload, ...] = (), *, scale_dtype: jnp.dtype = jnp.float32
) -> Payload:
    """The reference's bits, arranged for XLA:CPU (the `kernel="jnp"` path of the collective).

    XLA:CPU runs a row reduction fast only on a materialized array: a reduction that fuses its
    elementwise producer (abs, where, the dequantize-add) writes that producer out in f32 first
    and is ~8x slower. So the f32 sum is materialized once (an optimization barrier), and the
    absmax is max(max(row), -min(row)) straight off it (or off the raw input when nothing was
    received), which equals max|row| exactly for finite rows. Those reductions do not handle
    NaN reliably, so when the int8 result holds the non-finite code anywhere (a cheap int8 min),
    the message is re-quantized the reference way, with the absmax over finite values only.
    """
    if received:
        acc = local.astype(jnp.float32)
        for q, scale in received:
            acc = acc + dequantize(q, scale)
        local = lax.optimization_barrier(acc)
    return quantize_chunk_xla(local[None], 0, scale_dtype=scale_dtype)


def quantize_chunk_xla(
    values: jax.Array, index: jax.Array | int, *, scale_dtype: jnp.dtype = jnp.float32
) -> Payload:
    """Quantizes chunk `index` of values [N, R, B] (see `accumulate_quantize_xla`).

    The row absmax is reduced over all of `values` (CSE'd across chunks) rather than over a
    sliced-out chunk, and the exact fallback slices `values` itself, so no chunk is copied out.
    """
    take = lambda a: lax.dynamic_index_in_dim(a, index, 0, keepdims=False)
    row_max = jnp.max(values, axis=-1, keepdims=True)
    row_min = jnp.min(values, axis=-1, keepdims=True)
    absmax = take(jnp.maximum(row_max, -row_min).astype(jnp.float32))
    q, scale = _quantize_with_absmax(take(values).astype(jnp.float32), absmax, scale_dtype)
    return lax.cond(
        jnp.min(q) == NONFINITE_CODE,
        lambda values: _quantize_rows(take(values).astype(jnp.float32), scale_dtype),
        lambda _: (q, scale),
        values,
    )


# --- the Pallas kernel ----------------------------------------------------------------------


def _accumulate_quantize_kernel(local_ref, *refs, num_received: int, scale_dtype: jnp.dtype):
    received_refs, (q_ref, scale_ref) = refs[: 2 * num_received], refs[2 * num_received :]
    acc = local_ref[...].astype(jnp.float32)  # [TR, B]
    for k in range(num_received):
        acc = acc + dequantize(received_refs[2 * k][...], received_refs[2 * k + 1][...])
    q, scale = _quantize_rows(acc, scale_dtype)
    q_ref[...] = q
    scale_ref[...] = scale


@functools.partial(jax.jit, static_argnames=("interpret", "scale_dtype"))
def accumulate_quantize(
    local: jax.Array,
    received: tuple[Payload, ...] = (),
    *,
    interpret: bool = False,
    scale_dtype: jnp.dtype = jnp.float32,
) -> Payload:
    """Pallas version of `accumulate_quantize_reference` (same arguments, same bits).

    local: [R, B] float32/bfloat16/float16; received: K pairs (int8 [R, B], scales [R, 1] in
    scale_dtype). R must be <= 32 or a multiple of 32 (see `padded_rows`). Returns (int8 [R, B],
    scales [R, 1] in scale_dtype).
    """
    scale_dtype = check_scale_dtype(scale_dtype)
    if local.ndim != 2:
        raise ValueError(f"local must be [rows, block_size], got shape {local.shape}")
    rows, block = local.shape
    for q, scale in received:
        if q.shape != (rows, block) or q.dtype != jnp.int8:
            raise ValueError(f"received q must be int8 {(rows, block)}, got {q.dtype} {q.shape}")
        if scale.shape != (rows, 1) or scale.dtype != scale_dtype:
            raise ValueError(
                f"received scale must be {scale_dtype} {(rows, 1)}, got {scale.dtype} {scale.shape}"
            )
    tile = row_tile(rows)
    varying = jax.typeof(local).mat
    values_spec = pl.BlockSpec((tile, block), lambda i: (i, 0))
    scales_spec = pl.BlockSpec((tile, 1), lambda i: (i, 0))
    return tuple(
        pl.pallas_call(
            functools.partial(
                _accumulate_quantize_kernel, num_received=len(received), scale_dtype=scale_dtype
            ),
            grid=(rows // tile,),
            in_specs=[values_spec] + [values_spec, scales_spec] * len(received),
            out_specs=[values_spec, scales_spec],
            out_shape=[
                # Inside shard_map the outputs vary over the same mesh axes as `local`.
                jax.ShapeDtypeStruct((rows, block), jnp.int8, manual_axis_type=varying),
                jax.ShapeDtypeStruct((rows, 1), scale_dtype, manual_axis_type=varying),
            ],
            # TPU interpret mode: unlike the generic one, it runs inside shard_map with check_vma.
            interpret=pltpu.InterpretParams() if interpret else False,
            name="equarx_accumulate_quantize",
        )(local, *[a for pair in received for a in pair])
    )
