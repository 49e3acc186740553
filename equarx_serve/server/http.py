"""What an operator sets around the HTTP server, with safe defaults (`HTTPSettings`).

- A request body limit (413) and a deadline for receiving the body (408), both checked before
  the body is parsed; uvicorn's h11 limits a request head to 16 KiB (400).
- A deadline for each request head (the request line and headers): a client that connects and
  sends half a head is disconnected (uvicorn itself has no such timeout); idle keep-alive
  connections close after `keep_alive_s` (uvicorn's).
- A connection limit (uvicorn's `limit_concurrency`: past it, requests get 503).
- An optional API key: requests to /v1/* need `Authorization: Bearer <key>` (401).
- A Host allow-list (400 for any other Host header): a server on loopback answers only to
  loopback names, so a web page whose DNS name is re-pointed at 127.0.0.1 (DNS rebinding)
  cannot make a browser call it. A server on another address accepts any Host by default:
  put it behind a proxy that checks Host, or give `--allowed-hosts` and `--api-key`.
- A drain window on SIGTERM/SIGINT (`drain_on_signal`): /health answers 503 and new requests a
  JSON 503 while the listener stays open for `drain_s` (so a load balancer sees the replica
  leave), then it closes; requests still running `graceful_timeout_s` after the signal end
  with a 503 (streams: an error event, then `[DONE]`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from equarx_serve.server.protocol import APIError
from equarx_serve.server.settings import LOOPBACK_HOSTS, HTTPSettings

__all__ = ["LOOPBACK_HOSTS", "HTTPSettings", "add_http_guards", "drain_on_signal", "uvicorn_config"]

logger = logging.getLogger("equarx_serve.server")

GRACE_MARGIN_S = 5.0  # uvicorn's own shutdown timeout, after ours, as a backstop
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _error(status: int, message: str, code: str, headers: dict | None = None) -> JSONResponse:
    body = APIError(status, message, code=code).body()
    return JSONResponse(body, status_code=status, headers=headers)


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def _host_name(host: str) -> str:
    """The host of a Host header, without its port ("[::1]:8000" -> "::1")."""
    if host.startswith("["):
        return host[1 : host.find("]")].lower()
    return host.rsplit(":", 1)[0].lower() if host.count(":") == 1 else host.lower()


class _Guard:
    """An ASGI middleware that answers some HTTP requests itself (`check`: a response or None)."""

    def __init__(self, app: Any, check: Callable[[dict], JSONResponse | None]):
        self.app = app
        self.check = check

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        refusal = self.check(scope) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            await refusal(scope, receive, send)


def _host_check(allowed: tuple[str, ...]) -> Callable[[dict], JSONResponse | None]:
    names = {name.lower().strip("[]") for name in allowed}

    def check(scope: dict) -> JSONResponse | None:
        host = _header(scope, b"host")
        if host is not None and _host_name(host) in names:
            return None
        return _error(400, f"Host {host!r} is not served here", "invalid_host")

    return check


def _api_key_check(key: str) -> Callable[[dict], JSONResponse | None]:
    expected = f"Bearer {key}".encode()

    def check(scope: dict) -> JSONResponse | None:
        if not scope["path"].startswith("/v1/"):
            return None
        given = (_header(scope, b"authorization") or "").encode("latin-1")
        if secrets.compare_digest(given, expected):
            return None
        message = "a valid API key is required: Authorization: Bearer <key>"
        return _error(401, message, "invalid_api_key", {"WWW-Authenticate": "Bearer"})

    return check


class _BoundedBody:
    """ASGI middleware: reads a request's whole body before the app sees it, refusing one over
    `limit` bytes (413, from Content-Length at once, else as it arrives) or not received
    within `timeout_s` (408); the app then reads the body from memory."""

    def __init__(self, app: Any, limit: int, timeout_s: float):
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.limit:
                        await self._too_large(scope, receive, send)
                        return
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            message = f"the request body did not arrive within {self.timeout_s:g} s"
            await _error(408, message, "request_timeout")(scope, receive, send)
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # e.g. http.disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope: dict, receive: Any, send: Any) -> None:
        message = f"the request body is larger than this server's limit of {self.limit} bytes"
        await _error(413, message, "request_too_large")(scope, receive, send)


def add_http_guards(app: Any, settings: HTTPSettings) -> None:
    """The body limit and deadline, the API key and the Host allow-list, as middleware (the
    Host is checked first)."""
    app.add_middleware(
        _BoundedBody, limit=settings.max_body_bytes, timeout_s=settings.body_timeout_s
    )
    if settings.api_key is not None:
        app.add_middleware(_Guard, check=_api_key_check(settings.api_key))
    if settings.allowed_hosts:
        app.add_middleware(_Guard, check=_host_check(settings.allowed_hosts))


def _protocol_with_head_deadline(timeout_s: float) -> type:
    """uvicorn's h11 protocol, plus a deadline for each request head (see the module doc)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadlineH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _head_cycle: Any = None  # the cycle (request) before the awaited head

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_response_complete(self) -> None:
            self._arm_head_deadline()  # for the next request on this connection
            super().on_response_complete()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not self._head_cycle:  # a complete head arrived
                self._disarm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_deadline()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            self._disarm_head_deadline()
            self._head_cycle = self.cycle
            self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)

        def _disarm_head_deadline(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            if not self.transport.is_closing():
                logger.info(
                    "%s: no complete request head within %g s; closed", self.client, timeout_s
                )
                self.transport.close()

    return HeadDeadlineH11Protocol


def uvicorn_config(app: Any, settings: HTTPSettings, **options: Any) -> Any:
    """A `uvicorn.Config` for `app` with the settings' connection limits and timeouts
    (`options`: host, port, log_level, ...)."""
    import uvicorn

    return uvicorn.Config(
        app,
        http=_protocol_with_head_deadline(settings.header_timeout_s),
        limit_concurrency=settings.max_connections,
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=max(settings.graceful_timeout_s - settings.drain_s, 0)
        + GRACE_MARGIN_S,
        **options,
    )


def drain_on_signal(server: Any, worker: Any, settings: HTTPSettings, shutting_down: str) -> None:
    """Make a `uvicorn.Server`'s SIGTERM/SIGINT drain first (see the module doc); a second
    signal closes the listener at once. `shutting_down`: the message of the requests ended
    when the grace period is over."""
    handle_exit = server.handle_exit

    def later(delay_s: float, action: Callable, *args: Any) -> None:
        timer = threading.Timer(delay_s, action, args=args)
        timer.daemon = True
        timer.start()

    def drain_then_exit(sig: int, frame: Any) -> None:
        if worker.draining:
            handle_exit(sig, frame)
            return
        logger.info(
            "signal %d: draining for %g s, then closing; running requests end in %g s",
            sig,
            settings.drain_s,
            settings.graceful_timeout_s,
        )
        worker.drain()
        later(settings.drain_s, handle_exit, sig, None)
        later(settings.graceful_timeout_s, worker.end_all, shutting_down)

    server.handle_exit = drain_then_exit
