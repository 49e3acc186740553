"""EQuARX: dynamic, block-wise int8 quantized all-reduce (Ahmed et al., 2025), in JAX.

Algorithm (inside `jax.shard_map`, over one mesh axis of N devices):
  1. Size gate: messages smaller than `min_size_bytes` use `lax.psum` (quantizing cannot pay).
  2. Flatten, optionally rotate every block of B elements with an orthonormal Hadamard
     transform (`rotation="hadamard"`), pad to whole blocks and chunks, cut into
     `[directions, num_slices, N, rows, B]` lanes (see `ring.py`).
  3. Reduce-scatter with `ppermute`. Wire payload: int8 values plus one f32 scale per block of
     B elements (symmetric absmax, round to nearest, clamp to [-127, 127], floored scale).
     Every receiver dequantizes and accumulates in f32; nothing is ever summed in int8.
       schedule="ring":     N-1 hops, the running partial sum re-quantized at each hop
                            (the paper's TPU ring; error grows slowly with N).
       schedule="two-shot": each device quantizes its contribution once and sends chunk j to
                            device j; the owner sums in f32 (every element quantized exactly
                            twice, whatever N; better on switched networks).
  4. All-gather (N-1 hops): each owner quantizes its reduced chunk once; the int8 payload is
     forwarded unchanged; every device, the owner too, dequantizes the same bytes, so all
     replicas are bit-identical.
  5. Crop, un-rotate, cast back to the input dtype.

Quantize/dequantize-accumulate is one fused step (`kernels/block_quantize.py`): a Pallas kernel
on TPU/GPU (`kernel="auto"` or `"pallas"`; interpreted on CPU) or the same math in `jnp`, which
XLA fuses, on CPU (`kernel="auto"` or `"jnp"`).

Cost in bytes each device puts on the wire, for L elements (padded to L'):
    2 (N-1)/N * L' * (1 + 4/B)          e.g. B = 256: 0.508x of a 16-bit ring, 0.254x of f32.

Non-finite inputs: a NaN or Inf element is carried as the int8 code -128 and comes out as NaN
in that output element only (its block's other elements keep their precision). With the
Hadamard rotation on, it spreads to the B elements of its rotation block. Both are non-finite
where `psum` is; an Inf comes out as NaN because the int8 payload carries no sign for it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp

from equarx_serve.collectives.base import AllReduce, check_float_dtype
from equarx_serve.collectives.hadamard import block_hadamard
from equarx_serve.collectives.registry import register_all_reduce
from equarx_serve.collectives.ring import LaneLayout, pipelined_all_reduce, take_chunk
from equarx_serve.kernels import block_quantize

# The gate falls back to psum, so it sits where the quantized path starts to beat psum.
# `equarx-serve bench allreduce --processes 2` (gloo, 2 CPU cores), ungated equarx-int8 vs
# psum: 64 KiB 0.77 vs 0.48 ms, 256 KiB 1.09 vs 0.95 ms, 1 MiB 1.94 vs 2.86 ms. Below that the
# fixed cost of 2(N-1) collectives and the quantize passes outweighs the bytes saved.
DEFAULT_MIN_SIZE_BYTES = 1 << 20

SCHEDULES = ("ring", "two-shot")
ROTATIONS = (None, "hadamard")
KERNELS = ("auto", "pallas", "jnp")


@dataclasses.dataclass(frozen=True)
class BlockInt8Codec:
    """int8 values + one f32 scale per row of B elements; accumulation in f32."""

    use_pallas: bool
    interpret: bool

    def _accumulate_quantize(self, local: jax.Array, received: tuple) -> tuple:
        lead, (rows, block) = local.shape[:-2], local.shape[-2:]
        flat_local = local.reshape(-1, block)
        flat_received = tuple((q.reshape(-1, block), s.reshape(-1, 1)) for q, s in received)
        if self.use_pallas:
            q, s = block_quantize.accumulate_quantize(
                flat_local, flat_received, interpret=self.interpret
            )
        else:
            q, s = block_quantize.accumulate_quantize_xla(flat_local, flat_received)
        return q.reshape(*lead, rows, block), s.reshape(*lead, rows, 1)

    def encode_chunk(self, lane: jax.Array, index: jax.Array) -> tuple:
        if self.use_pallas:
            return self._accumulate_quantize(take_chunk(lane, index), ())
        return block_quantize.quantize_chunk_xla(lane, index)

    def accumulate_encode(self, local: jax.Array, received: tuple) -> tuple:
        return self._accumulate_quantize(local, received)

    def decode(self, payload: tuple, dtype: jnp.dtype) -> jax.Array:
        return block_quantize.dequantize(*payload).astype(dtype)


@register_all_reduce
@dataclasses.dataclass(frozen=True)
class EquarxInt8(AllReduce):
    """EQuARX int8 all-reduce; see the module docstring. Options are validated on creation."""

    name: ClassVar[str] = "equarx-int8"
    quantized: ClassVar[bool] = True

    block_size: int = 256
    # two-shot: the ring's bytes, and error that does not grow with N (0.96% vs 1.50% relative
    # RMS at N = 8 on Gaussian data); "ring" keeps every transfer to a neighbour (TPU torus).
    schedule: Literal["ring", "two-shot"] = "two-shot"
    # hadamard: ~10x less error with outlier channels; ~4x the all-reduce time on CPU.
    rotation: Literal["hadamard"] | None = None
    # More lanes (pipelining) measured slower on CPU (more, smaller ops and collectives on 2
    # cores); on accelerators with async collectives try bidirectional=True, num_slices=2-4.
    bidirectional: bool = False
    num_slices: int = 1
    min_size_bytes: int = DEFAULT_MIN_SIZE_BYTES
    kernel: Literal["auto", "pallas", "jnp"] = "auto"

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"block_size must be an int >= 2, got {self.block_size!r}")
        if self.rotation == "hadamard" and self.block_size & (self.block_size - 1):
            raise ValueError(
                f"rotation='hadamard' needs a power-of-two block_size, got {self.block_size}"
            )
        for field, value, valid in (
            ("schedule", self.schedule, SCHEDULES),
            ("rotation", self.rotation, ROTATIONS),
            ("kernel", self.kernel, KERNELS),
        ):
            if value not in valid:
                raise ValueError(f"{field} must be one of {valid}, got {value!r}")
        if not isinstance(self.bidirectional, bool):
            raise ValueError(f"bidirectional must be a bool, got {self.bidirectional!r}")
        if not isinstance(self.num_slices, int) or self.num_slices < 1:
            raise ValueError(f"num_slices must be an int >= 1, got {self.num_slices!r}")
        if not isinstance(self.min_size_bytes, int) or self.min_size_bytes < 0:
            raise ValueError(f"min_size_bytes must be an int >= 0, got {self.min_size_bytes!r}")

    def _codec(self) -> BlockInt8Codec:
        backend = jax.default_backend()
        use_pallas = self.kernel == "pallas" or (self.kernel == "auto" and backend != "cpu")
        return BlockInt8Codec(use_pallas=use_pallas, interpret=backend == "cpu")

    def _layout(self, size: int, axis_size: int) -> LaneLayout:
        return LaneLayout.create(
            size,
            axis_size,
            directions=2 if self.bidirectional else 1,
            num_slices=self.num_slices,
            block_size=self.block_size,
            pad_rows=block_quantize.padded_rows,
        )

    def is_gated(self, num_elements: int, dtype: jnp.dtype) -> bool:
        """True when a message this size goes to plain `psum` (the size gate)."""
        return num_elements * jnp.dtype(dtype).itemsize < self.min_size_bytes

    def ungated(self) -> EquarxInt8:
        return dataclasses.replace(self, min_size_bytes=0)

    def reduce(self, x: jax.Array, axis_name: str, axis_size: int) -> jax.Array:
        check_float_dtype(x, self.name)
        if self.is_gated(x.size, x.dtype):
            return super().reduce(x, axis_name, axis_size)
        layout = self._layout(x.size, axis_size)
        lanes = layout.to_lanes(x.astype(jnp.float32) if self.rotation else x)
        if self.rotation:
            lanes = block_hadamard(lanes)
        out_dtype = jnp.float32 if self.rotation else x.dtype
        with jax.named_scope(f"equarx_int8_{self.schedule}"):
            reduced = pipelined_all_reduce(
                lanes, axis_name, self._codec(), schedule=self.schedule, out_dtype=out_dtype
            )
        if self.rotation:
            reduced = block_hadamard(reduced)
        return layout.from_lanes(reduced, x.shape).astype(x.dtype)

    def wire_bytes(self, num_elements: int, dtype: jnp.dtype, axis_size: int) -> int:
        if axis_size == 1:
            return 0
        if self.is_gated(num_elements, dtype):
            return super().wire_bytes(num_elements, dtype, axis_size)
        layout = self._layout(num_elements, axis_size)
        per_chunk = layout.padded_size // axis_size  # elements of one chunk, all lanes
        return 2 * (axis_size - 1) * (per_chunk + 4 * per_chunk // self.block_size)
