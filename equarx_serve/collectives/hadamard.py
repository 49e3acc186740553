"""Orthonormal block Hadamard rotation.

`block_hadamard(x)` multiplies every row of B elements (B a power of two) by H_B / sqrt(B).
The matrix is symmetric and orthonormal, so the transform is its own inverse, and it is linear,
so it commutes with the all-reduce: rotate each device's input, reduce, rotate the result back.
It spreads a few large (outlier) channels over the whole block, which shrinks the block's
absmax relative to its RMS and with it the int8 rounding error.

`HadamardRotation(block)` applies it along the last axis of any array whose last dimension is
a multiple of the block: that is also how a model folds the forward transform into the
weights that produce an all-reduce's input (`models.gemma3`), so that the collective only
applies the inverse.

Algorithm: for B <= 128 one matrix product of the rows, [M, B] x [B, B] (B multiply-adds per
element); above, two radix-sqrt(B) stages, H_B = H_a (x) H_b, a row viewed as an [a, b]
matrix X maps to H_a X H_b ((a + b) multiply-adds per element), in f32. The 1/sqrt(B)
normalization is in the matrix. In the one-product form, when the input is bf16 or f16 and
1/sqrt(B) is a power of two (B = 4, 16, 64), the matrix is exact in that dtype and the product
runs on the 16-bit values with f32 accumulation (every product exact); otherwise everything is
f32 at full precision. Measured on XLA:CPU (2 cores, variants side by side, bf16 messages of
1-16 MiB, B = 64): the normalization inside the matrix saves a pass over memory (15-20%), the
16-bit product halves the forward transform (0.63 vs 1.24 ms at 1 MiB, 24 vs 45 ms at 16 MiB);
in f32 the two-stage form is no faster at B = 64 and 128 (small [8, 8] products batch badly)
and faster at B = 256. The radix-2 butterfly (B log2 B adds) ran slower than both: log2 B
strided passes over memory. Every form maps onto GEMM units (TPU MXU, GPU tensor cores).

`hadamard_scaled_codes(q, scales)` rotates decoded int8 codes (a block quantizer's, whose
blocks are the rotation groups: H (s q) = s (H q), so the inverse rotation of a decoded block
is its scale times the rotated codes): an int8 x int8 product with int32 sums, exact, then
one multiply by scale / sqrt(B). Measured on XLA:CPU (`bench.rotation`: a decoded payload
back to bf16, B = 64, side by side): 17.2 ms at 16 MiB against 33.4 ms for dequantizing to
f32 and the f32 product (0.39 vs 0.59 ms at 1 MiB); the codes as bf16 with the exact 16-bit
product ran as fast as the int8 product at 16 MiB and 1.7x slower at 2 MiB (one run).

With groups of k blocks (`equarx-int8`'s two-shot default: blocks of 32, groups of 64) the
int8 product by H_B is followed by one fused elementwise pass that scales every block and
mixes a group's blocks by H_k (H_kB = H_k (x) H_B). Measured on XLA:CPU (`bench.rotation`,
16 MiB decoded back to bf16, side by side): 22.8 ms for blocks of 32 against 35.4 ms on the
values and 21.8 ms for one block of 64 a group. Two formulations of the mix ran slower
(ad-hoc micro-benchmarks, side by side): a [k, k] product across the rows (an extra f32
pass: 46 vs 18 ms at 16 MiB) and the +-1 factors of H_k broadcast over the rows (the fused
pass, fed by scales unpacked from an all-gathered byte buffer, 3x slower at 1 MiB: 1.22 vs
0.41 ms).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Up to this block size one [B, B] product beats the two-stage (Kronecker) form on XLA:CPU.
MAX_DENSE_BLOCK = 128
FORMS = ("auto", "dense", "kronecker")


def hadamard_matrix(size: int) -> np.ndarray:
    """The (unnormalized) Sylvester Hadamard matrix H_size, entries +-1."""
    matrix = np.ones((1, 1), np.float32)
    while matrix.shape[0] < size:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return matrix


def _check_block(block: int) -> None:
    if not isinstance(block, int) or block < 1 or block & (block - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two block size, got {block!r}")


def _exact_in(dtype: jnp.dtype, block: int) -> bool:
    """Whether H_B / sqrt(B) is exact in a 16-bit input dtype (1/sqrt(B) a power of two)."""
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return sixteen_bit and (block.bit_length() - 1) % 2 == 0


def block_hadamard(
    x: jax.Array, *, form: Literal["auto", "dense", "kronecker"] = "auto"
) -> jax.Array:
    """[..., B] (any float dtype) -> f32 [..., B], each row times the orthonormal H_B / sqrt(B).
    `form` picks the algorithm (see the module doc; "auto": dense up to `MAX_DENSE_BLOCK`)."""
    block = x.shape[-1]
    _check_block(block)
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if form == "dense" or (form == "auto" and block <= MAX_DENSE_BLOCK):
        if _exact_in(x.dtype, block):  # exact products of the 16-bit values, f32 sums
            matrix_dtype, precision = x.dtype, lax.Precision.DEFAULT
        else:
            x, matrix_dtype, precision = x.astype(jnp.float32), jnp.float32, lax.Precision.HIGHEST
        h = jnp.asarray(hadamard_matrix(block) / math.sqrt(block), matrix_dtype)
        rows = x.reshape(-1, block)  # [M, B]
        rotated = jnp.dot(rows, h, precision=precision, preferred_element_type=jnp.float32)
        return rotated.reshape(x.shape)
    # Two stages in f32 (a 16-bit intermediate would round).
    log2 = block.bit_length() - 1
    rows_factor, cols_factor = 1 << ((log2 + 1) // 2), 1 << (log2 // 2)  # a * b = B
    h_rows = jnp.asarray(hadamard_matrix(rows_factor) / math.sqrt(rows_factor))
    h_cols = jnp.asarray(hadamard_matrix(cols_factor) / math.sqrt(cols_factor))
    grid = x.astype(jnp.float32).reshape(*x.shape[:-1], rows_factor, cols_factor)  # [..., a, b]
    rotated = jnp.einsum(
        "ij,...jk,kl->...il", h_rows, grid, h_cols, precision=lax.Precision.HIGHEST
    )  # [..., a, b]
    return rotated.reshape(x.shape)


def _code_sums(codes: jax.Array) -> jax.Array:
    """int8 [..., B] -> int32 [M, B]: every row times the (unnormalized) H_B, exact
    (|sum| <= 128 B); M is the number of rows."""
    block = codes.shape[-1]
    _check_block(block)
    if codes.dtype != jnp.int8:
        raise TypeError(f"the Hadamard transform of codes takes int8 codes, got {codes.dtype}")
    h = jnp.asarray(hadamard_matrix(block), jnp.int8)
    return jnp.dot(codes.reshape(-1, block), h, preferred_element_type=jnp.int32)  # [M, B]


def hadamard_scaled_codes(codes: jax.Array, scales: jax.Array, group: int = 1) -> jax.Array:
    """Dequantized block codes rotated: int8 codes [..., R, B] times f32 scales [..., R, 1]
    (one per row), every run of `group` consecutive rows (one vector of group * B elements, R
    a multiple of `group`) times the orthonormal H_{group B} / sqrt(group B) -> f32 [..., R, B].

    Sylvester's matrices factor as H_{kB} = H_k (x) H_B: one exact int8 product by H_B
    (int32 sums, `_code_sums`), then one elementwise pass (XLA fuses it) that scales each row by
    scale / sqrt(kB) and mixes a run's k rows by H_k as k-term sums and differences, joined
    along the run's axis (see the module doc for what that form is measured against). For
    B = 32, k = 2 and bf16 scales every term is exact and the sum is rounded once."""
    _check_block(group)
    *lead, rows, block = codes.shape
    if rows % group or scales.shape != (*lead, rows, 1):
        raise ValueError(
            f"need scales [..., R, 1] for codes [..., R, B] with R a multiple of {group}, got "
            f"codes {codes.shape}, scales {scales.shape}"
        )
    sums = _code_sums(codes).reshape(-1, rows // group, group, block)  # [M, R / k, k, B]
    norm = scales.astype(jnp.float32).reshape(-1, rows // group, group, 1) * (
        1.0 / math.sqrt(group * block)
    )
    scaled = sums.astype(jnp.float32) * norm  # [M, R / k, k, B]
    terms = [scaled[:, :, j : j + 1] for j in range(group)]  # row j of each run: [M, R / k, 1, B]
    h = hadamard_matrix(group)  # [k, k], +-1
    # Output row i of a run is sum_j H_k[i, j] * term j, the k rows joined along the run's
    # axis (as +-1 factors broadcast over the rows, the fused pass ran 2-3x slower).
    mixed = [
        functools.reduce(
            lambda acc, j, i=i: acc + terms[j] if h[i, j] > 0 else acc - terms[j],
            range(1, group),
            terms[0],
        )
        for i in range(group)
    ]
    return jnp.concatenate(mixed, axis=2).reshape(codes.shape)


@dataclasses.dataclass(frozen=True)
class HadamardRotation:
    """The orthonormal block Hadamard transform on consecutive groups of `block` elements of an
    array's last axis (its own inverse)."""

    block: int

    def __post_init__(self):
        _check_block(self.block)

    def divides(self, size: int) -> bool:
        """Whether groups of `block` tile a last axis of `size` elements exactly."""
        return size % self.block == 0

    def apply(self, x: jax.Array, *, out_dtype: jnp.dtype | None = None) -> jax.Array:
        """[..., K * block] -> the same shape, each group rotated (sums in f32), returned in
        `out_dtype` (default x's dtype)."""
        if not self.divides(x.shape[-1]):
            raise ValueError(
                f"the last axis ({x.shape[-1]}) must be a multiple of the rotation block "
                f"{self.block}"
            )
        groups = x.reshape(*x.shape[:-1], -1, self.block)  # [..., K, block]
        rotated = block_hadamard(groups).reshape(x.shape)
        return rotated.astype(x.dtype if out_dtype is None else out_dtype)
