"""`equarx-serve generate` on the random-init "tiny" config: end to end in a subprocess (JSON and
streamed text), and bad input as one-line usage errors (exit code 2, no traceback)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from equarx_serve import cli

TINY = ["generate", "--model", "tiny", "--tp", "2", "--max-tokens", "6"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "equarx_serve", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_json_end_to_end(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('second prompt\n\n{"prompt": "third"}\n')
    done = _run(
        *TINY,
        "--prompt",
        "Hello",
        "--prompt-file",
        str(prompts),
        "--max-batch",
        "2",
        "--all-reduce",
        "equarx-int8:min_size_bytes=0",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["tp"] == 2 and record["model"] == "tiny"
    assert record["all_reduce"] == "equarx-int8:min_size_bytes=0"
    assert record["all_reduce_usage"]["decode"]["uses"] == "equarx-int8"
    assert [c["prompt"] for c in record["completions"]] == ["Hello", "second prompt", "third"]
    for c in record["completions"]:
        assert c["finish_reason"] in ("stop", "length")
        assert c["completion_tokens"] == len(c["tokens"]) <= 6
        assert c["prefill_ms"] > 0 and c["time_to_first_token_ms"] > 0


def test_streams_one_prompt_and_reports_the_gate():
    done = _run(*TINY, "--prompt", "Hello", "--chat", "--no-warmup")
    assert done.returncode == 0, done.stderr
    assert "time to first token" in done.stdout and "tokens/s" in done.stdout
    assert "decode [2x1x64] 256 B -> psum (size gate)" in done.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "  "], "prompt 0 is empty"),
        ([], "at least one --prompt"),
        (["--prompt", "x", "--all-reduce", "nope"], "unknown all-reduce 'nope'"),
        (["--prompt", "x", "--tp", "3"], "must divide num_heads"),
        (["--prompt", "x", "--max-length", "16", "--max-tokens", "20"], "maximum context of 16"),
        (["--prompt", "x", "--top-p", "0"], "top_p must be in"),
        (["--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt", "x", "--prompt-file", "/nonexistent/p.txt"], "No such file"),
        (["--prompt", "x", "--weights", "gguf"], "only the packaged gemma3-270m checkpoint"),
        (["--prompt", "x", "--weights", "int4"], "invalid choice: 'int4'"),
        (["--prompt", "x", "--overlap-chunks", "0"], "must be an integer >= 1"),
    ],
)
def test_bad_input_is_a_usage_error(args, message, capsys):
    argv = ["generate", "--model", "tiny", "--no-warmup", *args]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_weights_auto_decodes_on_the_gguf_blocks_only_where_a_gguf_gives_them():
    from equarx_serve.generation.model_args import resolved_weights

    args = lambda **kw: argparse.Namespace(**{"weights": "auto", "model": "gemma3-270m",
                                              "checkpoint": None, **kw})  # fmt: skip
    assert resolved_weights(args()) == "gguf"
    assert resolved_weights(args(model="tiny")) == "bf16"
    assert resolved_weights(args(checkpoint="/some/orbax")) == "bf16"
    assert resolved_weights(args(weights="bf16")) == "bf16"


@pytest.mark.parametrize(
    "argv", [["generate", "--model", "tiny", "--prompt", "x"], ["serve", "--model", "tiny"]]
)
def test_overlap_chunks_reach_the_engine(argv):
    from equarx_serve.generation.model_args import engine_from_args

    parser = cli.build_parser()
    chunks = engine_from_args(parser.parse_args([*argv, "--overlap-chunks", "4"]), max_length=64)
    default = engine_from_args(parser.parse_args(argv), max_length=64)
    assert (chunks.model.overlap_chunks, default.model.overlap_chunks) == (4, "auto")
