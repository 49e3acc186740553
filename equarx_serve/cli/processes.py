"""`serve` and `generate` on a mesh that spans processes: the flags, the launch, the roles.

    equarx-serve serve --processes 2 ...            # N local processes, gloo over loopback
    equarx-serve serve --coordinator host0:1234 --num-processes 2 --process-id 0 ...  # host 0
    equarx-serve serve --coordinator host0:1234 --num-processes 2 --process-id 1 ...  # host 1

With `--processes N` this process is only a launcher: it re-runs the same command line N times
with `--coordinator 127.0.0.1:PORT --num-processes N --process-id I --control-port PORT`
(every child gets the output streams, and a random token for the control channel in
`replicated.TOKEN_ENV`), forwards SIGTERM/SIGINT to process 0 (which drains and then stops the
others), and supervises: when a process exits non-zero the others are stopped and the launch
exits with that code. Children die with the launcher (PR_SET_PDEATHSIG).

Each member process has TP / N devices (host CPU devices here), joins `jax.distributed` (gloo
on CPU, `multiprocess.initialize`), and loads the model; process 0 (the leader) then listens
for the others on the control port (default: the coordinator's port + 1, on its host) and
drives the steps (`generation/replicated.py`); the others follow until it stops them.

With `--link RATE [--link-delay D]` the N local processes run on N emulated hosts joined by
links of that rate (`distributed/cluster.py`: network namespaces, a bridge, tc; needs root), the
link measured first and printed; the coordinator and the control channel are on host 0. `serve`
then listens inside host 0's namespace, and the launcher forwards its own --host/--port (in the
namespace it runs in) there (`port_forward.py`: no interface or route is added to any
namespace). Everything goes when the launch ends, however it ends (the Cluster's teardown).

Another way to start the processes only needs to run the same member command lines, each with
its own `--process-id`, and give them a coordinator address they all reach.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from equarx_serve.arguments import UsageError, argument_type, int_at_least, positive_seconds
from equarx_serve.bench import links
from equarx_serve.distributed.devices import (
    DEVICE_COUNT_FLAG,
    set_host_device_count,
    with_huge_pages,
)

if TYPE_CHECKING:
    from equarx_serve.generation.prefill import PrefillEngine
    from equarx_serve.generation.replicated import Leader

__all__ = [
    "Cluster",
    "Placement",
    "add_process_arguments",
    "cluster_from_args",
    "launch_local",
    "run_follower",
    "set_up_devices",
    "start_leader",
]

logger = logging.getLogger("equarx_serve.distributed.cluster")

LOOPBACK = "127.0.0.1"
DEFAULT_FOLLOWER_TIMEOUT_S = 15.0
STOP_GRACE_S = 10.0  # after a failure, how long the others get to exit before SIGKILL
FOLLOWER_EXIT_S = 60.0  # after the leader exited 0, how long its followers may take
_PR_SET_PDEATHSIG = 1


def add_process_arguments(parser: argparse.ArgumentParser) -> None:
    """--processes (local launch) and the flags of one member process."""
    group = parser.add_argument_group("processes (a mesh that spans processes or hosts)")
    group.add_argument(
        "--processes",
        type=argument_type(int_at_least(1)),
        metavar="N",
        help="run as N local processes joined by gloo (TP/N devices each)",
    )
    group.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="process 0's JAX coordinator (this process is one member of a multi-host run)",
    )
    group.add_argument(
        "--num-processes",
        type=argument_type(int_at_least(1)),
        default=1,
        metavar="N",
        help="processes of the mesh (with --coordinator)",
    )
    group.add_argument(
        "--process-id",
        type=argument_type(int_at_least(0)),
        default=0,
        metavar="I",
        help="this process (0 serves and decides each step)",
    )
    group.add_argument(
        "--control-port",
        type=argument_type(int_at_least(1)),
        metavar="PORT",
        help="process 0's port for the step broadcast (default: the coordinator's port + 1)",
    )
    group.add_argument(
        "--follower-timeout",
        type=argument_type(positive_seconds),
        default=DEFAULT_FOLLOWER_TIMEOUT_S,
        metavar="S",
        help="a process silent this long (stopped, hung) is lost (default: %(default)s)",
    )
    links.add_arguments(group, argument_type)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """How this process takes part: alone (num_processes 1), as the launcher of `launch`
    local processes, or as member `process_id` of `num_processes`."""

    num_processes: int = 1
    process_id: int = 0
    coordinator: str | None = None
    control_host: str = LOOPBACK
    control_port: int = 0
    follower_timeout_s: float = DEFAULT_FOLLOWER_TIMEOUT_S
    launch: int | None = None

    @property
    def member(self) -> bool:
        return self.coordinator is not None

    @property
    def leader(self) -> bool:
        return self.process_id == 0


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    """The processes the flags describe; UsageError for flags that do not go together."""
    tp = args.tp
    try:  # --link's own checks (launch_local builds the hosts)
        links.link_from_args(args, processes=(args.processes or 1) > 1)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.processes is not None:
        if args.coordinator is not None:
            raise UsageError("--processes starts local processes: drop --coordinator")
        if tp % args.processes:
            raise UsageError(f"--tp {tp} must be a multiple of --processes {args.processes}")
        return Cluster(launch=args.processes) if args.processes > 1 else Cluster()
    if args.coordinator is None:
        if args.num_processes != 1 or args.process_id != 0:
            raise UsageError("--num-processes and --process-id need --coordinator")
        return Cluster()
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")
    if args.process_id >= args.num_processes:
        raise UsageError(f"--process-id must be < --num-processes {args.num_processes}")
    if tp % args.num_processes:
        raise UsageError(f"--tp {tp} must be a multiple of --num-processes {args.num_processes}")
    return Cluster(
        num_processes=args.num_processes,
        process_id=args.process_id,
        coordinator=args.coordinator,
        control_host=host,
        control_port=args.control_port or int(port) + 1,
        follower_timeout_s=args.follower_timeout,
    )


def set_up_devices(cluster: Cluster, tp: int) -> None:
    """This process's host devices (before JAX starts), and joining the mesh's processes."""
    set_host_device_count(tp // cluster.num_processes)
    if cluster.member:
        from equarx_serve.distributed import multiprocess

        _native_output_to_stderr()
        multiprocess.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id)


def _native_output_to_stderr() -> None:
    """Native libraries print to file descriptor 1 (gloo: "[Gloo] Rank 0 is connected ..."):
    point it at stderr, and keep Python's `sys.stdout` on the real standard output, which stays
    the command's result (`generate --json`)."""
    sys.stdout.flush()
    stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(stdout, "w", buffering=1)


def start_leader(cluster: Cluster) -> Leader | None:
    """Process 0 of a member cluster: the control channel, with every follower connected."""
    if not cluster.member or cluster.num_processes == 1:
        return None
    from equarx_serve.generation.replicated import Leader

    leader = Leader.listen(
        cluster.control_host,
        cluster.control_port,
        cluster.num_processes - 1,
        heartbeat_timeout_s=cluster.follower_timeout_s,
    )
    leader.wait_for_followers()
    return leader


def run_follower(cluster: Cluster, engine: PrefillEngine) -> int:
    """A follower's whole life after loading: run the leader's steps. Returns 0 when stopped;
    on a failure it exits at once (`replicated.exit_now`)."""
    from equarx_serve.generation.replicated import exit_now, follow
    from equarx_serve.generation.runner import DeviceRunner

    runner = DeviceRunner(engine)
    code = follow(runner, cluster.control_host, cluster.control_port, cluster.process_id)
    if code:
        exit_now(code)
    return code


# -- the local launcher --------------------------------------------------------------------------


LAUNCHER_FLAGS = ("--processes", "--link", "--link-delay")  # the launcher's own, with a value


def _member_argv(command: str) -> list[str]:
    """This command line without the launcher's flags (the launcher re-runs it)."""
    argv = sys.argv[1:]
    if not argv or argv[0] != command:
        raise UsageError(f"--processes re-runs the command line; it must start with {command!r}")
    out: list[str] = []
    skip = False
    for arg in argv:
        name = arg.split("=", 1)[0]
        if skip:
            skip = False
        elif arg in LAUNCHER_FLAGS:
            skip = True
        elif name not in LAUNCHER_FLAGS:
            abbreviated = [flag for flag in LAUNCHER_FLAGS if flag.startswith(name)]
            if len(name) > 5 and abbreviated:
                raise UsageError(f"spell {abbreviated[0]} in full, not {arg!r}")
            out.append(arg)
    return [sys.executable, "-m", "equarx_serve", *out]


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the launcher dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the member processes run: the coordinator address they all reach, process 0's
    control port, and `command(i, argv)`, the command line that runs argv as process i (here:
    argv itself; an emulated host would run it inside its network namespace)."""

    coordinator: str
    control_port: int
    command: Callable[[int, list[str]], list[str]] = lambda i, argv: argv


def local_placement() -> Placement:
    from equarx_serve.distributed.multiprocess import free_port

    return Placement(f"{LOOPBACK}:{free_port()}", free_port())


def launch_local(
    command: str,
    num_processes: int,
    args: argparse.Namespace,
    placement: Placement | None = None,
) -> int:
    """Runs this command as `num_processes` member processes (see module doc): where
    `placement` says, else on emulated hosts when `args` (this process's parsed command line,
    the one the launch re-runs) has --link, else on this host's loopback. Returns the exit
    code: process 0's if it failed, else the first failing process's, else 0."""
    if placement is None and args.link is not None:
        return _launch_on_emulated_hosts(command, num_processes, args)
    return _launch(command, num_processes, placement or local_placement())


def _launch_on_emulated_hosts(command: str, num_processes: int, args: argparse.Namespace) -> int:
    """The launch on `num_processes` emulated hosts joined by the --link, measured first; for
    `serve`, --host/--port here forwarded to process 0's HTTP port inside host 0."""
    from equarx_serve.distributed.cluster import Cluster
    from equarx_serve.distributed.port_forward import forward_into

    with Cluster(num_processes, links.link_from_args(args, processes=True)) as hosts:
        print(hosts.measure_link().summary(), file=sys.stderr, flush=True)
        placement = Placement(hosts.coordinator(), hosts.next_port(), hosts.command)
        if command != "serve":
            return _launch(command, num_processes, placement)
        inside = hosts.next_port()  # free in host 0's fresh namespace, whatever --port is
        with forward_into(hosts.namespace_path(0), inside, (args.host, args.port)) as address:
            print(
                f"serving on http://{address[0]}:{address[1]} (forwarded to 127.0.0.1:{inside} "
                "in emulated host 0)",
                file=sys.stderr,
                flush=True,
            )
            http = ["--host", "127.0.0.1", "--port", str(inside)]
            placement = dataclasses.replace(
                placement, command=lambda i, argv: hosts.command(i, [*argv, *http])
            )
            return _launch(command, num_processes, placement)


def _launch(command: str, num_processes: int, placement: Placement) -> int:
    from equarx_serve.generation.replicated import TOKEN_ENV

    argv = _member_argv(command)
    env = with_huge_pages({**os.environ, TOKEN_ENV: secrets.token_hex(16)})
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if not f.startswith(DEVICE_COUNT_FLAG))
    member = [*argv, "--coordinator", placement.coordinator, "--num-processes", str(num_processes)]
    member += ["--control-port", str(placement.control_port)]
    procs = [
        subprocess.Popen(
            placement.command(i, [*member, "--process-id", str(i)]),
            env=env,
            preexec_fn=_die_with_parent,
        )
        for i in range(num_processes)
    ]
    pids = [p.pid for p in procs]
    print(f"launched {num_processes} processes: pids {pids}", file=sys.stderr, flush=True)

    def forward(sig: int, frame: Any) -> None:
        if procs[0].poll() is None:
            procs[0].send_signal(sig)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _supervise(procs)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for p in procs:  # interrupted: nothing may outlive the launcher
            if p.poll() is None:
                p.kill()
                p.wait()


def _supervise(procs: list[subprocess.Popen]) -> int:
    """Waits for every process; at the first failure, gives the others `STOP_GRACE_S` to exit
    by themselves (the leader answers 503 first), then stops them."""
    leader_done_at = None
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            _stop(procs)
            codes = [p.returncode for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c != 0]
            i, code = next(((i, c) for i, c in failed if i == 0), failed[0])
            print(f"process {i} of {len(procs)} exited with {code}", file=sys.stderr)
            return code if code > 0 else 128 - code
        if all(c == 0 for c in codes):
            return 0
        if codes[0] == 0:
            leader_done_at = leader_done_at or time.monotonic()
            if time.monotonic() - leader_done_at > FOLLOWER_EXIT_S:
                print("followers did not exit after the leader; stopping them", file=sys.stderr)
                _stop(procs)
                return 1
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen]) -> None:
    """Lets the processes exit by themselves for `STOP_GRACE_S`, then SIGTERM, then SIGKILL."""
    for signal_them in (lambda p: None, subprocess.Popen.terminate, subprocess.Popen.kill):
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            if p.poll() is None:
                signal_them(p)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        if all(p.poll() is not None for p in procs):
            return
