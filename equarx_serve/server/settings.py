"""The HTTP server's operator settings (`equarx_serve/server/http.py` applies them), in a module
of their own so that `equarx-serve serve --help` imports neither FastAPI nor JAX."""

from __future__ import annotations

import dataclasses

__all__ = ["LOOPBACK_HOSTS", "HTTPSettings"]

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclasses.dataclass(frozen=True)
class HTTPSettings:
    """What `equarx_serve/server/http.py` enforces (its module doc says how).

    Attributes:
      max_body_bytes: The largest request body (413).
      header_timeout_s: Seconds a client has to send a request's head after connecting or
        after its previous response (then it is disconnected).
      body_timeout_s: Seconds a client has to send a request's body (408).
      keep_alive_s: Seconds an idle keep-alive connection stays open.
      max_head_bytes: The largest request head (request line and headers; 431).
      max_headers: The most header lines in a request head (431).
      write_timeout_s: Seconds a client may take none of a response's bytes while the server
        waits on it (then it is disconnected and its request cancelled); nginx's
        `send_timeout` is 60 s.
      send_buffer_bytes: Each connection's kernel send buffer (SO_SNDBUF; Linux doubles it).
      max_connections: Open connections (and running requests) before requests get 503
        (/health and /metrics excepted).
      api_key: If set, /v1/* needs `Authorization: Bearer <api_key>` (401).
      docs: Serve the /docs and /redoc pages.
      allowed_hosts: Host names (no port) a request's Host header may name; empty: any.
      drain_s: After SIGTERM/SIGINT, seconds /health and new requests get 503 before the
        listener closes.
      graceful_timeout_s: After the signal, seconds running requests may take; then they end
        with a 503.
    """

    max_body_bytes: int = 1 << 20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_head_bytes: int = 16 << 10
    max_headers: int = 100
    write_timeout_s: float = 60.0
    send_buffer_bytes: int = 256 << 10
    max_connections: int = 512
    api_key: str | None = None
    docs: bool = True
    allowed_hosts: tuple[str, ...] = ()
    drain_s: float = 5.0
    graceful_timeout_s: float = 120.0

    def __post_init__(self):
        positive = (
            self.max_body_bytes,
            self.header_timeout_s,
            self.body_timeout_s,
            self.keep_alive_s,
            self.max_head_bytes,
            self.max_headers,
            self.write_timeout_s,
            self.send_buffer_bytes,
            self.max_connections,
        )
        if min(positive) <= 0:
            raise ValueError(f"limits and timeouts must be positive: {self}")
        if self.drain_s < 0 or self.graceful_timeout_s < 0:
            raise ValueError("drain_s and graceful_timeout_s must be >= 0")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key must not be empty")
