"""A TCP port inside a network namespace, reachable from the namespace this process runs in.

    with forward_into("/run/netns/equarx-1234abcd-h0", 8000, ("127.0.0.1", 8000)) as address:
        ...  # http://127.0.0.1:8000 here reaches 127.0.0.1:8000 inside the namespace

The forwarder listens in this process's own namespace (normally the root one) and carries
every connection it accepts to 127.0.0.1:PORT inside the other namespace: the thread that
serves the connection enters that namespace (`setns`, which changes the calling thread's
namespace only), connects there, and copies bytes both ways until each side has closed its
half. Nothing is added to either namespace's networking (no interface, address or route), so
nothing is left behind: the listening socket and every connection close when the context ends.
A connection the other side refuses (nothing listening yet) is closed at once. Entering a
namespace needs CAP_SYS_ADMIN.
"""

from __future__ import annotations

import contextlib
import os
import socket
import socketserver
import threading
from collections.abc import Iterable, Iterator

CHUNK_BYTES = 1 << 16
CONNECT_TIMEOUT_S = 10.0


class _Forwarder(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = False  # server_close() waits for the connections' threads
    block_on_close = True

    def __init__(self, listen: tuple[str, int], namespace_path: str, port: int) -> None:
        self.address_family = socket.getaddrinfo(*listen, type=socket.SOCK_STREAM)[0][0]
        self.namespace_path = namespace_path
        self.port = port
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        self._closing = False
        super().__init__(listen, _Connection)

    def connect_inside(self) -> socket.socket:
        """A connection to the port inside the namespace (enters it: call on its own thread)."""
        with open(self.namespace_path) as namespace:
            os.setns(namespace.fileno(), os.CLONE_NEWNET)
        upstream = socket.create_connection(("127.0.0.1", self.port), CONNECT_TIMEOUT_S)
        upstream.settimeout(None)
        return upstream

    def track(self, *sockets: socket.socket) -> None:
        with self._open_lock:
            self._open.update(sockets)
            if self._closing:  # connected while closing: end it now
                _shut(sockets)

    def untrack(self, *sockets: socket.socket) -> None:
        with self._open_lock:
            self._open.difference_update(sockets)

    def close_connections(self) -> None:
        """Ends every open connection, and any made from now on (their threads then finish)."""
        with self._open_lock:
            self._closing = True
            _shut(self._open)


class _Connection(socketserver.BaseRequestHandler):
    server: _Forwarder

    def handle(self) -> None:
        try:
            upstream = self.server.connect_inside()
        except OSError:
            return  # refused or unreachable: the client sees its connection closed
        with upstream:
            self.server.track(self.request, upstream)
            try:
                back = threading.Thread(target=_copy, args=(upstream, self.request))
                back.start()
                _copy(self.request, upstream)
                back.join()
            finally:
                self.server.untrack(self.request, upstream)


def _shut(sockets: Iterable[socket.socket]) -> None:
    for s in sockets:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


def _copy(source: socket.socket, sink: socket.socket) -> None:
    """Bytes from `source` to `sink` until `source` is closed or fails; then closes the writing
    half of `sink` (HTTP clients and servers half-close)."""
    with contextlib.suppress(OSError):
        while data := source.recv(CHUNK_BYTES):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def forward_into(
    namespace_path: str, port: int, listen: tuple[str, int]
) -> Iterator[tuple[str, int]]:
    """Forwards `listen` (host, port; port 0: any free one) here to 127.0.0.1:`port` in the
    network namespace at `namespace_path`; yields the address it listens on."""
    forwarder = _Forwarder(listen, namespace_path, port)
    accepting = threading.Thread(target=forwarder.serve_forever, name="port-forward", daemon=True)
    accepting.start()
    try:
        yield forwarder.server_address[:2]
    finally:
        forwarder.shutdown()
        forwarder.close_connections()
        forwarder.server_close()
        accepting.join()
