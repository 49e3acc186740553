"""The baselines: XLA's own all-reduce, and unquantized and naive rings on EQuARX's schedule.

`psum`       `lax.psum` in the input dtype (`AllReduce` itself); `psum-f32` upcasts first.
`ring`       the EQuARX schedule with the input dtype on the wire (16 bits for bf16/f16), sent
             as raw bits (CPU XLA would otherwise widen 16-bit collectives to f32), partial sums
             accumulated in f32: isolates what quantization buys.
`naive-int8` the strawman: one scale for a whole message, the running partial sum re-quantized
             at every hop of a plain ring and accumulated in the input dtype: shows what
             block-wise scales and f32 accumulation buy.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
from jax import lax

from equarx_serve.collectives.base import (
    AllReduce,
    OneShotParts,
    raw_one_shot_parts,
    ring_all_reduce_bytes,
)
from equarx_serve.collectives.registry import register_all_reduce
from equarx_serve.collectives.ring import RingAllReduce, take_chunk
from equarx_serve.kernels.block_quantize import FLOAT32_TINY, INT8_MAX

register_all_reduce(AllReduce)  # `psum`


@register_all_reduce
@dataclasses.dataclass(frozen=True)
class PsumF32(AllReduce):
    """Upcast to f32, `lax.psum`, cast back: the numerical reference."""

    name: ClassVar[str] = "psum-f32"

    def reduce(self, x: jax.Array, axis_name: str, axis_size: int) -> jax.Array:
        return lax.psum(x.astype(jnp.float32), axis_name).astype(x.dtype)

    def wire_bytes(self, num_elements: int, dtype: jnp.dtype, axis_size: int) -> int:
        return ring_all_reduce_bytes(num_elements * 4, axis_size)

    def one_shot_parts(self, x: jax.Array, axis_size: int) -> OneShotParts:
        return raw_one_shot_parts(x, jnp.float32)


_RAW_BITS = {2: jnp.uint16, 4: jnp.uint32}
_LANE_BLOCK = 256  # elements per row of a lane; no scales, so only a layout choice


@dataclasses.dataclass(frozen=True)
class RawBitsCodec:
    """The values in `wire_dtype`, bit-cast to an unsigned int of the same width."""

    wire_dtype: jnp.dtype

    def _encode(self, values: jax.Array) -> jax.Array:
        return lax.bitcast_convert_type(values.astype(self.wire_dtype), _RAW_BITS[self.itemsize])

    def encode_chunk(self, lane: jax.Array, index: jax.Array) -> jax.Array:
        return self._encode(take_chunk(lane, index))

    def accumulate_encode(self, local: jax.Array, received: tuple) -> jax.Array:
        acc = local.astype(jnp.float32)
        for payload in received:
            acc = acc + self.decode(payload, jnp.float32)
        return self._encode(acc)

    def decode(self, payload: jax.Array, dtype: jnp.dtype) -> jax.Array:
        return lax.bitcast_convert_type(payload, self.wire_dtype).astype(dtype)

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.wire_dtype).itemsize


@register_all_reduce
@dataclasses.dataclass(frozen=True)
class Ring(RingAllReduce):
    """Pipelined ring all-reduce with unquantized payloads in the input dtype."""

    name: ClassVar[str] = "ring"
    lane_block: ClassVar[int] = _LANE_BLOCK
    # slice_bytes="auto" (`RingAllReduce.slice_bytes_for`). Measured on 2 emulated hosts:
    # 1 Gbit/s, 16 / 64 MiB: 227 / 928 ms in one slice, 159 / 630 ms in 0.5 MiB slices;
    # 2.5 Gbit/s, 16 MiB: 101 ms, 71 ms in 1 MiB slices; 5 Gbit/s: 60 and 61 ms. The probe
    # (`transport`) read 0.65, 1.73 and 3.12 Gbit/s on those links, 6.9 on loopback.
    AUTO_SLICE_BYTES: ClassVar[int] = 512 * 1024
    AUTO_SLICE_BELOW_BITS_PER_S: ClassVar[float] = 2.5e9

    schedule: Literal["auto", "ring", "two-shot", "one-shot"] = "auto"  # as equarx-int8's
    bidirectional: bool = False
    num_slices: int = 1
    slice_bytes: int | Literal["auto"] = "auto"  # as equarx-int8's

    def __post_init__(self):
        self.check_lane_options()

    def codec(self, dtype: jnp.dtype) -> RawBitsCodec:
        return RawBitsCodec(dtype)

    def payload_bytes(self, num_elements: int, dtype: jnp.dtype) -> int:
        return num_elements * jnp.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class PerTensorInt8Codec:
    """int8 values with one f32 scale for the whole message; sums in `accumulate_dtype`."""

    accumulate_dtype: jnp.dtype

    def encode_chunk(self, lane: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self._encode(take_chunk(lane, index))

    def _encode(self, local: jax.Array) -> tuple[jax.Array, jax.Array]:
        values = local.astype(jnp.float32)
        scale = jnp.maximum(jnp.max(jnp.abs(values), keepdims=True) / INT8_MAX, FLOAT32_TINY)
        q = jnp.clip(jnp.round(values / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
        return q, scale

    def accumulate_encode(self, local: jax.Array, received: tuple) -> tuple[jax.Array, jax.Array]:
        acc = local.astype(self.accumulate_dtype)
        for payload in received:
            acc = acc + self.decode(payload, self.accumulate_dtype)
        return self._encode(acc)

    def decode(self, payload: tuple[jax.Array, jax.Array], dtype: jnp.dtype) -> jax.Array:
        q, scale = payload
        return (q.astype(jnp.float32) * scale).astype(dtype)


@register_all_reduce
@dataclasses.dataclass(frozen=True)
class NaiveInt8(RingAllReduce):
    """Per-tensor-scale int8 ring, re-quantized and summed in the input dtype at every hop."""

    name: ClassVar[str] = "naive-int8"
    quantized: ClassVar[bool] = True
    lane_block: ClassVar[int] = _LANE_BLOCK
    schedule: ClassVar[str] = "ring"
    bidirectional: ClassVar[bool] = False
    num_slices: ClassVar[int] = 1
    slice_bytes: ClassVar[int] = 0

    def codec(self, dtype: jnp.dtype) -> PerTensorInt8Codec:
        return PerTensorInt8Codec(dtype)

    def payload_bytes(self, num_elements: int, dtype: jnp.dtype) -> int:
        return num_elements + 4  # int8 values and one f32 scale
