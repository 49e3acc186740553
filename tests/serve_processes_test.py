"""`serve` and `generate` on a mesh that spans 2 processes (tiny random-init model, TP = 2, one
CPU device per process, gloo over loopback): the same text as one process, a clean SIGTERM, and
a lost follower (killed, or stopped) answered with 503 and a non-zero exit within a bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from _serving import wait_healthy
from fastapi.testclient import TestClient

from equarx_serve.distributed.multiprocess import free_port
from equarx_serve.generation.generator import Generator, SamplingParams
from equarx_serve.generation.prefill import PrefillEngine
from equarx_serve.generation.replicated import EXIT_CLUSTER_FAILED, TOKEN_ENV
from equarx_serve.server import create_app

MODEL = "tiny"
MAX_LENGTH = 256
START_TIMEOUT_S = 240  # two processes load and compile on a shared CPU
FAILURE_BOUND_S = 30  # a lost follower: the server must have exited within this
SERVE = [sys.executable, "-m", "equarx_serve", "serve", "--model", MODEL, "--tp", "2"]
SERVE += ["--max-length", str(MAX_LENGTH), "--log-level", "warning"]
REQUESTS = [
    ("/v1/completions", {"prompt": "hello the world", "max_tokens": 12, "temperature": 0}),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 10, "temperature": 0.9, "seed": 5}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0},
    ),
]


def _env() -> dict[str, str]:
    """The test process's environment without its 8 fake devices."""
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _text(body: dict) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            p.kill()
        p.wait()


def _members(port: int, extra: list[str] = ()) -> list[subprocess.Popen]:
    """The real-hosts form: one `serve` command per process, each with its own id."""
    coordinator = f"127.0.0.1:{free_port()}"
    flags = ["--coordinator", coordinator, "--num-processes", "2", "--port", str(port)]
    flags += ["--control-port", str(free_port()), *extra]
    env = {**_env(), TOKEN_ENV: "test-token"}
    return [subprocess.Popen([*SERVE, *flags, "--process-id", str(i)], env=env) for i in range(2)]


def test_generate_on_two_processes_gives_the_text_of_one():
    prompts, params = ["hello the world", "abc"], SamplingParams(10, temperature=0.8, seed=3)
    engine = PrefillEngine.from_name(MODEL, 2, "equarx-int8", max_length=4096)
    generator = Generator(engine)
    expected = generator.generate([generator.tokenizer.encode(p) for p in prompts], params)
    command = [sys.executable, "-m", "equarx_serve", "generate", "--model", MODEL, "--tp", "2"]
    command += ["--prompt", prompts[0], "--prompt", prompts[1], "--max-tokens", "10"]
    command += ["--temperature", "0.8", "--seed", "3", "--no-warmup", "--json"]
    command += ["--processes", "2"]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)  # stdout is the JSON alone (gloo's lines go to stderr)
    assert record["processes"] == 2
    assert [c["tokens"] for c in record["completions"]] == [c.tokens for c in expected]
    assert all(c.tokens for c in expected)


def test_serve_on_two_processes_answers_as_one_process_and_drains_on_sigterm():
    engine = PrefillEngine.from_name(MODEL, 2, "equarx-int8", max_length=MAX_LENGTH)
    with TestClient(create_app(Generator(engine), model_name=MODEL)) as client:
        expected = [_text(client.post(path, json=body).json()) for path, body in REQUESTS]
    port = free_port()
    launcher = subprocess.Popen([*SERVE, "--processes", "2", "--port", str(port)], env=_env())
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, [launcher], START_TIMEOUT_S)
        got = []
        for path, body in REQUESTS:
            r = httpx.post(f"{url}{path}", json=body, timeout=120)
            assert r.status_code == 200, r.text
            got.append(_text(r.json()))
        assert got == expected
        metrics = httpx.get(f"{url}/metrics").text
        assert "equarx_processes 2.0" in metrics
        launcher.send_signal(signal.SIGTERM)  # to process 0: drain, stop the follower
        assert launcher.wait(120) == 0
    finally:
        _stop([launcher])


def test_a_killed_follower_fails_requests_with_503_and_the_server_exits():
    port = free_port()
    leader, follower = processes = _members(port)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, processes, START_TIMEOUT_S)
        body = {"prompt": "hello the world", "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # generating
            follower.kill()
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: ") :])["error"]
        assert error["code"] == "engine_unavailable" and "process 1 exited" in error["message"]
        assert leader.wait(FAILURE_BOUND_S) == EXIT_CLUSTER_FAILED
    finally:
        _stop(processes)


def test_a_stopped_follower_is_found_by_its_silence():
    port = free_port()
    leader, follower = processes = _members(port, ["--follower-timeout", "2"])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, processes, START_TIMEOUT_S)
        follower.send_signal(signal.SIGSTOP)  # alive, but answers nothing (a hung host)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 50}, timeout=60)
        assert r.status_code == 503, r.text
        assert "process 1 is silent" in r.json()["error"]["message"]
        assert leader.wait(FAILURE_BOUND_S) == EXIT_CLUSTER_FAILED
    finally:
        follower.send_signal(signal.SIGCONT)
        _stop(processes)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--processes", "3"], "--tp 2 must be a multiple of --processes 3"),
        (["--process-id", "1"], "need --coordinator"),
        (["--coordinator", "nohost", "--num-processes", "2"], "HOST:PORT"),
        (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], "< --num-proc"),
    ],
)
def test_bad_process_flags_are_usage_errors(flags, message, capsys):
    from equarx_serve import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--model", MODEL, *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
