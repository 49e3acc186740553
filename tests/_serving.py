"""Helpers for the tests that start `equarx-serve serve` processes."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_healthy(url: str, processes: list[subprocess.Popen], timeout_s: float) -> None:
    """Waits until `url`/health answers 200; fails if a process exits first or it takes
    longer than `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        for p in processes:
            assert p.poll() is None, f"a process exited with {p.returncode} while starting"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)
