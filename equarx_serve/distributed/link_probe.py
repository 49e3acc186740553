"""TCP throughput between two emulated hosts: one sender, one receiver, one TCP stream.

    python -m equarx_serve.distributed.link_probe receive --port P --seconds S
    python -m equarx_serve.distributed.link_probe send --to HOST:P --seconds S

The receiver listens, prints `READY_LINE` once it accepts connections (the sender is started
only then: no sleeps, no connection retries), takes one connection and counts the payload
bytes it reads until the sender closes it. The sender writes zeros for `--seconds` and closes.
The receiver leaves out the first `WARM_UP_FRACTION` of the transfer (TCP slow start) and
prints one JSON line: {"bytes": payload bytes after the warm-up, "seconds": the time they took,
"bits_per_s": their rate}. That is TCP goodput: what a TCP payload gets of the link after the
Ethernet, IP and TCP headers (~95% of a 1500-byte-MTU link's rate).

Standard library only: it starts in well under a second, with no JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import sys
import time
from collections.abc import Sequence

from equarx_serve.arguments import argument_type, positive_seconds

READY_LINE = "READY"
WARM_UP_FRACTION = 0.2
CHUNK_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Throughput:
    bytes: int
    seconds: float

    @property
    def bits_per_s(self) -> float:
        return 8 * self.bytes / self.seconds


def receive(port: int, seconds: float) -> Throughput:
    """Accepts one connection on `port` (all addresses) and measures its goodput."""
    with socket.create_server(("0.0.0.0", port)) as server:
        print(READY_LINE, flush=True)
        connection, _ = server.accept()
    buffer = bytearray(CHUNK_BYTES)
    warm_up_end = None
    with connection:
        first = connection.recv_into(buffer)
        if first == 0:
            raise RuntimeError("the sender closed the connection without sending")
        start = time.perf_counter()
        warm_up_bytes = total = first
        while received := connection.recv_into(buffer):
            total += received
            now = time.perf_counter()
            if warm_up_end is None and now - start >= WARM_UP_FRACTION * seconds:
                warm_up_end, warm_up_bytes = now, total
        end = time.perf_counter()
    if warm_up_end is None or end <= warm_up_end:
        raise RuntimeError(f"the transfer was too short to measure ({total} bytes)")
    return Throughput(total - warm_up_bytes, end - warm_up_end)


def send(host: str, port: int, seconds: float) -> None:
    """Writes zeros to host:port for `seconds`, then closes the connection."""
    payload = bytes(CHUNK_BYTES)
    with socket.create_connection((host, port)) as connection:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            connection.sendall(payload)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    roles = parser.add_subparsers(dest="role", required=True)
    receiver = roles.add_parser("receive")
    receiver.add_argument("--port", type=int, required=True)
    receiver.add_argument("--seconds", type=argument_type(positive_seconds), required=True)
    sender = roles.add_parser("send")
    sender.add_argument("--to", required=True, metavar="HOST:PORT")
    sender.add_argument("--seconds", type=argument_type(positive_seconds), required=True)
    args = parser.parse_args(argv)
    if args.role == "receive":
        result = receive(args.port, args.seconds)
        print(json.dumps(dataclasses.asdict(result) | {"bits_per_s": result.bits_per_s}))
    else:
        host, _, port = args.to.rpartition(":")
        send(host, int(port), args.seconds)


if __name__ == "__main__":
    sys.exit(main())
