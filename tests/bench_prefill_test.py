"""`equarx-serve bench prefill` end to end on the tiny model (one process, 2 host devices)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cluster_helpers import needs_root

from equarx_serve import cli
from equarx_serve.bench.prefill import DEFAULT_METHODS, LINKS, add_comparisons
from equarx_serve.distributed.multiprocess import free_port
from models.config import get_config


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefill") / "prefill.json"
    argv = ["bench", "prefill", "--model", "tiny", "--tp", "2", "--seq-lens", "16", "32"]
    argv += ["--overlap-chunks", "2"]
    assert cli.main([*argv, "--repeats", "2", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_rows_for_every_method_length_and_overlap(bench_json):
    rows = bench_json["rows"]
    labels = [*DEFAULT_METHODS, *(f"{m}/overlap=2" for m in DEFAULT_METHODS)]
    assert {(r["label"], r["seq_len"]) for r in rows} == {(m, s) for m in labels for s in (16, 32)}
    assert bench_json["settings"]["overlap_chunks"] == [1, 2]
    no_reduce_ms = {
        (run["seq_len"], chunks): no_reduce["median_ms"]
        for run in bench_json["runs"]
        for chunks, no_reduce in [("1", run["no_reduce"]), *run["no_reduce_overlap"].items()]
    }
    for r in rows:
        assert r["overlap_chunks"] == (2 if r["label"].endswith("/overlap=2") else 1)
        assert r["median_ms"] > 0 and r["p10_ms"] > 0 and r["p90_ms"] >= r["p10_ms"]
        # The all-reduce share is the time over the no-reduce program's of the same overlap
        # chunks (noisy on a tiny model, so checked for what it is, not for its value).
        no_reduce = no_reduce_ms[r["seq_len"], str(r["overlap_chunks"])]
        assert r["ar_ms"] == pytest.approx(r["median_ms"] - no_reduce)
        assert r["ar_share"] == pytest.approx(r["ar_ms"] / r["median_ms"])
        assert r["speedup"] > 0 and r["baseline"] in ("psum", "psum/overlap=2")
        assert r["link_ms"] is None and r["link_efficiency"] is None
        assert r["top1_agree_vs_first"] >= 0.0
    for run in bench_json["runs"]:
        assert run["no_reduce"]["median_ms"] > 0 and set(run["no_reduce_overlap"]) == {"2"}
        assert len(run["peak_rss_mib"]) == 1 and run["peak_rss_mib"][0] > 0
    assert bench_json["settings"]["link"] is None and bench_json["link_measurement"] is None


def test_wire_bytes_are_two_all_reduces_per_layer(bench_json):
    config = get_config("tiny")
    for r in bench_json["rows"]:
        assert r["num_reductions"] == 2 * config.num_layers
        # The formula is 2 * num_layers messages of [batch, bucket, embed_dim].
        assert r["wire_bytes_hlo_total"] == r["wire_bytes_formula"] > 0
        assert not r["gated"]
    psum = [r for r in bench_json["rows"] if r["label"] == "psum"]
    for r in psum:
        assert r["hlo_collectives"] == {"all-reduce": 2 * config.num_layers}
        # bf16 all-reduces as an accelerator sends them: 2 (N-1)/N x message bytes, N = 2.
        assert r["wire_bytes_projection"] == 2 * config.num_layers * r["message_bytes"]


def test_projection_fields(bench_json):
    settings = bench_json["settings"]
    assert "PROJECTION" in settings["projection_note"]
    assert settings["tp"] == 2 and settings["processes"] == 1 and settings["jax_version"]
    for r in bench_json["rows"]:
        assert set(r["PROJECTION"]) == set(LINKS)
        for p in r["PROJECTION"].values():
            assert p["t_proj_ms"] > p["comm_ms"] > 0 and p["speedup_vs_psum"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--methods", "no-such-method"], "unknown all-reduce 'no-such-method'"),
        (["--methods", "equarx-int8:bogus=1"], "unknown option"),
        (["--methods", "equarx-int8:x"], "options are key=value"),
        (["--model", "nope"], "unknown Gemma 3 config"),
        (["--model", "tiny", "--tp", "3"], "must divide num_heads"),
        (["--seq-lens", "5000"], "at most 4096"),
        (["--coordinator", "127.0.0.1:1"], "--coordinator and --num-processes go together"),
        (
            ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
            "--process-id must be < --num-processes",
        ),
        (
            ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--tp", "4"],
            "TP = --num-processes",
        ),
        (["--tp", "2", "--link", "1gbit"], "--link emulates hosts for the processes"),
        (["--processes", "2", "--link", "1 gbit/s"], "invalid link rate"),
        (["--processes", "2", "--link-delay", "1ms"], "--link-delay needs --link"),
    ],
)
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "prefill", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_each_host_runs_the_same_command_with_its_own_process_id(tmp_path):
    """The multi-host form, here with two "hosts" on loopback: process 0 reports."""
    port = free_port()

    def command(i: int) -> list[str]:
        return [
            *[sys.executable, "-m", "equarx_serve", "bench", "prefill", "--model", "tiny"],
            *["--seq-lens", "16", "--repeats", "1", "--coordinator", f"127.0.0.1:{port}"],
            *["--num-processes", "2", "--process-id", str(i)],
            *["--json", str(tmp_path / f"{i}.json")],
        ]

    procs = [
        subprocess.Popen(command(i), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    outputs = [proc.communicate(timeout=180)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    report = json.loads((tmp_path / "0.json").read_text())
    assert report["settings"]["mode"] == "multi-host"
    assert report["settings"]["processes"] == 2
    assert not (tmp_path / "1.json").exists()
    assert "process 0 prints the results" in outputs[1]


def _row(label: str, quantized: bool, median_ms: float, wire_bytes: int) -> dict:
    return {"label": label, "quantized": quantized, "median_ms": median_ms,
            "wire_bytes_hlo_total": wire_bytes, "wire_bytes_projection": wire_bytes}  # fmt: skip


def test_comparisons_against_the_fastest_unquantized_method_and_the_measured_link():
    result = {
        "no_reduce": {"median_ms": 50.0},
        "rows": [
            _row("psum", False, 100.0, 8 << 20),
            _row("ring", False, 90.0, 4 << 20),
            _row("equarx-int8", True, 70.0, 2 << 20),
        ],
        "link": {"measured_bits_per_s": 1e9},
    }
    add_comparisons(result)
    ring, eq = result["rows"][1], result["rows"][2]
    assert {row["baseline"] for row in result["rows"]} == {"ring"}
    assert eq["speedup"] == pytest.approx(90 / 70)
    assert eq["ar_ms"] == pytest.approx(20.0) and eq["ar_share"] == pytest.approx(20 / 70)
    # the byte bound: ring's 40 ms of all-reduce halved with the bytes, the 50 ms of compute
    # unchanged: 70 ms, which equarx-int8 reaches
    assert eq["byte_bound_efficiency"] == pytest.approx(1.0)
    assert ring["byte_bound_efficiency"] == pytest.approx(1.0)
    # 2 MiB at 1 Gbit/s: 16.78 ms, of 20 ms of all-reduce
    assert eq["link_ms"] == pytest.approx(16.777216)
    assert eq["link_efficiency"] == pytest.approx(16.777216 / 20)
    assert eq["PROJECTION"]["PCIe Gen4 x16"]["speedup_vs_psum"] > 1


def test_an_overlapped_row_is_compared_with_the_compute_of_its_own_chunks():
    overlapped = _row("psum/overlap=4", False, 80.0, 8 << 20) | {"overlap_chunks": 4}
    result = {
        "no_reduce": {"median_ms": 50.0},
        "no_reduce_overlap": {"4": {"median_ms": 60.0}},
        "rows": [_row("psum", False, 100.0, 8 << 20), overlapped],
    }
    add_comparisons(result)
    psum, overlapped = result["rows"]
    assert overlapped["baseline"] == "psum/overlap=4" and psum["speedup"] == pytest.approx(0.8)
    # 20 ms of all-reduce left exposed over the chunked compute's 60 ms (psum: 50 of 50 ms)
    assert overlapped["ar_ms"] == pytest.approx(20.0) and psum["ar_ms"] == pytest.approx(50.0)
    assert overlapped["ar_share"] == pytest.approx(0.25)


@needs_root
def test_processes_on_emulated_hosts_report_link_efficiency(tmp_path):
    path = tmp_path / "prefill.json"
    argv = ["bench", "prefill", "--model", "tiny", "--processes", "2", "--link", "1gbit"]
    argv += ["--seq-lens", "16", "--repeats", "1", "--json", str(path)]
    assert cli.main([*argv, "--plot", str(tmp_path / "prefill.png")]) == 0
    report = json.loads(path.read_text())
    assert report["settings"]["link"] == {"rate_bits_per_s": 10**9, "delay_us": 0}
    link = report["link_measurement"]
    assert link["configured_bits_per_s"] == 10**9 and link["measured_bits_per_s"] > 0
    rows = {row["label"]: row for row in report["rows"]}
    assert {row["baseline"] for row in rows.values()} == {"psum"}
    assert rows["equarx-int8:min_size_bytes=0"]["quantized"] and not rows["psum"]["quantized"]
    for row in rows.values():
        expected_ms = 8 * row["wire_bytes_hlo_total"] / link["measured_bits_per_s"] * 1e3
        assert row["link_ms"] == pytest.approx(expected_ms)
        if row["ar_ms"] > 0:
            assert row["link_efficiency"] == pytest.approx(row["link_ms"] / row["ar_ms"])
