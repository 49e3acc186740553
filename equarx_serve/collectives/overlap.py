"""An all-reduce started at one point of a program and waited for at a later one.

A chunked prefill (`models.gemma3`, "Overlap") starts each chunk's all-reduce as soon as its
partial sums exist and takes the result only where the next step needs it, so that the
compute in between can run while the message is on the wire. Who moves the bytes decides
whether it does:

- On CPU, in a run of several processes with one device each (`exchange.available`), the
  all-reduce runs as its one-shot form (`AllReduce.one_shot_parts`: encode in the program,
  exchange the bytes, decode and sum in rank order) with the bytes moved by `exchange` on
  threads beside XLA: `start_all_reduce` queues them, `Started.result(after)` waits for them
  only once `after` is computed. XLA:CPU's own collectives cannot overlap there: a device's
  program runs on one executing thread, and a gloo collective holds it until the bytes
  arrive (docs/decisions.md, "overlap").
- Elsewhere (TPU, GPU, fake CPU devices in one process, a gated message) it is the method's
  own collective, started behind the previous one (an ordering, not a wait): on TPU and GPU
  XLA's asynchronous collectives and its latency-hiding scheduler overlap it from the same
  chunked structure.

One exchange sends a device's whole encoded message to each of the N - 1 others: at N = 2 the
bytes of a bandwidth-optimal all-reduce, at N > 2 (N - 1) N / (2 (N - 1)) = N / 2 times them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax import lax

from equarx_serve.collectives import exchange, transport
from equarx_serve.collectives.base import AllReduce, axis_size_or_raise
from equarx_serve.kernels.native import target_platform

# overlap_chunks="auto" (`models.gemma3`): for prompts of at least AUTO_MIN_TOKENS, AUTO_CHUNKS
# token chunks of at least AUTO_MIN_CHUNK_TOKENS where the exchange runs between 2 processes
# (CPU) and `transport.measure` found a link slower than AUTO_BELOW_BITS_PER_S; else
# whole messages. Measured (docs/decisions.md, "Model and prefill"; bench prefill, TP = 2,
# 300 Mbit/s): 2048 tokens, equarx-int8 3050 ms whole, 2366 ms in 4 chunks, 2089 ms in 8
# (compute alone 1717 ms), ring 4381, 3021, 2857 ms; but 512 tokens in 8 chunks of 64,
# equarx-int8 520 -> 775 ms, ring 860 -> 916 ms (the compute alone 358 -> 444 ms: short chunks
# cost more than they hide); and TP = 4 at 1 Gbit/s, 2048 tokens, equarx-int8 3259 -> 3498 ms,
# ring 3926 -> 4516 ms (one exchange sends N / 2 times a bandwidth-optimal all-reduce's bytes,
# and 4 processes share 2 cores): so only between 2 processes. Between 512 and 2048 tokens, and
# the rate bound (the ring's slicing threshold) between 1 Gbit/s and loopback, are not measured.
AUTO_CHUNKS = 8
AUTO_MIN_TOKENS = 1024
AUTO_MIN_CHUNK_TOKENS = 128
AUTO_BELOW_BITS_PER_S = 2.5e9


@dataclasses.dataclass(frozen=True)
class Started:
    """An all-reduce on its way. `token` exists once it has started (the next one starts
    behind it); `result(after)` is its value, waited for only once `after` is computed (where
    the bytes move beside XLA; XLA's own collectives are scheduled by XLA). `orders_compute`:
    whether compute placed behind `token` (`behind`) must wait for the start, so that the
    bytes leave before that compute begins."""

    token: jax.Array
    orders_compute: bool
    _result: Callable[[jax.Array | None], jax.Array]

    def result(self, after: jax.Array | None = None) -> jax.Array:
        return self._result(after)


def auto_chunks(num_tokens: int) -> int:
    """The token chunks of a prefill of `num_tokens` under overlap_chunks="auto" (see
    AUTO_CHUNKS): where they pay (2 processes, a slow link, a long prompt), up to AUTO_CHUNKS
    of at least AUTO_MIN_CHUNK_TOKENS."""
    if target_platform() != "cpu" or not exchange.available() or jax.process_count() != 2:
        return 1
    if num_tokens < AUTO_MIN_TOKENS or not transport.slower_than(AUTO_BELOW_BITS_PER_S):
        return 1
    return min(AUTO_CHUNKS, num_tokens // AUTO_MIN_CHUNK_TOKENS)


def uses_exchange(all_reduce: AllReduce, x: jax.Array, axis_size: int) -> bool:
    """Whether `start_all_reduce` moves x's bytes beside XLA (see the module doc)."""
    return (
        axis_size > 1
        and target_platform() == "cpu"
        and exchange.available()
        and not all_reduce.is_gated(x.size, x.dtype)
    )


def start_all_reduce(
    all_reduce: AllReduce, x: jax.Array, axis_name: str, previous: Started | None = None
) -> Started:
    """Start `all_reduce` of x over `axis_name` behind `previous` (the all-reduce started
    before it, if any); see the module doc."""
    axis_size = axis_size_or_raise(axis_name)
    exchanged = uses_exchange(all_reduce, x, axis_size)
    parts = all_reduce.one_shot_parts(x, axis_size) if exchanged else None
    if parts is None:
        if previous is not None:
            x, _ = lax.optimization_barrier((x, previous.token))
        y = all_reduce(x, axis_name)
        return Started(token=y, orders_compute=False, _result=lambda after: y)
    handle = exchange.start_exchange(parts.payload, None if previous is None else previous.token)
    size = parts.payload.size
    return Started(
        token=handle,
        orders_compute=True,
        _result=lambda after: parts.combine(exchange.finish_exchange(handle, size, after)),
    )


def behind(x: jax.Array, started: Started | None) -> jax.Array:
    """x, computed from only once `started` has started where that matters (its bytes leave
    before the compute that follows): see `Started.orders_compute`."""
    if started is None or not started.orders_compute:
        return x
    x, _ = lax.optimization_barrier((x, started.token))
    return x
