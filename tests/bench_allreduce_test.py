"""`equarx-serve bench allreduce`: the comparisons, the --link options, and short end-to-end runs
over loopback and (as root) on emulated hosts."""

from __future__ import annotations

import json

import pytest
from cluster_helpers import needs_root

from equarx_serve import cli
from equarx_serve.arguments import UsageError
from equarx_serve.bench import allreduce
from equarx_serve.collectives.registry import parse_method
from equarx_serve.distributed import cluster

MIB = 1 << 20


def _row(label: str, quantized: bool, median_ms: float, wire_bytes: int) -> dict[str, object]:
    return {
        "label": label,
        "quantized": quantized,
        "median_ms": median_ms,
        "wire_bytes_hlo_total": wire_bytes,
        "wire_bytes_formula": wire_bytes,
    }


def test_comparisons_against_the_fastest_unquantized_method_and_the_measured_link():
    result = {
        "rows": [
            _row("psum", False, 100.0, 8 * MIB),
            _row("ring", False, 80.0, 4 * MIB),
            _row("equarx-int8", True, 40.0, 2 * MIB),
            _row("fast-but-lossy", True, 10.0, 1 * MIB),  # quantized: never the baseline
        ],
        "link": {"measured_bits_per_s": 0.8e9},
    }
    allreduce.add_comparisons(result)
    rows = {row["label"]: row for row in result["rows"]}
    assert {row["baseline"] for row in rows.values()} == {"ring"}
    eq = rows["equarx-int8"]
    assert eq["speedup"] == pytest.approx(2.0)  # 80 / 40
    assert eq["bytes_ratio"] == pytest.approx(0.5)
    assert eq["byte_bound_efficiency"] == pytest.approx(1.0)  # 2x faster for half the bytes
    # 2 MiB at 0.8 Gbit/s: 2 * 2**20 * 8 / 0.8e9 s = 20.97 ms, of 40 ms measured
    assert eq["link_ms"] == pytest.approx(20.97152)
    assert eq["link_efficiency"] == pytest.approx(20.97152 / 40)
    assert rows["psum"]["byte_bound_efficiency"] == pytest.approx(0.8 * 2.0)
    assert rows["ring"]["speedup"] == rows["ring"]["byte_bound_efficiency"] == 1.0


def test_comparisons_without_a_link_have_no_link_efficiency():
    result = {"rows": [_row("psum", False, 10.0, MIB), _row("equarx-int8", True, 5.0, MIB // 4)]}
    allreduce.add_comparisons(result)
    for row in result["rows"]:
        assert row["link_ms"] is None and row["link_efficiency"] is None
    assert result["rows"][1]["byte_bound_efficiency"] == pytest.approx(2.0 / 4)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "2", "--link", "1gbit"], "--link emulates hosts for the processes"),
        (["--link-delay", "1ms"], "--link-delay needs --link"),
        (["--link", "fast"], "invalid link rate 'fast'"),
        (["--link", "1gbit", "--link-delay", "soon"], "invalid delay 'soon'"),
    ],
)
def test_bad_link_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "allreduce", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_link_without_root_exits_2_before_running_anything(monkeypatch, capsys):
    monkeypatch.setattr(cluster, "_proc_status_field", lambda name: "0")
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "allreduce", "--processes", "2", "--link", "1gbit"])
    assert e.value.code == 2
    assert "need root" in capsys.readouterr().err


def test_timeline_needs_one_device_a_process(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "allreduce", "--devices", "2", "--timeline"])
    assert e.value.code == 2
    assert "--timeline traces one device a process" in capsys.readouterr().err


def test_timeline_shows_where_every_process_spent_one_call(tmp_path, capsys):
    path = tmp_path / "allreduce.json"
    argv = ["bench", "allreduce", "--processes", "2", "--sizes", "1MiB", "--repeats", "1"]
    argv += ["--methods", "ring", "equarx-int8:min_size_bytes=0", "--json", str(path)]
    assert cli.main([*argv, "--timeline"]) == 0
    assert "timeline of one call, 2 processes" in capsys.readouterr().out
    for row in json.loads(path.read_text())["rows"]:
        processes, summaries = row["timeline"]["processes"], row["timeline"]["summary"]
        assert [s["process"] for s in summaries] == [0, 1]
        assert min(s["start_ms"] for s in summaries) == 0.0
        for spans, summary in zip(processes, summaries, strict=True):
            assert "collective" in {span["kind"] for span in spans}
            assert all(0 <= span["start_ms"] <= span["end_ms"] for span in spans)
            assert summary["start_ms"] == min(span["start_ms"] for span in spans)
            assert summary["end_ms"] == max(span["end_ms"] for span in spans)
            length = summary["end_ms"] - summary["start_ms"]
            assert 0 <= summary["idle_ms"] <= length
            assert max(summary["busy_ms"].values()) <= length
            # the result is ready after the last op (the profiler's clock and the worker's are
            # both wall time; a millisecond for the two clocks' reading)
            assert summary["ready_ms"] >= summary["end_ms"] - 1.0


def _bench(tmp_path, *extra: str) -> dict[str, object]:
    path = tmp_path / "allreduce.json"
    argv = ["bench", "allreduce", "--processes", "2", "--sizes", "256KiB", "--repeats", "1"]
    argv += ["--methods", "psum", "ring", "equarx-int8:min_size_bytes=0", "--json", str(path)]
    assert cli.main([*argv, "--plot", str(tmp_path / "allreduce.png"), *extra]) == 0
    assert (tmp_path / "allreduce.png").stat().st_size > 0
    return json.loads(path.read_text())


def test_loopback_run_reports_efficiency_against_the_byte_bound(tmp_path):
    report = _bench(tmp_path, "--pre-rotated")
    assert report["settings"]["link"] is None and report["link_measurements"] == []
    for row in report["rows"]:
        assert row["link_ms"] is None and row["link_efficiency"] is None
        assert row["byte_bound_efficiency"] == pytest.approx(row["speedup"] * row["bytes_ratio"])
        assert row["identical"]
    rows = {row["label"]: row for row in report["rows"]}
    assert {label: row["quantized"] for label, row in rows.items()} == {
        "psum": False, "ring": False, "equarx-int8:min_size_bytes=0": True,
        "equarx-int8:min_size_bytes=0 [pre-rotated input]": True,
    }  # fmt: skip
    # The model's form sends the same bytes, with the error of the same codec.
    standalone, folded = rows["equarx-int8:min_size_bytes=0"], rows[PRE_ROTATED]
    assert folded["rotated_input"] and not standalone["rotated_input"]
    assert folded["wire_bytes_hlo_total"] == standalone["wire_bytes_hlo_total"]
    assert 0 < folded["rel_rms"] < 2 * standalone["rel_rms"]
    # Slices as the measured link decides (not asserted: a timing), the same in both forms.
    assert rows["psum"]["slices"] is None  # no lanes
    assert rows["ring"]["slices"] >= 1 and folded["slices"] == standalone["slices"] >= 1
    for row in rows.values():  # N = 2: one-shot, no pieces
        assert row["gather_piece_bytes"] is None and row["send_pieces"] is None
    [probe] = report["transport_probes"]  # the one size's processes measured the link
    assert probe["size_bytes"] == 256 * 1024 and probe["bits_per_s"] > 0


PRE_ROTATED = "equarx-int8:min_size_bytes=0" + allreduce.PRE_ROTATED_SUFFIX


def test_pre_rotated_adds_a_row_for_each_method_with_a_foldable_rotation():
    specs = [parse_method(m) for m in ("ring", "equarx-int8", "equarx-int8:rotation=none")]
    methods = allreduce.resolve_methods(specs, pre_rotated=True, sizes=[MIB])
    assert [(m["label"], m["rotated_input"]) for m in methods] == [
        ("ring", False), ("equarx-int8", False),
        ("equarx-int8" + allreduce.PRE_ROTATED_SUFFIX, True),
        ("equarx-int8:rotation=none", False),
    ]  # fmt: skip
    assert [m["rotated_input"] for m in allreduce.resolve_methods(specs)] == [False] * 3


@pytest.mark.parametrize(
    ("methods", "sizes", "message"),
    [
        (["ring", "equarx-int8:rotation=none"], [MIB], "no method given has a foldable"),
        (["equarx-int8"], [MIB, 96], "96B do not hold whole groups"),  # 48 elements, block 64
    ],
)
def test_pre_rotated_rejects_what_it_cannot_time(methods, sizes, message):
    with pytest.raises(UsageError, match=message):
        allreduce.resolve_methods([parse_method(m) for m in methods], pre_rotated=True, sizes=sizes)


@needs_root
def test_emulated_hosts_run_measures_the_link_first(tmp_path, capsys):
    report = _bench(tmp_path, "--link", "1gbit")
    out = capsys.readouterr().out
    assert "link: configured 1 Gbit/s each way; measured TCP goodput" in out
    assert "2 emulated hosts (gloo over TCP, links of 1 Gbit/s each way)" in out
    assert report["settings"]["link"] == {"rate_bits_per_s": 10**9, "delay_us": 0}
    (measurement,) = report["link_measurements"]
    assert measurement["n"] == 2 and measurement["measured_bits_per_s"] > 0
    for row in report["rows"]:
        expected_ms = 8 * row["wire_bytes_hlo_total"] / measurement["measured_bits_per_s"] * 1e3
        assert row["link_ms"] == pytest.approx(expected_ms)
        assert row["link_efficiency"] == pytest.approx(row["link_ms"] / row["median_ms"])
        assert row["identical"]
