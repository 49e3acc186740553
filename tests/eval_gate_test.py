"""The quick quality gate on the real Gemma 3 270M weights, as CI runs it: the command in
eval/thresholds-quick.toml must pass, and its report must hold what the gate checked."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import mesh_of

from equarx_serve import cli

THRESHOLDS = Path(__file__).parent.parent / "eval" / "thresholds-quick.toml"
QUICK = ["--seq-len", "128", "--num-seqs", "4", "--greedy-prompts", "2", "--greedy-tokens", "8"]


def test_quick_gate_passes_on_gemma3_270m(tmp_path, capsys):
    mesh_of(2)  # skips without 2 devices
    report_path = tmp_path / "eval.json"
    flags = [
        *QUICK,
        "--methods",
        "psum",
        "--json",
        str(report_path),
        "--report",
        str(tmp_path / "eval.md"),
        "--plot",
        str(tmp_path / "eval.png"),
    ]
    code = cli.main(["eval", *flags, "--check", str(THRESHOLDS)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "0 failed" in printed
    report = json.loads(report_path.read_text())
    assert report["settings"]["model_info"]["source"] == "gguf"
    assert report["settings"]["scored_tokens"] == 4 * 127
    assert set(report["methods"]) == {"psum", "equarx-int8", "naive-int8"}
    assert report["compute_floor"]["kl_mean"] > 0  # the float32 model differs from the bf16 one
