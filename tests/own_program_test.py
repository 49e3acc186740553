"""A user's own program gets the link-dependent defaults without the project's launcher: the
first all-reduce traced in a multi-process run measures the link (`collectives.transport`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from equarx_serve.collectives import transport
from equarx_serve.distributed import multiprocess

WORKER = Path(__file__).with_name("_plain_worker.py")
SLOW = transport.LinkEstimate(1e9, 2, 0.03, 0.001)


def test_a_plain_distributed_program_measures_the_link_on_its_first_all_reduce():
    outputs = multiprocess.run_local_processes(
        [sys.executable, str(WORKER)], 2, timeout_s=180, env={"JAX_PLATFORMS": "cpu"}
    )
    first, second = (json.loads(out.stdout.strip().splitlines()[-1]) for out in outputs)
    assert not first["measured_before"] and not second["measured_before"]
    assert first["link"] is not None and first["link"]["devices"] == 2
    assert first["link"] == second["link"]  # the slowest process's, on both
    assert first["program_sha256"] == second["program_sha256"]
    assert first["sum"] == second["sum"] == 2.0


@pytest.fixture
def several_processes(monkeypatch):
    """As in a joined run of 2 processes, `measure` recorded instead of run."""
    calls: list[int] = []

    def measure() -> transport.LinkEstimate:
        calls.append(1)
        monkeypatch.setattr(transport, "_measured", SLOW)
        return SLOW

    monkeypatch.setattr(transport, "_measured", transport._UNMEASURED)
    monkeypatch.setattr(transport, "_several_processes", lambda: True)
    monkeypatch.setattr(transport, "measure", measure)
    return calls


def test_the_first_read_of_the_link_measures_it_once(several_processes):
    assert transport.slower_than(2e9)
    assert transport.link() == SLOW
    assert several_processes == [1]


def test_an_assumed_link_is_not_measured(several_processes):
    fast = transport.LinkEstimate(1e11, 2, 0.001, 0.001)
    with transport.assume(fast):
        assert transport.link() == fast and not transport.slower_than(2e9)
    with transport.assume(None):  # the opt-out: no link, no slicing
        assert transport.link() is None and not transport.slower_than(2e9)
    assert several_processes == []


def test_one_process_measures_nothing(monkeypatch):
    monkeypatch.setattr(transport, "_measured", transport._UNMEASURED)
    monkeypatch.setattr(transport, "measure", lambda: pytest.fail("measured one process"))
    assert transport.link() is None and not transport.slower_than(2e9)


def test_the_bench_divides_each_plain_row_by_the_launchers_same_row():
    from equarx_serve.bench import allreduce

    def result(join: str, ms: float) -> dict[str, object]:
        rows = [{"label": "ring", "median_ms": 2 * ms}, {"label": "equarx-int8", "median_ms": ms}]
        return {"mode": "processes", "n": 2, "size_bytes": 1 << 24, "join": join, "rows": rows}

    launcher, plain = result("launcher", 100.0), result("plain", 104.0)
    allreduce.add_plain_over_launcher([launcher, plain])
    assert [row["plain_over_launcher"] for row in plain["rows"]] == [1.04, 1.04]
    assert all("plain_over_launcher" not in row for row in launcher["rows"])
