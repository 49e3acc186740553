"""EQuARX's steps on CPU as native kernels. One-shot's two: rotate-quantize-pack, and
dequantize-sum-rotate. Two-shot's three: `rotate_quantize_chunks` (every chunk of a lane
encoded), `reduce_chunk` (the own chunk plus the received payloads, re-quantized) and
`decode_rotate_each` (each all-gathered chunk decoded and rotated back).

    packed = one_shot.rotate_quantize(x, hadamard=True)
    # x bf16 [M, B] -> u8 [M * (B + 4)]: the codes int8 [M, B] of each row rotated by
    # H_B / sqrt(B), then their f32 scales [M] (the bytes `ring.pack_payload` sends)
    out = one_shot.dequantize_rotate(gathered, block=B, hadamard=True)
    # gathered u8 [K, M * (B + 4)], K such payloads -> bf16 [M, B]:
    # out[m] = bf16(H_B (sum_k scales[k, m] * codes[k, m]) / sqrt(B))
    # (both also with scale_dtype="bfloat16": 2-byte scales, rounded up)

    # The same on a slice of a message, in place: rows of B elements from element `start` of
    # the flat message (zeros past its end), decoded into the flat output from `start` on.
    packed = one_shot.rotate_quantize_rows(message, block=B, start=start, rows=M, hadamard=True)
    out = one_shot.dequantize_rotate_into(out, gathered, block=B, start=start, hadamard=True)

    # Two-shot (N chunks of M rows a lane; groups of G = 64, blocks of 32, bf16 scales):
    sent = one_shot.rotate_quantize_chunks(lanes, block=32, group=64, scale_dtype="bfloat16",
                                           hadamard=True, start=start, rows=M, chunks=N)
    reduced = one_shot.reduce_chunk(lanes, own_start, received, block=32, group=64,
                                    scale_dtype="bfloat16", hadamard=True, rows=M)
    # ... or in pieces of the chunk's rows: m rows from row `first`, against rows firsts[k] on
    # of received payload k; each all-gathered piece decoded into its rows of every chunk of one
    # buffer (XLA aliases `into` to the result; the first piece's `into` a ShapeDtypeStruct)
    piece = one_shot.reduce_chunk(lanes, own_start + first * 32, received, rows=m,
                                  firsts=[first] * len(received), ...)
    out = one_shot.decode_rotate_each(gathered_piece, block=32, group=64,
                                      scale_dtype="bfloat16", into=out, first=first)

In a one-shot all-reduce every device quantizes its whole message once, all-gathers the N
payloads and turns them into its output. As XLA ops on CPU that is a dense [B, B] product by H
(B multiply-adds an element) before quantizing and after the sum, and copies to pack the codes
and scales into one buffer and to unpack them after the all-gather. Here each step is one pass
over the data: the rotation is the fast Walsh-Hadamard transform (log2(B) adds an element), the
quantizer writes the packed payload, and the decoder reads the all-gathered bytes as they are
(algorithm, order of the arithmetic and cost in `one_shot.cc`). Measured, 8 Mi elements (16 MiB
of bf16), B = 64, one process: the decode of K = 2 payloads 6.3 ms (one thread, AVX-512 build)
vs 33.5 ms for the XLA ops (two threads); the model's all-reduce of 16 MiB on 2 fake devices
77.6 -> 21.8 ms with the decode kernel.

Two-shot's `reduce_chunk` (also its encode of each chunk it sends: nothing received) and
`decode_rotate_each` run asynchronously: each call on a thread of its own, so that XLA:CPU goes
on with the next collective meanwhile (why, and what it measured: `one_shot.cc`, `Later`).

On CPU the functions are custom calls into the kernels, built on first use (`native.py`);
elsewhere, with `EQUARX_SERVE_NATIVE_KERNELS=0` or without a C++ compiler they are the
`*_reference` functions: the same arithmetic in the same order as jnp ops, the same bits
(tested). Those differ from the dense product's in the last bit of a few values.
"""

from __future__ import annotations

import ctypes
import functools
import operator
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from equarx_serve.kernels import block_quantize
from equarx_serve.kernels.block_quantize import NONFINITE_CODE
from equarx_serve.kernels.native import NativeKernel, target_platform

__all__ = [
    "MAX_BLOCK",
    "decode_rotate_each",
    "decode_rotate_each_reference",
    "decodes_each",
    "dequantize_rotate",
    "dequantize_rotate_into",
    "dequantize_rotate_reference",
    "pack",
    "pays",
    "quantizes_chunks",
    "reduce_chunk",
    "rotate_quantize",
    "rotate_quantize_chunks",
    "rotate_quantize_reference",
    "rotate_quantize_rows",
    "unpack",
    "vectorized",
]

MAX_BLOCK = 256
_SOURCE = Path(__file__).with_suffix(".cc")
_FLAGS = ("-ffp-contract=off",)  # no fused multiply-adds: the references' bits
DEQUANTIZE = NativeKernel(
    _SOURCE, "EquarxDequantizeRotate", "equarx_dequantize_rotate", "XLA's ops", _FLAGS
)
DEQUANTIZE_INTO = NativeKernel(
    _SOURCE, "EquarxDequantizeRotateInto", "equarx_dequantize_rotate_into", "XLA's ops", _FLAGS
)
QUANTIZE = NativeKernel(
    _SOURCE, "EquarxRotateQuantize", "equarx_rotate_quantize", "XLA's ops", _FLAGS
)
REDUCE_CHUNK = NativeKernel(
    _SOURCE, "EquarxReduceChunk", "equarx_reduce_chunk", "XLA's ops", _FLAGS
)
DECODE_EACH = NativeKernel(
    _SOURCE, "EquarxDecodeRotateEach", "equarx_decode_rotate_each", "XLA's ops", _FLAGS
)
DECODE_EACH_INTO = NativeKernel(
    _SOURCE, "EquarxDecodeRotateEachInto", "equarx_decode_rotate_each_into", "XLA's ops", _FLAGS
)
_SCALE_BYTES = {"float32": 4, "bfloat16": 2}


def pack(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """codes int8 [K, M, B], scales f32 (or bf16) [K, M] -> packed u8 [K, M * (B + 4 (or 2))]:
    each payload's codes, then its scales (as `ring.pack_payload` packs a (codes, scales)
    payload)."""
    k = codes.shape[0]
    as_bytes = (lax.bitcast_convert_type(a, jnp.uint8).reshape(k, -1) for a in (codes, scales))
    return jnp.concatenate(list(as_bytes), axis=1)


def unpack(
    packed: jax.Array, block: int, scale_dtype: str = "float32"
) -> tuple[jax.Array, jax.Array]:
    """`pack`'s inverse: packed u8 [K, M * (B + S)] -> (codes int8 [K, M, B], scales f32 [K, M]),
    S the bytes of a `scale_dtype` scale."""
    return _split(packed, _packed_rows(packed, block, scale_dtype), block, scale_dtype)


def _split(packed: jax.Array, m: int, block: int, scale_dtype: str) -> tuple[jax.Array, jax.Array]:
    """Packed u8 [K, M * (B + S)] (checked) -> (codes int8 [K, M, B], scales f32 [K, M]), S the
    bytes of a `scale_dtype` scale."""
    k, scale_bytes = packed.shape[0], _SCALE_BYTES[scale_dtype]
    codes = lax.bitcast_convert_type(packed[:, : m * block], jnp.int8).reshape(k, m, block)
    raw_scales = packed[:, m * block :].reshape(k, m, scale_bytes)
    scales = lax.bitcast_convert_type(raw_scales, jnp.dtype(scale_dtype))
    return codes, scales.astype(jnp.float32)


def _check_block(block: int) -> None:
    if not isinstance(block, int) or not 2 <= block <= MAX_BLOCK or block & (block - 1):
        raise ValueError(f"block must be a power of two from 2 to {MAX_BLOCK}, got {block!r}")


def _packed_rows(packed: jax.Array, block: int, scale_dtype: str) -> int:
    """M, the rows of each payload of packed u8 [K, M * (B + S)]; ValueError unless it is
    that."""
    _check_block(block)
    _check_scale_dtype(scale_dtype)
    if packed.dtype != jnp.uint8 or packed.ndim != 2 or packed.shape[0] < 1:
        raise ValueError(f"want packed payloads u8 [K, bytes], got {packed.dtype} {packed.shape}")
    if packed.shape[1] % (block + _SCALE_BYTES[scale_dtype]):
        raise ValueError(
            f"a payload of {packed.shape[1]} bytes is not whole rows of {block} codes + a "
            f"{scale_dtype} scale"
        )
    return packed.shape[1] // (block + _SCALE_BYTES[scale_dtype])


def _check_rows(x: jax.Array) -> None:
    if x.dtype != jnp.bfloat16 or x.ndim != 2:
        raise ValueError(f"want rows bf16 [M, B], got {x.dtype} {x.shape}")
    _check_block(x.shape[1])


def _walsh_hadamard(v: jax.Array) -> jax.Array:
    """v [M, B] f32 -> H_B v / sqrt(B) per row, as the kernels: stride B/2 first, halved after
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


def rotate_quantize_reference(
    x: jax.Array, *, hadamard: bool, scale_dtype: str = "float32"
) -> jax.Array:
    """x bf16 [M, B] -> packed u8 [M * (B + S)] (see the module doc), as jnp ops."""
    _check_rows(x)
    _check_scale_dtype(scale_dtype)
    block = x.shape[1]
    codec = dict(block=block, group=block, hadamard=hadamard, scale_dtype=scale_dtype)
    return _quantize_reference(x, **codec).reshape(-1)


def _quantize_reference(
    values: jax.Array,
    *,
    block: int,
    group: int,
    hadamard: bool,
    scale_dtype: str = "float32",
    received: tuple = (),
    chunks: int = 1,
) -> jax.Array:
    """The kernels' encode as jnp ops: values (any shape, read flat, whole groups) in f32,
    each group of `group` rotated (`hadamard`), plus the `received` (codes, scales [R, 1])
    payloads, quantized in rows of `block` -> packed u8 [chunks, bytes] (`pack`)."""
    values = values.reshape(-1).astype(jnp.float32)
    if hadamard:
        values = _walsh_hadamard(values.reshape(-1, group))
    codes, scales = block_quantize.accumulate_quantize_reference(
        values.reshape(-1, block), received, scale_dtype=scale_dtype
    )
    return pack(codes.reshape(chunks, -1, block), scales.reshape(chunks, -1))


def dequantize_rotate_reference(
    packed: jax.Array, *, block: int, hadamard: bool, scale_dtype: str = "float32"
) -> jax.Array:
    """packed u8 [K, M * (B + S)] -> bf16 [M, B] (see the module doc), as jnp ops."""
    codes, scales = unpack(packed, block, scale_dtype)
    decoded = codes.astype(jnp.float32) * scales[..., None]
    decoded = jnp.where(codes == NONFINITE_CODE, jnp.nan, decoded)
    summed = functools.reduce(operator.add, [decoded[k] for k in range(codes.shape[0])])
    return (_walsh_hadamard(summed) if hadamard else summed).astype(jnp.bfloat16)


def _each_rows(packed: jax.Array, block: int, group: int, scale_dtype: str) -> tuple[int, int]:
    """(K, M) of packed u8 [K, M * (B + S)], S the scale bytes of `scale_dtype`; ValueError
    unless the rows make whole groups of `group` elements."""
    _check_block(group)
    _check_scale_dtype(scale_dtype)
    if not isinstance(block, int) or block < 1 or block & (block - 1) or group % block:
        raise ValueError(f"block must be a power of two dividing group {group}, got {block!r}")
    per_row = block + _SCALE_BYTES[scale_dtype]
    if packed.dtype != jnp.uint8 or packed.ndim != 2 or packed.shape[0] < 1:
        raise ValueError(f"want packed payloads u8 [K, bytes], got {packed.dtype} {packed.shape}")
    if packed.shape[1] % per_row or (packed.shape[1] // per_row) % (group // block):
        raise ValueError(
            f"a payload of {packed.shape[1]} bytes is not whole groups of {group // block} rows "
            f"of {block} codes + a {scale_dtype} scale"
        )
    return packed.shape[0], packed.shape[1] // per_row


def decode_rotate_each_reference(
    packed: jax.Array, *, block: int, group: int, scale_dtype: str
) -> jax.Array:
    """packed u8 [K, M * (B + S)], K payloads of different chunks -> bf16 [K, M, B]: each
    decoded on its own and rotated back in groups of `group` elements, as jnp ops."""
    k, m = _each_rows(packed, block, group, scale_dtype)
    codes, scales = _split(packed, m, block, scale_dtype)
    decoded = jnp.where(
        codes == NONFINITE_CODE, jnp.nan, codes.astype(jnp.float32) * scales[..., None]
    )
    rotated = _walsh_hadamard(decoded.reshape(-1, group))
    return rotated.astype(jnp.bfloat16).reshape(k, m, block)


def decodes_each(block: int, group: int) -> bool:
    """Whether `decode_rotate_each` is the faster way for these rows: the CPU, an AVX-512 build
    of the kernels, and the form its vector loop takes (groups of 64 of blocks of 16 to 64)."""
    fits = group == 64 and block in (16, 32, 64)
    return fits and target_platform() == "cpu" and DECODE_EACH.available() and vectorized()


def decode_rotate_each(
    packed: jax.Array,
    *,
    block: int,
    group: int,
    scale_dtype: str,
    held: Sequence[jax.Array] = (),
    into: jax.Array | jax.ShapeDtypeStruct | None = None,
    first: int = 0,
) -> jax.Array:
    """Two-shot's last step: packed u8 [K, M * (B + S)] (K all-gathered chunk payloads, codes
    then scales) -> bf16 [K, M, B], each chunk decoded and rotated back in groups of `group`:
    the kernel on CPU where it is available, else `decode_rotate_each_reference` (the same
    bits). `held`: arrays the kernel takes without reading them, as `dequantize_rotate_into`.
    With `into` (bf16 [K, R, B], R >= first + M): into with rows first .. first + M - 1 of
    each chunk replaced by the decoded rows, so that the pieces of an all-gather (rows of every
    chunk) fill one buffer: XLA aliases `into` to the result (no copy); a ShapeDtypeStruct is a
    new buffer whose other rows are left unset (zeros without the kernel), for the first piece."""
    k, m = _each_rows(packed, block, group, scale_dtype)
    _check_start(first)
    attrs = dict(
        block=np.int64(block),
        group=np.int64(group),
        scale_bytes=np.int64(_SCALE_BYTES[scale_dtype]),
        first=np.int64(first),
    )
    codec = dict(block=block, group=group, scale_dtype=scale_dtype)
    if into is None:
        out = jax.ShapeDtypeStruct((k, m, block), jnp.bfloat16)
        native = functools.partial(_call, DECODE_EACH, out=out, **attrs)
        reference = lambda packed, *held: decode_rotate_each_reference(packed, **codec)
        return _native_or(reference, DECODE_EACH, native, packed, *held)
    if into.dtype != jnp.bfloat16 or into.ndim != 3 or into.shape[::2] != (k, block):
        raise ValueError(f"want into bf16 [{k}, R, {block}], got {into.dtype} {into.shape}")
    if into.shape[1] < first + m:
        raise ValueError(f"rows {first} .. {first + m - 1} are past into's {into.shape[1]}")
    out = jax.ShapeDtypeStruct(into.shape, jnp.bfloat16)

    def reference(packed: jax.Array, into: jax.Array, *held: jax.Array) -> jax.Array:
        return into.at[:, first : first + m].set(decode_rotate_each_reference(packed, **codec))

    if isinstance(into, jax.ShapeDtypeStruct):
        native = functools.partial(_call, DECODE_EACH, out=out, **attrs)
        fresh = lambda packed, *held: reference(packed, jnp.zeros(out.shape, out.dtype))
        return _native_or(fresh, DECODE_EACH, native, packed, *held)
    native = functools.partial(_call, DECODE_EACH_INTO, out=out, aliases={1: 0}, **attrs)
    return _native_or(reference, DECODE_EACH_INTO, native, packed, into, *held)


def pays(block: int) -> bool:
    """Whether the kernels are the faster way for rows of `block`: the program is traced for
    the CPU (`target_platform`), the block is one the kernels take, they are available (built
    on the first call) and built with AVX-512 (`vectorized`)."""
    fits = 2 <= block <= MAX_BLOCK and not block & (block - 1)
    return fits and target_platform() == "cpu" and DEQUANTIZE.available() and vectorized()


@functools.cache
def vectorized() -> bool:
    """Whether the kernels' build has the AVX-512 loops. Without them (a CPU without AVX-512)
    the plain loops give the same bits but run slower than XLA's own ops: 8 Mi elements, one
    thread, quantize 66 vs 6 ms with AVX-512, decode 43 vs 7 ms, where XLA's ops for both took
    ~39 ms a device (16 MiB, 2 fake devices)."""
    library = ctypes.cdll.LoadLibrary(str(DEQUANTIZE.build()))
    return bool(library.EquarxOneShotVectorized())


def _call(
    kernel: NativeKernel,
    *operands: jax.Array,
    out: jax.ShapeDtypeStruct,
    aliases: dict[int, int] | None = None,
    **attrs,
) -> jax.Array:
    call = jax.ffi.ffi_call(kernel.target, out, input_output_aliases=aliases)
    # Inside shard_map the result varies over the mesh axes its operands vary over.
    varying = set().union(*(jax.typeof(a).mat.varying for a in operands))
    result = call(*(_vary(a, varying) for a in operands), **attrs)
    return _vary(result, varying)


def _vary(a: jax.Array, axes: set) -> jax.Array:
    """a, marked as varying over `axes` (inside shard_map) where it does not already."""
    missing = tuple(sorted(axes - set(jax.typeof(a).mat.varying)))
    return lax.pcast(a, missing, to="varying") if missing else a


def _native_or(reference, kernel: NativeKernel, native, *operands: jax.Array) -> jax.Array:
    """`native` on CPU where the kernel is available, else `reference`."""
    if not kernel.available():
        return reference(*operands)
    return lax.platform_dependent(*operands, cpu=native, default=reference)


def rotate_quantize(x: jax.Array, *, hadamard: bool) -> jax.Array:
    """x bf16 [M, B] -> packed u8 [M * (B + 4)]: the kernel on CPU where it is available, else
    `rotate_quantize_reference` (the same bits)."""
    _check_rows(x)
    return rotate_quantize_rows(x, block=x.shape[1], start=0, rows=x.shape[0], hadamard=hadamard)


def rotate_quantize_rows(
    x: jax.Array,
    *,
    block: int,
    start: int,
    rows: int,
    hadamard: bool,
    scale_dtype: str = "float32",
    held: Sequence[jax.Array] = (),
) -> jax.Array:
    """`rotate_quantize` of `rows` rows of `block` elements of x (bf16, any shape, read flat)
    from element `start` on, zeros past x's end: a slice of a message (and its padding) encoded
    straight from the message, with no copy of the slice, with `scale_dtype` scales (bfloat16:
    rounded up). -> packed u8 [rows * (block + S)], S the scale's bytes. `held`: arrays the
    kernel takes without reading them, as `dequantize_rotate_into`."""
    packed = rotate_quantize_chunks(
        x,
        block=block,
        start=start,
        rows=rows,
        chunks=1,
        hadamard=hadamard,
        scale_dtype=scale_dtype,
        held=held,
    )
    return packed.reshape(-1)


def rotate_quantize_chunks(
    x: jax.Array,
    *,
    block: int,
    start: int,
    rows: int,
    chunks: int,
    hadamard: bool,
    group: int | None = None,
    scale_dtype: str = "float32",
    held: Sequence[jax.Array] = (),
) -> jax.Array:
    """`chunks` payloads of `rows` rows of `block` elements each, from x (bf16, any shape,
    read flat): payload c holds the elements start + c * rows * block on (zeros past x's end),
    each group of `group` elements (default: block) rotated (`hadamard`), then quantized with
    `scale_dtype` scales (bfloat16: rounded up) -> packed u8 [chunks, rows * (block + S)] (S the
    scale's bytes; codes, then scales, as `ring.pack_payload` lays out a payload). Two-shot's
    chunks of a lane in one pass, from the message itself. The kernel on CPU where it is
    available, else the same arithmetic as jnp ops (the same bits). `held`: arrays the kernel
    takes without reading them, as `dequantize_rotate_into`."""
    group = group or block
    _check_chunks(x, block, group, scale_dtype, start, rows, chunks)
    codec = dict(block=block, group=group, hadamard=hadamard, scale_dtype=scale_dtype)
    scale_bytes = _SCALE_BYTES[scale_dtype]
    out = jax.ShapeDtypeStruct((chunks, rows * (block + scale_bytes)), jnp.uint8)
    attrs = dict(
        block=np.int64(block),
        group=np.int64(group),
        scale_bytes=np.int64(scale_bytes),
        hadamard=np.int64(hadamard),
        start=np.int64(start),
        chunks=np.int64(chunks),
    )
    native = functools.partial(_call, QUANTIZE, out=out, **attrs)

    def reference(x: jax.Array, *held: jax.Array) -> jax.Array:
        total = chunks * rows * block
        flat = x.reshape(-1)[start : start + total]
        values = jnp.pad(flat, (0, total - flat.size))
        return _quantize_reference(values, chunks=chunks, **codec)

    return _native_or(reference, QUANTIZE, native, x, *held)


def reduce_chunk(
    x: jax.Array,
    start: jax.Array | int,
    received: Sequence[jax.Array],
    *,
    block: int,
    rows: int,
    hadamard: bool,
    group: int | None = None,
    scale_dtype: str = "float32",
    firsts: Sequence[int] | None = None,
) -> jax.Array:
    """Two-shot's owner step: `rows` rows of `block` elements of x (bf16, any shape, read flat)
    from element `start` (traced; zeros past x's end), each group of `group` rotated
    (`hadamard`), plus the `received` payloads (u8 [R * (block + S)] each, as
    `rotate_quantize_chunks` lays one out) decoded and added in order in f32, quantized into one
    such payload -> u8 [rows * (block + S)]. Payload k adds its rows firsts[k] .. firsts[k] +
    rows - 1 (default: all from row 0), so that a piece of a chunk reduces against the whole
    chunks received, or against the piece of one that travelled on its own. The kernel on CPU
    where it is available, else the same arithmetic as jnp ops (the same bits)."""
    group = group or block
    _check_chunks(x, block, group, scale_dtype, 0, rows, 1)
    firsts = [0] * len(received) if firsts is None else list(firsts)
    if len(firsts) != len(received):
        raise ValueError(f"want a first row per received payload, got {firsts} for {len(received)}")
    codec = dict(block=block, group=group, hadamard=hadamard, scale_dtype=scale_dtype)
    per_row = block + _SCALE_BYTES[scale_dtype]
    for payload, first in zip(received, firsts, strict=True):
        _check_start(first)
        whole = payload.ndim == 1 and payload.shape[0] % per_row == 0
        if payload.dtype != jnp.uint8 or not whole or payload.shape[0] // per_row < first + rows:
            raise ValueError(
                f"want received payloads u8 [R * {per_row}] with R >= {first + rows} (rows "
                f"{first} .. {first + rows - 1} are added), got {payload.dtype} {payload.shape}"
            )
    start = jnp.asarray(start, jnp.int32)
    out = jax.ShapeDtypeStruct((rows * per_row,), jnp.uint8)
    attrs = dict(
        block=np.int64(block),
        group=np.int64(group),
        scale_bytes=np.int64(per_row - block),
        hadamard=np.int64(hadamard),
        firsts=np.asarray(firsts, np.int64),
    )
    native = functools.partial(_call, REDUCE_CHUNK, out=out, **attrs)

    def reference(x: jax.Array, start: jax.Array, *received: jax.Array) -> jax.Array:
        flat = jnp.pad(x.reshape(-1), (0, rows * block))
        values = lax.dynamic_slice_in_dim(flat, start, rows * block)
        payloads = []
        for payload, first in zip(received, firsts, strict=True):
            codes, scales = _split(payload[None], payload.shape[0] // per_row, block, scale_dtype)
            piece = slice(first, first + rows)
            payloads.append((codes[0, piece], scales[0, piece][:, None]))
        return _quantize_reference(values, received=tuple(payloads), **codec)[0]

    return _native_or(reference, REDUCE_CHUNK, native, x, start, *received)


def quantizes_chunks(block: int, group: int) -> bool:
    """Whether `rotate_quantize_chunks` is the faster way for these rows: the CPU, an AVX-512
    build of the kernels, and the form its vector loop takes (groups of 64 of blocks of 16 to
    64)."""
    fits = group == 64 and block in (16, 32, 64)
    native = QUANTIZE.available() and REDUCE_CHUNK.available()
    return fits and target_platform() == "cpu" and native and vectorized()


def dequantize_rotate(
    packed: jax.Array, *, block: int, hadamard: bool, scale_dtype: str = "float32"
) -> jax.Array:
    """packed u8 [K, M * (B + S)] (S the bytes of a `scale_dtype` scale) -> bf16 [M, B]: the
    kernel on CPU where it is available, else `dequantize_rotate_reference` (the same bits)."""
    rows = _packed_rows(packed, block, scale_dtype)
    out = jax.ShapeDtypeStruct((rows, block), jnp.bfloat16)
    attrs = _decode_attrs(block, scale_dtype, hadamard, start=0)
    native = functools.partial(_call, DEQUANTIZE, out=out, **attrs)
    reference = functools.partial(
        dequantize_rotate_reference, block=block, hadamard=hadamard, scale_dtype=scale_dtype
    )
    return _native_or(reference, DEQUANTIZE, native, packed)


def _decode_attrs(block: int, scale_dtype: str, hadamard: bool, start: int) -> dict:
    """The attributes of the DEQUANTIZE kernels."""
    return dict(
        block=np.int64(block),
        scale_bytes=np.int64(_SCALE_BYTES[scale_dtype]),
        hadamard=np.int64(hadamard),
        start=np.int64(start),
    )


def dequantize_rotate_into(
    out: jax.Array | jax.ShapeDtypeStruct,
    packed: jax.Array,
    *,
    block: int,
    start: int,
    hadamard: bool,
    scale_dtype: str = "float32",
    held: Sequence[jax.Array] = (),
) -> jax.Array:
    """out (bf16, any shape, `size` elements) with its elements start .. start + M B - 1 (read
    flat; those past its end dropped) replaced by `dequantize_rotate(packed, ...)`: a slice of a
    message decoded straight into the message's buffer (XLA aliases out to the result, so no
    copy of either). `out` a ShapeDtypeStruct: a new buffer of that shape whose other elements
    are left unset (zeros without the kernel), for the first of the slices that fill it (a
    64 MiB buffer zeroed first costs ~30 ms on 2 processes here). `held`: arrays the kernel
    takes as operands without reading them, so that XLA keeps their buffers until this call
    (`ring.packed_one_shot_all_reduce`); not with a ShapeDtypeStruct `out`."""
    _packed_rows(packed, block, scale_dtype)  # checks the layout
    if out.dtype != jnp.bfloat16:
        raise ValueError(f"want out bf16, got {out.dtype}")
    _check_start(start)
    attrs = _decode_attrs(block, scale_dtype, hadamard, start)
    result = jax.ShapeDtypeStruct(out.shape, jnp.bfloat16)
    decode = functools.partial(
        dequantize_rotate_reference, block=block, hadamard=hadamard, scale_dtype=scale_dtype
    )

    def reference(packed: jax.Array, out: jax.Array) -> jax.Array:
        flat = out.reshape(-1)
        values = decode(packed).reshape(-1)
        count = max(0, min(values.size, flat.size - start))
        return flat.at[start : start + count].set(values[:count]).reshape(out.shape)

    if isinstance(out, jax.ShapeDtypeStruct):
        if held:
            raise ValueError("held needs an out array, not a ShapeDtypeStruct")
        native = functools.partial(_call, DEQUANTIZE, out=result, **attrs)
        fresh = lambda packed: reference(packed, jnp.zeros(out.shape, out.dtype))
        return _native_or(fresh, DEQUANTIZE, native, packed)
    native = functools.partial(_call, DEQUANTIZE_INTO, out=result, aliases={1: 0}, **attrs)
    with_held = lambda packed, out, *held: reference(packed, out)
    return _native_or(with_held, DEQUANTIZE_INTO, native, packed, out, *held)


def _check_scale_dtype(scale_dtype: str) -> None:
    if scale_dtype not in _SCALE_BYTES:
        raise ValueError(f"scale_dtype must be one of {tuple(_SCALE_BYTES)}, got {scale_dtype!r}")


def _check_start(start: int) -> None:
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")


def _check_chunks(
    x: jax.Array, block: int, group: int, scale_dtype: str, start: int, rows: int, chunks: int
) -> None:
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"want x bf16, got {x.dtype}")
    _check_block(block)
    _check_block(group)
    if group % block:
        raise ValueError(f"group must be a multiple of block {block}, got {group}")
    _check_scale_dtype(scale_dtype)
    _check_start(start)
    for name, value in (("rows", rows), ("chunks", chunks)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if rows * block % group:
        raise ValueError(f"rows of {rows} x {block} elements are not whole groups of {group}")
