"""Orthonormal block Hadamard rotation (fast Walsh-Hadamard transform).

`block_hadamard(x)` multiplies every row of B elements (B a power of two) by H_B / sqrt(B).
The matrix is symmetric and orthonormal, so the transform is its own inverse, and it is linear,
so it commutes with the all-reduce: rotate each device's input, reduce, rotate the result back.
It spreads a few large (outlier) channels over the whole block, which shrinks the block's
absmax relative to its RMS and with it the int8 rounding error.

Cost: log2(B) butterfly stages of one add and one subtract per element: B log2(B) FLOPs per row;
read and written once when XLA fuses the stages.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def block_hadamard(x: jax.Array) -> jax.Array:
    """[..., B] -> [..., B], each row times the orthonormal Hadamard matrix H_B / sqrt(B)."""
    block = x.shape[-1]
    if block & (block - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two block size, got {block}")
    lead = x.shape[:-1]
    y = x
    half = 1
    while half < block:
        # [..., B] -> [..., B / 2h, 2, h]: pairs (a, b) at distance h -> (a + b, a - b).
        y = y.reshape(*lead, block // (2 * half), 2, half)
        a, b = y[..., 0, :], y[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2)
        half *= 2
    return y.reshape(*lead, block) * (1.0 / math.sqrt(block))
