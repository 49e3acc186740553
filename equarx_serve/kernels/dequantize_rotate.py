"""One-shot EQuARX's last step, fused: dequantize K payloads, sum them, rotate back, to bf16.

    out = dequantize_rotate.apply(packed, block=64, hadamard=True)
    # packed u8 [K, M * (B + 4)]: payload k = its codes int8 [M, B], then its scales f32 [M]
    # -> bf16 [M, B]: out[m] = bf16(H_B (sum_k scales[k, m] * codes[k, m]) / sqrt(B))

In a one-shot all-reduce every device all-gathers the N int8 payloads and turns them into its
output; with the Hadamard rotation that is a decode, a sum in rank order, the inverse rotation
(H_B / sqrt(B), its own inverse) and a cast. As XLA ops on CPU the rotation is a dense [B, B]
product (B multiply-adds an element), and the codes and scales are first copied out of the
all-gathered bytes; here the kernel reads the all-gathered bytes as they are (`pack`'s layout,
the one `ring.all_gather_payload` sends) and does the rest in one pass, with the fast
Walsh-Hadamard transform (log2(B) adds an element; algorithm, order of the arithmetic and cost
in `dequantize_rotate.cc`). Measured, 8 Mi elements (16 MiB of bf16 out),
K = 2, B = 64, one process: 6.3 ms (one thread, AVX-512 build) vs 33.5 ms for the XLA ops (two
threads); the results differ from those ops' in one bf16 rounding in 0.015% of the elements.

On CPU `apply` is a custom call into the kernel, built on first use (`native.py`); elsewhere,
with `EQUARX_SERVE_NATIVE_KERNELS=0` or without a C++ compiler it is `reference`, the same
arithmetic in the same order as jnp ops (the same bits, tested).
"""

from __future__ import annotations

import functools
import operator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from equarx_serve.kernels.block_quantize import NONFINITE_CODE
from equarx_serve.kernels.native import NativeKernel

__all__ = ["MAX_BLOCK", "apply", "pack", "pays", "reference", "unpack"]

MAX_BLOCK = 256
KERNEL = NativeKernel(
    Path(__file__).with_suffix(".cc"),
    "EquarxDequantizeRotate",
    "equarx_dequantize_rotate",
    "XLA's dequantize and dense rotation",
    extra_flags=("-ffp-contract=off",),  # no fused multiply-adds: the reference's bits
)


def pack(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """codes int8 [K, M, B], scales f32 [K, M] -> packed u8 [K, M * (B + 4)]: each payload's
    codes, then its scales (as `ring.all_gather_payload` packs a (codes, scales) payload)."""
    k = codes.shape[0]
    as_bytes = (lax.bitcast_convert_type(a, jnp.uint8).reshape(k, -1) for a in (codes, scales))
    return jnp.concatenate(list(as_bytes), axis=1)


def unpack(packed: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """`pack`'s inverse: packed u8 [K, M * (B + 4)] -> (codes int8 [K, M, B], scales f32 [K, M])."""
    _check(packed, block)
    k, m = packed.shape[0], packed.shape[1] // (block + 4)
    codes = lax.bitcast_convert_type(packed[:, : m * block], jnp.int8).reshape(k, m, block)
    raw_scales = packed[:, m * block :].reshape(k, m, 4)
    return codes, lax.bitcast_convert_type(raw_scales, jnp.float32)


def _check(packed: jax.Array, block: int) -> None:
    if not isinstance(block, int) or not 2 <= block <= MAX_BLOCK or block & (block - 1):
        raise ValueError(f"block must be a power of two from 2 to {MAX_BLOCK}, got {block!r}")
    if packed.dtype != jnp.uint8 or packed.ndim != 2 or packed.shape[0] < 1:
        raise ValueError(f"want packed payloads u8 [K, bytes], got {packed.dtype} {packed.shape}")
    if packed.shape[1] % (block + 4):
        raise ValueError(
            f"a payload of {packed.shape[1]} bytes is not whole rows of {block} codes + a scale"
        )


def _walsh_hadamard(v: jax.Array) -> jax.Array:
    """v [M, B] -> H_B v / sqrt(B) per row, as the kernel: stride B/2 first, halved after
    every second stage, a last 1/sqrt(2) for odd log2(B)."""
    rows, block = v.shape
    half, stage = block // 2, 0
    while half >= 1:
        pairs = v.reshape(rows, block // (2 * half), 2, half)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        v = jnp.stack([a + b, a - b], axis=2).reshape(rows, block)
        half, stage = half // 2, stage + 1
        if stage % 2 == 0:
            v = v * np.float32(0.5)
    return v * (np.float32(1.0) / np.sqrt(np.float32(2.0))) if stage % 2 else v


def reference(packed: jax.Array, *, block: int, hadamard: bool) -> jax.Array:
    """packed u8 [K, M * (B + 4)] -> bf16 [M, B] (see the module doc), as jnp ops."""
    codes, scales = unpack(packed, block)
    decoded = codes.astype(jnp.float32) * scales[..., None]
    decoded = jnp.where(codes == NONFINITE_CODE, jnp.nan, decoded)
    summed = functools.reduce(operator.add, [decoded[k] for k in range(codes.shape[0])])
    return (_walsh_hadamard(summed) if hadamard else summed).astype(jnp.bfloat16)


def pays(block: int) -> bool:
    """Whether `apply` runs the kernel for rows of `block`: the default backend is the CPU, the
    block is one the kernel takes, and the kernel is available (built on the first call)."""
    fits = 2 <= block <= MAX_BLOCK and not block & (block - 1)
    return fits and jax.default_backend() == "cpu" and KERNEL.available()


def _native(packed: jax.Array, *, block: int, hadamard: bool) -> jax.Array:
    rows = packed.shape[1] // (block + 4)
    out = jax.ShapeDtypeStruct((rows, block), jnp.bfloat16)
    attrs = dict(block=np.int64(block), hadamard=np.int64(hadamard))
    result = jax.ffi.ffi_call(KERNEL.target, out)(packed, **attrs)
    # Inside shard_map the result varies over the mesh axes its operand varies over.
    varying = tuple(jax.typeof(packed).mat.varying)
    return lax.pcast(result, varying, to="varying") if varying else result


def apply(packed: jax.Array, *, block: int, hadamard: bool) -> jax.Array:
    """packed u8 [K, M * (B + 4)] -> bf16 [M, B]: the kernel on CPU where it is available, else
    `reference` (the same bits)."""
    _check(packed, block)
    kernel = functools.partial(_native, block=block, hadamard=hadamard)
    fallback = functools.partial(reference, block=block, hadamard=hadamard)
    if not KERNEL.available():
        return fallback(packed)
    return lax.platform_dependent(packed, cpu=kernel, default=fallback)
