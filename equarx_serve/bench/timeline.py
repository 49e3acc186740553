"""Where one call's time goes on each process: XLA:CPU's operations, from a profiler trace.

XLA:CPU runs a compiled program as a graph of "thunks" (a fusion, a custom call such as
EQuARX's native kernels, a collective) and, while `jax.profiler` traces, records each one it
runs with its HLO op name and the run it belongs to. `trace_call(call, hlo_text)` traces one
call (`call` runs a barrier, then the program; the program's run is the last one to start) and
returns its `Span`s on this process; `op_kinds(hlo_text)` names each op's kind from the
compiled HLO: "collective" (all-gather, collective-permute, all-reduce, ...), "kernel" (a
custom call) or "compute" (everything else). Times are the host's wall clock (the trace's
start time plus each event's offset), so the spans of processes on one machine, or on hosts
with synchronized clocks, line up; `summarize` measures every process from the earliest start
of the call on any process.

What it shows (`ProcessSummary`): when the process started the call (its first span), how long
its collectives, kernels and other compute ran (the union of their spans: work on several
threads at once counts once), the time between its first and last span when it ran nothing of
the program (idle), when its last span ended, and when its result was ready (the caller's
clock when the call returned; given to `summarize`). What it does not show: a collective's span
is the whole time its thread is blocked in it, waiting for a late peer included; an
asynchronous kernel's span (two-shot's reduce and decode, `kernels/one_shot.cc`) is only its
dispatch, the time others wait for it counts as idle, and the work of the last one runs after
the last span: between the end and the result's being ready.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

KINDS = ("collective", "kernel", "compute")
_COLLECTIVE_OPCODES = {
    "all-gather",
    "all-gather-start",
    "all-reduce",
    "all-reduce-start",
    "all-to-all",
    "collective-broadcast",
    "collective-permute",
    "collective-permute-start",
    "reduce-scatter",
}
# `%name = <type> opcode(`: the type holds no "word(" (tuple types open with a bare "(").
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=.*?\b(?P<opcode>[a-z][\w\-]*)\("
)


@dataclasses.dataclass(frozen=True)
class Span:
    """One op of the program as this process ran it: [start_ns, end_ns) on the wall clock."""

    op: str
    kind: str
    start_ns: int
    end_ns: int


@dataclasses.dataclass(frozen=True)
class ProcessSummary:
    """One process's call, in ms from the earliest start of the call on any process."""

    process: int
    start_ms: float
    end_ms: float
    busy_ms: dict[str, float]  # kind -> the union of its spans
    idle_ms: float  # from start_ms to end_ms, with no span of the program running
    ready_ms: float | None = None  # when its result was ready (None: not given)


def op_kinds(hlo_text: str) -> dict[str, str]:
    """Each instruction of a compiled module's HLO text -> its kind (see the module doc)."""
    kinds = {}
    for line in hlo_text.splitlines():
        if (match := _INSTRUCTION.match(line)) is None:
            continue
        opcode = match["opcode"]
        if opcode in _COLLECTIVE_OPCODES:
            kinds[match["name"]] = "collective"
        elif opcode == "custom-call":
            kinds[match["name"]] = "kernel"
        else:
            kinds[match["name"]] = "compute"
    return kinds


def spans_of_last_run(
    events: Iterable[tuple[str, int, int, int]], kinds: dict[str, str]
) -> list[Span]:
    """The spans of the last run to start, from (op, run_id, start_ns, duration_ns) events;
    ops the HLO does not name count as compute."""
    by_run: dict[int, list[Span]] = {}
    for op, run_id, start, duration in events:
        span = Span(op, kinds.get(op, "compute"), start, start + duration)
        by_run.setdefault(run_id, []).append(span)
    if not by_run:
        return []
    last = max(by_run.values(), key=lambda spans: min(s.start_ns for s in spans))
    return sorted(last, key=lambda s: (s.start_ns, s.end_ns))


def trace_call(call: Callable[[], None], hlo_text: str) -> list[Span]:
    """Traces `call()` (a barrier, then the program whose compiled HLO is `hlo_text`) with
    `jax.profiler` and returns the program's spans on this process."""
    import jax

    with tempfile.TemporaryDirectory(prefix="equarx-timeline-") as directory:
        jax.profiler.start_trace(directory)
        try:
            call()
        finally:
            jax.profiler.stop_trace()
        paths = list(Path(directory).glob("plugins/profile/*/*.xplane.pb"))
        if len(paths) != 1:
            raise RuntimeError(f"jax.profiler wrote {len(paths)} traces, want 1, in {directory}")
        return spans_of_last_run(_thunk_events(paths[0]), op_kinds(hlo_text))


def _thunk_events(path: Path) -> list[tuple[str, int, int, int]]:
    """(op, run_id, start_ns, duration_ns) of every thunk in an XSpace file (wall clock)."""
    from jax.profiler import ProfileData

    profile = ProfileData.from_file(str(path))
    environment = [dict(p.stats) for p in profile.planes if p.name == "Task Environment"]
    if not environment or "profile_start_time" not in environment[0]:
        raise RuntimeError(f"no profile_start_time in {path}: cannot place its events in time")
    origin = int(environment[0]["profile_start_time"])  # ns since the epoch; events count from it
    events = []
    for plane in profile.planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" in stats and "run_id" in stats:
                    events.append(
                        (
                            str(stats["hlo_op"]),
                            int(stats["run_id"]),
                            origin + int(event.start_ns),
                            int(event.duration_ns),
                        )
                    )
    return events


def _union_ns(spans: Iterable[Span]) -> int:
    total, reach = 0, None
    for span in sorted(spans, key=lambda s: s.start_ns):
        if reach is None or span.start_ns > reach:
            total += span.end_ns - span.start_ns
            reach = span.end_ns
        elif span.end_ns > reach:
            total += span.end_ns - reach
            reach = span.end_ns
    return total


def earliest_start_ns(processes: list[list[Span]]) -> int | None:
    """The earliest start of any span of any process (None without spans): the call's origin."""
    return min((s.start_ns for spans in processes for s in spans), default=None)


def summarize(
    processes: list[list[Span]], ready_ns: list[int] | None = None
) -> list[ProcessSummary]:
    """Every process's spans (in process order) and, if given, the wall-clock time its result
    was ready -> its summary, in ms from `earliest_start_ns`; processes without a span are
    left out."""
    origin = earliest_start_ns(processes)
    if origin is None:
        return []
    if ready_ns is not None and len(ready_ns) != len(processes):
        raise ValueError(f"{len(ready_ns)} ready times for {len(processes)} processes")
    traced = [(p, spans) for p, spans in enumerate(processes) if spans]
    summaries = []
    for process, spans in traced:
        start = min(s.start_ns for s in spans)
        end = max(s.end_ns for s in spans)
        busy = {kind: _union_ns(s for s in spans if s.kind == kind) / 1e6 for kind in KINDS}
        summaries.append(
            ProcessSummary(
                process=process,
                start_ms=(start - origin) / 1e6,
                end_ms=(end - origin) / 1e6,
                busy_ms=busy,
                idle_ms=(end - start - _union_ns(spans)) / 1e6,
                ready_ms=None if ready_ns is None else (ready_ns[process] - origin) / 1e6,
            )
        )
    return summaries


def to_json(spans: list[Span], origin_ns: int) -> list[dict[str, object]]:
    """Spans as JSON rows, in ms from `origin_ns`."""
    return [
        {
            "op": s.op,
            "kind": s.kind,
            "start_ms": (s.start_ns - origin_ns) / 1e6,
            "end_ms": (s.end_ns - origin_ns) / 1e6,
        }
        for s in spans
    ]
