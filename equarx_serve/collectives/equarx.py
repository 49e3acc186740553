"""EQuARX: dynamic, block-wise int8 quantized all-reduce (Ahmed et al., 2025), in JAX.

Algorithm (inside `jax.shard_map`, over one mesh axis of N devices):
  1. Size gate: messages smaller than `min_size_bytes` use `lax.psum` (quantizing cannot pay).
  2. Flatten, pad to whole blocks and chunks, cut into `[directions, num_slices, N, rows, B]`
     lanes (`ring.py`; each lane a contiguous run of whole rotation groups); rotate every group
     of `rotation_block` elements (default: the block size where that is given, else 64) of
     each lane with an orthonormal Hadamard transform (`rotation="hadamard"`, the default; f32
     result).
  3. Quantize blocks of B elements: int8 values plus one scale per block (symmetric absmax,
     round to nearest, clamp to [-127, 127], floored; f32, or bf16 rounded up with
     `scale_dtype="bfloat16"`). Where not given, B and the scale dtype follow the schedule
     (`CODEC_BY_SCHEDULE`): 64 and bf16 for one-shot, 32 and bf16 for two-shot and ring.
     Every receiver dequantizes and accumulates in f32; nothing is ever summed in int8. The
     schedules (`schedule`, see `ring.py`):
       "one-shot": every device sends its whole quantized message to every other; each sums
                   all N dequantized contributions, its own too, in rank order (each element
                   quantized once; one step; N/2 times the others' bytes).
       "two-shot": reduce-scatter, each device quantizes its contribution once and sends
                   chunk j to device j; the owner sums in f32; then an all-gather (each
                   element quantized exactly twice, whatever N).
       "ring":     reduce-scatter over N-1 hops, the running partial sum re-quantized at each
                   (the paper's TPU ring; error grows slowly with N); then an all-gather.
       "auto":     (default) one-shot over 2 devices, where it sends two-shot's bytes;
                   two-shot over more.
     In the all-gathers each owner quantizes its reduced chunk once and the int8 payload is
     forwarded unchanged; every device, the owner too, dequantizes the same bytes, so all
     replicas are bit-identical (in one-shot every device sums the same payloads in the same
     order). One-shot and two-shot's all-gather are one `lax.all_gather` per lane (gloo/NCCL),
     the f32 scales bit-cast into the same buffer as the int8 values; the ring schedule stays
     a ring of `ppermute`s (every transfer to a neighbour).
  4. Rotate each reduced lane back (the transform is its own inverse), cast back to the input
     dtype, crop. Where every element's result is decoded from one payload (two-shot, ring)
     and the rotation groups are whole quantization blocks (two-shot's default: two blocks of
     32 in each group of 64; block_size=64: one), the inverse runs on the int8 codes
     (`inverse="auto"`): H (s q) = s (H q), an exact int8 product by H_B, then one elementwise
     pass that scales each block and mixes a group's k blocks by H_k (H_kB = H_k (x) H_B),
     instead of dequantizing to f32 and rotating that.

Folded rotation: a model can multiply the weights that produce the all-reduce's input by the
rotation once (`foldable_rotation`, `models.gemma3`) and reduce with `with_rotated_input()`
(`RotatedInput`): then step 2 has no transform and only the inverse of step 4 runs.

Quantize/dequantize-accumulate is one fused step (`kernels/block_quantize.py`): a Pallas kernel
on TPU/GPU (`kernel="auto"` or `"pallas"`; interpreted on CPU) or the same math in `jnp`, which
XLA fuses, on CPU (`kernel="auto"` or `"jnp"`). On CPU with `kernel="auto"`, where the kernels
build with AVX-512 (`kernels/one_shot.py`, built on first use), native kernels run instead:
  one-shot (the N = 2 default: bf16 messages, rotation groups of one block; also
  without a rotation, then bit-identical to XLA's ops): one kernel rotates (a fast
  Walsh-Hadamard transform, not XLA's dense [B, B] product), quantizes and writes the packed
  payload of a lane, reading it straight from the message; the other decodes the all-gathered
  bytes as they arrive, sums them in rank order, rotates back and casts to bf16, writing
  straight into the output (no lane is copied out or stacked back). Measured, 16 MiB on 2
  fake devices, the model's form: 77.6 -> 21.8 ms with the decode kernel alone; 64 MiB in 68
  slices on 2 processes: 183 -> 122-127 ms of compute without the copies. The lanes' kernels
  and all-gathers are ordered so that each lane's compute runs beside the next lane's
  transfer (`ring.packed_one_shot_all_reduce`): 2 emulated hosts at 1 Gbit/s, 16 MiB 86 -> 74
  ms, 64 MiB 350-357 -> 301-314 ms, at 96-100% of the link time of the bytes.
  two-shot (N > 2, rotation groups of 64 made of blocks of 16 to 64): one kernel encodes every
  chunk of a lane in one pass, another rotates the device's own chunk, adds the received
  payloads and quantizes the sum in one pass, a third decodes and rotates back each
  all-gathered chunk. 4 emulated hosts at 1 Gbit/s, standalone: 16 MiB 200-213 -> 164-176 ms,
  64 MiB 877-1119 -> 692-746 ms.
Their bits are those of the same arithmetic as jnp ops (`one_shot.*_reference`), which differ
from the dense product's in the last bit of a few values, so all hosts of a mesh should take
the same path: a host without a C++ compiler takes XLA's ops, and its replica can differ from
the others' in those bits.

Cost in bytes each device puts on the wire, for L elements (padded to L') and scales of c bytes:
    2 (N-1)/N * L' * (1 + c/B)          ring, two-shot, and one-shot at N = 2
    (N-1) * L' * (1 + c/B)              one-shot
  e.g. B = 64, c = 2 (the one-shot default): 0.516x of a 16-bit ring; B = 32, c = 2 (the
  two-shot default) or B = 64, c = 4: 0.531x, 0.266x of f32; B = 256, c = 4: 0.508x.

Non-finite inputs: a NaN or Inf element is carried as the int8 code -128 and comes out as NaN
in that output element only (its block's other elements keep their precision). With the
Hadamard rotation on, it spreads to the elements of its rotation block. Both are non-finite
where `psum` is; an Inf comes out as NaN because the int8 payload carries no sign for it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
from jax import lax

from equarx_serve.collectives import ring, transport
from equarx_serve.collectives.base import (
    AllReduce,
    OneShotParts,
    check_float_dtype,
    ring_all_reduce_bytes,
)
from equarx_serve.collectives.hadamard import (
    MAX_DENSE_BLOCK,
    HadamardRotation,
    hadamard_scaled_codes,
)
from equarx_serve.collectives.registry import register_all_reduce
from equarx_serve.collectives.ring import NativeTwoShot, PackedOneShot, RingAllReduce, take_chunk
from equarx_serve.kernels import block_quantize, one_shot
from equarx_serve.kernels.native import target_platform

# The gate falls back to psum, so it sits where the quantized path starts to beat psum.
# `equarx-serve bench allreduce --processes 2` (gloo, 2 CPU cores), ungated equarx-int8 vs
# psum: 64 KiB 0.77 vs 0.48 ms, 256 KiB 1.09 vs 0.95 ms, 1 MiB 1.94 vs 2.86 ms. Below that the
# fixed cost of 2(N-1) collectives and the quantize passes outweighs the bytes saved.
DEFAULT_MIN_SIZE_BYTES = 1 << 20

ROTATIONS = (None, "hadamard")
INVERSES = ("auto", "codes", "values")
KERNELS = ("auto", "pallas", "jnp")
SCALE_DTYPES = ("float32", "bfloat16")
# 16-bit scales travel as raw bits: XLA:CPU would widen a bfloat16 collective to f32.
_SCALE_WIRE = {"float32": None, "bfloat16": jnp.uint16}
# The default codec (block size, scale dtype) of each schedule, where the caller gives none,
# chosen on Gemma 3 270M (`equarx-serve eval`, README "Quality"). One-shot quantizes each
# element once: block 64 with bf16 scales, 1.03125 bytes per element (0.516x a 16-bit ring; f32
# scales: 1.0625, KL 1.68-1.77x the float32 model's floor at TP = 2). The bf16 scale is the f32
# one rounded up, a step at most 2^-8 coarser, and on 2 emulated hosts at 1 Gbit/s the 3% fewer
# bytes measured 85.5 vs 90.7 ms (16 MiB) and 349 vs 356 ms (64 MiB). Two-shot quantizes it
# twice, the second time in a sum N times the variance: block 32 with bf16 scales (1.0625 bytes)
# shrinks that error (TP = 4, Python source, 16 windows: KL 1.92x the floor's vs 2.04x for
# block 64 + f32 scales; default corpus 1.91x both, top-1 0.2 points closer to the floor's).
CODEC_BY_SCHEDULE = {
    "one-shot": (64, "bfloat16"),
    "two-shot": (32, "bfloat16"),
    "ring": (32, "bfloat16"),
}
DEFAULT_ROTATION_BLOCK = 64


@dataclasses.dataclass(frozen=True)
class BlockInt8Codec:
    """int8 values + one scale (f32 or bf16) per row of B elements; accumulation in f32.

    `kernel`: "auto" picks the quantizer by the platform the program is lowered for
    (`lax.platform_dependent`), so one traced program lowers for CPU, TPU and GPU alike: the
    Pallas kernel compiled (Mosaic on TPU, Triton on GPU), XLA's ops on CPU
    (`block_quantize.*_xla`). "pallas": the kernel everywhere, interpreted where the program is
    traced for CPU devices (`target_platform`, the mesh's platform: Pallas' TPU interpreter,
    the one that runs inside `shard_map`, has effects that `platform_dependent` cannot stage
    beside the compiled kernel). "jnp": XLA's ops everywhere. All give the same bits.
    """

    kernel: Literal["auto", "pallas", "jnp"]
    scale_dtype: str

    def _to_wire(self, payload: tuple) -> tuple:
        q, scale = payload
        wire = _SCALE_WIRE[self.scale_dtype]
        return (q, scale) if wire is None else (q, lax.bitcast_convert_type(scale, wire))

    def _from_wire(self, payload: tuple) -> tuple:
        q, scale = payload
        if _SCALE_WIRE[self.scale_dtype] is None:
            return q, scale
        return q, lax.bitcast_convert_type(scale, jnp.dtype(self.scale_dtype))

    def _per_platform(self, xla, pallas, *operands) -> tuple:
        """`xla(*operands)` where XLA's ops run (above), else `pallas(*operands, interpret=)`."""
        if self.kernel == "jnp":
            return xla(*operands)
        if self.kernel == "pallas":
            return pallas(*operands, interpret=target_platform() == "cpu")
        compiled = lambda *args: pallas(*args, interpret=False)
        return lax.platform_dependent(*operands, cpu=xla, default=compiled)

    def _rows(self, quantize, local: jax.Array, received: tuple) -> tuple:
        """`quantize` on local [..., R, B] and received payloads flattened to rows [*, B]; the
        result in local's shape."""
        lead, (rows, block) = local.shape[:-2], local.shape[-2:]
        flat_received = tuple((q.reshape(-1, block), s.reshape(-1, 1)) for q, s in received)
        q, s = quantize(local.reshape(-1, block), flat_received, scale_dtype=self.scale_dtype)
        return q.reshape(*lead, rows, block), s.reshape(*lead, rows, 1)

    def _pallas(self, local: jax.Array, received: tuple, *, interpret: bool) -> tuple:
        kernel = functools.partial(block_quantize.accumulate_quantize, interpret=interpret)
        return self._rows(kernel, local, received)

    def _accumulate_quantize(self, local: jax.Array, received: tuple) -> tuple:
        received = tuple(self._from_wire(payload) for payload in received)
        xla = functools.partial(self._rows, block_quantize.accumulate_quantize_xla)
        return self._to_wire(self._per_platform(xla, self._pallas, local, received))

    def encode_chunk(self, lane: jax.Array, index: jax.Array) -> tuple:
        xla = lambda lane, index: block_quantize.quantize_chunk_xla(
            lane, index, scale_dtype=self.scale_dtype
        )
        pallas = lambda lane, index, *, interpret: self._pallas(
            take_chunk(lane, index), (), interpret=interpret
        )
        return self._to_wire(self._per_platform(xla, pallas, lane, index))

    def accumulate_encode(self, local: jax.Array, received: tuple) -> tuple:
        return self._accumulate_quantize(local, received)

    def decode(self, payload: tuple, dtype: jnp.dtype) -> jax.Array:
        return block_quantize.dequantize(*self._from_wire(payload)).astype(dtype)

    def decode_rotated(self, payload: tuple, rotation_block: int) -> jax.Array:
        """`decode` in f32 with every group of `rotation_block` elements (a whole number of
        rows) times the orthonormal Hadamard transform, computed on the codes
        (`hadamard_scaled_codes`: an exact int8 product by H_B, then one elementwise pass that
        scales each row and mixes a group's blocks). A row holding the non-finite code is NaN
        throughout, and so is its group, as rotating its NaN would give."""
        q, scale = self._from_wire(payload)
        # The mark goes into the row's scale (a min over the int8 rows), so the product's
        # scaling and the caller's cast stay one pass; masking the f32 values instead (under
        # a lax.cond on any mark) wrote them out once more: 31-34 vs 20 ms at 16 MiB.
        marked = jnp.min(q, axis=-1, keepdims=True) == block_quantize.NONFINITE_CODE
        scale = jnp.where(marked, jnp.nan, scale.astype(jnp.float32))
        return hadamard_scaled_codes(q, scale, rotation_block // q.shape[-1])


@register_all_reduce
@dataclasses.dataclass(frozen=True)
class EquarxInt8(RingAllReduce):
    """EQuARX int8 all-reduce; see the module docstring. Options are validated on creation."""

    name: ClassVar[str] = "equarx-int8"
    quantized: ClassVar[bool] = True
    # slice_bytes="auto". Measured on 2 emulated hosts, 16 / 64 MiB: 1 Gbit/s 121 / 535 ms in
    # one slice, 96-102 / 426-443 ms in 0.5 MiB slices; 2.5 Gbit/s 55 vs 67 ms (16 MiB), 5
    # Gbit/s 32 vs 55 ms: slicing pays only on the slowest of those links, where the probe
    # (`transport`) read 0.65 Gbit/s (2.5 Gbit/s: 1.73).
    AUTO_SLICE_BYTES: ClassVar[int] = 512 * 1024
    AUTO_SLICE_BELOW_BITS_PER_S: ClassVar[float] = 1.2e9
    # Two-shot's reduce, all-gather and decode in pieces (`ring.GATHER_PIECE_BYTES`) only where
    # `transport.measure` found a link slower than this. Measured at N = 4 (docs/decisions.md, "the
    # all-gather in pieces"), 16 / 64 MiB, in pieces against whole: 1 Gbit/s (probe 0.84 Gbit/s)
    # 128-133 / 530-547 ms against 138-142 / 579-601 ms; 2.5 Gbit/s (probe 1.6-2.3) 75.0 / 298.8
    # against 75.5 / 315.0 ms; but 10 Gbit/s (probe 4.6-5.3) 73.6 / 277.0 against 66.0 / 235.6 ms
    # and loopback (probe 5.8-6.1) 77.6 / 334.7 against 56.9 / 216.9 ms: where the link is fast,
    # each extra collective's fixed cost is more than the decode it hides.
    AUTO_PIECES_BELOW_BITS_PER_S: ClassVar[float] = 3e9
    # And its encode and reduce-scatter in the same pieces only where the link is slower than this.
    # Measured at N = 4 (docs/decisions.md, "every send in pieces"), 16 / 64 MiB, sent in pieces
    # against whole, alternated: 1 Gbit/s (probe 0.8-1.0 Gbit/s), four runs each, 125.5-138.1 /
    # 497-508 ms against 127.1-135.0 / 542-554 ms; but 2.5 Gbit/s (probe 1.9-2.4), two runs each,
    # 77.1-91.9 / 342-349 ms against 71.4-72.0 / 317 ms: there the fixed cost of ~50 more
    # collectives outweighs the encodes it hides.
    AUTO_SEND_PIECES_BELOW_BITS_PER_S: ClassVar[float] = 1.3e9
    # min_size_bytes="auto": no gate where the link is slower than this (the slicing bound).
    AUTO_UNGATED_BELOW_BITS_PER_S: ClassVar[float] = AUTO_SLICE_BELOW_BITS_PER_S

    # The codec, where not given (None): chosen by the schedule the axis size runs
    # (`for_axis_size`, `CODEC_BY_SCHEDULE`): block 64 with bfloat16 scales for one-shot (N = 2,
    # 1.03125 bytes per element), block 32 with bfloat16 scales for two-shot and ring (1.0625).
    # A block_size given without a scale_dtype has float32 scales.
    block_size: int | None = None
    # bfloat16: 2 scale bytes per block instead of 4 (block 32 + bfloat16 sends what block 64 +
    # float32 does), rounded up so that no element clips.
    scale_dtype: Literal["float32", "bfloat16"] | None = None
    # hadamard: spreads outlier channels over the rotation block before quantizing.
    rotation: Literal["hadamard"] | None = "hadamard"
    # Elements per Hadamard block (a power of two; None: block_size when that is given, else
    # 64). 64 and 128 divide the width of every Gemma 3 model, so the model can fold the
    # transform into its weights.
    rotation_block: int | None = None
    # Let a model fold the forward rotation into the weights that produce this all-reduce's
    # input (`models.gemma3`: then only the inverse runs here). Called on its own (a user's
    # shard_map) the all-reduce always rotates its input itself.
    fold_rotation: bool = True
    # Where the inverse rotation runs: "codes" on each all-gathered payload's int8 codes, then
    # its scales (needs rotation groups of whole quantization blocks; in one-shot each of
    # the N payloads is rotated before they are summed); "values" on the f32 sum after
    # dequantizing. "auto": codes where each result element comes from one payload (two-shot,
    # ring), the rotation groups are whole blocks, and the blocks are at most MAX_DENSE_BLOCK
    # (a dense product); values otherwise.
    # Measured on 1 Gbit/s emulated hosts, 16 MiB, the model's (pre-rotated) form: two-shot at
    # N = 4 with block 64 + f32 scales 265 -> 233 ms with the codes, with the default block 32
    # + bf16 scales (two blocks a group) 265 -> 228 ms (block 64 223 ms in the same run);
    # one-shot at N = 2 170 ms on the values, 219 ms on the codes (two int8 products per
    # element against one f32 product of the sum).
    inverse: Literal["auto", "codes", "values"] = "auto"
    # auto: one-shot over 2 devices (two-shot's bytes in one step, each element quantized once
    # instead of twice), two-shot over more (the ring's bytes, error that does not grow with
    # N); "ring" keeps every transfer to a neighbour (TPU torus). See ring.py.
    schedule: Literal["auto", "ring", "two-shot", "one-shot"] = "auto"
    # Pipelining (num_slices lanes, each rotated, quantized, all-gathered and summed on its
    # own; their collectives ordered so that one lane's compute overlaps the next lane's
    # transfers, `ring.py`): on loopback more lanes measured slower (more, smaller ops and
    # collectives on 2 cores). Two-shot on 4 emulated hosts at 1 Gbit/s (2026-12-04, the
    # model's form): 4 lanes 8 MiB 67 vs 77 ms, 16 MiB 145-148 vs 161 ms, but 2.5 MiB 35 vs
    # 22 ms, 32 MiB 333 vs 329 ms and 64 MiB 678-684 vs 660-676 ms; 3 and 6 lanes slower at
    # every size. So 1 by default (N = 2 slices by `slice_bytes`); on accelerators with async
    # collectives try num_slices=2-4 (and bidirectional=True with schedule="ring").
    bidirectional: bool = False
    num_slices: int = 1
    # With slice_bytes > 0, more slices where a message needs them so that a device sends at
    # most slice_bytes for one slice (`RingAllReduce.slices_for`); "auto": AUTO_SLICE_BYTES
    # between 2 devices where `transport.measure` found a link slower than
    # AUTO_SLICE_BELOW_BITS_PER_S (hosts on a slow network), else none (loopback, fake devices,
    # more than 2 devices: every extra collective costs ~1-2 ms and pays nothing there).
    slice_bytes: int | Literal["auto"] = "auto"
    # Messages smaller than this go to `psum`; "auto": DEFAULT_MIN_SIZE_BYTES, measured where
    # the fixed cost of a collective dominates (loopback), except where `transport.measure`
    # found a link slower than AUTO_UNGATED_BELOW_BITS_PER_S: there the bytes dominate and
    # every message is quantized (bench prefill, 512 tokens, TP = 2, 300 Mbit/s: gated to psum
    # 1528 ms, quantized 520 ms).
    min_size_bytes: int | Literal["auto"] = "auto"
    # auto: the Pallas quantizer on TPU/GPU; on CPU the jnp one, and one-shot's last step as
    # the native dequantize-rotate kernel where it applies (module doc). jnp: XLA ops only.
    kernel: Literal["auto", "pallas", "jnp"] = "auto"

    def __post_init__(self):
        if self.block_size is not None and (
            not isinstance(self.block_size, int) or self.block_size < 2
        ):
            raise ValueError(f"block_size must be an int >= 2, got {self.block_size!r}")
        for field, value, valid in (
            ("scale_dtype", self.scale_dtype, (*SCALE_DTYPES, None)),
            ("rotation", self.rotation, ROTATIONS),
            ("kernel", self.kernel, KERNELS),
            ("inverse", self.inverse, INVERSES),
        ):
            if value not in valid:
                raise ValueError(f"{field} must be one of {valid}, got {value!r}")
        if self.rotation is None and self.rotation_block is not None:
            raise ValueError("rotation_block needs rotation='hadamard'")
        if self.rotation is not None:
            block = self._rotation_group
            if not isinstance(block, int) or block < 1 or block & (block - 1):
                which = "rotation_block" if self.rotation_block else "block_size"
                raise ValueError(f"rotation='hadamard' needs a power-of-two {which}, got {block!r}")
        if self.inverse == "codes" and not self._rotates_blocks:
            raise ValueError(
                "inverse='codes' needs rotation='hadamard' and a block_size that divides the "
                f"rotation block, got rotation={self.rotation!r}, block_size={self.block_size!r}, "
                f"rotation_block={self.rotation_block!r}"
            )
        if not isinstance(self.fold_rotation, bool):
            raise ValueError(f"fold_rotation must be a bool, got {self.fold_rotation!r}")
        self.check_lane_options()
        size = self.min_size_bytes
        if size != "auto" and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise ValueError(f"min_size_bytes must be an int >= 0 or 'auto', got {size!r}")

    def for_axis_size(self, axis_size: int) -> EquarxInt8:
        """This all-reduce as it runs over `axis_size` devices: the codec fields left None
        filled in from `CODEC_BY_SCHEDULE` for the schedule that runs there, the rotation block
        pinned (what `reduce` and `wire_bytes` use)."""
        block, scale = CODEC_BY_SCHEDULE[self.schedule_for(axis_size)]
        if self.block_size is not None:  # a block size given alone keeps f32 scales
            block, scale = self.block_size, "float32"
        rotation = self.input_rotation
        return dataclasses.replace(
            self,
            block_size=block,
            scale_dtype=self.scale_dtype or scale,
            rotation_block=None if rotation is None else rotation.block,
        )

    @property
    def lane_block(self) -> int:
        if self.block_size is None:
            raise ValueError("the block size depends on the axis size: use for_axis_size(N)")
        return self.block_size

    def pad_rows(self, rows: int) -> int:
        """The quantizer's tiling, and with a rotation, whole rotation groups in every chunk
        (rows * B a multiple of the rotation block), so that each lane rotates on its own."""
        rows = block_quantize.padded_rows(rows)
        if (rotation := self.input_rotation) is not None:
            multiple = rotation.block // math.gcd(rotation.block, self.block_size)
            rows = -(-rows // multiple) * multiple
        return rows

    def codec(self, dtype: jnp.dtype) -> BlockInt8Codec:
        return BlockInt8Codec(self.kernel, scale_dtype=self.scale_dtype)

    def payload_bytes(self, num_elements: int, dtype: jnp.dtype) -> int:
        scale_bytes = jnp.dtype(self.scale_dtype).itemsize
        return num_elements + scale_bytes * num_elements // self.block_size

    @property
    def input_rotation(self) -> HadamardRotation | None:
        """The orthonormal transform applied to every input before it is quantized."""
        if self.rotation is None:
            return None
        return HadamardRotation(self._rotation_group)

    @property
    def _rotation_group(self) -> int:
        """Elements per rotation group: `rotation_block`, else the block size where one is
        given, else `DEFAULT_ROTATION_BLOCK` (the same at every axis size, so that a model can
        fold it)."""
        return self.rotation_block or self.block_size or DEFAULT_ROTATION_BLOCK

    @property
    def foldable_rotation(self) -> HadamardRotation | None:
        return self.input_rotation if self.fold_rotation else None

    @property
    def _rotates_blocks(self) -> bool:
        """Whether each rotation group is a whole number of quantization blocks (the inverse
        can run on the codes); False while the block size is left to the axis size
        (`for_axis_size`)."""
        rotation = self.input_rotation
        return (
            rotation is not None
            and self.block_size is not None
            and rotation.block % self.block_size == 0
        )

    def inverse_on_codes(self, axis_size: int) -> bool:
        """Whether the inverse rotation runs on the int8 codes over `axis_size` devices."""
        if self.block_size is None:
            return self.for_axis_size(axis_size).inverse_on_codes(axis_size)
        if self.inverse == "auto":
            return (
                self._rotates_blocks
                and self.block_size <= MAX_DENSE_BLOCK
                and self.schedule_for(axis_size) != "one-shot"
            )
        return self.inverse == "codes"

    def with_rotated_input(self) -> RotatedInput:
        if self.input_rotation is None:
            raise ValueError(f"{self.name} with rotation=None has no input rotation to fold")
        return RotatedInput(self)

    def is_gated(self, num_elements: int, dtype: jnp.dtype) -> bool:
        """True when a message this size goes to plain `psum` (the size gate)."""
        return num_elements * jnp.dtype(dtype).itemsize < self.gate_bytes()

    def gate_bytes(self) -> int:
        """`min_size_bytes` as it applies in this run ("auto": see the field)."""
        if self.min_size_bytes != "auto":
            return self.min_size_bytes
        slow = transport.slower_than(self.AUTO_UNGATED_BELOW_BITS_PER_S)
        return 0 if slow else DEFAULT_MIN_SIZE_BYTES

    def ungated(self) -> EquarxInt8:
        return dataclasses.replace(self, min_size_bytes=0)

    def wire_bytes(self, num_elements: int, dtype: jnp.dtype, axis_size: int) -> int:
        if axis_size > 1 and self.is_gated(num_elements, dtype):
            return AllReduce.wire_bytes(self, num_elements, dtype, axis_size)  # psum
        return RingAllReduce.wire_bytes(
            self.for_axis_size(axis_size), num_elements, dtype, axis_size
        )

    def reduce(self, x: jax.Array, axis_name: str, axis_size: int) -> jax.Array:
        check_float_dtype(x, self.name)
        if self.is_gated(x.size, x.dtype):
            return lax.psum(x, axis_name)
        concrete = self.for_axis_size(axis_size)
        if concrete.input_rotation is None:
            kernels = concrete._one_shot_kernels(x.dtype, axis_size, rotate_input=False)
            encoder = concrete._two_shot_kernels(x.dtype, axis_size, rotate_input=False)
            return concrete.ring_reduce(
                x, axis_name, axis_size, x.dtype, packed=kernels, native=encoder
            )
        # Each lane is rotated (to f32) before it is quantized, and rotated back once its sum is
        # decoded: lanes are contiguous runs of whole rotation groups of the flat message
        # (`pad_rows`), so this is the message's rotation, pipelined with the transfers.
        return concrete._reduce_rotated_back(x, axis_name, axis_size, rotate_input=True)

    def reduce_rotated_input(self, x: jax.Array, axis_name: str, axis_size: int) -> jax.Array:
        """The sum of inputs already rotated along their last axis by `input_rotation`, rotated
        back. Gated messages are summed by `psum` in f32, so the result is rounded once."""
        check_float_dtype(x, self.name)
        rotation = self.input_rotation
        if self.is_gated(x.size, x.dtype):
            return rotation.apply(lax.psum(x.astype(jnp.float32), axis_name), out_dtype=x.dtype)
        return self.for_axis_size(axis_size)._reduce_rotated_back(
            x, axis_name, axis_size, rotate_input=False
        )

    def _reduce_rotated_back(
        self, x: jax.Array, axis_name: str, axis_size: int, *, rotate_input: bool
    ) -> jax.Array:
        """`ring_reduce` with the inverse rotation applied to the sum (and with `rotate_input`
        the forward rotation applied to x first): one-shot's native kernels where they apply
        (`_runs_natively`), else on the int8 codes as they are decoded or on the decoded f32
        values (`inverse_on_codes`)."""
        rotation = self.input_rotation
        kernels = self._one_shot_kernels(x.dtype, axis_size, rotate_input=rotate_input)
        if kernels is not None:
            return self.ring_reduce(x, axis_name, axis_size, x.dtype, packed=kernels)
        prepare = None
        if rotate_input:
            prepare = lambda lane: _rotate_lane(rotation, lane, jnp.float32)
        encoder = self._two_shot_kernels(x.dtype, axis_size, rotate_input=rotate_input)
        if self._decodes_natively(x.dtype, axis_size):
            decode = lambda gathered, held, into, first: one_shot.decode_rotate_each(
                gathered,
                block=self.block_size,
                group=rotation.block,
                scale_dtype=self.scale_dtype,
                held=held,
                into=into,
                first=first,
            )
            return self.ring_reduce(
                x,
                axis_name,
                axis_size,
                x.dtype,
                prepare=prepare,
                decode_gathered=decode,
                native=encoder,
            )
        if self.inverse_on_codes(axis_size):
            codec, group = self.codec(x.dtype), rotation.block
            return self.ring_reduce(
                x,
                axis_name,
                axis_size,
                x.dtype,
                prepare=prepare,
                decode=lambda payload: codec.decode_rotated(payload, group),
                native=encoder,
            )
        return self.ring_reduce(
            x,
            axis_name,
            axis_size,
            x.dtype,
            prepare=prepare,
            finish=lambda lane: _rotate_lane(rotation, lane, x.dtype),
            native=encoder,
        )

    def one_shot_parts(
        self, x: jax.Array, axis_size: int, *, rotate_input: bool = True
    ) -> OneShotParts:
        """This all-reduce as one exchange (`OneShotParts`): the one-shot schedule over any N,
        with one-shot's codec (`for_axis_size`), native kernels where `reduce` would take them,
        and the sum rotated back; `rotate_input=False` for inputs already rotated
        (`RotatedInput`). A gated message has no quantized form: `reduce` it instead."""
        check_float_dtype(x, self.name)
        single = dataclasses.replace(self, schedule="one-shot", bidirectional=False, num_slices=1)
        single = single.for_axis_size(axis_size)
        rotation = single.input_rotation
        rotate_input = rotate_input and rotation is not None
        kernels = single._one_shot_kernels(x.dtype, axis_size, rotate_input=rotate_input)
        if kernels is not None or rotation is None:
            return single.one_shot_exchange(x, axis_size, packed=kernels)
        prepare = (lambda lane: _rotate_lane(rotation, lane, jnp.float32)) if rotate_input else None
        if single.inverse_on_codes(axis_size):
            codec, group = single.codec(x.dtype), rotation.block
            decode = lambda payload: codec.decode_rotated(payload, group)
            return single.one_shot_exchange(x, axis_size, prepare=prepare, decode=decode)
        finish = lambda lane: _rotate_lane(rotation, lane, x.dtype)
        return single.one_shot_exchange(x, axis_size, prepare=prepare, finish=finish)

    def _runs_natively(self, dtype: jnp.dtype, axis_size: int) -> bool:
        """Whether one-shot runs as the native kernels of `kernels/one_shot.py` (rotate and
        quantize into the packed payload; decode, sum, rotate back and cast straight from the
        all-gathered bytes): `kernel="auto"` on CPU where they build with AVX-512, bf16 in and
        out, f32 or bf16 scales, no rotation or rotation groups of one block with the inverse
        on the values (module doc)."""
        rotation = self.input_rotation
        return (
            self.kernel == "auto"
            and self.schedule_for(axis_size) == "one-shot"
            and not self.inverse_on_codes(axis_size)
            and jnp.dtype(dtype) == jnp.bfloat16
            and (rotation is None or rotation.block == self.block_size)
            and one_shot.pays(self.block_size)
        )

    def _decodes_natively(self, dtype: jnp.dtype, axis_size: int) -> bool:
        """Whether two-shot's last step (decode each all-gathered chunk, rotate it back, cast)
        runs as the native kernel `one_shot.decode_rotate_each`: `kernel="auto"` and
        `inverse="auto"` on CPU where it builds with AVX-512, bf16 in and out, rotation groups
        of 64 elements made of whole blocks (the N > 2 default: two blocks of 32). Measured on
        4 fake devices, 16 MiB, the model's form: 117.5 -> 43.5 ms (XLA's ops -> the kernel;
        `rotation=None` 36 ms); standalone 131 -> 108 ms (its forward rotation to f32 stays
        XLA's; an FWHT kernel for it, tried, changed nothing)."""
        rotation = self.input_rotation
        return (
            self.kernel == "auto"
            and self.inverse == "auto"
            and self.schedule_for(axis_size) == "two-shot"
            and jnp.dtype(dtype) == jnp.bfloat16
            and rotation is not None
            and one_shot.decodes_each(self.block_size, rotation.block)
        )

    def _encodes_natively(self, dtype: jnp.dtype, axis_size: int) -> bool:
        """Whether two-shot's reduce-scatter runs as the native kernels (`_two_shot_kernels`):
        `kernel="auto"` on CPU where they build with AVX-512, bf16 in, rotation groups (or
        blocks, without a rotation) of 64 elements made of blocks of 16 to 64 (the N > 2
        default: two blocks of 32)."""
        return (
            self.kernel == "auto"
            and self.schedule_for(axis_size) == "two-shot"
            and jnp.dtype(dtype) == jnp.bfloat16
            and one_shot.quantizes_chunks(self.block_size, self._quantized_group)
        )

    @property
    def _quantized_group(self) -> int:
        """The elements the quantizer reads as one unit: a rotation group, or without a
        rotation one block."""
        return self._rotation_group if self.input_rotation is not None else self.block_size

    def _two_shot_kernels(
        self, dtype: jnp.dtype, axis_size: int, *, rotate_input: bool
    ) -> NativeTwoShot | None:
        """Two-shot's reduce-scatter as `one_shot.rotate_quantize_chunks` (every chunk of a
        lane rotated, quantized and packed in one pass, straight from the message) and
        `one_shot.reduce_chunk` (the own chunk rotated, the received payloads decoded and
        added, the sum quantized, in one pass); rotating the input only if `rotate_input`.
        None where they do not apply (`_encodes_natively`)."""
        if not self._encodes_natively(dtype, axis_size):
            return None
        codec = dict(
            block=self.block_size,
            group=self._quantized_group,
            scale_dtype=self.scale_dtype,
            hadamard=rotate_input and self.input_rotation is not None,
        )
        return NativeTwoShot(
            encode=lambda lanes, start, rows: one_shot.rotate_quantize_chunks(
                lanes, start=start, rows=rows, chunks=lanes.shape[2], **codec
            ),
            reduce=lambda lanes, start, rows, received, firsts: one_shot.reduce_chunk(
                lanes, start, received, rows=rows, firsts=firsts, **codec
            ),
            row_bytes=self.payload_bytes(self.block_size, dtype),
            group_rows=self._quantized_group // self.block_size,
            piece_bytes=self.gather_piece_bytes(),
            send_pieces=self.sends_in_pieces(),
        )

    def gather_piece_bytes(self) -> int:
        """The most payload bytes of a piece of two-shot's reduce, all-gather and decode:
        `ring.GATHER_PIECE_BYTES` where `transport.measure` found a link slower than
        AUTO_PIECES_BELOW_BITS_PER_S, else 0 (whole chunks: loopback, fast links, fake
        devices)."""
        slow = transport.slower_than(self.AUTO_PIECES_BELOW_BITS_PER_S)
        return ring.GATHER_PIECE_BYTES if slow else 0

    def sends_in_pieces(self) -> bool:
        """Whether two-shot's encode and reduce-scatter go in the pieces of
        `gather_piece_bytes` too: where `transport.measure` found a link slower than
        AUTO_SEND_PIECES_BELOW_BITS_PER_S."""
        return self.gather_piece_bytes() > 0 and transport.slower_than(
            self.AUTO_SEND_PIECES_BELOW_BITS_PER_S
        )

    def _one_shot_kernels(
        self, dtype: jnp.dtype, axis_size: int, *, rotate_input: bool
    ) -> PackedOneShot | None:
        """The native kernels for one lane: rotate the input first only if `rotate_input`;
        rotate the sum back whenever this all-reduce has a rotation. None where they do not
        apply (`_runs_natively`)."""
        if not self._runs_natively(dtype, axis_size):
            return None
        rotated = self.input_rotation is not None
        block = self.block_size
        return PackedOneShot(
            encode=lambda flat, start, rows, held: one_shot.rotate_quantize_rows(
                flat,
                block=block,
                start=start,
                rows=rows,
                hadamard=rotate_input and rotated,
                scale_dtype=self.scale_dtype,
                held=held,
            ),
            combine=lambda out, gathered, start, held: one_shot.dequantize_rotate_into(
                out,
                gathered,
                block=block,
                start=start,
                hadamard=rotated,
                scale_dtype=self.scale_dtype,
                held=held,
            ),
        )


def _rotate_lane(rotation: HadamardRotation, lane: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """A lane [..., R, B] of the flat message, each run of `rotation.block` elements rotated."""
    flat = lane.reshape(*lane.shape[:-2], -1)
    return rotation.apply(flat, out_dtype=out_dtype).reshape(lane.shape)


@dataclasses.dataclass(frozen=True)
class RotatedInput(AllReduce):
    """`method` for inputs whose forward rotation the caller folded into the weights that
    produce them (`models.gemma3`): `y = ar(x_rotated, axis)` skips the forward transform and
    applies only the inverse to the reduced result, on every path a message can take (the
    size gate's psum too). Built by `EquarxInt8.with_rotated_input()`; not registered."""

    name: ClassVar[str] = EquarxInt8.name
    quantized: ClassVar[bool] = True

    method: EquarxInt8

    def __post_init__(self):
        if self.method.input_rotation is None:
            raise ValueError("RotatedInput needs a method with an input rotation")

    @property
    def rotation(self) -> HadamardRotation:
        return self.method.input_rotation

    def reduce(self, x: jax.Array, axis_name: str, axis_size: int) -> jax.Array:
        if not self.rotation.divides(x.shape[-1] if x.ndim else 1):
            raise ValueError(
                f"a rotated input's last axis must be a multiple of the rotation block "
                f"{self.rotation.block}, got shape {x.shape}"
            )
        return self.method.reduce_rotated_input(x, axis_name, axis_size)

    def exact_sum(self, x: jax.Array, axis_name: str) -> jax.Array:
        return self.rotation.apply(super().exact_sum(x, axis_name))

    def one_shot_parts(self, x: jax.Array, axis_size: int) -> OneShotParts:
        return self.method.one_shot_parts(x, axis_size, rotate_input=False)

    def options(self) -> dict[str, object]:
        return self.method.options()

    def is_gated(self, num_elements: int, dtype: jnp.dtype) -> bool:
        return self.method.is_gated(num_elements, dtype)

    def gate_bytes(self) -> int:
        return self.method.gate_bytes()

    def ungated(self) -> RotatedInput:
        return RotatedInput(self.method.ungated())

    def wire_bytes(self, num_elements: int, dtype: jnp.dtype, axis_size: int) -> int:
        if axis_size > 1 and self.is_gated(num_elements, dtype):
            return ring_all_reduce_bytes(num_elements * 4, axis_size)  # psum in f32
        return self.method.wire_bytes(num_elements, dtype, axis_size)
