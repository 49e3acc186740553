"""Pipelined all-reduce over `ppermute` and `all_gather`, generic in what goes on the wire.

The message (flattened, padded) is laid out as lanes `[D, S, N, R, B]`: D directions (1, or 2
when bidirectional: lane d=0 travels i -> i+1, d=1 travels i -> i-1), S pipeline slices, N
chunks (one per device), R rows of B elements. Every (direction, slice) lane is an independent
all-reduce of `N*R*B` elements, a contiguous run of the flat message; the program is emitted
step-major, so while slice s is on the wire, slice s+1 is being encoded: the slices form a
software pipeline. (XLA:CPU overlaps them only where nothing orders them otherwise: it runs
collectives one at a time in schedule order and makes every reuse of a buffer an edge of the
program's DAG, so the native one-shot and two-shot paths fix their collectives' order and hold
buffers until the last decode: `packed_one_shot_all_reduce`, `_native_two_shot_all_reduce`.)
Optional per-lane transforms (`prepare` before encoding, `finish` after decoding: the
Hadamard rotation and its inverse) pipeline with them; a `decode` hook may replace the codec's
decoding of the reduced payloads by a linear map of it (the inverse rotation applied to the
int8 codes, before their scales).
One-shot lanes may instead run as two fused kernels on the bytes that travel (`PackedOneShot`:
EQuARX's native CPU kernels), which read each lane from the message and write its result into
one output buffer (`packed_one_shot_all_reduce`: no lane copies, no stacking).

Two reduce-scatters:
  ring      (N-1 hops) device i sends the running partial sum of chunk i - s*dir at step s;
            the receiver decodes it, adds its own contribution in f32 and re-encodes it.
            Afterwards device i owns chunk i + dir. Every hop encodes once more.
  two-shot  each device encodes its contribution once and sends chunk j straight to device j
            (N-1 shifted ppermutes); the owner sums its own exact contribution and the N-1
            decoded ones in f32. Device i owns chunk i. Each element is encoded exactly twice.
Then an all-gather: each owner encodes its reduced chunk once; the payload travels unchanged,
and every device, the owner included, decodes the same bytes, so all replicas are
bit-identical. After two-shot (owners in rank order) it is one `lax.all_gather` per lane (gloo's
all-gather on CPU, NCCL's on GPU), the values and scales packed into one buffer; after the ring
reduce-scatter it is a ring of N-1 `ppermute` hops, so that every transfer stays between
neighbours (a physical ring: the TPU ICI torus).

A third schedule needs no reduce-scatter:
  one-shot  each device encodes its whole lane once and all-gathers it (one collective per
            lane); every device decodes all N payloads, its own included, and adds them in f32
            in rank order, so replicas are bit-identical. Each element is encoded once. One
            step instead of two, and at N = 2 the same bytes as the others; at N > 2 it sends
            N/2 times their bytes.

Why all-gathers: on XLA:CPU a collective-permute is one unbound send and one receive, waited
on together, and its two directions do not overlap on the wire (a 4 MiB exchange over a
1 Gbit/s link: 48-67 ms, 53-73% of the link), while gloo's all-gather moves 4 MiB in ~50 ms
(~70%); and one collective per lane instead of one per payload array saves the ~20 ms that a
small collective after a large one costs there.

Bytes each device sends, for E encoded bytes per element: 2 (N-1) R B D S * E for ring and
two-shot, (N-1) N R B D S * E for one-shot. `schedule="auto"` (`RingAllReduce.schedule_for`)
runs one-shot over 2 devices, where it sends what two-shot sends in one step instead of two,
and two-shot over more.

`RingAllReduce` is the base of every all-reduce built on this engine (`ring`, `naive-int8`,
`equarx-int8`): the layout, the option checks, `reduce` and `wire_bytes`; a subclass says
what travels (`codec`, `payload_bytes`) and how wide a lane's rows are (`lane_block`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from equarx_serve.collectives import transport
from equarx_serve.collectives.base import (
    AllReduce,
    OneShotParts,
    check_float_dtype,
    sum_in_rank_order,
)

Payload = Any  # a pytree of arrays: what one hop puts on the wire
SCHEDULES = ("auto", "ring", "two-shot", "one-shot")
MAX_SLICES = 256  # slice_bytes never cuts a message into more lanes (program size)
# A pairwise swap (the shift by N / 2, where devices i and i + N / 2 send each other a chunk over
# one gloo connection) sent as one message crossed 4 emulated hosts' 1 Gbit/s links at about half
# the link's rate; sent in pieces of at most this many bytes, each its own collective, near the
# link's rate (docs/decisions.md, "two-shot's pairwise swap in pieces"; two runs each way, 16 / 64
# MiB: `ring` 240-244 / 965-1007 ms vs 270-293 / 1050-1109 ms, `equarx-int8` 146-150 / 596-600 ms vs
# 161-162 / 689-714 ms).
SWAP_PIECE_BYTES = 512 * 1024
# Where the link is slow (`EquarxInt8.gather_piece_bytes`), two-shot's reduce, all-gather and decode
# go in pieces of a lane's rows of at most this many payload bytes each (and where it is slower
# still, `EquarxInt8.sends_in_pieces`, its encode and reduce-scatter too:
# `_native_two_shot_all_reduce`), so that a piece's decode runs while the next piece is on the wire.
# 4 emulated hosts, 1 Gbit/s, `equarx-int8`, two runs each (docs/decisions.md, "the all-gather in
# pieces"): pieces of 256 KiB / 512 KiB / 1 MiB / 2 MiB 131-134 / 138-139 / 131-139 / 134-138 ms at
# 16 MiB and 542-559 / 534-535 / 548 / 547-550 ms at 64 MiB, within this machine's spread of one
# another; in one piece 137-142 and 579-601 ms.
GATHER_PIECE_BYTES = 512 * 1024


class Codec(Protocol):
    """What travels on the wire, and how partial sums are combined."""

    def encode_chunk(self, lane: jax.Array, index: jax.Array) -> Payload:
        """Chunk `index` (traced) of a lane [N, R, B] -> its payload."""

    def accumulate_encode(self, local: jax.Array, received: tuple[Payload, ...]) -> Payload:
        """Encode local [R, B] + sum(decode(received)), accumulating as the codec defines."""

    def decode(self, payload: Payload, dtype: jnp.dtype) -> jax.Array:
        """payload [..., R, B] -> values [..., R, B] in `dtype`."""


@dataclasses.dataclass(frozen=True)
class LaneLayout:
    """How a flat message of `size` elements is padded and cut into `[D, S, N, R, B]` lanes."""

    size: int
    axis_size: int
    directions: int
    num_slices: int
    block_size: int
    rows: int  # R: rows per chunk per lane

    @classmethod
    def create(
        cls,
        size: int,
        axis_size: int,
        *,
        directions: int,
        num_slices: int,
        block_size: int,
        pad_rows: Callable[[int], int] = lambda rows: rows,
    ) -> LaneLayout:
        units = directions * num_slices * axis_size * block_size
        rows = pad_rows(max(1, -(-size // units)))
        return cls(size, axis_size, directions, num_slices, block_size, rows)

    @property
    def lane_shape(self) -> tuple[int, ...]:
        return (self.directions, self.num_slices, self.axis_size, self.rows, self.block_size)

    @property
    def padded_size(self) -> int:
        return self.directions * self.num_slices * self.axis_size * self.rows * self.block_size

    def to_lanes(self, x: jax.Array) -> jax.Array:
        flat = x.reshape(-1)
        return jnp.pad(flat, (0, self.padded_size - self.size)).reshape(self.lane_shape)

    def from_lanes(self, lanes: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        return lanes.reshape(-1)[: self.size].reshape(shape)


def take_chunk(tree: Payload, index: jax.Array) -> Payload:
    """Chunk `index` (traced) of every array in a payload of [N, ...] arrays."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, 0, keepdims=False), tree)


def _shift_perm(axis_size: int, shift: int) -> list[tuple[int, int]]:
    return [(i, (i + shift) % axis_size) for i in range(axis_size)]


def _swaps(axis_size: int, shift: int) -> bool:
    """Whether shifting by `shift` pairs the devices up, each sending to its own sender."""
    return 2 * (shift % axis_size) == axis_size


def _behind(operand: jax.Array, previous: jax.Array | None) -> jax.Array:
    """`operand`, after `previous` (an optimization barrier on both; None: as it is): XLA:CPU
    then runs what reads it after what produced `previous`, e.g. collectives in a fixed order."""
    if previous is not None:
        operand, _ = lax.optimization_barrier((operand, previous))
    return operand


def permute_shift(
    data: jax.Array, axis_name: str, axis_size: int, shift: int, *, after: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """`data` (u8 [bytes]) from every device to the one `shift` after it, a swap in pieces of at
    most SWAP_PIECE_BYTES (see there), one after another, joined again; the first collective
    behind `after` (an optimization barrier on it: e.g. the previous collective's result).
    Returns the received bytes and the last collective's result (to order the next one)."""
    perm = _shift_perm(axis_size, shift)
    if not _swaps(axis_size, shift) or data.size <= SWAP_PIECE_BYTES:
        received = lax.ppermute(_behind(data, after), axis_name, perm)
        return received, received
    pieces, previous = [], after
    for start in range(0, data.size, SWAP_PIECE_BYTES):
        previous = lax.ppermute(
            _behind(data[start : start + SWAP_PIECE_BYTES], previous), axis_name, perm
        )
        pieces.append(previous)
    return jnp.concatenate(pieces), previous


def permute_payload_shift(payload: Payload, axis_name: str, axis_size: int, shift: int) -> Payload:
    """`ppermute_payload` by a shift; a swap larger than SWAP_PIECE_BYTES travels as its bytes
    in pieces (`permute_shift`)."""
    leaves = jax.tree.leaves(payload)
    size = sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in leaves)
    if not _swaps(axis_size, shift) or size <= SWAP_PIECE_BYTES:
        return ppermute_payload(payload, axis_name, _shift_perm(axis_size, shift))
    received, _ = permute_shift(pack_payload(payload), axis_name, axis_size, shift)
    return jax.tree.unflatten(jax.tree.structure(payload), unpack_payload(received, leaves))


LaneFn = Callable[[jax.Array], jax.Array]
PayloadFn = Callable[[Payload], jax.Array]
# all-gathered bytes (rows `first` on of every chunk), arrays to hold live until the call
# without reading them, and the lane [N, R, B] they are decoded into (a ShapeDtypeStruct: a new
# one) -> that lane with those rows replaced
GatheredFn = Callable[
    [jax.Array, tuple[jax.Array, ...], "jax.Array | jax.ShapeDtypeStruct", int], jax.Array
]


@dataclasses.dataclass(frozen=True)
class PackedOneShot:
    """One-shot as two fused kernels on the bytes that travel, reading and writing the message
    itself (no lanes are copied out of it or stacked back): `encode(flat, start, rows)` maps
    rows of B elements of the flat message from element `start` on (zeros past its end: the
    padding) to their payload as `pack_payload` lays it out (what `prepare`, the codec and the
    packing would give); `combine(out, gathered, start, held)` returns the flat output `out`
    with the lane's outputs written from element `start` (those past the end dropped), from the
    all-gathered bytes [N (source rank), bytes] (what decoding, the sum in rank order and
    `finish` would give), holding the arrays `held` live until then without reading them.
    `encode(flat, start, rows, held)` holds `held` likewise (an ordering: it runs after them)."""

    encode: Callable[[jax.Array, int, int, tuple[jax.Array, ...]], jax.Array]
    combine: Callable[[jax.Array, jax.Array, int, tuple[jax.Array, ...]], jax.Array]


@dataclasses.dataclass(frozen=True)
class NativeTwoShot:
    """Two-shot's reduce-scatter as two fused kernels on the bytes that travel, reading the
    lanes [D, S, N, R, B] flat: `encode(lanes, start, rows)` maps the lane from element `start`
    to its N chunk payloads (what `prepare` and the codec's encoding give, as `pack_payload`
    lays each out), u8 [N, bytes]; `reduce(lanes, start, rows, received, firsts)` maps `rows`
    rows of the device's own chunk from element `start` (traced) and rows firsts[k] on of the
    N - 1 payloads k it received (u8 [bytes] each, in shift order) to the payload of those
    reduced rows, u8 [bytes] (what `prepare` and the codec's accumulate-encode give); with
    nothing received, to their payload (what `encode` gives for them:
    `_native_two_shot_all_reduce` encodes each chunk it sends so). A payload has `row_bytes`
    bytes a row; a lane's reduce, all-gather and decode go in pieces of whole groups of
    `group_rows` rows and at most `piece_bytes` of payload (0: whole chunks); with
    `send_pieces`, every chunk a device sends travels in those pieces too."""

    encode: Callable[[jax.Array, int, int], jax.Array]
    reduce: Callable[[jax.Array, jax.Array, int, list[jax.Array], list[int]], jax.Array]
    row_bytes: int
    group_rows: int = 1
    piece_bytes: int = 0
    send_pieces: bool = False


def pipelined_all_reduce(
    lanes: jax.Array,
    axis_name: str,
    codec: Codec,
    *,
    schedule: str,
    out_dtype: jnp.dtype,
    prepare: LaneFn | None = None,
    decode: PayloadFn | None = None,
    finish: LaneFn | None = None,
    decode_gathered: GatheredFn | None = None,
    native: NativeTwoShot | None = None,
) -> jax.Array:
    """All-reduce `lanes` [D, S, N, R, B] over `axis_name`; returns [D, S, N, R, B] out_dtype.

    `prepare` maps each lane [N, R, B] to the values that are encoded (e.g. a rotation);
    `decode` maps all-gathered payloads (leaves [..., R, ...]) to f32 values [..., R, B]
    (default `codec.decode`; else a linear map of its values, since one-shot sums what it
    returns for each source's payload: e.g. the inverse rotation applied to int8 codes); and
    `finish` maps each reduced lane of those values to the output in `out_dtype` (e.g. the
    inverse rotation). All per lane, so lane k's transforms can overlap lane k+1's transfer.
    Two-shot only: `decode_gathered(gathered, held)` replaces `decode` and `finish` of the
    all-gathered payloads by one kernel on their bytes (u8 [N, bytes] as `pack_payload` lays
    each out -> [N, R, B] out_dtype), holding the arrays `held` live until then; and `native`
    replaces `prepare` and the codec in the reduce-scatter by its kernels (the payloads travel
    as their bytes). With both, `_native_two_shot_all_reduce` runs it.
    """
    keys = _LaneKeys.of(lanes, axis_name)
    prepare = prepare or (lambda lane: lane)
    decode = decode or (lambda payload: codec.decode(payload, jnp.float32))
    finish = finish or (lambda lane: lane.astype(out_dtype))
    if schedule == "one-shot":
        return _one_shot_all_reduce(
            lanes,
            axis_name,
            codec,
            prepare=prepare,
            decode=decode,
            finish=finish,
        )
    for hook, name in ((decode_gathered, "decode_gathered"), (native, "native")):
        if hook is not None and schedule != "two-shot":
            raise ValueError(f"{name} is for the two-shot schedule, not {schedule!r}")
    if native is not None and decode_gathered is not None:
        return _native_two_shot_all_reduce(lanes, axis_name, native, decode_gathered)
    values = None if native is not None else {key: prepare(lanes[key]) for key in keys.keys}
    if schedule == "ring":
        with jax.named_scope("ring_reduce_scatter"):
            payload, owned = _ring_reduce_scatter(values, keys, codec)
    elif schedule == "two-shot":
        with jax.named_scope("two_shot_reduce_scatter"):
            payload, owned = _two_shot_reduce_scatter(lanes, values, keys, codec, native)
    else:
        raise ValueError(f"unknown schedule {schedule!r}; valid: {SCHEDULES}")
    decoded = {}
    for key in keys.keys:
        decoded[key] = _all_gather_lane(
            payload[key],
            owned[key],
            keys,
            key,
            ring=schedule == "ring",
            decode=lambda gathered: finish(decode(gathered)),
            decode_gathered=decode_gathered,
            lane=jax.ShapeDtypeStruct(lanes.shape[2:], out_dtype),
        )
    return jnp.stack(
        [jnp.stack([decoded[(d, s)] for s in range(keys.num_slices)]) for d in range(keys.num_dirs)]
    )


LaneKey = tuple[int, int]  # (direction, slice)


@dataclasses.dataclass(frozen=True)
class _LaneKeys:
    """The (direction, slice) lanes of a [D, S, N, R, B] message in program order, each
    lane's direction round the ring (d=0: i -> i+1, d=1: i -> i-1), and this device's place."""

    keys: list[LaneKey]
    num_dirs: int
    num_slices: int
    axis_name: str
    axis_size: int
    index: jax.Array  # this device's rank (traced)

    @classmethod
    def of(cls, lanes: jax.Array, axis_name: str) -> _LaneKeys:
        num_dirs, num_slices, n = lanes.shape[:3]
        index = lax.axis_index(axis_name)
        keys = [(d, s) for d in range(num_dirs) for s in range(num_slices)]
        return cls(keys, num_dirs, num_slices, axis_name, n, index)

    def direction(self, key: LaneKey) -> int:
        return 1 if key[0] == 0 else -1


def _ring_reduce_scatter(
    values: dict[LaneKey, jax.Array], keys: _LaneKeys, codec: Codec
) -> tuple[dict[LaneKey, Payload], dict[LaneKey, jax.Array]]:
    """The ring's reduce-scatter (see the module doc), step-major over the lanes so that the
    lanes pipeline: each lane's reduced payload and the chunk this device owns (i + dir)."""
    n, index, axis_name = keys.axis_size, keys.index, keys.axis_name
    payload = {key: codec.encode_chunk(values[key], index) for key in keys.keys}
    for step in range(1, n):
        for key in keys.keys:
            dr = keys.direction(key)
            received = ppermute_payload(payload[key], axis_name, _shift_perm(n, dr))
            local_chunk = take_chunk(values[key], (index - dr * step) % n)
            payload[key] = codec.accumulate_encode(local_chunk, (received,))
    owned = {key: (index + keys.direction(key)) % n for key in keys.keys}
    return payload, owned


def _two_shot_reduce_scatter(
    lanes: jax.Array,
    values: dict[LaneKey, jax.Array] | None,
    keys: _LaneKeys,
    codec: Codec,
    native: NativeTwoShot | None,
) -> tuple[dict[LaneKey, Payload], dict[LaneKey, jax.Array]]:
    """Two-shot's reduce-scatter (see the module doc), shift-major over the lanes: chunk j of
    every lane straight to device j, encoded by the codec from `values` or, with `native`, by
    its kernels from `lanes` read flat (the payloads travel as their bytes). Each lane's
    reduced payload (the codec's arrays) and the chunk this device owns (its own rank)."""
    n, index, axis_name = keys.axis_size, keys.index, keys.axis_name
    received: dict[LaneKey, list[Payload]] = {key: [] for key in keys.keys}
    if native is not None:  # each lane's first element in `lanes`, read flat
        rows, lane_size = lanes.shape[3], n * lanes.shape[3] * lanes.shape[4]
        start = {(d, s): (d * keys.num_slices + s) * lane_size for d, s in keys.keys}
        sent = {key: native.encode(lanes, start[key], rows) for key in keys.keys}
    for shift in range(1, n):
        for key in keys.keys:
            dr = keys.direction(key)
            target = (index + dr * shift) % n
            if native is None:
                outgoing = codec.encode_chunk(values[key], target)
                moved = permute_payload_shift(outgoing, axis_name, n, dr * shift)
                received[key].append(moved)
            else:  # bytes
                outgoing = lax.dynamic_index_in_dim(sent[key], target, 0, keepdims=False)
                moved, _ = permute_shift(outgoing, axis_name, n, dr * shift)
                received[key].append(moved)
    payload, owned = {}, {}
    for key in keys.keys:
        owned[key] = index
        if native is None:
            local = take_chunk(values[key], index)
            payload[key] = codec.accumulate_encode(local, tuple(received[key]))
            continue
        own = start[key] + index * (lane_size // n)
        reduced = native.reduce(lanes, own, rows, received[key], [0] * (n - 1))
        # the codec decodes it (`decode_gathered` goes to _native_two_shot_all_reduce)
        payload[key] = _unpack_like(reduced, codec, lanes.shape[3:])
    return payload, owned


def _all_gather_lane(
    payload: Payload,
    owned: jax.Array,
    keys: _LaneKeys,
    key: LaneKey,
    *,
    ring: bool,
    decode: Callable[[Payload], jax.Array],
    decode_gathered: GatheredFn | None,
    lane: jax.ShapeDtypeStruct,
) -> jax.Array:
    """One lane's all-gather and decode: the owners' payloads, unchanged; everyone decodes
    the same bytes. Two-shot owners are in rank order, so one gloo/NCCL all-gather per lane
    carries them (decoded by `decode_gathered` on their bytes where given); the ring schedule
    forwards them around the ring (every transfer to a neighbour)."""
    if ring:
        with jax.named_scope("ring_all_gather"):
            in_place = _ring_all_gather(payload, owned, keys.axis_name, keys.direction(key))
    elif decode_gathered is not None:  # the kernel, on the bytes as they arrive
        with jax.named_scope("all_gather"):
            gathered = lax.all_gather(pack_payload(payload), keys.axis_name)
        return decode_gathered(gathered, (), lane, 0)
    else:
        with jax.named_scope("all_gather"):
            in_place = all_gather_payload(payload, keys.axis_name)  # chunk p from device p
    return decode(in_place)


def _gather_pieces(
    rows: int, row_bytes: int, group_rows: int, piece_bytes: int
) -> list[tuple[int, int]]:
    """(first row, rows) of the pieces a reduced chunk of `rows` rows of `row_bytes` bytes is
    all-gathered in: as many as keep a piece within `piece_bytes` (0: one), whole groups of
    `group_rows` rows each (the first ones one group larger where they do not divide evenly)."""
    groups = rows // group_rows
    count = max(1, min(groups, -(-rows * row_bytes // piece_bytes))) if piece_bytes else 1
    sizes = [(groups // count + (i < groups % count)) * group_rows for i in range(count)]
    return list(zip(itertools.accumulate(sizes, initial=0), sizes, strict=False))


def _native_two_shot_all_reduce(
    lanes: jax.Array, axis_name: str, native: NativeTwoShot, decode_gathered: GatheredFn
) -> jax.Array:
    """Two-shot on bytes (`native`'s kernels, then `decode_gathered`), its collectives in a
    pipelined order: lane k's N - 1 reduce-scatter permutes, then lane k - 1's all-gather, so
    that lane k - 1's reduce runs while lane k's permutes are on the wire and its decode while
    lane k + 1's are. Each chunk a device sends is encoded on its own (`encode`), so that the
    first transfer waits for one encode and the others run during it: on CPU the kernels run
    beside XLA's thread (`one_shot.cc`, `Later`). A lane's reduce, all-gather and decode may go
    in pieces of its rows (`_gather_pieces`): piece j's all-gather waits only for piece j's reduce,
    and piece j's decode runs while piece j + 1 is on the wire, so that only the first piece's
    reduce and the last piece's decode sit outside the transfers. Likewise the call's first
    chunk goes as its first piece and then the rest, so that the first transfer waits only for
    that piece's encode; or, with `native.send_pieces`, every chunk a device sends goes in the
    pieces, each encoded on its own, so that the later encodes run while earlier pieces are on
    the wire. As in `packed_one_shot_all_reduce`, XLA:CPU runs collectives one at a time
    in schedule order and a buffer's reuse is an edge of its DAG: each collective is put behind
    the previous one (an optimization barrier), and every received and all-gathered buffer is
    held until the last decode, else a lane's collective waited for the previous lane's
    compute."""
    return _NativeTwoShotProgram(lanes, axis_name, native, decode_gathered).run()


Segment = tuple[int, jax.Array]  # (first row, payload u8 [bytes]) of a chunk's rows


class _NativeTwoShotProgram:
    """The trace of one `_native_two_shot_all_reduce`: what its steps share is the order they
    are put in (`last`: every collective so far; `encoded`: every encode so far) and the
    buffers held until the last decode (`held`)."""

    def __init__(
        self, lanes: jax.Array, axis_name: str, native: NativeTwoShot, decode_gathered: GatheredFn
    ):
        _, _, self.n, self.rows, self.block = lanes.shape
        self.lanes, self.axis_name = lanes, axis_name
        self.native, self.decode_gathered = native, decode_gathered
        self.lane_size = self.n * self.rows * self.block
        self.pieces = _gather_pieces(
            self.rows, native.row_bytes, native.group_rows, native.piece_bytes
        )
        self.index = lax.axis_index(axis_name)
        self.held: list[jax.Array] = []
        self.last: list[jax.Array] = []  # the latest collective's result
        self.encoded: list[jax.Array] = []  # every payload encoded so far, in order

    def run(self) -> jax.Array:
        """Lane by lane: its reduce-scatter permutes, then the previous lane's all-gather,
        then its reduce; the last lane's all-gather at the end."""
        num_dirs, num_slices = self.lanes.shape[:2]
        chunk_size = self.lane_size // self.n
        decoded, pending = [], None  # pending: the previous lane's reduced pieces
        for d in range(num_dirs):
            dr = 1 if d == 0 else -1
            for s in range(num_slices):
                start = (d * num_slices + s) * self.lane_size
                targets = [
                    start + (self.index + dr * shift) % self.n * chunk_size
                    for shift in range(1, self.n)
                ]
                outgoing = [self.sent_in(target) for target in targets]
                received = []
                with jax.named_scope("two_shot_reduce_scatter"):
                    for shift, segments in enumerate(outgoing, start=1):
                        received.append(self.send(segments, dr * shift))
                self.held += [payload for chunk in received for _, payload in chunk]
                own = start + self.index * chunk_size
                if pending is not None:
                    with jax.named_scope("all_gather"):
                        decoded.append(self.all_gather(pending, final=False))
                pending = self.reduce(own, received)
        with jax.named_scope("all_gather"):
            decoded.append(self.all_gather(pending, final=True))
        return jnp.stack(decoded).reshape(self.lanes.shape[:2] + decoded[0].shape)

    def encode(self, start: jax.Array, count: int) -> jax.Array:
        """The payload of `count` rows from element `start` (the reduce kernel, nothing
        received). The first two encodes start together, every later one after the one before
        it: an encode whose input was ready at once would wait behind the collective that the
        previous encode's completion released (XLA:CPU takes ready operations in schedule order
        on one thread), and all at once they would share the cores."""
        source = _behind(self.lanes, self.encoded[-1] if len(self.encoded) >= 2 else None)
        self.encoded.append(self.native.reduce(source, start, count, [], []))
        return self.encoded[-1]

    def sent_in(self, target: jax.Array) -> list[Segment]:
        """The segments the chunk from element `target` is sent in: the pieces, where
        `native.send_pieces`; else whole, but for the call's first chunk (nothing encoded yet),
        which goes as its first piece and the rest."""
        spans = [(0, self.rows)]
        if self.native.send_pieces:
            spans = self.pieces
        elif not self.encoded and len(self.pieces) > 1:
            split = self.pieces[1][0]
            spans = [(0, split), (split, self.rows - split)]
        return [(first, self.encode(target + first * self.block, count)) for first, count in spans]

    def send(self, segments: list[Segment], shift: int) -> list[Segment]:
        """Each segment of a chunk to the device `shift` after this one, one after another
        behind the previous collective; the segments received."""
        received = []
        for first, payload in segments:
            after = self.last[-1] if self.last else None
            got, latest = permute_shift(payload, self.axis_name, self.n, shift, after=after)
            received.append((first, got))
            self.last.append(latest)
        return received

    def reduce(self, own: jax.Array, received: list[list[Segment]]) -> list[Segment]:
        """The reduced payload of each piece of the own chunk, each reduce after the one before
        (the first piece's all-gather waits for the first alone); a piece reads the received
        segment that holds its rows."""
        reduced, previous = [], None
        for first, count in self.pieces:
            segments = [max((seg for seg in chunk if seg[0] <= first), key=lambda seg: seg[0])
                        for chunk in received]  # fmt: skip
            payloads = [payload for _, payload in segments]
            firsts = [first - seg_first for seg_first, _ in segments]
            source = _behind(self.lanes, previous)
            previous = self.native.reduce(source, own + first * self.block, count, payloads, firsts)
            reduced.append((first, previous))
        return reduced

    def all_gather(self, reduced: list[Segment], *, final: bool) -> jax.Array:
        """The lane from its reduced pieces: each all-gathered behind the previous collective
        and decoded into the lane; the last decode of the call holds every buffer until then."""
        lane = jax.ShapeDtypeStruct((self.n, self.rows, self.block), self.lanes.dtype)
        for number, (first, payload) in enumerate(reduced):
            gathered = lax.all_gather(
                _behind(payload, self.last[-1] if self.last else None), self.axis_name
            )
            self.last.append(gathered)
            at_last = final and number == len(reduced) - 1
            lane = self.decode_gathered(gathered, tuple(self.held) if at_last else (), lane, first)
            self.held.append(gathered)
        return lane


def _unpack_like(packed: jax.Array, codec: Codec, chunk_shape: tuple[int, ...]) -> Payload:
    """A chunk's payload bytes (as `pack_payload` lays them out) -> the codec's payload arrays."""
    chunk = jax.ShapeDtypeStruct((1, *chunk_shape), jnp.float32)
    leaves, treedef = jax.tree.flatten(jax.eval_shape(lambda c: codec.encode_chunk(c, 0), chunk))
    return jax.tree.unflatten(treedef, unpack_payload(packed, leaves))


def _ring_all_gather(payload: Payload, owned: jax.Array, axis_name: str, direction: int) -> Payload:
    """Every chunk's payload in chunk order (leaves [N, ...]), forwarded N-1 hops round the ring
    from its owner (this device owns chunk `owned`). The payloads are kept in arrival order and
    one gather puts them in place (no zero-filled buffer, no per-chunk copies)."""
    n = lax.axis_size(axis_name)
    arrived = [payload]
    for _ in range(1, n):
        arrived.append(ppermute_payload(arrived[-1], axis_name, _shift_perm(n, direction)))
    # The payload that arrived at step k is chunk owned - dir*k, so chunk p arrived at step
    # dir * (owned - p) mod N.
    arrival_step = direction * (owned - jnp.arange(n)) % n  # [N]
    return jax.tree.map(lambda *chunks: jnp.take(jnp.stack(chunks), arrival_step, axis=0), *arrived)


def ppermute_payload(payload: Payload, axis_name: str, perm: list[tuple[int, int]]) -> Payload:
    """`lax.ppermute` of a payload in ONE collective-permute: a payload of several arrays
    travels bit-cast to bytes in one buffer (`pack_payload`), as in `all_gather_payload`."""
    leaves, treedef = jax.tree.flatten(payload)
    if len(leaves) == 1:
        return jax.tree.unflatten(treedef, [lax.ppermute(leaves[0], axis_name, perm)])
    moved = lax.ppermute(pack_payload(payload), axis_name, perm)
    return jax.tree.unflatten(treedef, unpack_payload(moved, leaves))


def unpack_payload(packed: jax.Array, like: list[jax.Array]) -> list[jax.Array]:
    """`pack_payload`'s bytes [..., bytes] -> arrays [..., *shape] of the shapes and dtypes of
    `like` (a payload's leaves), in order."""
    lead, unpacked, offset = packed.shape[:-1], [], 0
    for leaf in like:
        itemsize = jnp.dtype(leaf.dtype).itemsize
        part = packed[..., offset : offset + leaf.size * itemsize]
        offset += leaf.size * itemsize
        bytes_shape = (*lead, *leaf.shape) + ((itemsize,) if itemsize > 1 else ())
        unpacked.append(lax.bitcast_convert_type(part.reshape(bytes_shape), leaf.dtype))
    return unpacked


def all_gather_payload(payload: Payload, axis_name: str) -> Payload:
    """Every device's `payload`, stacked in rank order (leaves [N, ...]), in ONE all-gather
    (gloo's on CPU, NCCL's on GPU). A payload of several arrays travels bit-cast to bytes in one
    buffer (`pack_payload`), so the scales ride with the values instead of costing a collective
    of their own (a small extra collective costs ~20 ms on a 1 Gbit/s link here)."""
    leaves, treedef = jax.tree.flatten(payload)
    if len(leaves) == 1:
        return jax.tree.unflatten(treedef, [lax.all_gather(leaves[0], axis_name)])
    gathered = lax.all_gather(pack_payload(payload), axis_name)  # [N, bytes]
    return jax.tree.unflatten(treedef, unpack_payload(gathered, leaves))


def pack_payload(payload: Payload) -> jax.Array:
    """A payload's arrays as one u8 buffer: each leaf's bytes (native order), in tree order."""
    leaves = jax.tree.leaves(payload)
    return jnp.concatenate([lax.bitcast_convert_type(a, jnp.uint8).reshape(-1) for a in leaves])


def _one_shot_all_reduce(
    lanes: jax.Array,
    axis_name: str,
    codec: Codec,
    *,
    prepare: LaneFn,
    decode: PayloadFn,
    finish: LaneFn,
) -> jax.Array:
    """Every device encodes its whole lane once and all-gathers it (one collective per lane);
    every device decodes all N payloads, its own too, and sums them in f32 in rank order, so
    replicas are bit-identical."""
    num_dirs, num_slices, n = lanes.shape[:3]
    decoded = []
    with jax.named_scope("one_shot_all_gather"):
        for d in range(num_dirs):
            for s in range(num_slices):
                own = _one_shot_encode(prepare(lanes[d, s]), codec, n)
                by_rank = all_gather_payload(own, axis_name)  # [N (source rank), N, R, ...]
                decoded.append(_one_shot_combine(by_rank, decode, finish))
    return jnp.stack(decoded).reshape(lanes.shape)


def _one_shot_encode(values: jax.Array, codec: Codec, n: int) -> Payload:
    """A lane's values [N, R, B] -> the payload of all its N chunks (leaves [N, R, ...])."""
    return jax.tree.map(
        lambda *chunks: jnp.stack(chunks),
        *[codec.encode_chunk(values, jnp.int32(i)) for i in range(n)],
    )


def _one_shot_combine(by_rank: Payload, decode: PayloadFn, finish: LaneFn) -> jax.Array:
    """Every device's lane payload (leaves [N (source rank), N, R, ...]) -> their sum, finished."""
    values = decode(by_rank)  # [N, N, R, B] f32
    return finish(sum_in_rank_order(values))


def packed_one_shot_all_reduce(
    x: jax.Array, layout: LaneLayout, axis_name: str, packed: PackedOneShot
) -> jax.Array:
    """The one-shot schedule on `layout`'s lanes, run by `packed`'s kernels on the message
    itself: lane k (elements k L .. (k + 1) L - 1 of the flat message, L = N R B) is encoded
    from x, all-gathered and combined into one output buffer, so no lane is copied out of x
    and no result is stacked back (at 64 MiB in 68 lanes on 2 processes those copies cost more
    than the kernels: 183 vs 119 ms for all of the lanes' compute).

    XLA:CPU runs a program as a DAG of its operations whose edges include reuse of a buffer by
    a later operation, and collectives one at a time in the order the scheduler chose. So the
    lanes are all-gathered in lane order (each payload behind the previous all-gather, by an
    optimization barrier: the scheduler had put them in reverse, and the decodes, chained
    through `out` from lane 0 on, all waited for the last one), and every all-gathered buffer
    is held until the last decode (else lane k + 1's all-gather reused lane k's buffer and
    waited for lane k's decode): lane k decodes while lane k + 1 is on the wire. Each lane's
    encoder holds the previous lane's payload, so the encoders run one after another and the
    first all-gather starts after the first encoder, not behind all of them (all sources of the
    DAG, they were run first). 2 emulated hosts at 1 Gbit/s, the standalone all-reduce: 16 MiB
    86-87 -> 80-82 -> 74 ms, 64 MiB 350-357 -> 336-345 -> 306-314 ms (link time of its bytes:
    73 and 292 ms)."""
    flat = x.reshape(-1)
    lanes = layout.directions * layout.num_slices
    lane_size = layout.padded_size // lanes
    out = jax.ShapeDtypeStruct(flat.shape, flat.dtype)  # lane 0's combine creates it
    gathered: list[jax.Array] = []
    payload = None
    with jax.named_scope("one_shot_all_gather"):
        for lane in range(lanes):
            start = lane * lane_size
            after = (payload,) if gathered else ()  # the previous lane's encoder (see below)
            payload = packed.encode(flat, start, lane_size // layout.block_size, after)
            payload = _behind(payload, gathered[-1] if gathered else None)
            gathered.append(lax.all_gather(payload, axis_name))
            held = tuple(gathered[:-1]) if lane == lanes - 1 else ()
            out = packed.combine(out, gathered[-1], start, held)
    return out.reshape(x.shape)


@dataclasses.dataclass(frozen=True)
class RingAllReduce(AllReduce):
    """Base of the all-reduces on `pipelined_all_reduce` (see the module doc).

    Subclasses define `schedule` (one of `SCHEDULES`), `bidirectional`, `num_slices` and
    `slice_bytes` (an int, or "auto": see `slice_bytes_for`), as options (dataclass fields,
    checked by `check_lane_options`) or as fixed ClassVars, and `codec`, `payload_bytes` and
    `lane_block`; and may set what `slice_bytes="auto"` does (AUTO_SLICE_*).
    """

    # slice_bytes="auto": AUTO_SLICE_BYTES between 2 devices where `transport.measure` found
    # a link slower than AUTO_SLICE_BELOW_BITS_PER_S, else no slicing (subclasses set both).
    AUTO_SLICE_BYTES: ClassVar[int] = 0
    AUTO_SLICE_BELOW_BITS_PER_S: ClassVar[float] = 0.0

    def check_lane_options(self) -> None:
        """ValueError naming the first bad lane option."""
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not isinstance(self.bidirectional, bool):
            raise ValueError(f"bidirectional must be a bool, got {self.bidirectional!r}")
        if not isinstance(self.num_slices, int) or self.num_slices < 1:
            raise ValueError(f"num_slices must be an int >= 1, got {self.num_slices!r}")
        size = self.slice_bytes
        if size != "auto" and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise ValueError(f"slice_bytes must be an int >= 0 or 'auto', got {size!r}")

    def schedule_for(self, axis_size: int) -> str:
        """The schedule run over `axis_size` devices: `schedule`, where "auto" is one-shot over
        2 devices (two-shot's bytes in one step, each element encoded once) and two-shot over
        more (one-shot would send N/2 times the bytes)."""
        if self.schedule != "auto":
            return self.schedule
        return "one-shot" if axis_size == 2 else "two-shot"

    @property
    def lane_block(self) -> int:
        """B: elements per row of a lane."""
        raise NotImplementedError

    def pad_rows(self, rows: int) -> int:
        """The rows per chunk a lane is padded to (the codec's tiling needs)."""
        return rows

    def codec(self, dtype: jnp.dtype) -> Codec:
        """What travels on the wire for inputs of `dtype`."""
        raise NotImplementedError

    def payload_bytes(self, num_elements: int, dtype: jnp.dtype) -> int:
        """Bytes of one encoded chunk of `num_elements` (padded) elements of `dtype`."""
        raise NotImplementedError

    def slice_bytes_for(self, axis_size: int) -> int:
        """`slice_bytes` as it applies over `axis_size` devices (0: no slicing). "auto": slices
        only between 2 devices on a link that `transport.measure` found slow (see the class
        constants): there gloo moves a large message faster in pieces. Elsewhere each extra
        collective costs ~1-2 ms of fixed overhead and pays nothing: loopback, 16 MiB of int8
        payload in 16 slices 2x slower than in one; 4 emulated hosts on 2 shared cores at 1
        Gbit/s, 1.6-7x slower. README, the comm-bound regime."""
        if self.slice_bytes != "auto":
            return self.slice_bytes
        slow = transport.slower_than(self.AUTO_SLICE_BELOW_BITS_PER_S)
        return self.AUTO_SLICE_BYTES if axis_size == 2 and slow else 0

    def slices_for(self, size: int, dtype: jnp.dtype, axis_size: int) -> int:
        """The pipeline slices of a message of `size` elements: `num_slices`, or where
        `slice_bytes_for` is > 0 as many more as keep what a device sends for one slice (its
        collectives of one lane) within it, at most MAX_SLICES."""
        slice_bytes = self.slice_bytes_for(axis_size)
        if not slice_bytes or axis_size == 1:
            return self.num_slices
        directions = 2 if self.bidirectional else 1
        sent = self._wire_bytes_of(self.layout(size, axis_size, num_slices=1), dtype) // directions
        return max(self.num_slices, min(MAX_SLICES, -(-sent // slice_bytes)))

    def layout(self, size: int, axis_size: int, *, num_slices: int) -> LaneLayout:
        return LaneLayout.create(
            size,
            axis_size,
            directions=2 if self.bidirectional else 1,
            num_slices=num_slices,
            block_size=self.lane_block,
            pad_rows=self.pad_rows,
        )

    def _layout_for(self, size: int, dtype: jnp.dtype, axis_size: int) -> LaneLayout:
        return self.layout(size, axis_size, num_slices=self.slices_for(size, dtype, axis_size))

    def reduce(self, x: jax.Array, axis_name: str, axis_size: int) -> jax.Array:
        check_float_dtype(x, self.name)
        return self.ring_reduce(x, axis_name, axis_size, x.dtype)

    def ring_reduce(
        self,
        x: jax.Array,
        axis_name: str,
        axis_size: int,
        out_dtype: jnp.dtype,
        *,
        prepare: LaneFn | None = None,
        decode: PayloadFn | None = None,
        finish: LaneFn | None = None,
        packed: PackedOneShot | None = None,
        decode_gathered: GatheredFn | None = None,
        native: NativeTwoShot | None = None,
    ) -> jax.Array:
        """The sum over the ring of x (any shape), encoded with `codec(x.dtype)`, decoded to
        `out_dtype`; `prepare`, `decode`, `finish`, `decode_gathered` and `native` are
        `pipelined_all_reduce`'s hooks; `packed` runs the one-shot schedule as its kernels
        (`packed_one_shot_all_reduce`) instead."""
        layout = self._layout_for(x.size, x.dtype, axis_size)
        schedule = self.schedule_for(axis_size)
        scope = jax.named_scope(f"{self.name}_{schedule}".replace("-", "_"))
        if packed is not None:
            if schedule != "one-shot":
                raise ValueError(f"packed kernels are for the one-shot schedule, not {schedule!r}")
            with scope:
                return packed_one_shot_all_reduce(x, layout, axis_name, packed)
        with scope:
            reduced = pipelined_all_reduce(
                layout.to_lanes(x),
                axis_name,
                self.codec(x.dtype),
                schedule=schedule,
                out_dtype=out_dtype,
                prepare=prepare,
                decode=decode,
                finish=finish,
                decode_gathered=decode_gathered,
                native=native,
            )
        return layout.from_lanes(reduced, x.shape)

    def one_shot_parts(self, x: jax.Array, axis_size: int) -> OneShotParts:
        """The one-shot schedule of x as one exchange of bytes (see `OneShotParts`)."""
        return self.one_shot_exchange(x, axis_size)

    def one_shot_exchange(
        self,
        x: jax.Array,
        axis_size: int,
        *,
        prepare: LaneFn | None = None,
        decode: PayloadFn | None = None,
        finish: LaneFn | None = None,
        packed: PackedOneShot | None = None,
    ) -> OneShotParts:
        """`OneShotParts` of x (any shape) in one lane, with `ring_reduce`'s hooks: every
        device's whole message encoded once (`packed`'s kernel, or `prepare` and the codec),
        and every device's payload decoded and summed in rank order (`packed`'s kernel, or
        `decode` and `finish`), as the one-shot schedule does."""
        layout = self.layout(x.size, axis_size, num_slices=1)
        if layout.directions != 1:
            raise ValueError("one exchange carries one direction: bidirectional=False")
        if packed is not None:
            flat = x.reshape(-1)
            payload = packed.encode(flat, 0, layout.padded_size // layout.block_size, ())
            out = jax.ShapeDtypeStruct(flat.shape, flat.dtype)
            combine = lambda gathered: packed.combine(out, gathered, 0, ()).reshape(x.shape)
            return OneShotParts(payload, combine)
        codec, n = self.codec(x.dtype), axis_size
        prepare = prepare or (lambda lane: lane)
        decode = decode or (lambda payload: codec.decode(payload, jnp.float32))
        finish = finish or (lambda lane: lane.astype(x.dtype))
        own = _one_shot_encode(prepare(layout.to_lanes(x)[0, 0]), codec, n)
        leaves, treedef = jax.tree.flatten(own)

        def combine(gathered: jax.Array) -> jax.Array:
            by_rank = jax.tree.unflatten(treedef, unpack_payload(gathered, leaves))
            lane = _one_shot_combine(by_rank, decode, finish)
            return layout.from_lanes(lane[None, None], x.shape)

        return OneShotParts(pack_payload(own), combine)

    def wire_bytes(self, num_elements: int, dtype: jnp.dtype, axis_size: int) -> int:
        if axis_size == 1:
            return 0
        return self._wire_bytes_of(self._layout_for(num_elements, dtype, axis_size), dtype)

    def _wire_bytes_of(self, layout: LaneLayout, dtype: jnp.dtype) -> int:
        n = layout.axis_size
        per_chunk = layout.padded_size // n
        if self.schedule_for(n) == "one-shot":  # the whole message to N - 1 devices
            return (n - 1) * n * self.payload_bytes(per_chunk, dtype)
        return 2 * (n - 1) * self.payload_bytes(per_chunk, dtype)
