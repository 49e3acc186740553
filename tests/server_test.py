"""The OpenAI-compatible server (`equarx_serve/server.py`) on the tiny random-init model at TP=2:
the endpoints, streaming, errors, the bounded queue, batching of concurrent requests, client
disconnects, and one real `equarx-serve serve` process stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from equarx_serve.decode import Generator
from equarx_serve.engine import PrefillEngine
from equarx_serve.server import create_app
from equarx_serve.server_metrics import prefill_all_reduce_bytes

MODEL = "tiny"
MAX_LENGTH = 256
MAX_PROMPT = 64
PROMPT = "hello the world"
GREEDY = {"temperature": 0.0, "max_tokens": 8}


class Gated:
    """A Generator that can be held before it starts (`hold`), slowed per token
    (`token_delay_s`) or made to fail once (`fail_next`); it records every call's batch size
    and completions."""

    def __init__(self, inner: Generator):
        self.inner = inner
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.token_delay_s = 0.0
        self.fail_next: Exception | None = None
        self.batches: list[int] = []
        self.completions: list = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompts, params, *, on_token=None, **kwargs):
        self.batches.append(len(prompts))
        self.entered.set()
        self.open.wait(30)
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error

        def slow(i, token, text):
            time.sleep(self.token_delay_s)
            return on_token(i, token, text)

        out = self.inner.generate(prompts, params, on_token=slow if on_token else None, **kwargs)
        self.completions += out
        return out


@pytest.fixture(scope="module")
def generator() -> Generator:
    engine = PrefillEngine.from_name(MODEL, 2, "equarx-int8", max_length=MAX_LENGTH)
    return Generator(engine, max_batch=4)


@pytest.fixture(scope="module")
def gated(generator) -> Gated:
    return Gated(generator)


@pytest.fixture(scope="module")
def client(gated):
    app = create_app(gated, model_name=MODEL, max_queue=8, max_prompt_tokens=MAX_PROMPT)
    with TestClient(app) as c:
        yield c


@pytest.fixture(autouse=True)
def _reset(request):
    if "gated" in request.fixturenames:
        gated = request.getfixturevalue("gated")
        gated.open.set()
        gated.token_delay_s, gated.fail_next = 0.0, None


def sse_events(text: str) -> list:
    """The `data:` payloads of a server-sent event stream (JSON decoded, "[DONE]" kept)."""
    events = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        if sample.split("{")[0] != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', sample))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(value)
    raise KeyError(f"{name}{labels} not in the metrics")


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# -- completions and chat ----------------------------------------------------------------------
def test_completion_stream_matches_non_streamed(client, generator):
    noop = {"user": "u1", "logprobs": None, "echo": False, "presence_penalty": 0}
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, **GREEDY, **noop})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(generator.tokenizer.encode(PROMPT))
    assert 1 <= usage["completion_tokens"] <= GREEDY["max_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["timings"]["prefill_ms"] > 0

    r = client.post(
        "/v1/completions",
        json={"prompt": [PROMPT], "stream": True, "stream_options": {"include_usage": True},
              **GREEDY},
    )  # fmt: skip
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == usage


def test_chat_stream_matches_non_streamed(client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
    ]
    r = client.post("/v1/chat/completions", json={"messages": messages, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert body["usage"]["completion_tokens"] >= 1

    r = client.post("/v1/chat/completions", json={"messages": messages, "stream": True, **GREEDY})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == message["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]


def test_stop_strings_and_seeds(client):
    def complete(**extra) -> dict:
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    text = complete(temperature=0.0)["text"]
    assert len(text) >= 6, text
    stop = text[3:5]
    cut = text[: text.index(stop)]
    choice = complete(temperature=0.0, stop=[stop])
    assert (choice["text"], choice["finish_reason"]) == (cut, "stop")
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "stop": stop, "stream": True}
    r = client.post("/v1/completions", json=body)
    chunks = sse_events(r.text)[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut
    sampled = complete(temperature=1.0, top_k=50, top_p=0.9, seed=7)["text"]
    assert complete(temperature=1.0, top_k=50, top_p=0.9, seed=7)["text"] == sampled


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert client.get("/health").json() == {"status": "ok"}


def test_metrics_after_requests(client, generator):
    client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY})
    text = client.get("/metrics").text
    assert metric(text, "equarx_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert metric(text, "equarx_prompt_tokens_total") > 0
    assert metric(text, "equarx_generation_tokens_total") > 0
    assert metric(text, "equarx_prefill_seconds_count") >= 1
    assert metric(text, "equarx_time_to_first_token_seconds_count") >= 1
    assert metric(text, "equarx_queue_depth") == 0
    assert metric(text, "equarx_requests_in_flight") == 0
    assert metric(text, "equarx_tensor_parallel_degree") == 2
    assert metric(text, "equarx_model_info", model=MODEL, all_reduce="equarx-int8", tp="2") == 1
    expected = prefill_all_reduce_bytes(
        generator.engine, 1, len(generator.tokenizer.encode(PROMPT))
    )
    assert metric(text, "equarx_all_reduce_bytes_per_prefill") == expected > 0


# -- bad input -----------------------------------------------------------------------------------
BAD_COMPLETIONS = [
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 10**9}, 400, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 2.5}, 400, "max_tokens"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": 5}, 400, None),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": "hello " * 200}, 400, "prompt"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "model"),
    ({"prompt": PROMPT, "n": 2}, 400, "n"),
    ({"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ({"prompt": PROMPT, "top_k": 0}, 400, "top_k"),
    ({"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": PROMPT, "stream": "yes"}, 400, "stream"),
    ([PROMPT], 400, None),
    ({"prompt": PROMPT, "logprobs": 5}, 400, "logprobs"),
    ({"prompt": PROMPT, "echo": True}, 400, "echo"),
]
BAD_CHATS = [
    ({"messages": []}, 400, "messages"),
    ({}, 400, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, None),
    ({"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, 400, "tools"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests(client, body, status, param):
    assert_error(client.post("/v1/completions", json=body), status, param)


@pytest.mark.parametrize(("body", "status", "param"), BAD_CHATS)
def test_bad_chat_requests(client, body, status, param):
    assert_error(client.post("/v1/chat/completions", json=body), status, param)


def test_malformed_json_unknown_path_and_recovery(client):
    error = assert_error(
        client.post("/v1/completions", content=b'{"prompt": ',
                    headers={"content-type": "application/json"}), 400,
    )  # fmt: skip
    assert "JSON" in error["message"]
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)
    text = client.get("/metrics").text
    assert metric(text, "equarx_request_errors_total", endpoint="/v1/completions",
                  type="invalid_request_error") >= 1  # fmt: skip
    assert client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}).status_code == 200


def test_generation_failure_is_500_and_server_recovers(client, gated):
    gated.fail_next = RuntimeError("device on fire")
    error = assert_error(client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}), 500)
    assert "device on fire" in error["message"] and error["type"] == "server_error"
    assert client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}).status_code == 200
    assert client.get("/health").status_code == 200


# -- scheduling ----------------------------------------------------------------------------------
def _post_in_thread(client, results: list, body: dict) -> threading.Thread:
    thread = threading.Thread(
        target=lambda: results.append(client.post("/v1/completions", json=body))
    )
    thread.start()
    return thread


def _wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_concurrent_requests_share_one_generate_call(client, gated):
    scheduler = client.app.state.scheduler
    gated.open.clear()
    gated.entered.clear()
    results: list = []
    threads = [_post_in_thread(client, results, {"prompt": PROMPT, **GREEDY})]
    _wait_for(gated.entered.is_set)  # the worker holds the first request
    before = len(gated.batches)
    threads += [
        _post_in_thread(client, results, {"prompt": f"{PROMPT} {i}", **GREEDY}) for i in range(3)
    ]
    _wait_for(lambda: scheduler._queue.qsize() == 3)
    gated.open.set()
    for t in threads:
        t.join(30)
    assert [r.status_code for r in results] == [200] * 4
    assert gated.batches[before - 1 :] == [1]  # the three waiting ones joined the held call
    text = client.get("/metrics").text
    assert metric(text, "equarx_batch_size_bucket", le="3.0") - metric(
        text, "equarx_batch_size_bucket", le="2.0") >= 1  # fmt: skip


def test_request_sent_during_a_long_batch_joins_it(gated):
    """max_batch 2, one long request running: a short one sent meanwhile takes the free slot
    in the same generate call and finishes first (it used to wait for the whole batch)."""
    app = create_app(gated, model_name=MODEL, max_batch=2, max_prompt_tokens=MAX_PROMPT)
    with TestClient(app) as client:
        scheduler = app.state.scheduler
        gated.token_delay_s = 0.02  # the long request: >= 2 s
        calls, batches = scheduler.generate_calls, len(gated.batches)
        done: dict[str, float] = {}
        results: dict[str, dict] = {}

        def post(name: str, body: dict) -> threading.Thread:
            def run():
                r = client.post("/v1/completions", json=body)
                done[name] = time.monotonic()
                assert r.status_code == 200, r.text
                results[name] = r.json()

            thread = threading.Thread(target=run)
            thread.start()
            return thread

        long = post("long", {"prompt": PROMPT, "max_tokens": 100, "temperature": 0.0})
        _wait_for(lambda: scheduler.generate_calls == calls + 1)
        time.sleep(0.3)  # well into the long request's decoding
        sent = time.monotonic()
        short = post("short", {"prompt": "joining", "max_tokens": 4, "temperature": 0.0})
        short.join(30)
        long.join(60)
        assert done["short"] < done["long"]
        assert scheduler.generate_calls == calls + 1 and gated.batches[batches:] == [1]
        assert results["long"]["usage"]["completion_tokens"] == 100
        assert results["long"]["timings"]["total_ms"] > 2000
        short_ms = 1e3 * (done["short"] - sent)
        print(f"short request sent mid-batch: {short_ms:.0f} ms; long one: "
              f"{results['long']['timings']['total_ms']:.0f} ms; short timings "
              f"{results['short']['timings']}")  # fmt: skip
        assert short_ms < 1e3 * (done["long"] - sent)
        text = client.get("/metrics").text
        assert metric(text, "equarx_requests_in_flight") == 0
        assert metric(text, "equarx_queue_depth") == 0


def test_full_queue_answers_503_at_once(gated):
    app = create_app(gated, model_name=MODEL, max_queue=1, max_prompt_tokens=MAX_PROMPT)
    with TestClient(app) as client:
        gated.open.clear()
        gated.entered.clear()
        results: list = []
        threads = [_post_in_thread(client, results, {"prompt": PROMPT, **GREEDY})]
        _wait_for(gated.entered.is_set)
        threads.append(_post_in_thread(client, results, {"prompt": PROMPT, **GREEDY}))
        _wait_for(lambda: app.state.scheduler._queue.qsize() == 1)
        t0 = time.monotonic()
        r = client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY})
        assert time.monotonic() - t0 < 2.0
        error = assert_error(r, 503)
        assert error["code"] == "queue_full" and r.headers["retry-after"] == "1"
        gated.open.set()
        for t in threads:
            t.join(30)
        assert [r.status_code for r in results] == [200, 200]


def test_draining_refuses_new_requests(gated):
    app = create_app(gated, model_name=MODEL, max_prompt_tokens=MAX_PROMPT)
    with TestClient(app) as client:
        assert client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}).status_code == 200
        app.state.scheduler.drain()
        error = assert_error(client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}), 503)
        assert error["code"] == "shutting_down"
        assert client.get("/health").status_code == 503


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_client_disconnect_frees_its_slot(gated):
    import uvicorn

    app = create_app(gated, model_name=MODEL, max_queue=4, max_prompt_tokens=MAX_PROMPT)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        _wait_for(lambda: server.started)
        gated.token_delay_s = 0.05  # 100 tokens would take >= 5 s
        done = len(gated.completions)
        body = {"prompt": PROMPT, "max_tokens": 100, "temperature": 0.0, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        _wait_for(lambda: len(gated.completions) > done)
        completion = gated.completions[-1]
        assert completion.finish_reason == "cancelled" and len(completion.tokens) < 100
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert metric(text, "equarx_requests_finished_total", finish_reason="cancelled") == 1
        assert metric(text, "equarx_requests_in_flight") == 0
    finally:
        server.should_exit = True
        thread.join(30)


# -- the command ---------------------------------------------------------------------------------
def test_serve_command_end_to_end_and_sigterm():
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    process = subprocess.Popen(
        [sys.executable, "-m", "equarx_serve", "serve", "--model", MODEL, "--tp", "2",
         "--port", str(port), "--max-length", "512", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, **GREEDY}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert "equarx_model_info" in httpx.get(f"{url}/metrics").text
        # SIGTERM while a long stream runs: it still finishes, then the process exits 0.
        body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(signal.SIGTERM)
            events = sse_events("\n\n".join(line for line in lines if line))
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 400
        assert process.wait(60) == 0, process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
