"""Issue 31: the second adversarial round. Each finding is reproduced over HTTP against a real
uvicorn server on loopback (in this process, so that a test can hold the device steps; a
`equarx-serve serve` process for signals): client aborts counted as server errors, readers
that stop reading and hold their slots, one request taking the whole queue, a second Ctrl-C
cutting the drain, request heads that were never limited, the connection limit's plain-text
503, and the smaller ones."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from _serving import (
    assert_error,
    gated_generator,
    metric,
    serving,
    sse_events,
    wait_healthy,
    wait_until,
)

from equarx_serve.distributed.multiprocess import free_port
from equarx_serve.generation.prefill import PrefillEngine
from equarx_serve.server import create_app
from equarx_serve.server.settings import HTTPSettings

MODEL = "tiny"
MAX_LENGTH = 512
MAX_BATCH = 4
MAX_QUEUE = 64  # the per-request prompt limit too
PROMPT = "hello the world"
WRITE_TIMEOUT_S = 1.0
WAIT_S = 60.0
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def engine() -> PrefillEngine:
    return PrefillEngine.from_name(MODEL, 2, "equarx-int8", max_length=MAX_LENGTH)


class Live:
    def __init__(self, url: str, app, runner):
        self.url, self.app, self.runner = url, app, runner
        self.worker = app.state.worker
        self.port = int(url.rsplit(":", 1)[1])

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics").text

    def errors(self, kind: str) -> float:
        return sum(
            metric(self.metrics(), "equarx_request_errors_total", 0.0, endpoint=e, type=kind)
            for e in ("/v1/completions", "/health", "other")
        )


@pytest.fixture(scope="module")
def live(engine) -> Iterator[Live]:
    generator = gated_generator(engine, max_batch=MAX_BATCH)
    settings = HTTPSettings(write_timeout_s=WRITE_TIMEOUT_S, send_buffer_bytes=4096)
    app = create_app(
        generator, model_name=MODEL, max_queue=MAX_QUEUE, max_batch=MAX_BATCH, http=settings
    )
    with serving(app, settings) as url:
        yield Live(url, app, generator.runner)
        generator.runner.open.set()


@pytest.fixture
def logged_errors(caplog) -> Iterator[list[logging.LogRecord]]:
    """ERROR records of this server and of uvicorn (whose loggers do not propagate)."""
    uvicorn_logger = logging.getLogger("uvicorn")
    uvicorn_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO):
            yield caplog.records
    finally:
        uvicorn_logger.removeHandler(caplog.handler)


def request_on_socket(port: int, body: dict, path: str = "/v1/completions") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def post(live: Live, body: dict) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/completions", json=body, timeout=WAIT_S)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of the one response a server sends before it closes."""
    sock.settimeout(WAIT_S)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ")[1]), headers, body


# -- 1: a client that leaves is not a server error ---------------------------------------------
def test_a_storm_of_aborted_requests_leaves_no_server_error(live, logged_errors):
    """Was: every non-streamed client disconnect logged `InvalidStateError: Result is not set`
    and counted a server_error (`collect.cancel()` only asks the task to stop)."""
    finished = "equarx_requests_finished_total"
    before = metric(live.metrics(), finished, 0.0, finish_reason="cancelled")
    for _ in range(10):
        live.runner.entered.clear()
        live.runner.open.clear()  # the request's first step waits at the gate
        sock = request_on_socket(live.port, {"prompt": PROMPT, "max_tokens": 200})
        wait_until(live.runner.entered.is_set)
        sock.close()
        count = before + 1
        wait_until(lambda c=count: metric(live.metrics(), finished, finish_reason="cancelled") >= c)
        before += 1
        live.runner.open.set()
    wait_until(lambda: not live.worker.engine.has_unfinished)
    assert live.errors("server_error") == 0
    assert metric(live.metrics(), "equarx_requests_in_flight") == 0
    assert [r.getMessage() for r in logged_errors if r.levelno >= logging.ERROR] == []


# -- 2: a reader that stops reading is disconnected --------------------------------------------
def test_a_stalled_reader_is_reset_within_the_write_deadline(live):
    """Was: a stream whose client stopped reading held its connection, its slot and the
    gauges for as long as the client kept the socket (90 s tried)."""
    before = live.errors("write_timeout")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", live.port))
    body = json.dumps(
        {"prompt": [PROMPT] * 4, "max_tokens": 400, "stream": True, "temperature": 0}
    ).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_until(lambda: live.errors("write_timeout") == before + 1, timeout_s=WAIT_S)
    wait_until(lambda: metric(live.metrics(), "equarx_requests_in_flight") == 0)
    wait_until(lambda: not live.worker.engine.has_unfinished)
    sock.settimeout(WAIT_S)
    with pytest.raises(ConnectionResetError):
        while sock.recv(65536):
            pass
    sock.close()


def test_a_slow_reader_that_keeps_reading_is_not_cut(live):
    """The deadline is for taking no bytes at all: a client that reads a little at a time,
    each read within the deadline, gets its whole stream."""
    before = live.errors("write_timeout")
    body = {"prompt": [PROMPT] * 4, "max_tokens": 300, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=WAIT_S) as r:
        lines = []
        for i, line in enumerate(r.iter_lines()):
            if i % 200 == 0:
                time.sleep(WRITE_TIMEOUT_S / 2)
            if line:
                lines.append(line)
    assert sse_events("\n\n".join(lines))[-1] == "[DONE]"
    assert live.errors("write_timeout") == before


# -- 3: one request cannot take the whole queue ------------------------------------------------
def test_a_request_of_many_prompts_takes_one_place_and_takes_turns(live):
    """Was: 64 prompts took 64 places (every other client got 503 queue_full at once) and all
    ran before the next request's first."""
    live.runner.entered.clear()
    live.runner.open.clear()
    many = {"prompt": ["a b c"] * 64, "max_tokens": 8, "temperature": 0}
    result: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: result.append(
            httpx.post(f"{live.url}/v1/completions", json=many, timeout=WAIT_S)
        )
    )
    thread.start()
    wait_until(live.runner.entered.is_set)  # its first batch waits at the gate
    short = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    answers: list[httpx.Response] = []
    other = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{live.url}/v1/completions", json=short, timeout=WAIT_S)
        )
    )
    other.start()
    wait_until(lambda: live.worker.queue_depth == 64 - MAX_BATCH + 1)  # both queued
    live.runner.open.set()
    other.join(WAIT_S)
    assert answers and answers[0].status_code == 200, answers
    assert thread.is_alive() or len(result[0].json()["choices"]) == 64  # answered first
    thread.join(WAIT_S)
    assert result[0].status_code == 200 and len(result[0].json()["choices"]) == 64


# -- 5: the request head is limited whatever the pieces ----------------------------------------
@pytest.mark.parametrize(
    "headers",
    [
        [f"X-Big: {'a' * 100_000}"],
        [f"X-H{i}: v" for i in range(2000)],
        [f"X-Big: {'a' * 200_000}"],
    ],
    ids=["one-100kB-header", "2000-headers", "200kB"],
)
def test_a_head_over_the_limits_sent_in_one_write_is_refused(live, headers):
    """Was: a head sent in one write was never limited (h11 bounds only one in pieces): one
    100,000-byte header or 2,000 headers got 200."""
    before = live.errors("request_header_too_large")
    sock = socket.create_connection(("127.0.0.1", live.port))
    head = "\r\n".join(["GET /health HTTP/1.1", "Host: 127.0.0.1", *headers]) + "\r\n\r\n"
    sock.sendall(head.encode())
    status, response_headers, body = read_response(sock)
    sock.close()
    assert status == 431
    assert response_headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "header_too_large"
    assert live.errors("request_header_too_large") == before + 1


def test_a_head_within_the_limits_in_many_pieces_is_served(live):
    sock = socket.create_connection(("127.0.0.1", live.port))
    head = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "X-A: b\r\n" * 90 + "Connection: close"
    for i in range(0, len(head), 7):
        sock.sendall(head[i : i + 7].encode())
    sock.sendall(b"\r\n\r\n")
    status, _, body = read_response(sock)
    sock.close()
    assert (status, json.loads(body)) == (200, {"status": "ok"})


# -- 6: past the connection limit: our JSON, Retry-After, a counter, /health answers ------------
def test_the_connection_limit_answers_in_json_and_health_still_answers(engine):
    settings = HTTPSettings(max_connections=4)
    app = create_app(gated_generator(engine), model_name=MODEL, http=settings)
    with serving(app, settings) as url:
        port = int(url.rsplit(":", 1)[1])
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        time.sleep(0.2)  # the server has accepted them
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert assert_error(refused, 503)["code"] == "server_busy"
        assert refused.headers["retry-after"] == "1"
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        count = metric(
            httpx.get(f"{url}/metrics").text,
            "equarx_request_errors_total",
            endpoint="/v1/completions",
            type="connection_limit",
        )
        assert count == 1
        for sock in held:
            sock.close()
        wait_until(
            lambda: (
                httpx.post(
                    f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}
                ).status_code
                == 200
            )
        )


# -- 7: the smaller ones -----------------------------------------------------------------------
def test_a_token_id_outside_the_vocabulary_names_the_prompt(live):
    """Was: 400 with param null."""
    error = assert_error(post(live, {"prompt": [1, 10**9], "max_tokens": 1}), 400, "prompt")
    assert error["code"] == "invalid_token_id"
    long = {"prompt": PROMPT, "max_tokens": 10 * MAX_LENGTH}
    assert assert_error(post(live, long), 400, "max_tokens")["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
    ],
)
def test_tool_choice_and_continuous_usage_are_refused_like_tools(live, extra, param):
    """Was: ignored silently while `tools` was refused."""
    assert_error(post(live, {"prompt": PROMPT, "max_tokens": 1} | extra), 400, param)
    no_op = {"prompt": PROMPT, "max_tokens": 1, "tool_choice": "none"}
    assert post(live, no_op).status_code == 200


@pytest.mark.parametrize(
    "headers, body, status, code",
    [
        ({"Content-Type": "text/plain"}, b'{"prompt": "a"}', 415, "unsupported_media_type"),
        (
            JSON | {"Content-Encoding": "gzip"},
            b"\x1f\x8b\x08\x00",
            415,
            "unsupported_media_type",
        ),
        (JSON, b'{"prompt": "\xff\xfe"}', 400, "invalid_json"),
        (JSON, b"[" * 100_000, 400, "invalid_json"),
        (
            {"Content-Type": "application/json"},
            b'{"seed": ' + b"9" * 5000 + b"}",
            400,
            "invalid_json",
        ),
    ],
    ids=["text-plain", "gzip", "invalid-utf8", "deep-nesting", "5000-digits"],
)
def test_bodies_that_are_not_plain_json_get_a_clear_code(live, headers, body, status, code):
    """Was: a wrong Content-Type came back as `model_attributes_type` quoting the body's
    bytes, undecodable bodies with `code: null`."""
    response = httpx.post(
        f"{live.url}/v1/completions", content=body, headers=headers, timeout=WAIT_S
    )
    error = assert_error(response, status)
    assert error["code"] == code
    assert "b'" not in error["message"]


def test_head_health_answers_like_get(live):
    """Was: 405 (load balancers probe with HEAD)."""
    response = httpx.head(f"{live.url}/health")
    assert response.status_code == 200 and response.content == b""


# -- 4: a second signal during the drain stays graceful -----------------------------------------
@pytest.mark.parametrize(
    "second", [signal.SIGINT, signal.SIGTERM], ids=["sigint-sigint", "sigint-sigterm"]
)
def test_a_second_signal_during_the_drain_closes_the_listener_and_stays_graceful(second):
    """Was: SIGINT then SIGINT: when the drain timer fired it called uvicorn's SIGINT handler
    a second time, a forced exit: streams ended with no error event and no [DONE], the
    non-streamed request got a plain-text 500. Now the second signal closes the listener at
    once; running requests go on until the grace period and end with a JSON 503 (streams: an
    error event, then [DONE]); the process exits 0."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    command = [sys.executable, "-m", "equarx_serve", "serve", "--model", MODEL, "--tp", "2"]
    # The requests must outlast drain + grace (3 s): 4000 tokens take ~30 s on the tiny model.
    command += ["--port", str(port), "--max-length", "4096", "--log-level", "warning"]
    command += ["--drain-seconds", "2", "--graceful-timeout", "3"]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, [process], timeout_s=120)
        long = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0.0}
        plain: list[httpx.Response] = []
        thread = threading.Thread(
            target=lambda: plain.append(
                httpx.post(f"{url}/v1/completions", json=long, timeout=WAIT_S)
            )
        )
        thread.start()
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=long | {"stream": True}, timeout=WAIT_S
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(signal.SIGINT)
            time.sleep(0.5)
            process.send_signal(second)
            wait_until(lambda: _refused(port), timeout_s=10)  # the listener closed at once
            events = sse_events("\n\n".join(line for line in lines if line))
        assert events[-1] == "[DONE]"
        assert events[-2].get("error", {}).get("code") == "shutting_down", events[-2]
        thread.join(WAIT_S)
        assert assert_error(plain[0], 503)["code"] == "shutting_down"
        output, _ = process.communicate(timeout=60)
        assert process.returncode == 0, output
        assert "Traceback" not in output and "CancelledError" not in output, output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False
