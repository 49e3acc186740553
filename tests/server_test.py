"""The OpenAI-compatible server (`equarx_serve/server/`) on the tiny random-init model at TP=2:
the endpoints, streaming, errors, the bounded queue, batching of concurrent requests, client
disconnects, the all-reduce bytes metric against the compiled program's HLO, and one real
`equarx-serve serve` process stopped with SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from _serving import assert_error, gated_generator, metric, sse_events, wait_healthy, wait_until
from fastapi.testclient import TestClient

from equarx_serve.bench.hlo_bytes import collective_wire_bytes
from equarx_serve.distributed.multiprocess import free_port
from equarx_serve.generation.generator import Generator
from equarx_serve.generation.prefill import PrefillEngine
from equarx_serve.generation.steps import DecodeStep, PrefillStep
from equarx_serve.server import create_app
from models.gemma3 import layers_hlo

MODEL = "tiny"
MAX_LENGTH = 256
MAX_PROMPT = 64
PROMPT = "hello the world"
GREEDY = {"temperature": 0.0, "max_tokens": 8}


@pytest.fixture(scope="module")
def engine() -> PrefillEngine:
    return PrefillEngine.from_name(MODEL, 2, "equarx-int8", max_length=MAX_LENGTH)


@pytest.fixture(scope="module")
def generator(engine) -> Generator:
    return gated_generator(engine)


@pytest.fixture(scope="module")
def client(generator):
    app = create_app(generator, model_name=MODEL, max_queue=8, max_prompt_tokens=MAX_PROMPT)
    with TestClient(app) as c:
        yield c


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
        json={
            "prompt": [PROMPT],
            "stream": True,
            "stream_options": {"include_usage": True},
            **GREEDY,
        },
    )
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
    assert metric(text, "equarx_processes") == 1
    assert metric(text, "equarx_model_info", model=MODEL, all_reduce="equarx-int8", tp="2") == 1
    assert metric(text, "equarx_engine_steps_total", phase="prefill") >= 1


def _hlo_bytes(output) -> int:
    """Bytes each device sends in the layers' collectives (the row-parallel all-reduces) of
    the program a step ran (its HLO). The vocab-parallel head's own (the embedding lookup's
    psum, sampling's maxima and candidates) are not the all-reduce's traffic."""
    return sum(collective_wire_bytes(layers_hlo(output.program.hlo_text()), 2).values())


@pytest.mark.parametrize("all_reduce", ["equarx-int8", "equarx-int8:min_size_bytes=0"])
def test_all_reduce_bytes_metric_is_what_the_compiled_programs_send(engine, all_reduce):
    """One short request alone (a 1-request prefill, padded to 2 rows for XLA:CPU): the bytes
    metrics equal the collective bytes of the compiled programs that ran, counted from their
    HLO (gated: psum's f32 all-reduces; ungated: equarx's int8 ring)."""
    from equarx_serve.collectives import get_all_reduce

    options = {"min_size_bytes": 0} if all_reduce.endswith("=0") else {}
    generator = gated_generator(engine.with_all_reduce(get_all_reduce("equarx-int8", **options)))
    app = create_app(generator, model_name=MODEL, max_prompt_tokens=MAX_PROMPT)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY})
        assert r.status_code == 200, r.text
        text = client.get("/metrics").text
    runner = generator.runner
    [(step, prefill)] = runner.prefills()
    assert len(step.prompts) == 2  # the request and its padding copy
    assert metric(text, "equarx_all_reduce_bytes_per_prefill") == _hlo_bytes(prefill) > 0
    assert metric(text, "equarx_all_reduce_bytes_total", phase="prefill") == _hlo_bytes(prefill)
    decoded = sum(_hlo_bytes(output) for _, output in runner.decodes())
    assert metric(text, "equarx_all_reduce_bytes_total", phase="decode") == decoded > 0


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
    ({"prompt": ["a", ""]}, 400, "prompt.1"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": [10**9]}, 400, None),
    ({"prompt": [[2, 5], []]}, 400, "prompt.1"),
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
        client.post(
            "/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"}
        ),
        400,
    )
    assert "JSON" in error["message"]
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)
    text = client.get("/metrics").text
    assert (
        metric(
            text,
            "equarx_request_errors_total",
            endpoint="/v1/completions",
            type="invalid_request_error",
        )
        >= 1
    )
    assert client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}).status_code == 200


def test_generation_failure_is_500_and_server_recovers(client, generator):
    generator.runner.fail_next = RuntimeError("device on fire")
    error = assert_error(client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}), 500)
    # The cause goes to the log, never to the client; the client gets the request id.
    assert "device on fire" not in error["message"] and error["type"] == "server_error"
    assert re.search(r"request cmpl-\w+", error["message"]), error
    assert client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}).status_code == 200
    assert client.get("/health").status_code == 200


# -- scheduling ----------------------------------------------------------------------------------
def _post_in_thread(client, results: list, body: dict) -> threading.Thread:
    thread = threading.Thread(
        target=lambda: results.append(client.post("/v1/completions", json=body))
    )
    thread.start()
    return thread


def test_requests_waiting_for_a_held_step_are_prefilled_together(engine):
    generator = gated_generator(engine)
    runner = generator.runner
    app = create_app(generator, model_name=MODEL, max_prompt_tokens=MAX_PROMPT)
    with TestClient(app) as client:
        worker = app.state.worker
        runner.open.clear()
        runner.entered.clear()
        results: list = []
        threads = [_post_in_thread(client, results, {"prompt": PROMPT, **GREEDY})]
        wait_until(runner.entered.is_set)  # the worker holds the first request's prefill
        threads += [
            _post_in_thread(client, results, {"prompt": f"{PROMPT} {i}", **GREEDY})
            for i in range(3)
        ]
        wait_until(lambda: worker.queue_depth == 3)
        runner.open.set()
        for t in threads:
            t.join(60)
        assert [r.status_code for r in results] == [200] * 4
        # The three that waited took the three free slots in one prefill step.
        assert [len(set(s.slots) - {s.cache_rows}) for s, _ in runner.prefills()] == [1, 3]
        text = client.get("/metrics").text
        assert (
            metric(text, "equarx_batch_size_bucket", le="3.0")
            - metric(text, "equarx_batch_size_bucket", le="2.0")
            == 1
        )


def test_request_sent_while_another_decodes_joins_its_batch(engine):
    """max_batch 2, one long request decoding: a short one sent meanwhile is prefilled into the
    free slot between two of the long one's decode steps, both then decode in the same steps,
    and the short one finishes while the long one still decodes."""
    generator = gated_generator(engine, max_batch=2)
    runner = generator.runner
    app = create_app(generator, model_name=MODEL, max_batch=2, max_prompt_tokens=MAX_PROMPT)
    with TestClient(app) as client:
        runner.hold_at = 3  # the long request's prefill and 2 decode steps, then wait
        long = {"prompt": PROMPT, "max_tokens": 100, "temperature": 0.0, "stream": True}
        with client.stream("POST", "/v1/completions", json=long) as stream:
            wait_until(runner.entered.is_set)
            results: list = []
            short = _post_in_thread(
                client, results, {"prompt": "joining", "max_tokens": 4, "temperature": 0.0}
            )
            wait_until(lambda: app.state.worker.queue_depth == 1)
            runner.open.set()
            short.join(60)
            assert results[0].status_code == 200, results[0].text
            events = sse_events("\n\n".join(line for line in stream.iter_lines() if line))
        assert events[-1] == "[DONE]"
        text = client.get("/metrics").text
    model_steps = [s for s, _ in runner.steps if isinstance(s, PrefillStep | DecodeStep)]
    prefills = [i for i, s in enumerate(model_steps) if isinstance(s, PrefillStep)]
    # Held before step 3 (a decode already decided), then the short one's prefill.
    assert prefills == [0, 4]
    decodes = [s for s, _ in runner.decodes()]
    both = [i for i, s in enumerate(decodes) if all(s.lengths)]  # both slots decoding
    assert 1 <= len(both) <= 4
    # The short one finished first: the long one decoded alone after it (from the recorded
    # steps, not from which answer arrived first).
    assert any(s.lengths[0] and not s.lengths[1] for s in decodes[both[-1] + 1 :])
    assert metric(text, "equarx_requests_finished_total", finish_reason="length") >= 1
    assert metric(text, "equarx_requests_in_flight") == 0


def test_full_queue_answers_503_at_once(engine):
    generator = gated_generator(engine)
    runner = generator.runner
    app = create_app(generator, model_name=MODEL, max_queue=1, max_prompt_tokens=MAX_PROMPT)
    with TestClient(app) as client:
        runner.open.clear()
        runner.entered.clear()
        results: list = []
        threads = [_post_in_thread(client, results, {"prompt": PROMPT, **GREEDY})]
        wait_until(runner.entered.is_set)
        # The engine has free slots, but the worker is inside a step: this one waits queued.
        threads.append(_post_in_thread(client, results, {"prompt": PROMPT, **GREEDY}))
        wait_until(lambda: app.state.worker.queue_depth == 1)
        r = client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY})
        error = assert_error(r, 503)  # answered while the step is still held
        assert error["code"] == "queue_full" and r.headers["retry-after"] == "1"
        assert not runner.open.is_set()
        runner.open.set()
        for t in threads:
            t.join(60)
        assert [r.status_code for r in results] == [200, 200]


def test_draining_refuses_new_requests(engine):
    app = create_app(gated_generator(engine), model_name=MODEL, max_prompt_tokens=MAX_PROMPT)
    with TestClient(app) as client:
        assert client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}).status_code == 200
        app.state.worker.drain()
        error = assert_error(client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}), 503)
        assert error["code"] == "shutting_down"
        assert client.get("/health").json() == {"status": "draining"}


def test_engine_failure_answers_503_and_health_says_why(engine):
    """`fail` (what a lost follower process triggers) answers every request at once, even
    while the worker is stuck inside a step, and refuses new ones."""
    generator = gated_generator(engine)
    runner = generator.runner
    failures: list[str] = []
    app = create_app(
        generator, model_name=MODEL, max_prompt_tokens=MAX_PROMPT, on_failure=failures.append
    )
    with TestClient(app) as client:
        runner.open.clear()
        runner.entered.clear()
        results: list = []
        thread = _post_in_thread(client, results, {"prompt": PROMPT, **GREEDY})
        wait_until(runner.entered.is_set)  # stuck inside a step
        app.state.worker.fail("process 1 exited")
        thread.join(60)
        error = assert_error(results[0], 503)
        assert error["code"] == "engine_unavailable" and "process 1 exited" in error["message"]
        error = assert_error(client.post("/v1/completions", json={"prompt": PROMPT}), 503)
        assert error["code"] == "engine_unavailable"
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "failed", "reason": "process 1 exited"}
        assert failures == ["process 1 exited"]
        runner.open.set()


def test_client_disconnect_frees_its_slot(engine):
    import uvicorn

    generator = gated_generator(engine)
    runner = generator.runner
    app = create_app(generator, model_name=MODEL, max_queue=4, max_prompt_tokens=MAX_PROMPT)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        wait_until(lambda: server.started)
        runner.hold_at = 3  # the request's prefill and 2 decode steps, then it waits
        body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0.0, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            assert r.status_code == 200
            wait_until(runner.entered.is_set)
        # The client is gone; the server notices and cancels it in the engine.
        url = f"http://127.0.0.1:{port}/metrics"

        def cancelled() -> float:
            text = httpx.get(url).text
            return metric(text, "equarx_requests_finished_total", finish_reason="cancelled")

        wait_until(lambda: cancelled() == 1)
        runner.open.set()
        wait_until(lambda: not app.state.worker.engine.has_unfinished)
        assert len(runner.decodes()) <= 3
        assert metric(httpx.get(url).text, "equarx_requests_in_flight") == 0
    finally:
        runner.open.set()
        server.should_exit = True
        thread.join(30)


# -- the command ---------------------------------------------------------------------------------
def test_serve_command_end_to_end_and_sigterm():
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "equarx_serve",
            "serve",
            "--model",
            MODEL,
            "--tp",
            "2",
            "--port",
            str(port),
            "--max-length",
            "512",
            "--log-level",
            "warning",
            "--drain-seconds",
            "1",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, [process], timeout_s=120)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, **GREEDY}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert "equarx_model_info" in httpx.get(f"{url}/metrics").text
        # SIGTERM while a long stream runs: it still finishes, then the process exits 0.
        body = {
            "prompt": PROMPT,
            "max_tokens": 400,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
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
