"""The one owner of batch padding, and of the all-reduces each step makes.

    policy = BatchPolicy(engine)
    shape = policy.prefill_shape([5, 11])   # StepShape(phase="prefill", rows=2, length=16)
    policy.traffic(shape)                   # AllReduceTraffic: 2 per layer, [2, 16, D], bytes

Every step runs on a padded batch, and this module alone decides how:
- prefill: the prompts are right-padded to the engine's length bucket of the longest, and the
  batch to a power of two rows (few programs), and to at least MIN_ROWS rows when the bucket
  is short (see MIN_ROWS), with copies of the first prompt;
- decode: the KV cache has one row per slot, and at least MIN_ROWS (an idle row if need be);
  a step decodes its first rows up to the highest running slot, a power of two of them (at
  least MIN_ROWS on bf16 weights, 1 on the GGUF's blocks).

The runner executes exactly these shapes, the engine builds its steps from them, and the
server's metrics and the CLI's reports read the all-reduce traffic from here: each layer
reduces two row-parallel partial sums (attention output, MLP output) of [rows, length, D] in
the parameter dtype, each priced by the engine's all-reduce (`AllReduce.wire_bytes`, which
knows its size gate and XLA:CPU's widening of 16-bit psums to f32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

import jax.numpy as jnp

__all__ = [
    "MIN_ROWS",
    "MIN_ROWS_MAX_BUCKET",
    "AllReduceTraffic",
    "AllReduceUsage",
    "BatchPolicy",
    "Phase",
    "StepShape",
]

# Decode batches have at least 2 rows (an idle one if need be), and so do prefill batches of
# short prompts: XLA:CPU runs a 1-row bf16 matmul (GEMV) ~7x slower than a 2-row one. Measured
# on this project's machine, [B, 640] x [262144, 640] bf16 (Gemma 3 270M's logits): B = 1
# 0.28 s, B = 2 0.040 s. Prefill of one 270M prompt, TP = 2, as 1 row vs 2 rows (a copy):
# bucket 128 0.79 vs 0.40 s, 512 1.16 vs 1.70 s, 1024 3.18 vs 3.51 s; so prompts in buckets
# above MIN_ROWS_MAX_BUCKET are prefilled as 1 row.
MIN_ROWS = 2
# Decode steps on the GGUF's int8 blocks (`--weights gguf`, and `auto`'s 1-row steps) run one
# row natively (every matmul a native kernel, none an XLA GEMV): one running request decodes 1
# row, not 2. The 270M step, TP = 2, a 512-entry cache: 1 row 29.9 ms, 2 rows 48.9 ms (same
# process, one after another).
MIN_GGUF_DECODE_ROWS = 1
MIN_ROWS_MAX_BUCKET = 128
GATED = "psum (size gate)"  # what `uses` says for a message below the method's size gate


class Phase(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The padded batch one device step computes on: `rows` sequences of `length` tokens
    (prefill: the length bucket; decode: 1)."""

    phase: Phase
    rows: int
    length: int


@dataclasses.dataclass(frozen=True)
class AllReduceTraffic:
    """The row-parallel all-reduces of one step.

    Attributes:
      shape: One message, [rows, length, embed_dim].
      count: Messages per step (2 per layer).
      message_bytes: One message in the parameter dtype.
      uses: The collective that carries it: the method's name, or "psum (size gate)".
      wire_bytes: Bytes each device sends in all `count` of them.
    """

    shape: tuple[int, int, int]
    count: int
    message_bytes: int
    uses: str
    wire_bytes: int


@dataclasses.dataclass(frozen=True)
class AllReduceUsage:
    """Which collective prefill and decode messages take, for one batch of prompts."""

    all_reduce: str
    options: dict[str, Any]
    min_size_bytes: int | None  # the gate as it applies in this run; None: the method has none
    prefill: AllReduceTraffic
    decode: AllReduceTraffic

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class BatchPolicy:
    """Batch padding and all-reduce accounting for one `PrefillEngine` (see module doc)."""

    def __init__(self, engine: Any):
        self.engine = engine
        # "auto" runs 1-row steps on the blocks too (`PrefillEngine.decoder`).
        blocks_at_one_row = getattr(engine, "weights", "bf16") in ("gguf", "auto")
        self.min_decode_rows = MIN_GGUF_DECODE_ROWS if blocks_at_one_row else MIN_ROWS

    def prefill_shape(self, prompt_lengths: Sequence[int]) -> StepShape:
        """The padded batch of a prefill of prompts of these lengths (ValueError if empty or
        a prompt is longer than the engine's maximum length)."""
        if not prompt_lengths:
            raise ValueError("a prefill needs at least one prompt")
        bucket = self.engine.bucket_for(max(prompt_lengths))
        rows = 1 << (len(prompt_lengths) - 1).bit_length()
        if bucket <= MIN_ROWS_MAX_BUCKET:
            rows = max(rows, MIN_ROWS)
        return StepShape(Phase.PREFILL, rows, bucket)

    def decode_shape(self, slots: int) -> StepShape:
        """The batch of a decode step over `slots` KV-cache slots."""
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        return StepShape(Phase.DECODE, max(slots, MIN_ROWS), 1)

    def running_decode_shape(self, last_running_slot: int, cache_rows: int) -> StepShape:
        """The batch a decode step computes when `last_running_slot` is the highest slot
        running: the cache's first rows up to it, a power of two of them (few programs), at
        least MIN_ROWS (MIN_GGUF_DECODE_ROWS on GGUF blocks), at most `cache_rows`. Slots are
        taken lowest first, so one running request decodes that many rows, not the cache's
        all."""
        if not 0 <= last_running_slot < cache_rows:
            raise ValueError(f"slot {last_running_slot} is not one of {cache_rows} rows")
        rows = 1 << last_running_slot.bit_length()  # the smallest power of two above it
        return StepShape(Phase.DECODE, min(cache_rows, max(rows, self.min_decode_rows)), 1)

    def traffic(self, shape: StepShape) -> AllReduceTraffic:
        """The all-reduces a step of this shape makes."""
        engine, config = self.engine, self.engine.config
        elements = shape.rows * shape.length * config.embed_dim
        count = 2 * config.num_layers
        all_reduce = engine.all_reduce
        gated = all_reduce.is_gated(elements, engine.dtype)
        return AllReduceTraffic(
            shape=(shape.rows, shape.length, config.embed_dim),
            count=count,
            message_bytes=elements * jnp.dtype(engine.dtype).itemsize,
            uses=GATED if gated else all_reduce.name,
            wire_bytes=count * all_reduce.wire_bytes(elements, engine.dtype, engine.tp),
        )

    def usage(self, batch: int, prompt_len: int) -> AllReduceUsage:
        """The traffic of a prefill of `batch` prompts of `prompt_len` tokens and of a decode
        step over `batch` slots."""
        options = self.engine.all_reduce.options()
        return AllReduceUsage(
            all_reduce=self.engine.all_reduce.name,
            options=options,
            min_size_bytes=self.engine.all_reduce.gate_bytes(),
            prefill=self.traffic(self.prefill_shape([prompt_len] * batch)),
            decode=self.traffic(self.decode_shape(batch)),
        )
