"""Emulated hosts on bandwidth-limited links: network namespaces, a bridge, `tc` shaping.

`Cluster(num_hosts, Link.parse("1gbit", "0.2ms"))` is a context manager that builds, for the
time of one run:

    host i   network namespace equarx-<run>-h<i>: interface eth0, address 10.77.0.<i+1>/24
    switch   network namespace equarx-<run>-sw: a bridge br0 with one port p<i> per host
    link i   a veth pair eth0 <-> p<i>, shaped with tc in both directions:
               host -> switch, on eth0: [netem delay D, then] tbf at the rate
               switch -> host, on p<i>: tbf at the rate

so a host sends and receives at the link rate at the same time (full duplex), a packet from one
host to another is delayed by D, and the switch port toward a host queues what several hosts
send it at once, as a real switch's output port does. The subnet exists only inside these
namespaces: nothing is added to the root namespace, and no namespace has a route out of it.

`cluster.command(i, argv)` runs argv on host i: in its network namespace and in a UTS namespace
of its own with the host name equarx-h<i>, which /etc/netns/<namespace>/hosts (mounted over
/etc/hosts by `ip netns exec`) resolves to the host's address. That is what makes gloo use the
link: its TCP transport binds to the address of the host name. (Its own `hostname`/`interface`
options exist in jaxlib, but JAX passes neither and has no public way to.) The process is
killed when the process that started it dies (`setpriv --pdeathsig KILL`).

Teardown, on leaving the context for any reason (an error, a worker that crashed or hung,
Ctrl-C, SIGTERM or SIGHUP, which raise SystemExit while a cluster is up), kills every process
left in the namespaces, deletes them (with them go their links, the bridge and the qdiscs), the
hosts files and the run's lock file. A SIGKILLed run cannot clean up after itself: the next
cluster finds its namespaces by the prefix `equarx-`, sees that no live process holds the run's
lock (/run/equarx-cluster/<run>.lock) and removes them; so does
`python -m equarx_serve.distributed.cluster --cleanup`.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 (`ip`, `tc`), util-linux (`unshare`,
`setpriv`) and `hostname`: `check_privileges` fails at once, saying what is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from equarx_serve.distributed.link_probe import READY_LINE

PREFIX = "equarx-"
SUBNET = "10.77.0"  # host i is SUBNET.(i+1); the /24 exists only inside the namespaces
HOST_NAME = "equarx-h{}"
STATE_DIR = Path("/run/equarx-cluster")  # <run>.lock: held by the live process of a run
NETNS_RUN = Path("/run/netns")  # `ip netns add NS` makes NETNS_RUN/NS
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` mounts NETNS_ETC/NS/* over /etc/*
_NAMESPACE = re.compile(rf"{PREFIX}(?P<run>[0-9a-f]{{8}})-(?P<role>sw|h\d+)")
MAX_HOSTS = 250

TOOLS = ("ip", "tc", "unshare", "setpriv", "hostname")
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21

# tbf: a bucket of 2 ms at the rate, at least 256 KiB (more than a 64 KiB GSO packet; with it,
# 1 Gbit/s gave 0.95 Gbit/s of TCP goodput, the Ethernet/IP/TCP headers taking the rest).
# A packet waits at most QUEUE_LATENCY in a port's queue before it is dropped.
BURST_SECONDS = 0.002
MIN_BURST_BYTES = 256 * 1024
QUEUE_LATENCY = "50ms"
NETEM_LIMIT_PACKETS = 100_000  # netem's default (1000) drops at high rate x delay

FIRST_PORT = 20000  # each coordinator or probe gets the next port: the namespaces are fresh
PROBE_SECONDS = 1.0
PROBE_ROUNDS = 3
PROBE_TOLERANCE = 0.10  # the measured rate must be within 10% of the configured one
PROCESS_EXIT_TIMEOUT_S = 10.0
PROBE_STARTUP_TIMEOUT_S = 60.0

_RATE_UNITS = {"bit": 1, "bps": 8} | {
    f"{prefix}{unit}": scale * factor**power
    for unit, scale in (("bit", 1), ("bps", 8))
    for power, (si, iec) in enumerate((("k", "ki"), ("m", "mi"), ("g", "gi"), ("t", "ti")), 1)
    for prefix, factor in ((si, 1000), (iec, 1024))
}
_DELAY_UNITS = {
    **dict.fromkeys(("s", "sec", "secs"), 1_000_000),
    **dict.fromkeys(("ms", "msec", "msecs"), 1000),
    **dict.fromkeys(("us", "usec", "usecs"), 1),
}
_QUANTITY = re.compile(r"\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]+)\s*", re.I)


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built, or something of it could not be removed."""


def _parse_quantity(text: str, units: dict[str, float], what: str, example: str) -> float:
    match = _QUANTITY.fullmatch(text)
    if match is None or match["unit"].lower() not in units:
        raise ValueError(
            f"invalid {what} {text!r}: a number and a unit in tc syntax, e.g. {example} "
            f"(units: {', '.join(sorted(units, key=units.get))})"
        )
    return float(match["number"]) * units[match["unit"].lower()]


@dataclasses.dataclass(frozen=True)
class Link:
    """Every host's link to the switch: `rate` each way, `delay_us` one way host to host."""

    rate_bits_per_s: int
    delay_us: int = 0

    def __post_init__(self) -> None:
        if self.rate_bits_per_s < 8:
            raise ValueError(f"link rate must be at least 8 bit/s, got {self.rate_bits_per_s}")
        if self.delay_us < 0:
            raise ValueError(f"link delay must be >= 0, got {self.delay_us} us")

    @classmethod
    def parse(cls, rate: str, delay: str | None = None) -> Link:
        """From tc syntax: `rate` like 1gbit, 500mbit, 10gbit, 125mbps; `delay` like 0.2ms."""
        bits = _parse_quantity(rate, _RATE_UNITS, "link rate", "1gbit or 500mbit")
        us = 0.0 if delay is None else _parse_quantity(delay, _DELAY_UNITS, "delay", "0.2ms")
        return cls(round(bits), round(us))

    def __str__(self) -> str:
        text = f"{_format_rate(self.rate_bits_per_s)} each way"
        return text + (f", {self.delay_us / 1000:g} ms one-way delay" if self.delay_us else "")


def _format_rate(bits_per_s: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.3g} {unit}"
    return f"{bits_per_s:.3g} bit/s"


@dataclasses.dataclass(frozen=True)
class LinkMeasurement:
    """TCP goodput between hosts 0 and 1, both directions at once (`link_probe.py`): the best
    of several rounds, since other work on this machine can only slow a round down."""

    configured_bits_per_s: int
    delay_us: int
    forward_bits_per_s: float  # host 0 -> host 1, in the best round
    backward_bits_per_s: float  # host 1 -> host 0, in the best round
    seconds: float  # each stream's duration
    rounds_bits_per_s: tuple[tuple[float, float], ...]  # (forward, backward) of every round

    @property
    def measured_bits_per_s(self) -> float:
        return (self.forward_bits_per_s + self.backward_bits_per_s) / 2

    @property
    def ratio(self) -> float:
        """Measured over configured rate."""
        return self.measured_bits_per_s / self.configured_bits_per_s

    @property
    def within_tolerance(self) -> bool:
        return abs(self.ratio - 1) <= PROBE_TOLERANCE

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self) | {
            "measured_bits_per_s": self.measured_bits_per_s,
            "ratio": self.ratio,
            "within_tolerance": self.within_tolerance,
        }

    def summary(self) -> str:
        text = (
            f"link: configured {_format_rate(self.configured_bits_per_s)} each way; measured "
            f"TCP goodput {_format_rate(self.forward_bits_per_s)} host 0 -> 1 and "
            f"{_format_rate(self.backward_bits_per_s)} host 1 -> 0 at the same time (best of "
            f"{len(self.rounds_bits_per_s)} x {self.seconds:g} s): {100 * self.ratio:.1f}% of "
            "the configured rate"
        )
        if not self.within_tolerance:
            text += (
                f"\nWARNING: the link measured more than {100 * PROBE_TOLERANCE:.0f}% away "
                "from its configured rate (a busy CPU cannot drive a fast link); efficiencies "
                "use the measured rate"
            )
        return text


def check_privileges() -> None:
    """Raises ClusterError, saying what is missing, unless this process can build a cluster."""
    if sys.platform != "linux":
        raise ClusterError(f"emulated hosts need Linux network namespaces; this is {sys.platform}")
    effective = int(_proc_status_field("CapEff"), 16)
    missing = [name for name, bit in (("CAP_NET_ADMIN", CAP_NET_ADMIN),
               ("CAP_SYS_ADMIN", CAP_SYS_ADMIN)) if not effective >> bit & 1]  # fmt: skip
    if missing:
        raise ClusterError(
            f"emulated hosts (--link) need root: creating network namespaces and shaping links "
            f"takes {' and '.join(missing)}, which this process lacks. Run as root, or leave "
            "out --link to run the processes over loopback."
        )
    if absent := [tool for tool in TOOLS if shutil.which(tool) is None]:
        raise ClusterError(
            f"emulated hosts (--link) need {', '.join(absent)} on the PATH (iproute2, "
            "util-linux, hostname)"
        )


def _proc_status_field(name: str) -> str:
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    raise ClusterError(f"/proc/self/status has no {name} line")


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def _namespaces() -> list[str]:
    """Names of the network namespaces `ip netns` knows (`ip netns list`: `NAME [(id: N)]`)."""
    return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]


def _lock_path(run: str) -> Path:
    return STATE_DIR / f"{run}.lock"


def _create_lock(run: str) -> IO[bytes]:
    """A new lock file for `run`, locked before it appears under its name (renamed into place),
    so that no other process ever sees it unlocked while this one lives."""
    temporary = STATE_DIR / f".{run}.{os.getpid()}.tmp"
    for _ in range(3):  # another run's teardown may remove the empty folder in between
        STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            handle = temporary.open("wb")
            break
    else:
        raise ClusterError(f"could not create a lock file in {STATE_DIR}")
    fcntl.flock(handle, fcntl.LOCK_EX)
    if _lock_path(run).exists():
        temporary.unlink()
        handle.close()
        raise ClusterError(f"run id {run} is already in use")
    temporary.rename(_lock_path(run))
    return handle


def _lock_if_dead(run: str) -> IO[bytes] | None:
    """The run's lock file, locked, when no live process holds it (None when one does). A run
    with no lock file is dead: a live run creates its lock before anything else."""
    try:
        handle = _lock_path(run).open("rb")
    except FileNotFoundError:
        STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        handle = _lock_path(run).open("wb")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


@dataclasses.dataclass(frozen=True)
class Leftovers:
    """What a run left on this machine: namespaces and hosts-file folders."""

    run: str
    namespaces: tuple[str, ...]
    hosts_dirs: tuple[Path, ...]

    def names(self) -> list[str]:
        return [*self.namespaces, *map(str, self.hosts_dirs)]


def _runs_on_this_machine() -> dict[str, Leftovers]:
    """Every run that has namespaces, hosts folders or a lock file here, live or not."""
    namespaces: dict[str, list[str]] = {}
    hosts_dirs: dict[str, list[Path]] = {}
    for name in _namespaces():
        if match := _NAMESPACE.fullmatch(name):
            namespaces.setdefault(match["run"], []).append(name)
    for path in NETNS_ETC.glob(f"{PREFIX}*") if NETNS_ETC.is_dir() else ():
        if match := _NAMESPACE.fullmatch(path.name):
            hosts_dirs.setdefault(match["run"], []).append(path)
    locks = [p.stem for p in STATE_DIR.glob("*.lock")] if STATE_DIR.is_dir() else []
    return {
        run: Leftovers(run, tuple(namespaces.get(run, ())), tuple(hosts_dirs.get(run, ())))
        for run in {*namespaces, *hosts_dirs, *locks}
    }


def remove_stale() -> list[str]:
    """Removes what runs whose process is gone (no one holds their lock) left behind; returns
    the names removed. Raises ClusterError naming what could not be removed."""
    removed = []
    for run, leftovers in sorted(_runs_on_this_machine().items()):
        lock = _lock_if_dead(run)
        if lock is None:
            continue  # a live cluster
        with lock:
            _remove(leftovers)
            _lock_path(run).unlink(missing_ok=True)
        removed += leftovers.names()
    _remove_empty_dirs()
    return removed


def _remove_empty_dirs() -> None:
    """NETNS_ETC and STATE_DIR, when empty (other namespaces or live runs may use them)."""
    for folder in (NETNS_ETC, STATE_DIR):
        with contextlib.suppress(OSError):
            folder.rmdir()


def _kill_processes_in(namespace: str) -> None:
    """SIGKILLs every process in a network namespace and waits until none is left."""
    deadline = time.monotonic() + PROCESS_EXIT_TIMEOUT_S
    while pids := [int(p) for p in _run("ip", "netns", "pids", namespace).split()]:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise ClusterError(f"processes {pids} in {namespace} did not exit after SIGKILL")
        time.sleep(0.01)


def _remove(leftovers: Leftovers) -> None:
    """Kills the processes in the namespaces, deletes the namespaces and the hosts folders;
    ClusterError naming anything still there afterwards."""
    errors = []
    for namespace in leftovers.namespaces:
        try:
            _kill_processes_in(namespace)
            _run("ip", "netns", "delete", namespace)
        except ClusterError as e:
            errors.append(str(e))
    for path in leftovers.hosts_dirs:
        shutil.rmtree(path, ignore_errors=True)
    left = [n for n in _namespaces() if n in leftovers.namespaces]
    left += [str(p) for p in leftovers.hosts_dirs if p.exists()]
    if left:
        raise ClusterError(
            f"could not remove {', '.join(left)} ({'; '.join(errors) or 'unknown error'}); "
            "remove them with `ip netns delete NAME` and `rm -r /etc/netns/NAME`"
        )


class _Interruptions:
    """While a cluster is up, SIGTERM and SIGHUP raise SystemExit (Ctrl-C already raises
    KeyboardInterrupt), so that the teardown runs, unless they were ignored; during the
    teardown, all three are held and re-raised after it. Python handles signals in the main
    thread only: elsewhere, this does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self._active = threading.current_thread() is threading.main_thread()
        self._previous = {s: signal.getsignal(s) for s in self.SIGNALS} if self._active else {}
        self._held: int | None = None

    @staticmethod
    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    def _hold(self, signum: int, frame: object) -> None:
        self._held = self._held or signum

    def raise_on_termination(self) -> None:
        for s in (signal.SIGTERM, signal.SIGHUP):
            if self._active and self._previous[s] is not signal.SIG_IGN:  # e.g. under nohup
                signal.signal(s, self._exit)

    def hold(self) -> None:
        if self._active:
            for s in self.SIGNALS:
                signal.signal(s, self._hold)

    def restore(self, *, reraise: bool) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        held, self._held = self._held, None
        if held is not None and reraise:
            if held == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + held)


class Cluster:
    """`num_hosts` emulated hosts joined by shaped links (see the module docstring)."""

    def __init__(self, num_hosts: int, link: Link) -> None:
        if not 2 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"an emulated cluster has 2 to {MAX_HOSTS} hosts, got {num_hosts}")
        self.num_hosts = num_hosts
        self.link = link
        self.run = secrets.token_hex(4)
        self._lock: IO[bytes] | None = None
        self._interruptions: _Interruptions | None = None
        self._next_port = FIRST_PORT

    @property
    def switch_namespace(self) -> str:
        return f"{PREFIX}{self.run}-sw"

    def namespace(self, host: int) -> str:
        return f"{PREFIX}{self.run}-h{host}"

    def namespaces(self) -> list[str]:
        return [self.switch_namespace, *map(self.namespace, range(self.num_hosts))]

    def namespace_path(self, host: int) -> str:
        """The file of host's network namespace (for `setns`)."""
        return str(NETNS_RUN / self.namespace(host))

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def __enter__(self) -> Cluster:
        check_privileges()
        remove_stale()
        self._lock = _create_lock(self.run)
        self._interruptions = _Interruptions()
        self._interruptions.raise_on_termination()
        try:
            self._build()
        except BaseException:
            self._teardown(reraise_signal=False)
            raise
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        self._teardown(reraise_signal=exc_type is None)

    def _build(self) -> None:
        switch = self.switch_namespace
        _run("ip", "netns", "add", switch)
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        for host in range(self.num_hosts):
            namespace, port = self.namespace(host), f"p{host}"
            _run("ip", "netns", "add", namespace)
            _run("ip", "-n", switch, "link", "add", port, "type", "veth",
                 "peer", "name", "eth0", "netns", namespace)  # fmt: skip
            _run("ip", "-n", switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _run("ip", "-n", namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            self._shape(namespace, "eth0", delay=True)
            self._shape(switch, port, delay=False)
            self._write_hosts_file(namespace)

    def _shape(self, namespace: str, device: str, *, delay: bool) -> None:
        rate_bytes = self.link.rate_bits_per_s / 8
        burst = max(MIN_BURST_BYTES, round(rate_bytes * BURST_SECONDS))
        tbf = ["tbf", "rate", f"{self.link.rate_bits_per_s}bit", "burst", str(burst),
               "latency", QUEUE_LATENCY]  # fmt: skip
        qdisc = ["tc", "-n", namespace, "qdisc", "add", "dev", device]
        if delay and self.link.delay_us:
            netem = ["netem", "delay", f"{self.link.delay_us}us", "limit", str(NETEM_LIMIT_PACKETS)]
            try:
                _run(*qdisc, "root", "handle", "1:", *netem)
            except ClusterError as e:
                if "qdisc kind is unknown" not in str(e):
                    raise
                raise ClusterError(
                    "a link delay needs the netem qdisc, which this kernel does not have "
                    "(CONFIG_NET_SCH_NETEM); leave out --link-delay"
                ) from None
            _run(*qdisc, "parent", "1:1", "handle", "10:", *tbf)
        else:
            _run(*qdisc, "root", "handle", "1:", *tbf)

    def _write_hosts_file(self, namespace: str) -> None:
        folder = NETNS_ETC / namespace
        folder.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1\tlocalhost"] + [
            f"{self.address(h)}\t{HOST_NAME.format(h)}" for h in range(self.num_hosts)
        ]
        (folder / "hosts").write_text("\n".join(lines) + "\n")

    def _teardown(self, *, reraise_signal: bool) -> None:
        assert self._interruptions is not None
        self._interruptions.hold()
        try:
            namespaces = tuple(self.namespaces())
            _remove(Leftovers(self.run, namespaces, tuple(NETNS_ETC / n for n in namespaces)))
            if self._lock is not None:
                _lock_path(self.run).unlink(missing_ok=True)
                self._lock.close()
                self._lock = None
            _remove_empty_dirs()
        finally:
            self._interruptions.restore(reraise=reraise_signal)

    def next_port(self) -> int:
        self._next_port += 1
        return self._next_port

    def coordinator(self) -> str:
        """host:port for the coordinator of a `jax.distributed` run, on host 0."""
        return f"{self.address(0)}:{self.next_port()}"

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """argv wrapped to run on `host` (see the module docstring)."""
        if not 0 <= host < self.num_hosts:
            raise ValueError(f"host must be in [0, {self.num_hosts}), got {host}")
        return [
            *["ip", "netns", "exec", self.namespace(host)],
            *["setpriv", "--pdeathsig", "KILL"],
            *["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"'],
            HOST_NAME.format(host),
            *argv,
        ]

    def measure_link(
        self, seconds: float = PROBE_SECONDS, rounds: int = PROBE_ROUNDS
    ) -> LinkMeasurement:
        """TCP goodput from host 0 to host 1 and back, both at once, `rounds` times."""
        measured = tuple(self._probe(seconds) for _ in range(rounds))
        forward, backward = max(measured, key=sum)
        return LinkMeasurement(
            configured_bits_per_s=self.link.rate_bits_per_s,
            delay_us=self.link.delay_us,
            forward_bits_per_s=forward,
            backward_bits_per_s=backward,
            seconds=seconds,
            rounds_bits_per_s=measured,
        )

    def _probe(self, seconds: float) -> tuple[float, float]:
        """One round of `link_probe.py`: (bits/s host 0 -> 1, bits/s host 1 -> 0)."""
        probe = [sys.executable, "-m", "equarx_serve.distributed.link_probe"]
        timeout_s = seconds + PROBE_STARTUP_TIMEOUT_S
        processes: list[subprocess.Popen] = []
        try:
            receivers = {}  # receiving host -> (its process, its port)
            for host in (0, 1):
                port = self.next_port()
                argv = [*probe, "receive", "--port", str(port), "--seconds", str(seconds)]
                receivers[host] = self._start(host, argv), port
                processes.append(receivers[host][0])
            for host, (receiver, _) in receivers.items():
                if receiver.stdout.readline().strip() != READY_LINE:
                    _raise_failed(receiver, f"the link probe's receiver on host {host}")
            senders = {}
            for host, (_, port) in receivers.items():
                to = f"{self.address(host)}:{port}"
                senders[host] = self._start(1 - host, [*probe, "send", "--to", to,
                                                       "--seconds", str(seconds)])  # fmt: skip
                processes.append(senders[host])
            rates = {}
            for host, (receiver, _) in receivers.items():
                for process, role in ((senders[host], "sender"), (receiver, "receiver")):
                    if process.wait(timeout_s) != 0:
                        _raise_failed(process, f"the link probe's {role} toward host {host}")
                rates[host] = json.loads(receiver.stdout.read())["bits_per_s"]
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                process.communicate()
        return rates[1], rates[0]

    def _start(self, host: int, argv: Sequence[str]) -> subprocess.Popen:
        return subprocess.Popen(
            self.command(host, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )


def _raise_failed(process: subprocess.Popen, what: str) -> None:
    if process.poll() is None:
        process.kill()
    _, stderr = process.communicate()
    raise ClusterError(f"{what} failed (exit code {process.returncode}): {stderr[-2000:]}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cleanup", action="store_true", help="remove what killed runs left behind"
    )
    args = parser.parse_args(argv)
    if not args.cleanup:
        parser.print_help()
        return 0
    check_privileges()
    removed = remove_stale()
    print(f"removed: {', '.join(removed)}" if removed else "nothing to remove")
    return 0


if __name__ == "__main__":
    sys.exit(main())
