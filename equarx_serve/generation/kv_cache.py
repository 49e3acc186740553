"""The KV cache of decoding: its slots (host bookkeeping) and its arrays (on the mesh).

`SlotTable` (process 0 only) says which request holds which row, each row's length (the
tokens in its cache: where the next token's k/v go) and last token. `DeviceKVCache` (every
process) holds every layer's k and v, [rows, capacity, K, H], and is changed only by the
device steps: allocated with zeros, grown to a longer capacity (zero padded), filled from a
prefill's cache, released.

Rows beyond the slots stay idle (see `batching.MIN_ROWS`); idle rows decode token 0 at
position 0 and their output is ignored.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

__all__ = ["DeviceKVCache", "SlotTable"]

Cache = dict[str, dict[str, jax.Array]]


class SlotTable[T]:
    """Which holder (a request) has each of `slots` rows of a cache of `rows` rows."""

    def __init__(self, slots: int, rows: int):
        if not 1 <= slots <= rows:
            raise ValueError(f"need 1 <= slots <= rows, got {slots} slots, {rows} rows")
        self.slots = slots
        self.rows = rows
        self.capacity = 0  # positions per row of the allocated cache; 0: none allocated
        self._holders: list[T | None] = [None] * slots
        self._lengths = np.zeros(rows, np.int32)
        self._last_tokens = np.zeros(rows, np.int32)

    def free(self) -> list[int]:
        return [s for s, holder in enumerate(self._holders) if holder is None]

    def running(self) -> list[tuple[int, T]]:
        return [(s, h) for s, h in enumerate(self._holders) if h is not None]

    def assign(self, slot: int, holder: T, length: int) -> None:
        """`holder` takes `slot`, whose cache holds `length` tokens."""
        if self._holders[slot] is not None:
            raise ValueError(f"slot {slot} is taken")
        if length >= max(self.capacity, 1):
            raise ValueError(f"length {length} does not fit the capacity {self.capacity}")
        self._holders[slot] = holder
        self._lengths[slot] = length

    def release(self, slot: int) -> None:
        self._holders[slot] = None
        self._lengths[slot] = self._last_tokens[slot] = 0

    def advance(self, slot: int, token: int) -> None:
        """The slot's last decoded token went into its cache; `token` is its next input."""
        self._lengths[slot] += 1
        self._last_tokens[slot] = token

    def set_next_token(self, slot: int, token: int) -> None:
        """The first token sampled from the slot's prefill: its next input."""
        self._last_tokens[slot] = token

    def decode_inputs(self) -> tuple[list[int], list[int]]:
        """(tokens, lengths) of every row for a decode step (idle rows: 0, 0)."""
        return self._last_tokens.tolist(), self._lengths.tolist()


def _zeros(rows, capacity, *, layers, config, dtype):
    shape = (rows, capacity, config.num_kv_heads, config.head_dim)  # [B, S, K, H]
    return {name: {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for name in layers}


def _grow(cache, capacity):
    """Every layer's k and v [rows, S, K, H] padded with zeros to [rows, capacity, K, H]."""

    def grow(kv):
        return jnp.pad(kv, ((0, 0), (0, capacity - kv.shape[1]), (0, 0), (0, 0)))

    return jax.tree.map(grow, cache)


def _insert(cache, prefill_cache, dst):
    """Copies every layer's prefill KV [b, bucket, K, H] into rows `dst` [b] of the cache
    [rows, capacity, K, H] (positions 0 to bucket - 1); out-of-range rows are dropped."""

    def insert(slot_kv, new_kv):
        bucket = new_kv.shape[1]
        return slot_kv.at[dst, :bucket].set(new_kv.astype(slot_kv.dtype), mode="drop")

    return jax.tree.map(insert, cache, prefill_cache)


class DeviceKVCache:
    """Every layer's k and v on the engine's mesh (see module doc)."""

    def __init__(self, engine: Any):
        sharding = NamedSharding(engine.mesh, engine.model.cache_spec)
        shardings = {
            f"layer_{i}": {"k": sharding, "v": sharding} for i in range(engine.config.num_layers)
        }
        zeros = functools.partial(
            _zeros, layers=tuple(shardings), config=engine.config, dtype=engine.dtype
        )
        self._zeros = jax.jit(zeros, static_argnums=(0, 1), out_shardings=shardings)
        self._grow = jax.jit(_grow, static_argnums=1, out_shardings=shardings)
        self._insert = jax.jit(_insert, donate_argnums=0, out_shardings=shardings)
        self.arrays: Cache | None = None
        self.rows = 0
        self.capacity = 0

    def ensure(self, rows: int, capacity: int) -> None:
        """A cache of `rows` rows and at least `capacity` positions (kept if it has them)."""
        if self.arrays is None or rows != self.rows:
            self.arrays, self.rows, self.capacity = self._zeros(rows, capacity), rows, capacity
        elif capacity > self.capacity:
            self.arrays, self.capacity = self._grow(self.arrays, capacity), capacity

    def insert(self, prefill_cache: Cache, dst: jax.Array) -> None:
        """Rows `dst` take the prefill's KV (donates the old arrays)."""
        arrays, self.arrays = self._take(), None
        self.arrays = self._insert(arrays, prefill_cache, dst)

    def take(self) -> Cache:
        """The arrays, for a program that donates them; `put` the result back."""
        arrays, self.arrays = self._take(), None
        return arrays

    def put(self, arrays: Cache) -> None:
        self.arrays = arrays

    def release(self) -> None:
        self.arrays, self.rows, self.capacity = None, 0, 0

    def _take(self) -> Cache:
        if self.arrays is None:
            raise RuntimeError("no KV cache is allocated (or a failed step lost it)")
        return self.arrays
