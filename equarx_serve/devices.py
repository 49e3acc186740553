"""Fake host devices for one-process tensor parallelism on a CPU."""

from __future__ import annotations

import os

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def set_host_device_count(n: int) -> None:
    """N host CPU devices: sets XLA_FLAGS, which JAX reads when its CPU backend starts, so
    call it before JAX is first used (later calls do nothing to a running backend)."""
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)
    ]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT_FLAG}={n}"])
