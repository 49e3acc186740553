"""An all-gather of bytes between a run's processes on communication threads of their own.

XLA:CPU runs a device's program on one executing thread, collectives included: while a gloo
all-gather waits for a slow link, none of the program's compute runs (docs/decisions.md,
"overlap"). This module moves the bytes beside XLA instead. `ByteExchange` holds a TCP
connection to every other process of the run, with a sender and a receiver thread each;
`start(payload)` queues this process's bytes for every peer and returns at once, and
`finish(seq)` waits until every peer's bytes of the same exchange have arrived. Inside a
program the pair runs as two `io_callback`s (`start_exchange`, `finish_exchange`): the program
computes what does not need the result while the bytes cross the link, and waits only where it
does. So an all-reduce that is one exchange (one-shot: every device sends its whole encoded
message to every other, and every device decodes and sums all N in rank order, so replicas are
bit-identical) overlaps the compute its caller places between the two.

The exchanges of a program are numbered in the order their `start`s run, which is the same on
every process when each `start` is ordered behind the one before (a data dependency, as
`start_exchange`'s `after` gives): every process runs the same programs in the same order.
Connections are made once, on first use while a program is traced (every process traces the
same program at the same point, as for `transport.measure`): each process listens on the
address its host name resolves to (the address gloo uses) and publishes it in the key-value
store of `jax.distributed`. Cost per exchange: a device sends its payload to each of the
N - 1 others, (N - 1) x its bytes; framing adds 16 bytes a message.

Two implementations of the same exchange, chosen once a process: `NativeExchange`
(`exchange.cc`: XLA:CPU custom calls and C++ threads, no Python on the program's path), built
with the native kernels (`kernels/native.py`); and `ByteExchange` (Python threads, the pair as
`io_callback`s) where they are unavailable (no compiler, `EQUARX_SERVE_NATIVE_KERNELS=0`).
Measured in one process, 288 chained start/finish pairs of 170 KB (a 2048-token prefill's in 8
chunks), beside the same program without them (~0.12 ms a step): the `io_callback` pair added
~0.9-1.1 ms each (~0.45 ms at 1 KB payloads), ~0.3 s of each process's CPU in a prefill that
computes for ~1.6 s; the custom calls none measurable (the program ran 0.08-0.09 ms a step).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import queue
import socket
import struct
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

from equarx_serve.kernels.native import NativeKernel

_HEADER = struct.Struct("<QQ")  # exchange number, payload bytes
_KEY = "equarx_serve/exchange/{}"
CONNECT_TIMEOUT_S = 120.0
_SOURCE = Path(__file__).with_suffix(".cc")
_FALLBACK = "the Python exchange (io_callback)"
START = NativeKernel(
    _SOURCE, "EquarxExchangeStart", "equarx_exchange_start", _FALLBACK, ("-pthread",)
)
FINISH = NativeKernel(
    _SOURCE, "EquarxExchangeFinish", "equarx_exchange_finish", _FALLBACK, ("-pthread",)
)
# How long `finish` waits for a peer's bytes before failing the program rather than hanging.
FINISH_TIMEOUT_S = 600.0


@dataclasses.dataclass
class ExchangeTimes:
    """When one exchange's steps happened on this process (wall clock, `time.time()` s):
    `started` (queued), `sent` (the last peer's sendall returned), `arrived` (the last peer's
    bytes in: before `started` where a peer was ahead), `waited` (the program asked for the
    result) and `done` (it had it). The program
    blocked for done - waited; the bytes were in flight from started to arrived."""

    seq: int
    started: float | None = None
    sent: float | None = None
    arrived: float | None = None
    waited: float | None = None
    done: float | None = None


@dataclasses.dataclass
class _Arrivals:
    """The payloads of one exchange received so far, by rank."""

    by_rank: dict[int, bytes] = dataclasses.field(default_factory=dict)


class ByteExchange:
    """This process's end of the exchanges: rank `rank` of `size`, a socket to every peer."""

    def __init__(self, rank: int, size: int, peers: dict[int, socket.socket]):
        self.rank, self.size = rank, size
        self._next_seq = 0
        self.sent_bytes = 0  # payload bytes queued for peers so far, summed over the peers
        self.times: dict[int, ExchangeTimes] | None = None  # recorded while not None (`record`)
        self._lock = threading.Condition()
        self._arrivals: dict[int, _Arrivals] = {}
        self._own: dict[int, bytes] = {}
        self._failure: BaseException | None = None
        self._outboxes: dict[int, queue.SimpleQueue] = {}
        for peer, sock in peers.items():
            outbox: queue.SimpleQueue = queue.SimpleQueue()
            self._outboxes[peer] = outbox
            for target, name in ((self._send_loop, "send"), (self._receive_loop, "receive")):
                args = (peer, sock, outbox) if name == "send" else (peer, sock)
                threading.Thread(
                    target=target, args=args, name=f"exchange-{name}-{peer}", daemon=True
                ).start()

    def start(self, payload: bytes) -> int:
        """Queue `payload` for every peer; its exchange's number."""
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._own[seq] = payload
            self.sent_bytes += len(payload) * len(self._outboxes)
            self._note(seq, "started")
        for outbox in self._outboxes.values():
            outbox.put((seq, payload))
        return seq

    def finish(self, seq: int, timeout_s: float = FINISH_TIMEOUT_S) -> np.ndarray:
        """Every process's payload of exchange `seq`, u8 [size (rank), bytes]."""
        with self._lock:
            self._note(seq, "waited")
            arrived = self._lock.wait_for(
                lambda: self._failure is not None or self._complete(seq), timeout=timeout_s
            )
            if self._failure is not None:
                raise RuntimeError("a peer's connection failed") from self._failure
            if not arrived:
                raise TimeoutError(f"exchange {seq}: no bytes from every peer in {timeout_s} s")
            by_rank = self._arrivals.pop(seq).by_rank if self.size > 1 else {}
            by_rank[self.rank] = self._own.pop(seq)
            self._note(seq, "done")
        return np.stack([np.frombuffer(by_rank[r], np.uint8) for r in range(self.size)])

    def record(self) -> None:
        """Record every exchange's `ExchangeTimes` from now on (in `times`, by number)."""
        with self._lock:
            self.times = {}

    def recorded(self) -> list[ExchangeTimes]:
        """The exchanges recorded since `record`, by number; recording stops."""
        with self._lock:
            times, self.times = self.times or {}, None
        return sorted(times.values(), key=lambda t: t.seq)

    def _note(self, seq: int, step: str) -> None:
        """The time of `step` of exchange `seq`, when recording (hold the lock)."""
        if self.times is not None:
            setattr(self.times.setdefault(seq, ExchangeTimes(seq)), step, time.time())

    def _complete(self, seq: int) -> bool:
        return self.size == 1 or len(self._arrivals.get(seq, _Arrivals()).by_rank) == self.size - 1

    def _send_loop(self, peer: int, sock: socket.socket, outbox: queue.SimpleQueue) -> None:
        try:
            while True:
                seq, payload = outbox.get()
                sock.sendall(_HEADER.pack(seq, len(payload)))
                sock.sendall(payload)
                with self._lock:
                    self._note(seq, "sent")  # the last peer's: each overwrites
        except OSError as e:
            self._fail(e)

    def _receive_loop(self, peer: int, sock: socket.socket) -> None:
        try:
            while True:
                seq, size = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
                payload = _receive_exactly(sock, size)
                with self._lock:
                    self._arrivals.setdefault(seq, _Arrivals()).by_rank[peer] = payload
                    self._note(seq, "arrived")
                    self._lock.notify_all()
        except (OSError, ConnectionError) as e:
            self._fail(e)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self._failure = error
            self._lock.notify_all()


class NativeExchange:
    """`ByteExchange`'s interface over `exchange.cc`'s exchange: the sockets are handed to C++
    (closed here), whose threads move the bytes; inside a program `start_exchange` and
    `finish_exchange` are its custom calls."""

    def __init__(self, rank: int, size: int, peers: dict[int, socket.socket]):
        self.rank, self.size = rank, size
        self._lib = _native_library()
        fds = (ctypes.c_int32 * size)(*[-1] * size)
        for peer, sock in peers.items():
            fds[peer] = sock.detach()
        self.id = self._lib.equarx_exchange_open(rank, size, fds)
        self._sizes: dict[int, int] = {}  # the payload sizes of `start`s outside programs

    def start(self, payload: bytes) -> int:
        """Queue `payload` for every peer; its exchange's number."""
        seq = self._lib.equarx_exchange_start(self.id, payload, len(payload))
        self._sizes[seq] = len(payload)
        return seq

    def finish(self, seq: int, timeout_s: float = FINISH_TIMEOUT_S) -> np.ndarray:
        """Every process's payload of exchange `seq`, u8 [size (rank), bytes]; a payload of
        another size than this process's is an error."""
        out = np.empty((self.size, nbytes := self._sizes.pop(seq)), np.uint8)
        why = ctypes.create_string_buffer(1024)
        if self._lib.equarx_exchange_finish(
            self.id, seq, out.ctypes.data, nbytes, timeout_s, why, len(why)
        ):
            reason = why.value.decode()
            raise (TimeoutError if "no bytes" in reason else RuntimeError)(reason)
        return out

    @property
    def sent_bytes(self) -> int:
        return self._lib.equarx_exchange_sent_bytes(self.id)

    def record(self) -> None:
        """Record every exchange's `ExchangeTimes` from now on (`recorded`)."""
        self._lib.equarx_exchange_record(self.id, 1)

    def recorded(self) -> list[ExchangeTimes]:
        """The exchanges recorded since `record`, by number; recording stops."""
        rows = np.empty((1 << 16, 6))
        count = self._lib.equarx_exchange_times(self.id, rows.ctypes.data, len(rows))
        self._lib.equarx_exchange_record(self.id, 0)
        nan_none = lambda t: None if np.isnan(t) else float(t)
        return [ExchangeTimes(int(r[0]), *map(nan_none, r[1:])) for r in rows[:count]]

    def close(self) -> None:
        """Stop the threads and close the sockets (a pending `finish` fails)."""
        self._lib.equarx_exchange_close(self.id)


@functools.cache
def _native_library() -> ctypes.CDLL:
    """exchange.cc's library (registered as XLA:CPU custom calls), its C functions typed."""
    if not native_available():
        raise RuntimeError("exchange.cc is unavailable here: use ByteExchange")
    lib = ctypes.cdll.LoadLibrary(str(START.build()))
    i64, i32, p, f64 = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_double
    for name, result, args in (
        ("open", i64, [i32, i32, ctypes.POINTER(i32)]),
        ("close", None, [i64]),
        ("start", i64, [i64, ctypes.c_char_p, i64]),
        ("finish", i64, [i64, i64, p, i64, f64, ctypes.c_char_p, i64]),
        ("sent_bytes", i64, [i64]),
        ("record", None, [i64, i32]),
        ("times", i64, [i64, p, i64]),
    ):
        function = getattr(lib, f"equarx_exchange_{name}")
        function.restype, function.argtypes = result, args
    return lib


def native_available() -> bool:
    """Whether the exchange runs as `NativeExchange` (building exchange.cc on first use)."""
    return START.available() and FINISH.available()


def receive_exactly(sock: socket.socket, size: int) -> bytes | None:
    """`size` bytes from `sock`, or None when the peer closes the connection first."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return bytes(buffer)


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = receive_exactly(sock, size)
    if data is None:
        raise ConnectionError("the peer closed its connection")
    return data


_exchange: ByteExchange | NativeExchange | None = None
_exchange_lock = threading.Lock()


def available() -> bool:
    """Whether this run can exchange beside XLA: several processes (`jax.distributed`), one
    device each."""
    return jax.process_count() > 1 and jax.local_device_count() == 1


def sent_bytes() -> int:
    """Payload bytes this process has sent its peers through exchanges so far (0 before the
    first): what a benchmark adds to the collectives' bytes it counts in the HLO."""
    return 0 if _exchange is None else _exchange.sent_bytes


def get() -> ByteExchange | NativeExchange:
    """This process's exchange, connected on first use (collectively: see the module doc)."""
    global _exchange
    with _exchange_lock:
        if _exchange is None:
            _exchange = _connect(jax.process_index(), jax.process_count())
        return _exchange


def _connect(rank: int, size: int) -> ByteExchange | NativeExchange:
    from jax._src import distributed  # the run's key-value store; no public API exposes it

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("exchanges between processes need jax.distributed.initialize first")
    host = socket.gethostbyname(socket.gethostname())
    listener = socket.create_server((host, 0))
    client.key_value_set(_KEY.format(rank), f"{host}:{listener.getsockname()[1]}")
    peers: dict[int, socket.socket] = {}
    for peer in range(rank):  # connect to the lower ranks, accept the higher ones
        address, port = client.blocking_key_value_get(
            _KEY.format(peer), int(CONNECT_TIMEOUT_S * 1000)
        ).rsplit(":", 1)
        sock = socket.create_connection((address, int(port)), timeout=CONNECT_TIMEOUT_S)
        sock.sendall(struct.pack("<Q", rank))
        peers[peer] = sock
    listener.settimeout(CONNECT_TIMEOUT_S)
    for _ in range(rank + 1, size):
        sock, _ = listener.accept()
        (peer,) = struct.unpack("<Q", _receive_exactly(sock, 8))
        peers[peer] = sock
    listener.close()
    for sock in peers.values():
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ends = NativeExchange if native_available() else ByteExchange
    return ends(rank, size, peers)


def start_exchange(payload: jax.Array, after: jax.Array | None = None) -> jax.Array:
    """Inside a program: start exchanging `payload` (u8 [bytes]) once `after` (the previous
    exchange's handle, if any) exists; the handle (int32 scalar) for `finish_exchange`."""
    exchange = get()
    if isinstance(exchange, NativeExchange):
        call = jax.ffi.ffi_call(START.target, _HANDLE, has_side_effect=True)
        started = call(payload, _ready(payload if after is None else after), exchange=exchange.id)
        return _varying_as(started, payload)

    def start(payload: np.ndarray, *after: np.ndarray) -> np.ndarray:
        return np.int32(exchange.start(payload.tobytes()))  # a copy: XLA may reuse the buffer

    operands = (payload,) if after is None else (payload, _ready(after))
    return io_callback(start, _HANDLE, *operands)


def finish_exchange(handle: jax.Array, nbytes: int, after: jax.Array | None = None) -> jax.Array:
    """Inside a program: every process's payload of the exchange `handle`, u8 [N, nbytes],
    waited for only once `after` (the compute to run first, any array) exists."""
    exchange = get()
    shape = jax.ShapeDtypeStruct((exchange.size, nbytes), jnp.uint8)
    if isinstance(exchange, NativeExchange):
        call = jax.ffi.ffi_call(FINISH.target, shape, has_side_effect=True)
        timeout = np.float64(FINISH_TIMEOUT_S)
        done = call(handle, _ready(handle if after is None else after), exchange=exchange.id,
                    timeout_s=timeout)  # fmt: skip
        return _varying_as(done, handle)

    def finish(handle: np.ndarray, *after: np.ndarray) -> np.ndarray:
        return exchange.finish(int(handle))

    operands = (handle,) if after is None else (handle, _ready(after))
    return io_callback(finish, shape, *operands)


_HANDLE = jax.ShapeDtypeStruct((), jnp.int32)


def _varying_as(y: jax.Array, x: jax.Array) -> jax.Array:
    """y, varying over the mesh axes x varies over (inside `shard_map`, a custom call's result
    is typed as the same on every device; this one differs by process)."""
    varying = tuple(jax.typeof(x).mat.varying)
    return lax.pcast(y, varying, to="varying") if varying else y


def _ready(x: jax.Array) -> jax.Array:
    """One element of `x` that exists only once all of `x` does: the barrier keeps XLA from
    computing just that element (a slice of a dot folds into a smaller dot), and one element is
    all the callback copies to the host."""
    return lax.optimization_barrier(x).reshape(-1)[:1]
