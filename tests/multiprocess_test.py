"""equarx-int8 across 2 local JAX processes (one CPU device each), over gloo."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from equarx_serve import multiprocess

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
