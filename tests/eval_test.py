"""The eval harness: corpus windows, metrics against hand-computed values, the threshold gate,
and whole runs on the "tiny" model at TP=2 (reference, floor, quantized methods; the CLI's
exit codes for a passing, a failing and a malformed gate)."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import mesh_of

from equarx_serve import cli
from equarx_serve.collectives import parse_method
from eval import corpus, gate, harness, metrics
from models.config import get_config

# -- corpus -------------------------------------------------------------------------------------


def test_default_corpus_is_fixed_text_that_ships_with_python():
    first, second = corpus.default_corpus(), corpus.default_corpus()
    assert first.sha256 == second.sha256
    assert first.num_chars > 100_000 and len(first.documents) > 50


def test_the_second_corpus_is_the_standard_librarys_source_code():
    code = corpus.named_corpus("python-stdlib")
    assert code.sha256 == corpus.named_corpus("python-stdlib").sha256
    assert code.sha256 != corpus.default_corpus().sha256
    assert code.num_chars > 1_000_000 and len(code.documents) > 100
    assert any(d.lstrip().startswith('"""') and "\ndef " in d for d in code.documents)
    with pytest.raises(ValueError, match="python-reference, python-stdlib"):
        corpus.named_corpus("wikipedia")


def test_greedy_prompts_come_from_their_own_places_in_the_stream():
    stream = np.arange(100, 200, dtype=np.int32)
    prompts = corpus.greedy_prompts(stream, bos_id=2, prompt_len=5, count=4)
    assert prompts == [[2, 100, 101, 102, 103], [2, 132, 133, 134, 135],
                       [2, 164, 165, 166, 167], [2, 196, 197, 198, 199]]  # fmt: skip
    assert len(corpus.greedy_prompts(stream, bos_id=2, prompt_len=5, count=99)) == 25


def test_user_corpus_from_a_file_a_jsonl_file_and_a_folder(tmp_path):
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "b.jsonl").write_text('{"text": "second"}\n\n{"text": "third"}\n')
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    assert corpus.load_corpus(tmp_path / "a.txt").documents == ("first document",)
    assert corpus.load_corpus(tmp_path / "b.jsonl").documents == ("second", "third")
    assert corpus.load_corpus(tmp_path).documents == ("first document", "second", "third")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": 3}\n', 'a "text" string'),
        ("not json\n", "not JSON"),
        ("   \n", "no text"),
    ],
)
def test_bad_corpus_files_say_what_is_wrong(tmp_path, content, message):
    path = tmp_path / ("bad.jsonl" if "{" in content or "json" in content else "empty.txt")
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        corpus.load_corpus(path)
    with pytest.raises(ValueError, match="no such file"):
        corpus.load_corpus(tmp_path / "missing.txt")


def test_windows_are_bos_then_consecutive_stream_tokens_evenly_spaced():
    stream = np.arange(100, 200, dtype=np.int32)  # 100 tokens: 11 windows of 1 + 9
    windows = corpus.make_windows(stream, bos_id=2, seq_len=10, num_seqs=3)
    assert windows.shape == (3, 10)
    assert (windows[:, 0] == 2).all()
    np.testing.assert_array_equal(windows[0, 1:], np.arange(100, 109))  # the first window
    np.testing.assert_array_equal(windows[-1, 1:], np.arange(190, 199))  # the last whole one
    assert len(corpus.make_windows(stream, bos_id=2, seq_len=10, num_seqs=50)) == 11
    with pytest.raises(ValueError, match="too short for one window"):
        corpus.make_windows(stream[:5], bos_id=2, seq_len=10, num_seqs=1)


# -- metrics ------------------------------------------------------------------------------------


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_token_metrics_match_numpy():
    rng = np.random.default_rng(0)
    reference = rng.normal(size=(2, 4, 40)).astype(np.float32)
    method = reference + rng.normal(scale=0.3, size=reference.shape).astype(np.float32)
    float32 = reference + rng.normal(scale=0.1, size=reference.shape).astype(np.float32)
    targets = rng.integers(0, 40, size=(2, 4)).astype(np.int32)
    got = metrics.token_metrics(metrics.baseline(reference, float32), method, targets)

    log_p, log_q, log_f = _log_softmax(reference), _log_softmax(method), _log_softmax(float32)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    kl_to_float32 = (np.exp(log_f) * (log_f - log_q)).sum(-1)
    np.testing.assert_allclose(got["kl_to_float32"], kl_to_float32, rtol=1e-4, atol=1e-6)
    nll = -np.take_along_axis(log_q, targets[..., None], -1)[..., 0]
    top1 = reference.argmax(-1) == method.argmax(-1)
    np.testing.assert_allclose(got["kl"], kl, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got["nll"], nll, rtol=1e-5)
    np.testing.assert_array_equal(got["top1"], top1)
    np.testing.assert_allclose(got["max_abs"], np.abs(method - reference).max(-1))
    assert (np.asarray(got["nonfinite"]) == 0).all()


def test_identical_logits_have_no_error_and_nan_is_counted():
    logits = np.random.default_rng(1).normal(size=(1, 3, 16)).astype(np.float32)
    base = metrics.baseline(logits, logits)
    got = metrics.token_metrics(base, logits, np.zeros((1, 3), np.int32))
    np.testing.assert_allclose(got["kl"], 0.0, atol=1e-6)
    np.testing.assert_array_equal(got["top5"], 1.0)
    np.testing.assert_allclose(got["cosine"], 1.0, rtol=1e-6)
    broken = logits.copy()
    broken[0, 1, 3] = np.nan
    got = metrics.token_metrics(base, broken, np.zeros((1, 3), np.int32))
    np.testing.assert_array_equal(got["nonfinite"], [[0, 1, 0]])


def test_greedy_agreement_counts_tokens_before_the_first_divergence():
    result = metrics.greedy_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 9, 7, 8]])
    assert result["greedy_matched"] == [4, 1]
    assert result["greedy_matched_mean"] == 2.5
    assert result["greedy_matched_stderr"] == pytest.approx(1.5)  # std (ddof 1) 2.12 / sqrt(2)
    assert result["greedy_identical"] == 0.5


def test_numbers_relative_to_the_compute_floor():
    floor = {"kl_mean": 0.002, "top1_agreement": 0.98}
    method = {"kl_mean": 0.003, "top1_agreement": 0.97}
    relative = metrics.relative_to_floor(method, floor)
    assert relative["kl_mean_vs_floor"] == pytest.approx(1.5)
    assert relative["top1_disagreement_vs_floor"] == pytest.approx(1.5)
    assert relative["top1_agreement_below_floor"] == pytest.approx(0.01)
    exact = {"kl_mean": 0.0, "top1_agreement": 1.0}
    assert metrics.relative_to_floor(exact, exact)["kl_mean_vs_floor"] == 0
    assert metrics.relative_to_floor(method, exact)["kl_mean_vs_floor"] == math.inf


# -- gate ---------------------------------------------------------------------------------------

REPORT = {
    "compute_floor": {"kl_mean": 0.002, "top1_agreement": 0.98, "nonfinite": 0},
    "methods": {
        "psum": {"ppl_rel_change": 0.0, "top1_agreement": 1.0, "nonfinite": 0},
        "equarx-int8": {
            "ppl_rel_change": 0.004,
            "top1_agreement": 0.97,
            "kl_mean_vs_floor": 1.5,
            "nonfinite": 0,
        },
    },
}


def _thresholds(tmp_path, text):
    path = tmp_path / "thresholds.toml"
    path.write_text(text)
    return path


def test_gate_passes_and_fails_on_each_limit(tmp_path):
    limits = gate.load_thresholds(
        _thresholds(
            tmp_path,
            '[all]\nmax_nonfinite = 0\n[methods."equarx-int8"]\n'
            "max_ppl_rel_change = 0.005\nmin_top1_agreement = 0.99\n",
        )
    )
    assert gate.methods_named(limits) == ["equarx-int8"]
    checks = {(c.method, c.limit.number): c for c in gate.check(REPORT, limits)}
    assert checks["psum", "nonfinite"].passed and checks["equarx-int8", "nonfinite"].passed
    assert checks["equarx-int8", "ppl_rel_change"].passed
    failed = checks["equarx-int8", "top1_agreement"]
    assert not failed.passed
    assert failed.describe().split()[:4] == ["FAIL", "equarx-int8", "top1_agreement", "0.97"]


def test_gate_limits_relative_to_the_floor_and_on_the_floor_itself(tmp_path):
    limits = gate.load_thresholds(
        _thresholds(
            tmp_path,
            "[compute_floor]\nmin_kl_mean = 0.001\nmax_kl_mean = 0.0015\n"
            '[methods."equarx-int8"]\nmax_kl_mean_vs_floor = 2.0\n',
        )
    )
    assert gate.methods_named(limits) == ["equarx-int8"]
    checks = {(c.method, c.limit.bound, c.limit.number): c for c in gate.check(REPORT, limits)}
    assert checks["compute_floor", "min", "kl_mean"].passed
    assert not checks["compute_floor", "max", "kl_mean"].passed
    assert checks["equarx-int8", "max", "kl_mean_vs_floor"].passed


def test_a_method_that_did_not_run_fails_its_checks(tmp_path):
    limits = gate.load_thresholds(_thresholds(tmp_path, "[methods.ring]\nmin_top1_agreement = 0"))
    (result,) = gate.check(REPORT, limits)
    assert not result.passed and "not measured" in result.describe()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[methods.x]\nmax_speed = 1\n", "not a limit"),
        ('[methods.x]\nmax_kl_mean = "small"\n', "must be a number"),
        ("[nonsense]\nmax_kl_mean = 1\n", "unknown table"),
        ("[methods.x\n", "not valid TOML"),
        ("", "no limits"),
    ],
)
def test_malformed_thresholds_are_rejected_before_anything_runs(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        gate.load_thresholds(_thresholds(tmp_path, text))


# -- whole runs on the tiny model ---------------------------------------------------------------

TINY = dict(model="tiny", tp=2, seq_len=40, num_seqs=3, batch_size=2,
            greedy_prompts=2, greedy_prompt_len=12, greedy_tokens=6)  # fmt: skip
TINY_FLAGS = ["--model", "tiny", "--tp", "2", "--seq-len", "40", "--num-seqs", "2",
              "--greedy-prompts", "1", "--greedy-tokens", "4"]  # fmt: skip


@functools.cache
def _tiny_report():
    mesh_of(2)  # skips without 2 devices
    methods = ("psum-f32", "ring", "naive-int8", "equarx-int8",
               "equarx-int8:min_size_bytes=1048576")  # fmt: skip
    config = harness.EvalConfig(methods=tuple(parse_method(m) for m in methods), **TINY)
    return harness.run_eval(config)


def test_report_holds_every_method_with_the_reference_first_and_the_compute_floor():
    report = _tiny_report()
    assert report["reference"] == "psum"
    assert list(report["methods"])[:2] == ["psum", "psum-f32"]
    for numbers in [*report["methods"].values(), report["compute_floor"]]:
        for key in ("perplexity", "ppl_rel_change", "kl_mean", "kl_p99", "top1_agreement",
                    "top5_overlap", "logit_max_abs_error", "greedy_matched_mean",
                    "greedy_matched_stderr", "kl_mean_vs_floor",
                    "top1_disagreement_vs_floor", "top1_agreement_below_floor"):  # fmt: skip
            assert math.isfinite(numbers[key]), key
        assert len(numbers["per_layer"]) == 2 * get_config("tiny").num_layers
        assert numbers["nonfinite"] == 0
    settings = report["settings"]
    assert settings["scored_tokens"] == 3 * 39
    assert settings["corpus"]["sha256"] == corpus.default_corpus().sha256
    assert settings["methods"]["equarx-int8"]["options"]["min_size_bytes"] == 0
    assert settings["compute_floor"] == {"dtype": "float32", "all_reduce": "psum"}
    assert settings["greedy"]["prompts"] == TINY["greedy_prompts"]
    json.dumps(report)  # every number serializes


def test_the_compute_floor_is_the_float32_model_and_methods_are_measured_against_it():
    report = _tiny_report()
    floor, methods = report["compute_floor"], report["methods"]
    # bf16 arithmetic alone moves the logits: a nonzero floor, larger than bf16 psum vs f32
    # psum on the same bf16 model (which XLA:CPU computes identically).
    assert floor["kl_mean"] > 1e-6 and floor["kl_mean_vs_floor"] == 1
    assert floor["final_layer_error"] > methods["psum-f32"]["final_layer_error"]
    equarx = methods["equarx-int8"]
    assert equarx["kl_mean_vs_floor"] == pytest.approx(equarx["kl_mean"] / floor["kl_mean"])
    assert equarx["top1_agreement_below_floor"] == pytest.approx(
        floor["top1_agreement"] - equarx["top1_agreement"]
    )
    assert methods["psum"]["kl_mean_vs_floor"] == 0
    # Against the float32 model itself: the floor is at 0, the reference at about the floor's
    # KL (the other direction), a quantized method further away.
    assert floor["kl_to_float32"] == pytest.approx(0, abs=1e-6)
    assert methods["psum"]["kl_to_float32"] == pytest.approx(floor["kl_mean"], rel=0.5)
    assert equarx["kl_to_float32"] > methods["psum"]["kl_to_float32"]


def test_reference_against_itself_is_exact_and_lossless_methods_match_it():
    methods = _tiny_report()["methods"]
    reference = methods["psum"]
    assert reference["kl_mean"] == 0 and reference["top1_agreement"] == 1
    assert reference["greedy_identical"] == 1
    for lossless in ("psum-f32", "ring"):  # f32 sums, 16-bit words: no quantization
        assert methods[lossless]["final_layer_error"] < 1e-2
        assert methods[lossless]["kl_mean"] < 1e-5


def test_quantized_methods_show_their_error_and_naive_int8_is_worse():
    methods = _tiny_report()["methods"]
    equarx, naive = methods["equarx-int8"], methods["naive-int8"]
    assert 1e-3 < equarx["born_error_max"] < 0.03
    assert equarx["final_layer_error"] > methods["psum-f32"]["final_layer_error"]
    assert naive["final_layer_error"] > equarx["final_layer_error"]
    assert naive["born_error_max"] > equarx["born_error_max"]
    # The size gate left on: these messages are far below 1 MiB, so equarx is plain psum.
    assert methods["equarx-int8:min_size_bytes=1048576"]["kl_mean"] == 0


def test_split_positions_pads_any_length_and_gathers_a_vocab_sharded_array():
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = mesh_of(2)
    values = np.arange(3 * 7 * 8, dtype=np.float32).reshape(3, 7, 8)  # [B, L odd, V]
    vocab_sharded = jax.device_put(values, NamedSharding(mesh, P(None, None, "tp")))
    split = metrics.split_positions(vocab_sharded, mesh, "tp")
    assert split.shape == (3, 8, 8)
    assert split.sharding.spec == P(None, "tp")
    np.testing.assert_array_equal(np.asarray(split)[:, :7], values)
    np.testing.assert_array_equal(np.asarray(split)[:, 7:], 0)
    with pytest.raises(ValueError, match="replicated"):
        metrics.local_copy(vocab_sharded)


def test_a_window_that_fills_no_bucket_scores_like_one_inside_a_larger_bucket():
    """Regression: a window of 37 tokens (no bucket size, and odd at TP = 2) scored nan
    perplexity, from gathering targets out of one device's half of the vocab-sharded logits.
    The same windows, padded to the 64 bucket (the greedy prompts need it), score the same."""
    mesh_of(2)
    settings = dict(model="tiny", tp=2, seq_len=37, num_seqs=2, batch_size=2, greedy_prompts=0)
    exact = harness.run_eval(harness.EvalConfig(**settings, greedy_prompt_len=12, greedy_tokens=6))
    padded = harness.run_eval(harness.EvalConfig(**settings, greedy_prompt_len=64))
    for label, numbers in exact["methods"].items():
        assert math.isfinite(numbers["perplexity"]), label
        assert numbers["nonfinite"] == 0
        for key in ("perplexity", "kl_mean", "top1_agreement"):
            assert numbers[key] == pytest.approx(padded["methods"][label][key], rel=1e-3, abs=1e-6)


def test_per_layer_error_covers_every_all_reduce_in_depth_order():
    per_layer = _tiny_report()["methods"]["equarx-int8"]["per_layer"]
    assert _tiny_report()["settings"]["model_info"]["source"] == "random-init"
    assert [site["kind"] for site in per_layer[:2]] == ["attn", "mlp"]
    assert [site["layer"] for site in per_layer] == sorted(site["layer"] for site in per_layer)
    assert all(site["born_error"] > 0 for site in per_layer)


def test_cli_gate_exit_codes_and_reports(tmp_path, capsys, monkeypatch):
    mesh_of(2)
    # Both thresholds name the same method: the second command's eval is the first one's, so
    # it is run once and the second command gates its report.
    runs: list[tuple[harness.EvalConfig, dict]] = []
    run_eval = harness.run_eval

    def run_eval_once(config: harness.EvalConfig, **kwargs) -> dict:
        if not any(config == done for done, _ in runs):
            runs.append((config, run_eval(config, **kwargs)))
        return next(report for done, report in runs if done == config)

    monkeypatch.setattr(harness, "run_eval", run_eval_once)
    passing = _thresholds(tmp_path, '[all]\nmax_nonfinite = 0\n[methods."equarx-int8"]\n'
                          "min_top1_agreement = 0\n")  # fmt: skip
    out = tmp_path / "out"
    flags = [*TINY_FLAGS, "--methods", "psum", "--json", str(out / "e.json"),
             "--report", str(out / "e.md"), "--plot", str(out / "e.png")]  # fmt: skip
    assert cli.main(["eval", *flags, "--check", str(passing)]) == 0
    printed = capsys.readouterr().out
    assert "PASS  equarx-int8" in printed and "0 failed" in printed
    report = json.loads((out / "e.json").read_text())
    assert set(report["methods"]) == {"psum", "equarx-int8"}  # added by the gate
    assert report["compute_floor"]["kl_mean_vs_floor"] == 1
    assert "| equarx-int8 |" in (out / "e.md").read_text()
    assert (out / "e.png").read_bytes()[:4] == b"\x89PNG"

    failing = _thresholds(tmp_path, '[methods."equarx-int8"]\nmin_top1_agreement = 1.01\n')
    assert cli.main(["eval", *flags, "--check", str(failing)]) == 1
    assert "FAIL  equarx-int8" in capsys.readouterr().out
    assert len(runs) == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--check", "missing.toml"], "no such thresholds file"),
        (["--methods", "psum", "psum"], "more than once"),
        (["--methods", "no-such-reduce"], "unknown all-reduce"),
        (["--text", "missing-dir"], "no such file or folder"),
        (["--text", "x.txt", "--corpus", "python-stdlib"], "not allowed with"),
        (["--corpus", "wikipedia"], "invalid choice"),
        (["--seq-len", "40000"], "longer than Gemma 3's context"),
        (["--tp", "3"], "3"),
        (["--weights", "gguf"], "packaged gemma3-270m GGUF"),
    ],
)
def test_cli_rejects_bad_input_with_a_usage_error(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", *TINY_FLAGS, *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "methods"),
    [
        ("thresholds.toml", {"equarx-int8"}),
        ("thresholds-quick.toml", {"equarx-int8", "naive-int8"}),
    ],
)
def test_the_repos_thresholds_files_are_valid(name, methods):
    limits = gate.load_thresholds(Path(__file__).parent.parent / "eval" / name)
    assert set(gate.methods_named(limits)) == methods
    assert {limit.number for limit in limits if limit.method == gate.FLOOR} >= {"kl_mean"}


def test_stopping_early_or_late_is_a_divergence():
    # What the harness passes: completions that stopped carry their stop token (1 = EOS).
    stopped, went_on = [5, 6, 1], [5, 6, 7, 8]
    assert metrics.greedy_agreement([stopped], [went_on])["greedy_identical"] == 0
    assert metrics.greedy_agreement([went_on], [stopped])["greedy_matched"] == [2]


def test_non_finite_errors_are_reported_not_hidden():
    sums = np.array([[np.nan, np.nan, 1.0, 4.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    rows = metrics.summarize_sites(["layer_0/attn", "layer_0/mlp"], sums)
    assert math.isnan(rows[0]["born_error"]) and rows[0]["error"] == 0.5
    assert rows[1]["born_error"] == 0.0 and rows[1]["error"] == 0.0
