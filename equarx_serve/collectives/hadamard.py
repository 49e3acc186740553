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

`hadamard_codes(q)` rotates int8 codes (a block quantizer's, whose blocks are the rotation
groups: H (s q) = s (H q), so the inverse rotation of a decoded block is its scale times the
rotated codes): an int8 x int8 product with int32 sums, exact, then one multiply by
1/sqrt(B). Measured on XLA:CPU (`bench.rotation`: a decoded payload back to bf16, B = 64,
side by side): 17.2 ms at 16 MiB against 33.4 ms for dequantizing to f32 and the f32 product
(0.39 vs 0.59 ms at 1 MiB); the codes as bf16 with the exact 16-bit product ran as fast as
the int8 product at 16 MiB and 1.7x slower at 2 MiB (one side-by-side run).
"""

from __future__ import annotations

import dataclasses
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


def hadamard_codes(codes: jax.Array) -> jax.Array:
    """int8 [..., B] -> f32 [..., B], each row times the orthonormal H_B / sqrt(B): an int8
    product with int32 sums (exact: |sum| <= 127 B) scaled once by 1/sqrt(B), so the result
    is exact for B a power of 4 (B = 4, 16, 64, 256) and rounded once otherwise."""
    block = codes.shape[-1]
    _check_block(block)
    if codes.dtype != jnp.int8:
        raise TypeError(f"hadamard_codes rotates int8 codes, got {codes.dtype}")
    h = jnp.asarray(hadamard_matrix(block), jnp.int8)
    sums = jnp.dot(codes.reshape(-1, block), h, preferred_element_type=jnp.int32)  # [M, B]
    return (sums.astype(jnp.float32) * (1.0 / math.sqrt(block))).reshape(codes.shape)


def combine_rotated_blocks(rotated: jax.Array, group: int) -> jax.Array:
    """f32 [..., R, B] rows each already times H_B / sqrt(B), R a multiple of `group` -> every
    run of `group` consecutive rows (one vector of group * B elements) times
    H_{group B} / sqrt(group B). Sylvester's matrices factor as H_{kB} = H_k (x) H_B, so this
    is the [group, group] transform H_k / sqrt(k) across the rows of a run (k multiply-adds an
    element, f32)."""
    _check_block(group)
    if group == 1:
        return rotated
    *lead, rows, block = rotated.shape
    runs = rotated.reshape(*lead, rows // group, group, block)  # [..., R / k, k, B]
    h = jnp.asarray(hadamard_matrix(group) / math.sqrt(group), jnp.float32)
    mixed = jnp.einsum("ij,...jb->...ib", h, runs, precision=lax.Precision.HIGHEST)
    return mixed.reshape(rotated.shape)


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
