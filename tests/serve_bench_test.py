"""`serve_bench` against a real server (tiny random-init model, TP = 2, in this process): the
official OpenAI client's load and time-to-first-token paths, and the summary."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading

import pytest
import uvicorn

from equarx_serve.bench import serve as serve_bench
from equarx_serve.bench import served
from equarx_serve.distributed.multiprocess import free_port
from equarx_serve.generation.generator import Generator
from equarx_serve.generation.prefill import PrefillEngine
from equarx_serve.generation.text import byte_tokenizer
from equarx_serve.server import create_app
from models.config import get_config

MODEL = "tiny"


@pytest.fixture(scope="module")
def url():
    engine = PrefillEngine.from_name(MODEL, 2, "equarx-int8", max_length=256)
    app = create_app(Generator(engine, max_batch=4), model_name=MODEL)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "the server did not start"
            thread.join(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_load_answers_every_request_and_the_server_agrees(url):
    before = serve_bench.finished_on_server(url)
    level = asyncio.run(serve_bench.load_level(url, MODEL, clients=4, per_client=2, max_tokens=4))
    assert (level.requests, level.answered, level.errors, level.lost) == (8, 8, 0, 0)
    assert 0 < level.latency_p50_s <= level.latency_p99_s
    assert 0 < level.completion_tokens <= 8 * 4
    assert serve_bench.finished_on_server(url) - before == 8


def test_time_to_first_token_and_summary(url):
    prompt = serve_bench.long_prompt(MODEL, 100)
    seconds, prompt_tokens = serve_bench.time_to_first_token(url, MODEL, prompt)
    assert seconds > 0 and prompt_tokens == 100
    result = {
        "ttft": {
            "psum": {"prompt_tokens": 100, "seconds": [2.0], "median_s": 2.0},
            "equarx-int8": {"prompt_tokens": 100, "seconds": [1.0], "median_s": 1.0},
        },
        "load": [],
    }
    assert "`equarx-int8` / `psum` TTFT: 0.500x" in serve_bench.format_summary(result)


def _parsed_args(monkeypatch, argv: list[str]) -> argparse.Namespace:
    """serve_bench's arguments as main() parses and checks them (nothing is run)."""
    parsed = []
    monkeypatch.setattr(serve_bench, "run", lambda args: parsed.append(args) or {})
    monkeypatch.setattr(serve_bench, "format_summary", lambda result: "")
    serve_bench.main(argv)
    return parsed[0]


def test_servers_run_on_emulated_links_when_asked(monkeypatch):
    args = _parsed_args(monkeypatch, ["--processes", "2", "--link", "1gbit", "--link-delay", "1ms"])
    command = serve_bench.server_command(args, "psum", 8000)
    assert command[command.index("--processes") + 1] == "2"
    assert command[command.index("--link") + 1] == "1gbit"
    assert command[command.index("--link-delay") + 1] == "1ms"
    loopback = serve_bench.server_command(_parsed_args(monkeypatch, []), "psum", 8000)
    assert "--link" not in loopback and "--link-delay" not in loopback


def test_every_method_is_served_with_every_overlap_setting(monkeypatch):
    run = serve_bench.run  # _parsed_args replaces it
    args = _parsed_args(monkeypatch, ["--methods", "ring", "equarx-int8", "--overlap-chunks", "1"])
    command = serve_bench.server_command(args, "ring", 8000, args.overlap_chunks[0])
    assert command[command.index("--overlap-chunks") + 1] == "1"
    assert command[command.index("--weights") + 1] == "auto"  # serve's own default
    args = _parsed_args(monkeypatch, ["--weights", "bf16"])
    command = serve_bench.server_command(args, "ring", 8000)
    assert command[command.index("--weights") + 1] == "bf16"
    args = _parsed_args(monkeypatch, ["--methods", "ring", "equarx-int8", "--overlap-chunks", "1",
                                      "auto", "--clients", "--ttft-repeats", "1"])  # fmt: skip
    served_commands = []

    @contextlib.contextmanager
    def fake_server(command, port):
        served_commands.append(command)
        yield "http://fake"

    monkeypatch.setattr(serve_bench, "running_server", fake_server)
    monkeypatch.setattr(serve_bench, "long_prompt", lambda model, tokens: "prompt")
    monkeypatch.setattr(serve_bench, "_measure_ttft", lambda url, args, prompt: {"median_s": 1})
    result = run(args)
    assert list(result["ttft"]) == [
        "ring/overlap=1", "ring/overlap=auto", "equarx-int8/overlap=1", "equarx-int8/overlap=auto"
    ]  # fmt: skip
    chunks = [(c[c.index("--all-reduce") + 1], c[c.index("--overlap-chunks") + 1])
              for c in served_commands]  # fmt: skip
    assert chunks == [
        ("ring", "1"),
        ("ring", "auto"),
        ("equarx-int8", "1"),
        ("equarx-int8", "auto"),
    ]
    with pytest.raises(SystemExit):
        serve_bench.main(["--overlap-chunks", "0"])


@pytest.mark.parametrize("argv", [["--processes", "0", "--link", "1gbit"], ["--link-delay", "1ms"]])
def test_link_options_are_checked(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve_bench.main(argv)
    assert exit_info.value.code == 2
    assert "--link" in capsys.readouterr().err


@pytest.fixture
def short_requests(monkeypatch):
    """Served requests short enough for the tiny model's 256 positions."""
    monkeypatch.setattr(served, "SERVED_MAX_TOKENS", 4)
    monkeypatch.setattr(served, "PROMPT_TOKENS", 40)


def test_served_level_counts_usage_tokens_latency_and_streams(url, short_requests):
    texts = served.prompts(byte_tokenizer(get_config(MODEL).vocab_size), 8)
    before = serve_bench.finished_on_server(url)
    level = served.measure_level(url, served.PROJECT, MODEL, texts, clients=2)
    assert (level.requests, level.errors) == (8, 0)
    assert serve_bench.finished_on_server(url) - before == 16  # both passes, every request
    assert 0 < level.output_tokens <= 8 * 4 and level.output_tokens_per_s > 0
    assert 0 < level.latency_p50_s <= level.latency_p99_s
    assert 0 < level.ttft_p50_s <= level.ttft_p99_s
    assert level.stream_decode_tokens_per_s > 0  # this server's streams carry usage


def test_served_prompts_are_distinct_windows(short_requests):
    tokenizer = byte_tokenizer(get_config(MODEL).vocab_size)
    texts = served.prompts(tokenizer, 5)
    assert len(set(texts)) == 5
    assert all(len(tokenizer.encode(t)) == 40 for t in texts)  # with its BOS
    assert served.requests_per_client(1) == 8 and served.requests_per_client(16) == 2


def test_stream_decode_rate():
    assert served.stream_decode_rate(served._Answer(2.5, 11, 0.5)) == pytest.approx(10 / 2.0)
    assert served.stream_decode_rate(served._Answer(2.5, None, 0.5)) is None  # no usage
    assert served.stream_decode_rate(served._Answer(2.5, 1, 0.5)) is None


def test_real_llama_cpp_server_answers_the_served_level(monkeypatch, short_requests):
    """With llama-cpp-python's server extra installed: its OpenAI server on the packaged GGUF
    through the same client code (no usage in its streams)."""
    if reason := served.llama_server_missing():
        pytest.skip(reason)
    from models.cache import load_gemma3_270m, packaged_gguf_path

    monkeypatch.setattr(served, "MIN_REQUESTS", 2)
    texts = served.prompts(load_gemma3_270m(verify=False)[1], 2)
    port = free_port()
    command = served.llama_server_command(packaged_gguf_path()[0], "gemma3-270m", 2, port)
    with serve_bench.running_server(command, port, ready_path="/v1/models") as llama_url:
        level = served.measure_level(llama_url, served.LLAMA_SERVER, "gemma3-270m", texts, 1)
    assert (level.requests, level.errors) == (2, 0)
    assert 0 < level.output_tokens <= 2 * 4 and level.ttft_p50_s > 0
    assert level.stream_decode_tokens_per_s is None
