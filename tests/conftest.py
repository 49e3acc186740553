"""Shared setup: 8 virtual CPU devices, a shard_map runner, and test-data generators."""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import tempfile

from equarx_serve.distributed.devices import set_host_device_count

# Must happen before jax is imported anywhere: 8 host devices for meshes of 2, 4 and 8.
set_host_device_count(8)

# The suite compiles the same XLA programs many times over: every tiny engine's init and steps
# (one engine per test module), every `serve` subprocess's. JAX's persistent compilation cache,
# in a folder of this session's own (so each run, like a fresh clone, compiles everything once)
# and inherited through the environment by the subprocesses and by pytest-xdist's workers (which
# `make test` starts after this ran), compiles each program once. The executables are the same;
# what the tests check is not changed. An existing setting is kept. Two processes compiling one
# program write the same entry; a read that meets a half-written file fails over to compiling.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="equarx-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import functools  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from equarx_serve.collectives import AllReduce  # noqa: E402

AXIS = "tp"
# Held by each test of emulated hosts (cluster_helpers.needs_root) for its whole run.
EMULATED_HOSTS_LOCK = Path(tempfile.gettempdir()) / "equarx-test-emulated-hosts.lock"
OUTLIER_CHANNELS = (3, 97, 511, 700)  # fixed hidden channels, the same on every device


@functools.cache
def mesh_of(n: int) -> Mesh:
    """A 1-D mesh over the first n devices, axis "tp"."""
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, have {len(jax.devices())}")
    return Mesh(np.array(jax.devices()[:n]), (AXIS,))


@functools.cache
def _compiled(ar: AllReduce, n: int):
    mesh = mesh_of(n)
    body = lambda b: ar(b[0], AXIS)[None]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def run_all_reduce(ar: AllReduce, per_device: np.ndarray, n: int) -> np.ndarray:
    """All-reduce `per_device[i]` (device i's input) over n devices; returns every device's
    output stacked, [n, ...], so that replicas can be compared bit for bit."""
    assert per_device.shape[0] == n, (per_device.shape, n)
    x = jax.device_put(per_device, NamedSharding(mesh_of(n), P(AXIS)))
    return np.asarray(_compiled(ar, n)(x))


def lower_all_reduce(ar: AllReduce, per_device: np.ndarray, n: int) -> str:
    """The optimized HLO text of the jitted all-reduce program."""
    x = jax.device_put(per_device, NamedSharding(mesh_of(n), P(AXIS)))
    return _compiled(ar, n).lower(x).compile().as_text()


def rank_offsets(n: int, shape: tuple[int, ...]) -> np.ndarray:
    """[n, *shape] with every element of device i equal to i: added to inputs so each device's
    contribution differs and a misordered reduction shows."""
    return np.broadcast_to(
        np.arange(n, dtype=np.float64).reshape(n, *[1] * len(shape)), (n, *shape)
    )


def gaussian(n: int, shape: tuple[int, ...] = (64, 1024), seed: int = 0) -> np.ndarray:
    """[n, *shape] f32: zero-mean normal, device i's standard deviation 1 + i / 4."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *shape)) * (1.0 + 0.25 * rank_offsets(n, shape))
    return x.astype(np.float32)


def llm_activations(n: int, tokens: int = 64, hidden: int = 1024, seed: int = 0) -> np.ndarray:
    """[n, tokens, hidden] f32, like transformer activations: heavy-tailed (student-t, 3 dof)
    values plus a few outlier channels ~100x larger, the same channels on every device; each
    device's scale depends on its rank."""
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, size=(n, tokens, hidden))
    x[..., list(OUTLIER_CHANNELS)] *= 100.0
    x *= (1.0 + 0.25 * np.arange(n)).reshape(n, 1, 1)
    return x.astype(np.float32)


def integers(n: int, shape: tuple[int, ...], low: int = -8, high: int = 8, seed: int = 0):
    """[n, *shape] f32 of small integers (sums are exact in f32 and, for small N, bf16),
    differing by rank."""
    rng = np.random.default_rng(seed)
    x = rng.integers(low, high, size=(n, *shape)) + rank_offsets(n, shape)
    return x.astype(np.float32)


def reference_sum(per_device: np.ndarray) -> np.ndarray:
    """The exact all-reduce result, in float64."""
    return per_device.astype(np.float64).sum(axis=0)


def rel_rms(outputs: np.ndarray, per_device: np.ndarray) -> float:
    """||y - ref|| / ||ref|| of device 0's output against the float64 sum of the inputs."""
    ref = reference_sum(per_device)
    return float(np.linalg.norm(outputs[0].astype(np.float64) - ref) / np.linalg.norm(ref))


def assert_replicas_identical(outputs: np.ndarray) -> None:
    """Every device's output has the same bits as device 0's (NaNs included)."""
    bits = outputs.view(np.dtype(f"u{outputs.dtype.itemsize}"))
    for i in range(1, outputs.shape[0]):
        np.testing.assert_array_equal(bits[i], bits[0], err_msg=f"device {i} differs from 0")


@pytest.fixture
def emulated_hosts_alone() -> Iterator[None]:
    """Runs the test while no other test of emulated hosts runs on this machine: `make test`
    runs the suite on 2 workers (pytest-xdist), other checkouts' suites may run too, and these
    tests count the machine-wide `equarx-*` namespaces and root interfaces before and after."""
    with EMULATED_HOSTS_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield
