"""`bench/timeline.py`: op kinds from compiled HLO, the traced run, the per-process summary."""

from __future__ import annotations

import pytest

from equarx_serve.bench import timeline
from equarx_serve.bench.timeline import Span

HLO = """
HloModule jit__lambda, entry_computation_layout={(bf16[1,8]{1,0})->bf16[1,8]{1,0}}

ENTRY %main.1 (x.1: bf16[1,8]) -> bf16[1,8] {
  %x.1 = bf16[1,8]{1,0} parameter(0)
  %ffi_call.9 = u8[20]{0} custom-call(bf16[1,8]{1,0} %x.1), custom_call_target="Equarx"
  %all_gather.7 = u8[2,20]{1,0} all-gather(u8[20]{0} %ffi_call.9), channel_id=1, dimensions={0}
  %ppermute.3 = u8[20]{0} collective-permute(u8[20]{0} %ffi_call.9), source_target_pairs={{0,1}}
  %tuple.2 = (u8[20]{0}, u8[2,20]{1,0}) tuple(u8[20]{0} %ppermute.3, u8[2,20]{1,0} %all_gather.7)
  ROOT %convert_fusion = bf16[1,8]{1,0} fusion(u8[2,20]{1,0} %all_gather.7), kind=kLoop
}
"""


def test_op_kinds_from_compiled_hlo():
    assert timeline.op_kinds(HLO) == {
        "x.1": "compute",
        "ffi_call.9": "kernel",
        "all_gather.7": "collective",
        "ppermute.3": "collective",
        "tuple.2": "compute",
        "convert_fusion": "compute",
    }


def test_spans_of_the_last_run_to_start():
    kinds = {"all_gather.7": "collective", "ffi_call.9": "kernel"}
    events = [
        ("psum.1", 11, 1_000, 500),  # the barrier: an earlier run
        ("ffi_call.9", 22, 3_000, 1_000),
        ("all_gather.7", 22, 4_000, 2_000),
        ("fusion.4", 22, 2_500, 100),  # not in the HLO: compute
    ]
    assert timeline.spans_of_last_run(events, kinds) == [
        Span("fusion.4", "compute", 2_500, 2_600),
        Span("ffi_call.9", "kernel", 3_000, 4_000),
        Span("all_gather.7", "collective", 4_000, 6_000),
    ]
    assert timeline.spans_of_last_run([], kinds) == []


def test_summary_counts_overlapping_work_once_and_idle_between_spans():
    ms = 1_000_000
    first = [
        Span("ffi_call.9", "kernel", 10 * ms, 12 * ms),
        Span("ppermute.3", "collective", 11 * ms, 15 * ms),  # beside the kernel
        Span("all_gather.7", "collective", 14 * ms, 18 * ms),  # overlaps the permute
        Span("fusion.1", "compute", 20 * ms, 21 * ms),  # after 2 ms of nothing
    ]
    second = [Span("all_gather.7", "collective", 13 * ms, 18 * ms)]
    early, late = timeline.summarize([first, [], second])
    assert (early.process, early.start_ms, early.end_ms) == (0, 0.0, 11.0)
    assert early.busy_ms == {"collective": 7.0, "kernel": 2.0, "compute": 1.0}
    assert early.idle_ms == pytest.approx(2.0)
    assert (late.process, late.start_ms, late.end_ms, late.idle_ms) == (2, 3.0, 8.0, 0.0)
    assert early.ready_ms is None  # not given
    ready = timeline.summarize([first, [], second], ready_ns=[25 * ms, 0, 19 * ms])
    assert [(s.process, s.ready_ms) for s in ready] == [(0, 15.0), (2, 9.0)]
    with pytest.raises(ValueError, match="2 ready times for 3 processes"):
        timeline.summarize([first, [], second], ready_ns=[25 * ms, 19 * ms])
    assert timeline.summarize([[], []]) == []


def test_spans_as_json_rows_from_an_origin():
    rows = timeline.to_json([Span("all_gather.7", "collective", 3_000_000, 5_500_000)], 1_000_000)
    assert rows == [{"op": "all_gather.7", "kind": "collective", "start_ms": 2.0, "end_ms": 4.5}]


def test_a_trace_without_its_start_time_is_an_error(monkeypatch, tmp_path):
    import jax

    plane = type("Plane", (), {"name": "/host:CPU", "stats": [], "lines": []})()
    profile = type("Profile", (), {"planes": [plane]})()
    fake = type("ProfileData", (), {"from_file": staticmethod(lambda path: profile)})
    monkeypatch.setattr(jax.profiler, "ProfileData", fake)
    with pytest.raises(RuntimeError, match="no profile_start_time"):
        timeline._thunk_events(tmp_path / "trace.xplane.pb")
