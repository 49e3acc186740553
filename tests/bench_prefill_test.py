"""`equarx-serve bench prefill` end to end on the tiny model (one process, 2 host devices)."""

from __future__ import annotations

import json

import pytest

from equarx_serve import cli
from equarx_serve.bench.prefill import DEFAULT_METHODS, LINKS
from models.config import get_config


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefill") / "prefill.json"
    argv = ["bench", "prefill", "--model", "tiny", "--tp", "2", "--seq-lens", "16", "32"]
    assert cli.main([*argv, "--repeats", "2", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_rows_for_every_method_and_length(bench_json):
    rows = bench_json["rows"]
    assert {(r["label"], r["seq_len"]) for r in rows} == {
        (m, s) for m in DEFAULT_METHODS for s in (16, 32)
    }
    for r in rows:
        assert r["median_ms"] > 0 and r["p10_ms"] > 0 and r["p90_ms"] >= r["p10_ms"]
        assert -0.5 <= r["ar_share"] <= 1
        assert r["speedup_vs_psum"] > 0
        assert r["top1_agree_vs_first"] >= 0.0
    for run in bench_json["runs"]:
        assert run["no_reduce"]["median_ms"] > 0
        assert len(run["peak_rss_mib"]) == 1 and run["peak_rss_mib"][0] > 0


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
    ],
)
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "prefill", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
