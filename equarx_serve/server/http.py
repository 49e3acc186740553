"""What an operator sets around the HTTP server, with safe defaults (`HTTPSettings`).

- A request body limit (413) and a deadline for receiving the body (408), both checked before
  the body is parsed; an API body must be uncompressed JSON (415 otherwise, 400
  `invalid_json` for one that does not decode).
- A request head limit (`max_head_bytes`, `max_headers`: 431 in JSON, then the connection
  closes), counted as the bytes arrive whatever the pieces they come in (h11's own limit only
  bounds a head that arrives in pieces), and a deadline for each request head (the request
  line and headers): a client that connects and sends half a head is disconnected (uvicorn
  itself has no such timeout); idle keep-alive connections close after `keep_alive_s`.
- A write deadline: a client that takes none of a response's bytes for `write_timeout_s`
  while the server waits on it (writing paused on a full buffer, or a finished response
  still buffered) is reset, which cancels its request and frees its slot, like a client that
  leaves; each socket's kernel send buffer is bounded (`send_buffer_bytes`) so that a stalled
  reader is seen soon and holds little memory.
- A connection limit: past `max_connections` open connections (or running requests), requests
  get our JSON 503 with `Retry-After` (counted), except /health and /metrics, which still
  answer. A proxy in front should limit connections per client, so one client cannot take
  them all.
- An optional API key: requests to /v1/* need `Authorization: Bearer <key>` (401).
- A Host allow-list (400 for any other Host header): a server on loopback answers only to
  loopback names, so a web page whose DNS name is re-pointed at 127.0.0.1 (DNS rebinding)
  cannot make a browser call it. A server on another address accepts any Host by default:
  put it behind a proxy that checks Host, or give `--allowed-hosts` and `--api-key`.
- A drain window on SIGTERM/SIGINT (`drain_on_signal`): /health answers 503 and new requests a
  JSON 503 while the listener stays open for `drain_s` (so a load balancer sees the replica
  leave), then it closes; requests still running `graceful_timeout_s` after the signal end
  with a 503 (streams: an error event, then `[DONE]`). A second signal closes the listener at
  once and the drain goes on; a third exits at once.

Refusals and deadlines past the app are counted in `equarx_request_errors` through the app's
`count_error(path, type)` (`app.state.count_error`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import h11
from fastapi.responses import JSONResponse

from equarx_serve.server.protocol import APIError
from equarx_serve.server.settings import LOOPBACK_HOSTS, HTTPSettings

__all__ = ["LOOPBACK_HOSTS", "HTTPSettings", "add_http_guards", "drain_on_signal", "uvicorn_config"]

logger = logging.getLogger("equarx_serve.server")

LINGERING_CLOSE_S = 2.0  # how long a refused client may go on sending before the close
GRACE_MARGIN_S = 5.0  # uvicorn's own shutdown timeout, after ours, as a backstop
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
MONITORING_PATHS = frozenset({"/health", "/metrics"})

ErrorCounter = Callable[[str, str], None]  # (request path, error type)


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
        if (refusal := _json_body_problem(scope, body)) is not None:
            await refusal(scope, receive, send)
            return
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


def _json_body_problem(scope: dict, body: bytes) -> JSONResponse | None:
    """For the API's POSTs (/v1/*): a 415 for a body that is not plain JSON by its headers
    (FastAPI would report such a body as a wrong type, quoting its bytes), a 400
    `invalid_json` for one that does not decode (invalid UTF-8, deep nesting, an integer of
    thousands of digits: errors FastAPI answers with no code)."""
    if not scope["path"].startswith("/v1/"):
        return None
    encoding = (_header(scope, b"content-encoding") or "identity").strip().lower()
    if encoding != "identity":
        message = f"Content-Encoding {encoding!r} is not supported: send the body uncompressed"
        return _error(415, message, "unsupported_media_type")
    content_type = _header(scope, b"content-type")
    media_type = (content_type or "application/json").split(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        message = f"Content-Type must be application/json, got {content_type!r}"
        return _error(415, message, "unsupported_media_type")
    try:
        json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        detail = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        return _error(400, f"the body is not valid JSON: {detail}", "invalid_json")
    return None


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


def _refusal_bytes(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response in this server's JSON error shape that closes the
    connection, for refusals made before a request reaches the app."""
    body = json.dumps(APIError(status, message, code=code).body()).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class HeadMeter:
    """Measures a request head as its bytes arrive, whatever the pieces: its size up to the
    blank line that ends it and its number of lines (h11 bounds only a head that arrives in
    pieces, so one sent in a single write was never limited)."""

    def __init__(self) -> None:
        self.size = 0
        self.lines = 0
        self._tail = b""  # the last bytes seen, for an end or a line break split across pieces

    def feed(self, data: bytes) -> tuple[int, int]:
        """Counts `data`: the head's (size, lines) so far, or in all once it is complete
        (the meter then starts over for the next head)."""
        seen = self._tail + data
        end = seen.find(b"\r\n\r\n")
        part = seen if end < 0 else seen[: end + 2]
        lines = self.lines + part.count(b"\r\n") - self._tail.count(b"\r\n")
        size = self.size + (len(seen) if end < 0 else end + 4) - len(self._tail)
        if end >= 0:
            self.size, self.lines, self._tail = 0, 0, b""
        else:
            self.size, self.lines, self._tail = size, lines, seen[-3:]
        return size, lines


class _ConnectionGuards:
    """The connection-level limits of the module doc, mixed into uvicorn's h11 protocol
    (`_guarded_protocol`): the head's deadline and size, the write deadline, and the
    connection limit in JSON."""

    settings: HTTPSettings
    count_error: ErrorCounter
    _head_timer: asyncio.TimerHandle | None = None
    _head_cycle: Any = None  # the cycle (request) before the awaited head
    _write_timer: asyncio.TimerHandle | None = None
    _write_left = 0  # bytes buffered when the write deadline was (re)armed
    _lost = False
    _refused = False  # answered 431: what else arrives is dropped

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None  # ours answers in JSON (`_limited`)
        self._app = self.app
        self.app = self._limited
        self._head = HeadMeter()

    def connection_made(self, transport: Any) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:  # bounds what the kernel holds for a client that stops reading
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.settings.send_buffer_bytes)
        super().connection_made(transport)
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._disarm_head_deadline()
        if self._write_timer is not None:
            self._write_timer.cancel()
        super().connection_lost(exc)

    # -- the request head: a deadline and a size -------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and not self._head_within_limits(data):
            return
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not self._head_cycle:  # a complete head arrived
            self._disarm_head_deadline()

    def on_response_complete(self) -> None:
        self._arm_head_deadline()  # for the next request on this connection
        super().on_response_complete()
        if self.transport.get_write_buffer_size():
            self._watch_writes()

    def _head_within_limits(self, data: bytes) -> bool:
        if self._refused:
            return False  # the rest of what this client sends is read and dropped
        size, lines = self._head.feed(data)
        if size <= self.settings.max_head_bytes and lines <= self.settings.max_headers + 1:
            return True
        self.count_error("other", "request_header_too_large")
        logger.info("%s: a request head over the limits; refused", self.client)
        message = (
            f"the request head is larger than this server's limit of "
            f"{self.settings.max_head_bytes} bytes and {self.settings.max_headers} header lines"
        )
        self.transport.write(
            _refusal_bytes(431, "Request Header Fields Too Large", message, "header_too_large")
        )
        self._close_after_answer()
        return False

    def _close_after_answer(self) -> None:
        """Sends the answer and a FIN, then reads and drops what the client still sends
        for a while before closing: closing with unread bytes would reset the connection,
        and the client could lose the answer (nginx's lingering close)."""
        self._refused = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGERING_CLOSE_S, self.transport.close)

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_cycle = self.cycle
        self._head_timer = self.loop.call_later(
            self.settings.header_timeout_s, self._head_timed_out
        )

    def _disarm_head_deadline(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        if not self.transport.is_closing():
            logger.info(
                "%s: no complete request head within %g s; closed",
                self.client,
                self.settings.header_timeout_s,
            )
            self.transport.close()

    # -- the write deadline ------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch_writes()

    def _watch_writes(self) -> None:
        """While writing is paused, or a finished response is still buffered, the client
        must take some bytes every `write_timeout_s`."""
        if self._write_timer is None and not self._lost:
            self._write_left = self.transport.get_write_buffer_size()
            self._write_timer = self.loop.call_later(
                self.settings.write_timeout_s, self._check_writes
            )

    def _check_writes(self) -> None:
        self._write_timer = None
        if self._lost:
            return
        left = self.transport.get_write_buffer_size()
        if left == 0 and not self.flow.write_paused:
            return  # all taken: nothing to watch until writing pauses again
        if left < self._write_left:
            self._watch_writes()  # the client is reading, however slowly
            return
        path = self.cycle.scope["path"] if self.cycle is not None else "other"
        self.count_error(path, "write_timeout")
        logger.info(
            "%s: took no bytes of its response for %g s (%d buffered); disconnected",
            self.client,
            self.settings.write_timeout_s,
            left,
        )
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # a reset, not a close that waits on the unread bytes
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    # -- the connection limit ----------------------------------------------------------------

    async def _limited(self, scope: dict, receive: Any, send: Any) -> None:
        """The app, or past `max_connections` our JSON 503 (monitoring paths excepted: a
        full server must still say how it is)."""
        limit = self.settings.max_connections
        busy = len(self.connections) > limit or len(self.tasks) > limit
        if scope["type"] != "http" or not busy or scope["path"] in MONITORING_PATHS:
            await self._app(scope, receive, send)
            return
        self.count_error(scope["path"], "connection_limit")
        message = f"the server has its limit of {limit} connections open; retry later"
        refusal = _error(503, message, "server_busy", {"Retry-After": "1"})
        await refusal(scope, receive, send)


def _guarded_protocol(settings: HTTPSettings, count_error: ErrorCounter) -> type:
    """uvicorn's h11 protocol with `_ConnectionGuards` under `settings`."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    guards = {"settings": settings, "count_error": staticmethod(count_error)}
    return type("GuardedH11Protocol", (_ConnectionGuards, H11Protocol), guards)


def _error_counter(app: Any) -> ErrorCounter:
    """The app's `count_error(path, type)` (equarx_request_errors), if it has one."""
    count = getattr(app.state, "count_error", None)
    return count if count is not None else lambda path, kind: None


def uvicorn_config(app: Any, settings: HTTPSettings, **options: Any) -> Any:
    """A `uvicorn.Config` for `app` with the settings' connection limits and timeouts
    (`options`: host, port, log_level, ...)."""
    import uvicorn

    return uvicorn.Config(
        app,
        http=_guarded_protocol(settings, _error_counter(app)),
        h11_max_incomplete_event_size=settings.max_head_bytes + 1,  # ours refuses first
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=max(settings.graceful_timeout_s - settings.drain_s, 0)
        + GRACE_MARGIN_S,
        **options,
    )


def drain_on_signal(server: Any, worker: Any, settings: HTTPSettings, shutting_down: str) -> None:
    """Make a `uvicorn.Server`'s SIGTERM/SIGINT drain first (see the module doc). A second
    signal closes the listener at once and the drain goes on (uvicorn itself takes a second
    SIGINT as a forced exit that cuts streams); a third forces the exit. `shutting_down`: the
    message of the requests ended when the grace period is over."""
    handle_exit = server.handle_exit
    signals: list[int] = []
    listener_open = [True]

    def later(delay_s: float, action: Callable, *args: Any) -> None:
        timer = threading.Timer(delay_s, action, args=args)
        timer.daemon = True
        timer.start()

    def close_listener() -> None:
        """uvicorn's graceful shutdown, once: SIGTERM whatever the signal was (its handler
        would take a repeated SIGINT as a forced exit)."""
        if listener_open[0]:
            listener_open[0] = False
            handle_exit(signal.SIGTERM, None)

    def on_signal(sig: int, frame: Any) -> None:
        signals.append(sig)
        if len(signals) == 1:
            logger.info(
                "signal %d: draining for %g s, then closing; running requests end in %g s",
                sig,
                settings.drain_s,
                settings.graceful_timeout_s,
            )
            worker.drain()
            later(settings.drain_s, close_listener)
            later(settings.graceful_timeout_s, worker.end_all, shutting_down)
        elif len(signals) == 2:
            logger.info("signal %d again: the listener closes now; running requests go on", sig)
            close_listener()
        else:
            logger.warning("signal %d a third time: exiting now", sig)
            close_listener()
            server.force_exit = True

    server.handle_exit = on_signal
