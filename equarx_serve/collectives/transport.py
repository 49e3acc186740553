"""The link between a run's processes, measured once: what the all-reduces' defaults go by.

Whether cutting an all-reduce into pipeline slices pays depends on the transport under it.
Between 2 emulated hosts on a 1 Gbit/s link gloo moves a large message faster in pieces of
0.5-1 MiB than in one (16 MiB of bf16: `ring` 227 -> 159 ms, `equarx-int8` 121 -> 100 ms),
while over loopback every extra collective only adds its fixed cost (16 MiB: 39 -> 69 ms and
23 -> 55 ms); docs/decisions.md. So `slice_bytes="auto"` slices where this module has measured
a slow link, and nowhere else.

When it is measured: in a run of several processes (`jax.distributed.initialize`), the first
time an all-reduce asks for the link (`link`, `slower_than`: while its program is traced) and
nothing was measured or assumed, `measure()` runs there and then, inside that trace if need be
(on concrete arrays, outside the trace's context). Every process traces the same program in
the same order, so every process reaches it at the same point, as `measure` needs. The
project's launcher (`multiprocess.initialize`) measures right after joining instead; a user's
program may call `measure()` (`collectives.measure_link`) at a point of its choosing. One
process (fake CPU devices, one host): nothing measured, no link, no slicing. `assume(estimate)`
traces as if `measure` had found `estimate`; `assume(None)`: as if there were no link to
measure (no measurement, no slicing).

`measure()` is collective: every process calls it at the same point. It times an all-gather
over every global device of PROBE_BYTES per device and one of a few bytes, and takes the rate
at which a device sent the difference: the link's rate without the fixed cost of a collective
(which on loopback is most of a small transfer's time). Each time is the best of PROBE_ROUNDS
rounds after WARMUP_ROUNDS untimed ones. On loopback (2 processes) the first rounds of a fresh
run are slow: in 12 runs of 20 timed rounds after 3 untimed ones, 4 MiB took 16-33 ms in the
first 2-5 timed rounds of 5 of them and 2-7 ms afterwards, and the few-byte all-gather either
0.2 or 4 ms; so the median of 5 rounds after 1 read anywhere from 1.4 to 11,600 Gbit/s from
one run to the next, and even their best could read 1.6 Gbit/s. Past the warm-up, a link
carries a message no faster than its rate, so the best round is the closest to it. Every
process records the same number, the slowest process's (gathered over the same devices), so
that all of them trace the same programs (processes whose programs differ would wait on each
other's collectives forever). Cost: three compiles and 2 (WARMUP_ROUNDS + PROBE_ROUNDS + 1) + 1
runs, ~1.7 s of transfers on 1 Gbit/s links between 4 hosts, ~0.1 s on loopback.
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


# Neither measured nor assumed yet: the first `link()` of a multi-process run measures.
_UNMEASURED = object()
_measured: LinkEstimate | object | None = _UNMEASURED


def link() -> LinkEstimate | None:
    """The link: measured, assumed, or None (no processes to link, or `assume(None)`). The
    first call of a multi-process run that nothing measured or assumed measures it (collective:
    see the module doc)."""
    if _measured is _UNMEASURED and _several_processes():
        measure()
    return None if _measured is _UNMEASURED else _measured


def slower_than(bits_per_s: float) -> bool:
    """Whether the link (`link`) is slower than `bits_per_s` (the size gates that depend on
    the regime: slices, two-shot's pieces)."""
    found = link()
    return found is not None and found.bits_per_s < bits_per_s


def _several_processes() -> bool:
    """Whether this is a joined run of more than one process (without starting JAX's backends
    where it is not: `jax.distributed.initialize` must come before them)."""
    import jax

    return jax.distributed.is_initialized() and jax.process_count() > 1


@contextlib.contextmanager
def assume(estimate: LinkEstimate | None) -> Iterator[None]:
    """Trace as if `measure` had found `estimate` (a user who knows the link; tests); None:
    as if there were no link (no measurement, no slicing)."""
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
    from jax.sharding import Mesh

    if jax.process_count() == 1:
        _measured = None
        return None
    mesh = Mesh(np.array(jax.devices()), ("probe",))
    with _outside_traces():
        times = [_time_all_gather(mesh, size) for size in (PROBE_BYTES, _EMPTY_BYTES)]
        probe, empty = _slowest(mesh, times)
    devices = jax.device_count()
    sent_bits = 8 * (PROBE_BYTES - _EMPTY_BYTES) * (devices - 1)
    # A link so fast that the difference drowns in the noise reads as 1000x the probe's rate.
    _measured = LinkEstimate(sent_bits / max(probe - empty, probe / 1e3), devices, probe, empty)
    return _measured


@contextlib.contextmanager
def _outside_traces() -> Iterator[None]:
    """Run computations on concrete arrays now, even while a program is being traced (the
    first all-reduce of a multi-process run measures from inside its trace): eagerly, and
    outside the mesh of an enclosing `shard_map`."""
    import jax

    with (
        jax.ensure_compile_time_eval(),
        jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())),
    ):
        yield


def _gather(mesh) -> object:
    """A program that all-gathers a [devices * k] array over `mesh`'s one axis: every
    device's block of the result is the whole input."""
    import jax
    from jax.sharding import PartitionSpec as P

    def gather(local: jax.Array) -> jax.Array:
        return jax.lax.all_gather(local, "probe", tiled=True)

    return jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P("probe"), out_specs=P("probe")))


def _sharded(mesh, shape: tuple[int, ...], local: object) -> object:
    """A [devices * k] array over `mesh`, every device's block `local` (a numpy array)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.make_array_from_callback(shape, NamedSharding(mesh, P("probe")), lambda i: local)


def _slowest(mesh, times: list[float]) -> tuple[float, float]:
    """The most seconds any process took for each probe (collective; `process_allgather`
    cannot run inside a trace)."""
    import numpy as np

    local = np.array(times, np.float32)
    gathered = _gather(mesh)(_sharded(mesh, (local.size * mesh.size,), local))
    per_device = np.asarray(gathered.addressable_shards[0].data).reshape(mesh.size, -1)
    probe, empty = per_device.max(axis=0)
    return float(probe), float(empty)


def _time_all_gather(mesh, size: int) -> float:
    """Best seconds of one all-gather of `size` bytes per device over `mesh` (see the module
    doc)."""
    import numpy as np

    probe = _gather(mesh)
    data = _sharded(mesh, (size * mesh.size,), np.zeros(size, np.uint8))
    for _ in range(1 + WARMUP_ROUNDS):  # compile, connect, warm up
        probe(data).block_until_ready()
    times = []
    for _ in range(PROBE_ROUNDS):
        start = time.perf_counter()
        probe(data).block_until_ready()
        times.append(time.perf_counter() - start)
    return min(times)
