"""The link between a run's processes, measured once: what the all-reduces' defaults go by.

Whether cutting an all-reduce into pipeline slices pays depends on the transport under it.
Between 2 emulated hosts on a 1 Gbit/s link gloo moves a large message faster in pieces of
0.5-1 MiB than in one (16 MiB of bf16: `ring` 227 -> 159 ms, `equarx-int8` 121 -> 100 ms),
while over loopback every extra collective only adds its fixed cost (16 MiB: 39 -> 69 ms and
23 -> 55 ms); README, the comm-bound regime. So `slice_bytes="auto"` slices where this module
has measured a slow link, and nowhere else.

`measure()` is collective: every process of a `jax.distributed` run calls it at the same point
(`multiprocess.initialize` does, right after joining). It times an all-gather over every
global device of PROBE_BYTES per device and one of a few bytes, and takes the rate at which a
device sent the difference: the link's rate without the fixed cost of a collective (which
on loopback is most of a small transfer's time). Each time is the best of PROBE_ROUNDS rounds
after WARMUP_ROUNDS untimed ones. On loopback (2 processes) the first rounds of a fresh run are
slow: in 12 runs of 20 timed rounds after 3 untimed ones, 4 MiB took 16-33 ms in the first 2-5
timed rounds of 5 of them and 2-7 ms afterwards, and the few-byte all-gather either 0.2 or
4 ms; so the median of 5 rounds after 1 read anywhere from 1.4 to 11,600 Gbit/s from one run
to the next, and even their best could read 1.6 Gbit/s. Past the warm-up, a link carries a
message no faster than its rate, so the best round is the closest to it. Every process
records the same number, the slowest process's, so that all of them trace the same programs
(processes whose programs differ would wait on each other's collectives forever). Cost: two
compiles and 2 (WARMUP_ROUNDS + PROBE_ROUNDS + 1) runs, ~1.7 s of transfers on 1 Gbit/s links
between 4 hosts, ~0.1 s on loopback.

Not measured (one process, fake CPU devices, or before `measure`): no link, no slicing. A
program that joins its processes itself (`jax.distributed.initialize`) calls `measure()` after
it, before tracing its all-reduces, to get the same defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

PROBE_BYTES = 4 * 1024 * 1024
PROBE_ROUNDS = 10
WARMUP_ROUNDS = 5
_EMPTY_BYTES = 8  # the all-gather that times a collective's fixed cost


@dataclasses.dataclass(frozen=True)
class LinkEstimate:
    """What `measure` found: the rate at which the slowest device sent, in bits/s, from the
    best times of an all-gather of PROBE_BYTES per device and of one of a few bytes."""

    bits_per_s: float
    devices: int
    probe_seconds: float
    empty_seconds: float


_measured: LinkEstimate | None = None


def link() -> LinkEstimate | None:
    """The measured link, or None where nothing was measured (no processes to link)."""
    return _measured


def slower_than(bits_per_s: float) -> bool:
    """Whether a link was measured and found slower than `bits_per_s` (the size gates that
    depend on the regime: slices, two-shot's pieces)."""
    return _measured is not None and _measured.bits_per_s < bits_per_s


@contextlib.contextmanager
def assume(estimate: LinkEstimate | None) -> Iterator[None]:
    """Trace as if `measure` had found `estimate` (tests; a user who knows the link)."""
    global _measured
    saved, _measured = _measured, estimate
    try:
        yield
    finally:
        _measured = saved


def measure() -> LinkEstimate | None:
    """Time the probe (see the module doc) on every process and record the slowest rate.
    Every process must call it; with one process it records nothing and returns None."""
    global _measured
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        _measured = None
        return None
    times = [_time_all_gather(jax.devices(), size) for size in (PROBE_BYTES, _EMPTY_BYTES)]
    probe, empty = map(float, np.max(multihost_utils.process_allgather(np.array(times)), axis=0))
    devices = jax.device_count()
    sent_bits = 8 * (PROBE_BYTES - _EMPTY_BYTES) * (devices - 1)
    # A link so fast that the difference drowns in the noise reads as 1000x the probe's rate.
    _measured = LinkEstimate(sent_bits / max(probe - empty, probe / 1e3), devices, probe, empty)
    return _measured


def _time_all_gather(devices: list, size: int) -> float:
    """Best seconds of one all-gather of `size` bytes per device over `devices` (see the
    module doc)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices), ("probe",))

    def gather(local: jax.Array) -> jax.Array:
        return jax.lax.all_gather(local, "probe", tiled=True)

    probe = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P("probe"), out_specs=P("probe")))
    shape = (size * len(devices),)
    sharding = NamedSharding(mesh, P("probe"))
    data = jax.make_array_from_callback(shape, sharding, lambda i: np.zeros(shape, np.uint8)[i])
    for _ in range(1 + WARMUP_ROUNDS):  # compile, connect, warm up
        probe(data).block_until_ready()
    times = []
    for _ in range(PROBE_ROUNDS):
        start = time.perf_counter()
        probe(data).block_until_ready()
        times.append(time.perf_counter() - start)
    return min(times)
