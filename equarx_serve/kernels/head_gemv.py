"""A few rows times a bf16 table, the table read once: a native XLA:CPU kernel.

    logits = head_gemv.matmul(x, table)  # x [B, D], table [V, D] bfloat16 -> [B, V] float32

Gemma's output head in decode is x [B, D] times its tied embedding [V, D] with B = 1 to 8: a
memory-bound product (the table, 2 V D bytes, is read once; the FLOPs are 2 B V D). XLA:CPU's
dot runs it at about half the rate one core reads memory: it repacks the table on every call.
Measured at Gemma 3 270M's head per device, [B, 640] x [640, 131072], 2 host devices, medians
(2026-12-04, AVX512-BF16 build, another job running): B = 2: dot 20.4 ms, this kernel 15.1 ms
(a plain sum over the table: 11.5 ms); B = 8: 24.3 vs 20.1 ms; B = 9 (two passes): 26.9 vs
34.4 ms, so callers use the kernel up to `MAX_ROWS` rows. (B = 1 through XLA's matrix-vector
path: 240 ms.)

On CPU, `matmul` is a custom call into `head_gemv.cc` (algorithm and cost there), compiled on
first use (`native.py`: `c++ -O3 -march=native`, ~4 s, cached in
`$EQUARX_SERVE_CACHE/kernels`). Elsewhere (TPU, GPU), with `EQUARX_SERVE_NATIVE_KERNELS=0`, or
where the compiler fails (a warning, once), it is `reference`, the einsum.

Numerics: exact f32 products of the bf16 inputs, summed in f32, as XLA:CPU's bf16 dot does, in
another order: the two differ in the last bits of the f32 sums (tested). Where the CPU has
AVX512-BF16 (`vdpbf16ps`), denormal inputs and sums are flushed to zero.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

from equarx_serve.kernels.native import NativeKernel

__all__ = ["MAX_ROWS", "matmul", "native_available", "pays", "reference", "rows_times_table"]

MAX_ROWS = 8  # one pass over the table; above, XLA:CPU's dot is faster (see the module doc)
KERNEL = NativeKernel(
    Path(__file__).with_suffix(".cc"), "EquarxHeadGemv", "equarx_head_gemv", "XLA's dot"
)


def reference(x: jax.Array, table: jax.Array) -> jax.Array:
    """x [B, D], table [V, D] -> x table^T [B, V] in float32."""
    return jnp.einsum("BD,VD->BV", x, table, preferred_element_type=jnp.float32)


def native_available() -> bool:
    """Whether the CPU kernel is registered (compiling it on the first call), unless
    `EQUARX_SERVE_NATIVE_KERNELS=0`."""
    return KERNEL.available()


def pays(x: jax.Array, table: jax.Array) -> bool:
    """Whether `matmul` runs the kernel for x [B, D] and table [V, D] and it is the faster
    way: bf16 operands, at most `MAX_ROWS` rows, the kernel available."""
    rows = x.shape[0] if x.ndim == 2 else 0
    bf16 = x.dtype == table.dtype == jnp.bfloat16
    return 0 < rows <= MAX_ROWS and bf16 and native_available()


def _native(x: jax.Array, table: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], table.shape[0]), jnp.float32)
    logits = jax.ffi.ffi_call(KERNEL.target, out)(x, table)
    # Inside shard_map the result varies over the mesh axes its operands vary over.
    varying = tuple(jax.typeof(x).mat.varying | jax.typeof(table).mat.varying)
    return lax.pcast(logits, varying, to="varying") if varying else logits


def matmul(x: jax.Array, table: jax.Array) -> jax.Array:
    """x [B, D], table [V, D] -> [B, V] float32: the native kernel on CPU where it is available
    and both are bfloat16, else `reference` (see the module doc)."""
    if x.ndim != 2 or table.ndim != 2 or x.shape[1] != table.shape[1]:
        raise ValueError(f"want x [B, D] and table [V, D], got {x.shape} and {table.shape}")
    bf16 = x.dtype == table.dtype == jnp.bfloat16
    if not bf16 or not native_available():
        return reference(x, table)
    return lax.platform_dependent(x, table, cpu=_native, default=reference)


def rows_times_table(x: jax.Array, table: jax.Array) -> jax.Array:
    """x [B, D] times a table [V, D] stored output-major -> [B, V] in x's dtype, as XLA's dot
    gives it: the kernel where it `pays`, else XLA's dot. There a single row is computed as
    two (a zero row added, its result dropped): XLA:CPU's matrix-vector path for bf16 converts
    the whole table to f32 on every call (measured at Gemma 3 270M's head, [V/2 = 131072, 640]
    per device: 448 ms for 1 row, 25 ms for 2)."""
    if pays(x, table):
        return matmul(x, table).astype(x.dtype)
    if x.shape[0] == 1:
        return rows_times_table(jnp.concatenate([x, jnp.zeros_like(x)]), table)[:1]
    return lax.dot_general(x, table, (((1,), (1,)), ((), ())))
