"""Fake host devices for one-process tensor parallelism on a CPU, and the environment of the
JAX processes this project starts.

Every JAX process this project starts (bench workers, `--processes N` members) gets
`with_huge_pages`' environment: glibc's malloc then backs its large allocations with
transparent huge pages. XLA:CPU allocates a call's large buffers afresh each time (a 64 MiB
all-reduce's output, its temporaries), and glibc maps every allocation over 32 MiB anew, so each
call pays a page fault per 4 KiB it touches. Measured on 2 emulated hosts at 1 Gbit/s, 64 MiB:
the one-shot lanes' compute 122 -> 81 ms, their all-gathers alone 374 -> 333 ms, equarx-int8
398 -> 368 ms (README, the comm-bound regime). A process started by hand can set the same
`GLIBC_TUNABLES` itself (glibc reads it at start-up).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# XLA:CPU aborts the process when one device's thread reaches a collective more than 40 s
# (its default) before another: host devices share the CPU's cores, and under load (a large
# vocab projection, other processes) one lags that long. Seen here: the 270M eval at TP=2
# aborted with "Termination timeout for `all reduce ...` of 40 seconds exceeded".
COLLECTIVE_TIMEOUT_FLAGS = {
    "--xla_cpu_collective_call_terminate_timeout_seconds": 3600,
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds": 600,
}


def set_host_device_count(n: int) -> None:
    """N host CPU devices, and collective timeouts that tolerate a loaded CPU: sets XLA_FLAGS,
    which JAX reads when its CPU backend starts, so call it before JAX is first used (later
    calls do nothing to a running backend). Timeouts already in XLA_FLAGS are kept."""
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)
    ]
    for flag, seconds in COLLECTIVE_TIMEOUT_FLAGS.items():
        if not any(f.startswith(flag) for f in flags):
            flags.append(f"{flag}={seconds}")
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT_FLAG}={n}"])


HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def with_huge_pages(env: Mapping[str, str]) -> dict[str, str]:
    """env with glibc's malloc told to use transparent huge pages (`HUGE_PAGES_TUNABLE`, added
    to GLIBC_TUNABLES) unless it already says how (glibc.malloc.hugetlb). Where the kernel has
    transparent huge pages off, or the C library is not glibc 2.35+, the setting does nothing."""
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if not any(t.startswith("glibc.malloc.hugetlb=") for t in tunables):
        tunables.append(HUGE_PAGES_TUNABLE)
    return {**env, "GLIBC_TUNABLES": ":".join(tunables)}
