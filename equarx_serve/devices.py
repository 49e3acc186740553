"""Fake host devices for one-process tensor parallelism on a CPU."""

from __future__ import annotations

import os

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
