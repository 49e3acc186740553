"""One step on a mesh that spans processes: process 0 decides, every process runs it.

    # process 0 (the leader)                  # every other process (a follower)
    leader = Leader.listen(host, port, n - 1) runner = DeviceRunner(engine)
    leader.wait_for_followers()               code = follow(runner, host, port, process_id)
    runner = ReplicatedRunner(DeviceRunner(engine), leader)
    ... StepEngine(runner, ...) ...
    leader.stop()

The mesh's collectives need every process to run the same programs in the same order on the
same inputs. The leader's `StepEngine` decides each step (`steps.py`: plain data), the
`ReplicatedRunner` sends it to every follower over a control channel, then runs it itself; each
follower runs the steps it receives with its own `DeviceRunner`. Only the leader reads the
sampled tokens; followers only keep their part of the KV cache in step.

The control channel is TCP, apart from JAX's coordinator and gloo's transport: frames of a
4-byte length and JSON (no pickle), authenticated by a shared token (`TOKEN_ENV`). Followers
say hello, then send a heartbeat every `HEARTBEAT_INTERVAL_S`. The leader's monitor thread
watches them: a follower that exits (its socket closes), reports an error, or stays silent for
`heartbeat_timeout_s` (stopped, hung) fails the cluster at once: `on_failure(reason)` is called
(the server answers 503 and exits non-zero), and `ReplicatedRunner.run` raises `ClusterFailed`
instead of waiting on a collective that can never complete. A follower whose leader goes away
(EOF, or a heartbeat that cannot be sent) exits with `EXIT_CLUSTER_FAILED` at once, even while
stuck in a collective.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

from equarx_serve.collectives.exchange import receive_exactly
from equarx_serve.generation import steps as steps_lib
from equarx_serve.generation.runner import DeviceRunner, FatalRunnerError, StepOutput
from equarx_serve.generation.steps import Step, StopStep

__all__ = [
    "EXIT_CLUSTER_FAILED",
    "TOKEN_ENV",
    "ClusterFailed",
    "Leader",
    "ReplicatedRunner",
    "exit_now",
    "follow",
]

logger = logging.getLogger("equarx_serve.distributed.cluster")

EXIT_CLUSTER_FAILED = 3  # a process of the mesh was lost
TOKEN_ENV = "EQUARX_SERVE_CLUSTER_TOKEN"  # the shared secret of the control channel
HEARTBEAT_INTERVAL_S = 0.5
DEFAULT_HEARTBEAT_TIMEOUT_S = 15.0
CONNECT_TIMEOUT_S = 600.0  # followers load the model before they connect
FAILURE_GRACE_S = 2.0  # after a failed step: how long to wait for the monitor's verdict
MAX_FRAME_BYTES = 256 << 20
_HEADER = struct.Struct("!I")


class ClusterFailed(FatalRunnerError):
    """A process of the mesh was lost (the message says which and how)."""


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytes | None:
    """One frame, or None when the peer closed the connection."""
    header = receive_exactly(sock, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes is more than the control channel carries")
    return receive_exactly(sock, size)


def _message(kind: str, **fields: object) -> bytes:
    return json.dumps({"kind": kind, **fields}).encode()


def _token() -> str:
    return os.environ.get(TOKEN_ENV, "")


class Leader:
    """Process 0's end of the control channel (see module doc)."""

    def __init__(
        self,
        server: socket.socket,
        num_followers: int,
        *,
        token: str,
        heartbeat_timeout_s: float,
        on_failure: Callable[[str], None],
    ):
        self._server = server
        self.num_followers = num_followers
        self._token = token
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.on_failure = on_failure
        self._followers: dict[int, socket.socket] = {}
        self._last_seen: dict[int, float] = {}
        self._send_lock = threading.Lock()
        self._failed = threading.Event()
        self.failure: str | None = None
        self._closing = False

    @classmethod
    def listen(
        cls,
        host: str,
        port: int,
        num_followers: int,
        *,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        on_failure: Callable[[str], None] = lambda reason: None,
    ) -> Leader:
        server = socket.create_server((host, port))
        logger.info("control channel on %s:%d, waiting for %d followers", host, port, num_followers)
        return cls(
            server,
            num_followers,
            token=_token(),
            heartbeat_timeout_s=heartbeat_timeout_s,
            on_failure=on_failure,
        )

    @property
    def address(self) -> tuple[str, int]:
        return self._server.getsockname()[:2]

    def wait_for_followers(self, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Accepts every follower's hello (TimeoutError if they do not all come), then starts
        the monitor thread."""
        deadline = time.monotonic() + timeout_s
        while len(self._followers) < self.num_followers:
            self._server.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                sock, peer = self._server.accept()
            except TimeoutError:
                missing = sorted(set(range(1, self.num_followers + 1)) - set(self._followers))
                raise TimeoutError(
                    f"followers {missing} did not connect within {timeout_s:.0f} s"
                ) from None
            self._greet(sock, peer)
        self._server.close()
        threading.Thread(target=self._monitor, name="equarx-cluster-monitor", daemon=True).start()

    def _greet(self, sock: socket.socket, peer: tuple) -> None:
        sock.settimeout(10.0)
        try:
            hello = json.loads(recv_frame(sock) or b"{}")
            process_id = int(hello["process_id"])
            known = hmac.compare_digest(str(hello.get("token", "")), self._token)
        except (OSError, ValueError, KeyError, TypeError):
            known, process_id = False, -1
        if not known or not 1 <= process_id <= self.num_followers or process_id in self._followers:
            logger.warning("refused a control connection from %s", peer)
            sock.close()
            return
        sock.settimeout(None)
        self._followers[process_id] = sock
        self._last_seen[process_id] = time.monotonic()
        logger.info("follower %d connected from %s", process_id, peer[0])

    def broadcast(self, step: Step) -> None:
        """Sends a step to every follower; ClusterFailed if one is lost."""
        if self.failure is not None:
            raise ClusterFailed(self.failure)
        frame = steps_lib.encode(step)
        with self._send_lock:
            for process_id, sock in self._followers.items():
                try:
                    send_frame(sock, frame)
                except OSError as e:
                    self._fail(f"process {process_id} is unreachable: {e}")
                    raise ClusterFailed(self.failure) from e

    def wait_for_failure(self, timeout_s: float) -> str | None:
        """The failure the monitor finds within `timeout_s` (None if none)."""
        self._failed.wait(timeout_s)
        return self.failure

    def stop(self) -> None:
        """Tells the followers to leave their loop (if they still can) and closes."""
        self._closing = True
        if self.failure is None:
            with contextlib.suppress(ClusterFailed):
                self.broadcast(StopStep())
        for sock in self._followers.values():
            sock.close()

    def _fail(self, reason: str) -> None:
        if self.failure is not None or self._closing:
            return
        self.failure = reason
        self._failed.set()
        logger.error("the cluster failed: %s", reason)
        for sock in self._followers.values():  # followers see EOF and exit
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.on_failure(reason)

    def _monitor(self) -> None:
        names = {sock: process_id for process_id, sock in self._followers.items()}
        while self.failure is None and not self._closing:
            try:
                readable, _, _ = select.select(list(names), [], [], HEARTBEAT_INTERVAL_S)
            except (OSError, ValueError):  # a socket closed under us: stopping
                return
            for sock in readable:
                self._receive(names[sock], sock)
            now = time.monotonic()
            for process_id, seen in self._last_seen.items():
                if now - seen > self.heartbeat_timeout_s:
                    self._fail(f"process {process_id} is silent for {now - seen:.0f} s (hung?)")

    def _receive(self, process_id: int, sock: socket.socket) -> None:
        try:
            frame = recv_frame(sock)
        except (OSError, ValueError) as e:
            if self._closing:
                return
            frame = None
            logger.warning("process %d: %s", process_id, e)
        if frame is None:
            self._fail(f"process {process_id} exited (its control connection closed)")
            return
        message = json.loads(frame)
        if message.get("kind") == "error":
            self._fail(f"process {process_id} failed: {message.get('message')}")
        self._last_seen[process_id] = time.monotonic()


class ReplicatedRunner:
    """A runner whose every step also runs on the followers (see module doc)."""

    def __init__(self, runner: DeviceRunner, leader: Leader):
        self.runner = runner
        self.engine = runner.engine
        self.leader = leader

    def run(self, step: Step) -> StepOutput:
        self.leader.broadcast(step)
        try:
            return self.runner.run(step)
        except Exception as e:
            # A collective with a lost process fails (or hangs; the monitor calls on_failure).
            failure = self.leader.wait_for_failure(FAILURE_GRACE_S)
            if failure is not None:
                raise ClusterFailed(failure) from e
            raise


def _connect(host: str, port: int, timeout_s: float) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection((host, port), timeout=10.0)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)  # the leader is still loading the model


def follow(
    runner: DeviceRunner,
    host: str,
    port: int,
    process_id: int,
    *,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    on_leader_lost: Callable[[int], None] | None = None,
) -> int:
    """A follower's loop: runs every step the leader sends until it says stop (returns 0); 1
    if a step fails here (the leader is told), `EXIT_CLUSTER_FAILED` if the leader is gone.
    A heartbeat that cannot be sent means the leader is gone while this process may be stuck
    in a collective: `on_leader_lost(EXIT_CLUSTER_FAILED)` (default: `exit_now`)."""
    sock = _connect(host, port, connect_timeout_s)
    sock.settimeout(None)
    send_lock = threading.Lock()

    def send(payload: bytes) -> None:
        with send_lock:
            send_frame(sock, payload)

    send(_message("hello", process_id=process_id, token=_token()))
    logger.info("process %d follows the leader at %s:%d", process_id, host, port)

    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(HEARTBEAT_INTERVAL_S):
            try:
                send(_message("heartbeat"))
            except OSError:
                if not done.is_set():
                    logger.error("process %d: the leader is gone", process_id)
                    (on_leader_lost or exit_now)(EXIT_CLUSTER_FAILED)
                return

    threading.Thread(target=heartbeat, name="equarx-heartbeat", daemon=True).start()
    try:
        return _run_steps(runner, sock, send, process_id)
    finally:
        done.set()
        sock.close()


def _run_steps(
    runner: DeviceRunner, sock: socket.socket, send: Callable[[bytes], None], process_id: int
) -> int:
    steps = 0
    while True:
        frame = recv_frame(sock)
        if frame is None:
            logger.error("process %d: the leader closed the control channel", process_id)
            return EXIT_CLUSTER_FAILED
        step = steps_lib.decode(frame)
        if isinstance(step, StopStep):
            logger.info("process %d: stopped by the leader after %d steps", process_id, steps)
            return 0
        try:
            runner.run(step)
        except Exception as e:
            logger.exception("process %d: a step failed", process_id)
            with contextlib.suppress(OSError):
                send(_message("error", message=f"{type(e).__name__}: {e}"))
            return 1
        steps += 1


def exit_now(code: int) -> None:
    """Exits without running atexit hooks (`jax.distributed.shutdown` would wait on a barrier
    with the lost process)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
