"""equarx-int8 across 2 local JAX processes (one CPU device each), over gloo."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from equarx_serve.distributed import multiprocess
from equarx_serve.distributed.devices import HUGE_PAGES_TUNABLE, with_huge_pages

WORKER = Path(__file__).with_name("_gloo_worker.py")


def test_two_processes_over_gloo_agree_bit_for_bit():
    outputs = multiprocess.run_local_processes(
        [sys.executable, str(WORKER)], 2, timeout_s=120, env={"JAX_PLATFORMS": "cpu"}
    )
    reports = [json.loads(out.stdout.strip().splitlines()[-1]) for out in outputs]
    assert [r["process_id"] for r in reports] == [0, 1]
    assert all(r["devices"] == 2 for r in reports)
    for name, max_error in (("equarx-int8", 0.02), ("psum-f32", 1e-6)):
        first, second = (r[name] for r in reports)
        assert {first["shard"], second["shard"]} == {0, 1}  # one device in each process
        assert first["sha256"] == second["sha256"], name
        assert first["rel_rms"] == second["rel_rms"] < max_error, name
    assert reports[0]["equarx-int8"]["rel_rms"] > 1e-4  # it did quantize


def test_every_process_records_the_same_measured_link():
    """`multiprocess.initialize` measures the link (`collectives.transport`); the processes
    must agree on it exactly, or `slice_bytes="auto"` could trace different programs."""
    outputs = multiprocess.run_local_processes(
        [sys.executable, str(WORKER)], 2, timeout_s=120, env={"JAX_PLATFORMS": "cpu"}
    )
    first, second = (json.loads(out.stdout.strip().splitlines()[-1])["link"] for out in outputs)
    assert first == second
    assert first["devices"] == 2 and first["bits_per_s"] > 0


def _python(tmp_path: Path, code: str) -> list[str]:
    script = tmp_path / "child.py"
    script.write_text(code)
    return [sys.executable, str(script)]


def test_children_output_of_any_size_is_collected(tmp_path):
    # More than a pipe buffer (64 KiB): must not block the children.
    command = _python(tmp_path, "import sys; sys.stdout.write('x' * 300_000)")
    outputs = multiprocess.run_local_processes(command, 2, timeout_s=30)
    assert [len(out.stdout) for out in outputs] == [300_000, 300_000]


def test_children_run_with_huge_pages_for_malloc_and_keep_the_callers_tunables(tmp_path):
    command = _python(tmp_path, "import os; print(os.environ['GLIBC_TUNABLES'])")
    env = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    outputs = multiprocess.run_local_processes(command, 2, timeout_s=30, env=env)
    assert {out.stdout.strip() for out in outputs} == {
        f"glibc.malloc.arena_max=2:{HUGE_PAGES_TUNABLE}"
    }


@pytest.mark.parametrize(
    ("given", "want"),
    [
        (None, HUGE_PAGES_TUNABLE),
        ("", HUGE_PAGES_TUNABLE),
        ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),  # the caller's choice stands
        ("a=1:b=2", f"a=1:b=2:{HUGE_PAGES_TUNABLE}"),
    ],
)
def test_huge_pages_are_added_to_the_tunables_unless_they_say_otherwise(given, want):
    env = {"PATH": "/bin"} if given is None else {"PATH": "/bin", "GLIBC_TUNABLES": given}
    assert with_huge_pages(env) == {"PATH": "/bin", "GLIBC_TUNABLES": want}


def test_a_failing_process_fails_the_run_with_its_stderr(tmp_path):
    command = _python(
        tmp_path,
        "import sys\n"
        "if sys.argv[sys.argv.index('--process-id') + 1] == '1':\n"
        "    sys.exit('worker 1 broke')\n"
        "import time; time.sleep(60)\n",
    )
    with pytest.raises(RuntimeError, match=r"process 1 of 2 .* exited with 1:\nworker 1 broke"):
        multiprocess.run_local_processes(command, 2, timeout_s=30)


def test_processes_past_the_timeout_are_stopped(tmp_path):
    command = _python(tmp_path, "import time; time.sleep(60)")
    with pytest.raises(TimeoutError, match="did not finish in 1s"):
        multiprocess.run_local_processes(command, 2, timeout_s=1)
