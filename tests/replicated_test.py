"""The control channel of a mesh that spans processes (`generation/replicated.py`), with
followers in threads and runners that only record: steps reach every follower in order, and
every way of losing a follower (error, exit, silence) or the leader fails fast."""

from __future__ import annotations

import json
import socket
import threading

import numpy as np
import pytest

from equarx_serve.generation import replicated
from equarx_serve.generation.replicated import (
    EXIT_CLUSTER_FAILED,
    TOKEN_ENV,
    ClusterFailed,
    Leader,
    ReplicatedRunner,
    follow,
    recv_frame,
    send_frame,
)
from equarx_serve.generation.runner import StepOutput
from equarx_serve.generation.sampling import SamplingBatch, SamplingParams
from equarx_serve.generation.steps import DecodeStep, ReleaseStep

TOKEN = "s3cret"


class RecordingRunner:
    """Records the steps it runs; fails when told."""

    engine = None

    def __init__(self, fail_at: int | None = None):
        self.steps: list = []
        self.fail_at = fail_at

    def run(self, step):
        if self.fail_at is not None and len(self.steps) == self.fail_at:
            raise RuntimeError("boom")
        self.steps.append(step)
        return StepOutput(np.zeros(0, np.int32))


def decode_step(i: int) -> DecodeStep:
    sampling = SamplingBatch.for_rows([(SamplingParams(), i), None], 512)
    return DecodeStep((i, 0), (i + 1, 0), sampling)


@pytest.fixture(autouse=True)
def _token(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)


class Failures:
    """Records on_failure calls; `wait()` for the first."""

    def __init__(self):
        self.reasons: list[str] = []
        self.event = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.event.set()

    def wait(self) -> str:
        assert self.event.wait(30), "no failure was reported"
        return self.reasons[0]


def start_followers(port: int, runners: list, lost: list | None = None) -> list:
    """Followers 1..n in threads; returns [thread, result] pairs."""
    started = []
    for i, runner in enumerate(runners, start=1):
        result: list = []

        def run(runner=runner, i=i, result=result):
            result.append(follow(runner, "127.0.0.1", port, i, on_leader_lost=(lost or []).append))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        started.append((thread, result))
    return started


def make_leader(followers: int, timeout_s: float = 30.0) -> tuple[Leader, Failures]:
    failures = Failures()
    leader = Leader.listen(
        "127.0.0.1", 0, followers, heartbeat_timeout_s=timeout_s, on_failure=failures
    )
    return leader, failures


def test_every_follower_runs_the_leaders_steps_in_order_then_stops():
    leader, failures = make_leader(2)
    runners = [RecordingRunner(), RecordingRunner()]
    followers = start_followers(leader.address[1], runners)
    leader.wait_for_followers(timeout_s=30)
    own = RecordingRunner()
    replicated_runner = ReplicatedRunner(own, leader)
    steps = [decode_step(i) for i in range(5)] + [ReleaseStep()]
    for step in steps:
        replicated_runner.run(step)
    leader.stop()
    for thread, result in followers:
        thread.join(30)
        assert result == [0]
    assert own.steps == runners[0].steps == runners[1].steps == steps
    assert failures.reasons == []


def test_a_step_that_fails_on_a_follower_fails_the_leader():
    leader, failures = make_leader(1)
    followers = start_followers(leader.address[1], [RecordingRunner(fail_at=1)])
    leader.wait_for_followers(timeout_s=30)
    runner = ReplicatedRunner(RecordingRunner(), leader)
    runner.run(decode_step(0))
    runner.run(decode_step(1))  # fails on the follower
    assert failures.wait() == "process 1 failed: RuntimeError: boom"
    with pytest.raises(ClusterFailed, match="process 1 failed"):
        runner.run(decode_step(2))
    followers[0][0].join(30)
    assert followers[0][1] == [1]


def _raw_follower(port: int, process_id: int, token: str = TOKEN) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    send_frame(
        sock, json.dumps({"kind": "hello", "process_id": process_id, "token": token}).encode()
    )
    return sock


def test_a_follower_that_exits_fails_the_leader_at_once():
    leader, failures = make_leader(1)
    sock = _raw_follower(leader.address[1], 1)
    leader.wait_for_followers(timeout_s=30)
    sock.close()  # what the kernel does when the process dies
    assert failures.wait() == "process 1 exited (its control connection closed)"
    assert leader.failure == failures.reasons[0]


def test_a_silent_follower_fails_the_leader_after_the_timeout():
    leader, failures = make_leader(1, timeout_s=1.0)
    sock = _raw_follower(leader.address[1], 1)  # says hello, then nothing (stopped, hung)
    leader.wait_for_followers(timeout_s=30)
    assert "process 1 is silent" in failures.wait()
    sock.close()


def test_a_stranger_is_refused():
    leader, _ = make_leader(1)
    wrong = _raw_follower(leader.address[1], 1, token="guess")
    with pytest.raises(TimeoutError, match=r"followers \[1\] did not connect"):
        leader.wait_for_followers(timeout_s=1)
    assert recv_frame(wrong) is None  # closed by the leader
    wrong.close()


def test_a_follower_whose_leader_goes_away_exits_with_the_cluster_code():
    server = socket.create_server(("127.0.0.1", 0))
    lost: list[int] = []
    [(thread, result)] = start_followers(server.getsockname()[1], [RecordingRunner()], lost)
    conn, _ = server.accept()
    assert json.loads(recv_frame(conn))["kind"] == "hello"
    conn.close()  # the leader process died
    thread.join(30)
    assert result == [EXIT_CLUSTER_FAILED]
    server.close()


def test_a_failed_step_on_the_leader_becomes_cluster_failed_when_a_follower_is_lost(monkeypatch):
    """A collective with a lost process fails on the leader too: the monitor's verdict, not
    the device error, is what the engine sees."""
    monkeypatch.setattr(replicated, "FAILURE_GRACE_S", 30.0)
    leader, _ = make_leader(1)
    sock = _raw_follower(leader.address[1], 1)
    leader.wait_for_followers(timeout_s=30)

    class LosesItsPeer(RecordingRunner):
        def run(self, step):
            sock.close()  # the peer dies during the step...
            raise RuntimeError("gloo: connection reset")  # ...and the collective fails

    with pytest.raises(ClusterFailed, match="process 1 exited"):
        ReplicatedRunner(LosesItsPeer(), leader).run(decode_step(0))
