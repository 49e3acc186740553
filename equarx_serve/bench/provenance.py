"""Where a result came from: the `provenance` block every benchmark's JSON carries.

A number in the docs is only worth its source: `equarx-serve report` (bench/report.py) prints,
beside each table, the date, the commit (and whether the tree had changes), the machine, the
exact command line and, where the run had one, the link measured on its emulated hosts. Every
JSON writer (bench/allreduce, prefill, compare, lowering, serve and eval/) adds
`"provenance": collect(...)` so that nothing in a table is typed by hand.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    """One git command's output in the repository, or None (no git, or not a checkout)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    """Total memory from /proc/meminfo (Linux); None elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine() -> dict[str, Any]:
    """The machine a run measured: CPU, the cores it could use, memory, jax and python."""
    import jax

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
        "memory_bytes": _memory_bytes(),
        "system": f"{platform.system()} {platform.release()}",
        "jax_version": jax.__version__,
        "python_version": platform.python_version(),
    }


def command_line() -> str:
    """The command that ran, as typed (`sys.orig_argv`: `python -m ...` keeps its `-m`); an
    entry-point script (`equarx-serve ...`, run through its shebang) shows as its own name."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if len(argv) > 1 and not argv[1].startswith("-") and Path(argv[1]).is_file():
        argv = argv[1:]
    if argv:
        argv[0] = Path(argv[0]).name
    return shlex.join(argv)


def collect(link: dict[str, Any] | None = None) -> dict[str, Any]:
    """The provenance block: date (UTC, ISO 8601), git commit and dirty flag (tracked files
    changed, but for the results folder the benchmarks write to), machine, command line, and
    `link` (a link measurement as `Cluster.measure_link().as_dict()`) when the run measured
    one."""
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/results")
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "machine": machine(),
        "command": command_line(),
        "link_measured": link,
    }
