"""Helpers for the server tests: a runner whose steps a test can hold, server-sent events,
Prometheus samples, error answers, and starting `equarx-serve serve` processes."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx

from equarx_serve.distributed.multiprocess import free_port
from equarx_serve.generation.generator import Generator
from equarx_serve.generation.prefill import PrefillEngine
from equarx_serve.generation.runner import DeviceRunner
from equarx_serve.generation.steps import DecodeStep, PrefillStep
from equarx_serve.server.http import uvicorn_config
from equarx_serve.server.settings import HTTPSettings


def wait_healthy(url: str, processes: list[subprocess.Popen], timeout_s: float) -> None:
    """Waits until `url`/health answers 200; fails if a process exits first or it takes
    longer than `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        for p in processes:
            assert p.poll() is None, f"a process exited with {p.returncode} while starting"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


class GatedRunner:
    """A DeviceRunner whose model steps can be held at a gate (`open` cleared, or `hold_at`:
    the gate closes before that many model steps have run): a step waits there, and `entered`
    is set. It can fail once (`fail_next`), and records every step and its output."""

    def __init__(self, inner: DeviceRunner):
        self.inner = inner
        self.engine = inner.engine
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.hold_at: int | None = None
        self.fail_next: Exception | None = None
        self.steps: list = []  # (step, output)

    def run(self, step):
        if isinstance(step, PrefillStep | DecodeStep):
            if self.hold_at is not None and len(self.prefills() + self.decodes()) >= self.hold_at:
                self.hold_at = None
                self.open.clear()
            if not self.open.is_set():
                self.entered.set()
            assert self.open.wait(60), "the test never opened the gate"
            if self.fail_next is not None:
                error, self.fail_next = self.fail_next, None
                raise error
        output = self.inner.run(step)
        self.steps.append((step, output))
        return output

    def prefills(self) -> list:
        return [(s, o) for s, o in self.steps if isinstance(s, PrefillStep)]

    def decodes(self) -> list:
        return [(s, o) for s, o in self.steps if isinstance(s, DecodeStep)]


def gated_generator(engine: PrefillEngine, max_batch: int = 4) -> Generator:
    """A generator with a runner of its own (one engine at a time may use a runner)."""
    return Generator(engine, max_batch=max_batch, runner=GatedRunner(DeviceRunner(engine)))


def sse_events(text: str) -> list:
    """The `data:` payloads of a server-sent event stream (JSON decoded, "[DONE]" kept)."""
    events = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric(text: str, name: str, default: float | None = None, **labels: str) -> float:
    """The value of one sample in Prometheus text (`default` if it is not there)."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        if sample.split("{")[0] != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', sample))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(value)
    if default is None:
        raise KeyError(f"{name}{labels} not in the metrics")
    return default


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def wait_until(condition, timeout_s: float = 60.0) -> None:
    """Waits until `condition()` holds (another thread or process makes it so), checking every
    10 ms; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@contextlib.contextmanager
def serving(app, settings: HTTPSettings) -> Iterator[str]:
    """`app` under uvicorn with `settings` (as `equarx-serve serve` runs it), on loopback."""
    import uvicorn

    config = uvicorn_config(app, settings, host="127.0.0.1", port=free_port(), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive())
        assert server.started, "the server did not start"
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(30)
