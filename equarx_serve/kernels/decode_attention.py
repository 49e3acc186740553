"""One decode step's attention over a bf16 KV cache, each visible entry read once: a native
XLA:CPU kernel.

    out = decode_attention.attend(query, key, value, first, last, softcap=None)
    # query [B, 1, N, H], key/value caches [B' >= B, S, K, H] bf16, first/last [B] int32
    # -> [B, 1, N, H]: softmax attention of each row over its cache entries first..last

A decode step's attention is memory-bound (each visible k/v entry is used by G = N / K
queries once), but XLA:CPU runs it as two small batched dots that copy the key cache into
another layout every step. Measured in Gemma 3 270M's decode step (TP = 2, 2 rows, a
512-entry cache, `--weights gguf`), a profile per device: 10.8 ms in the attention's dots plus
3.0 ms of cache copies, of a 50 ms step. The kernel (`decode_attention.cc`: algorithm and cost)
reads each visible entry once. The window of a local layer is the caller's `first`.

On CPU, `attend` is a custom call into `decode_attention.cc`, compiled on first use
(`native.py`). Elsewhere, with `EQUARX_SERVE_NATIVE_KERNELS=0` or where the compiler fails, it
is `reference`: the masked softmax over the whole cache, in the inputs' dtype. Callers keep
their own XLA formulation where `pays` is False (TPU/GPU programs, other dtypes).

Numerics: exact f32 products of the bf16 inputs summed in f32, each logit rounded to bf16
(as a bf16 einsum gives it), the softmax in f32 with each probability rounded to bf16, the
values' sum in f32 rounded to bf16: within bf16 roundings of the XLA formulation, which rounds
the softmax's intermediate steps to bf16 as well (tested).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from equarx_serve.kernels import native
from equarx_serve.kernels.native import NativeKernel

__all__ = ["MAX_GROUP", "attend", "native_available", "pays", "reference"]

MAX_GROUP = 8  # query heads a KV head (the kernel's registers)
MASKED = -2.3819763e38  # gemma's masked-logit value
KERNEL = NativeKernel(
    Path(__file__).with_suffix(".cc"), "EquarxDecodeAttention", "equarx_decode_attention",
    "XLA's dots",
)  # fmt: skip


def _check(query: jax.Array, key: jax.Array, value: jax.Array, first, last) -> None:
    b, t, n, h = query.shape if query.ndim == 4 else (None,) * 4
    ok = (
        query.ndim == 4
        and t == 1
        and key.ndim == 4
        and key.shape == value.shape
        and key.shape[0] >= b
        and key.shape[3] == h
        and n % key.shape[2] == 0
        and first.shape == last.shape == (b,)
    )
    if not ok:
        raise ValueError(
            "want query [B, 1, N, H], key and value [B' >= B, S, K, H] (K dividing N), first and "
            f"last [B]; got {query.shape}, {key.shape}, {value.shape}, {first.shape}, "
            f"{last.shape}"
        )


def reference(query, key, value, first, last, *, softcap: float | None = None) -> jax.Array:
    """The same attention as XLA ops, in the inputs' dtype: logits over the whole cache, the
    entries outside first..last masked."""
    _check(query, key, value, first, last)
    b, _, n, h = query.shape
    k = key.shape[2]
    key, value = key[:b], value[:b]  # the query's rows
    grouped = query.reshape(b, k, n // k, h)  # [B, K, G, H]
    logits = jnp.einsum("BKGH,BSKH->BKGS", grouped, key)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    index = jnp.arange(key.shape[1])[None, :]  # [1, S]
    visible = (index >= first[:, None]) & (index <= last[:, None])  # [B, S]
    logits = jnp.where(visible[:, None, None, :], logits, MASKED)
    probs = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    encoded = jnp.einsum("BKGS,BSKH->BKGH", probs, value)
    return encoded.reshape(b, 1, n, h)


def native_available() -> bool:
    """Whether the CPU kernel is registered (compiling it on the first call), unless
    `EQUARX_SERVE_NATIVE_KERNELS=0`."""
    return KERNEL.available()


def pays(query: jax.Array, key: jax.Array) -> bool:
    """Whether `attend` runs the kernel for these operands in the program being traced: a
    CPU program (`native.target_platform`), bf16 query and cache, at most `MAX_GROUP` query
    heads a KV head, the kernel available."""
    bf16 = query.dtype == key.dtype == jnp.bfloat16
    small_group = query.ndim == key.ndim == 4 and query.shape[2] // key.shape[2] <= MAX_GROUP
    on_cpu = native.target_platform() == "cpu"
    return bf16 and small_group and on_cpu and native_available()


def _native(query, key, value, first, last, *, softcap):
    b, _, n, h = query.shape
    out = jax.ShapeDtypeStruct((b, n, h), jnp.bfloat16)
    call = jax.ffi.ffi_call(KERNEL.target, out)
    attended = call(
        query.reshape(b, n, h),
        key,
        value,
        first.astype(jnp.int32),
        last.astype(jnp.int32),
        softcap=np.float32(softcap or 0.0),
    )
    varying = set()
    for operand in (query, key, value, first, last):
        varying |= jax.typeof(operand).mat.varying
    attended = attended.reshape(b, 1, n, h)
    return lax.pcast(attended, tuple(varying), to="varying") if varying else attended


def attend(query, key, value, first, last, *, softcap: float | None = None) -> jax.Array:
    """query [B, 1, N, H] over each row's cache entries first[b]..last[b] (inclusive) of
    key/value [B' >= B, S, K, H] (the first B rows; the kernel reads them in place, with no
    slice copied) -> [B, 1, N, H]: the kernel where `pays`, else `reference`."""
    _check(query, key, value, first, last)
    if not pays(query, key):
        return reference(query, key, value, first, last, softcap=softcap)

    def native_call(*operands):
        return _native(*operands, softcap=softcap)

    def fallback(*operands):
        return reference(*operands, softcap=softcap)

    return lax.platform_dependent(query, key, value, first, last, cpu=native_call, default=fallback)
