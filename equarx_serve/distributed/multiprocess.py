"""Running one program as several JAX processes: on one host (local) or across hosts.

Every process calls `initialize` with the same coordinator address and process count and its
own id; on CPU the cross-process collectives go through gloo (a real transport).
`run_local_processes` starts N copies of a command from this machine, appends those three
flags to each, and collects their output; when one fails, it stops the others and raises with
the failing process's stderr. The processes run on 127.0.0.1, or on the emulated hosts of a
`cluster.Cluster` (`hosts=`: network namespaces joined by shaped links).
Every process gets `devices.with_huge_pages`' environment.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import jax

from equarx_serve.collectives import transport
from equarx_serve.distributed.devices import with_huge_pages


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """`jax.distributed.initialize`, with gloo for cross-process collectives on CPU; then the
    link between the processes is measured (`collectives.transport`, collective: every process
    calls this), which the all-reduces' `slice_bytes="auto"` goes by. (Without this, a plain
    `jax.distributed.initialize` program measures it on its first all-reduce's trace.)"""
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    transport.measure()


def add_process_flags(parser) -> None:
    """The flags `initialize` needs, for an argparse parser (the same on one host or many)."""
    parser.add_argument("--coordinator", help="host:port of process 0's coordinator")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Hosts(Protocol):
    """Where the processes of a run go: process i runs `command(i, argv)`, and process 0's
    coordinator listens at `coordinator()` (a fresh host:port each call)."""

    def coordinator(self) -> str: ...

    def command(self, host: int, argv: Sequence[str]) -> list[str]: ...


class Localhost:
    """Every process on this machine, over loopback."""

    def coordinator(self) -> str:
        return f"127.0.0.1:{free_port()}"

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        return list(argv)


@dataclass(frozen=True)
class ProcessOutput:
    process_id: int
    stdout: str
    stderr: str


def run_local_processes(
    command: Sequence[str],
    num_processes: int,
    *,
    timeout_s: float,
    env: dict[str, str] | None = None,
    hosts: Hosts | None = None,
) -> list[ProcessOutput]:
    """Runs `command` as `num_processes` cooperating JAX processes, process i on host i of
    `hosts` (default: all on 127.0.0.1)."""
    hosts = hosts or Localhost()
    coordinator = hosts.coordinator()
    child_env = with_huge_pages({**os.environ, **(env or {})})
    # One device per process; the host-device-count flag is for single-process runs only.
    xla_flags = child_env.get("XLA_FLAGS", "").split()
    child_env["XLA_FLAGS"] = " ".join(
        f for f in xla_flags if not f.startswith("--xla_force_host_platform_device_count")
    )
    # Output goes to temporary files, not pipes: a pipe nobody reads fills up and blocks.
    with contextlib.ExitStack() as files:
        logs = [
            (
                files.enter_context(tempfile.TemporaryFile("w+")),
                files.enter_context(tempfile.TemporaryFile("w+")),
            )
            for _ in range(num_processes)
        ]
        procs = [
            subprocess.Popen(
                hosts.command(
                    i,
                    [
                        *command,
                        *["--coordinator", coordinator, "--num-processes", str(num_processes)],
                        *["--process-id", str(i)],
                    ],
                ),
                stdout=stdout,
                stderr=stderr,
                text=True,
                env=child_env,
            )
            for i, (stdout, stderr) in enumerate(logs)
        ]

        def output(i: int) -> ProcessOutput:
            stdout, stderr = logs[i]
            stdout.seek(0)
            stderr.seek(0)
            return ProcessOutput(i, stdout.read(), stderr.read())

        def raise_if_failed() -> None:
            for i, proc in enumerate(procs):
                if proc.returncode not in (None, 0):
                    raise RuntimeError(
                        f"process {i} of {num_processes} ({' '.join(command)}) exited with "
                        f"{proc.returncode}:\n{output(i).stderr[-4000:]}"
                    )

        deadline = time.monotonic() + timeout_s
        try:
            # A failed process fails the run at once: its peers would wait for it until timeout.
            while any([proc.poll() is None for proc in procs]):  # a list: poll every one
                raise_if_failed()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{num_processes} processes did not finish in {timeout_s:.0f}s"
                    )
                time.sleep(0.05)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        raise_if_failed()
        return [output(i) for i in range(num_processes)]


def python_module_command(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
