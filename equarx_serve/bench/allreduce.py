"""`equarx-serve bench allreduce`: all-reduce methods side by side, per mesh and message size.

For every mesh, `--devices N` (one process, N host CPU devices) or `--processes N` (N local
processes, one CPU device each, jax.distributed over gloo; with `--link RATE`, on N emulated
hosts joined by links of that rate, the link measured first: see `links.py`), and every message
size, one worker run (`allreduce_worker.py`, which documents exactly what is timed) measures all
methods, in a fresh child process so that the device count can be set before JAX starts.
Reported per row:

  median ms     of the timed calls (p10 and p90 in the JSON), the slowest process's time
  speed-up      the baseline's median / this method's median, where the BASELINE is the
                fastest unquantized method at that mesh and size: the lowest median among the
                measured methods that do not quantize this message (`AllReduce.quantizes`:
                psum, psum-f32, ring, or a gated one); none when no such method was measured
  wire MiB      bytes each device sends, counted from the compiled program's HLO
                (`hlo_bytes.py`); flagged when it differs from the method's `wire_bytes` formula
  bytes ratio   wire bytes / the baseline's wire bytes
  vs bytes      efficiency against the byte bound: speed-up / (1 / bytes ratio), where
                1 / bytes ratio is the speed-up that the bytes saved alone would give; 1.0 when
                a method beats the baseline exactly by the bytes it saves
  vs link       with --link: efficiency against the link: the time the wire bytes need at
                the MEASURED link rate / the median (1.0: as fast as the link allows)
  rel RMS, max  the output against an f32 all-reduce with an f32 output, over all devices:
                ||y - ref|| / ||ref|| and max |y - ref|
  identical     whether every device's output has the same bits

`--pre-rotated` adds, for every method with a foldable input rotation (`equarx-int8`'s
Hadamard), a second row labelled `LABEL [pre-rotated input]`: the collective as the model uses it
(`ar.with_rotated_input()`), its input already rotated (as by the folded weights), so only the
inverse transform runs. The method's own row stays the standalone collective (it rotates its
input itself); both are timed in the same rounds.

`--timeline` (one device a process) traces one more call of every method after the timed
rounds, on every process, and prints where each process spent it (`timeline.py`): when it
started (from the earliest start on any process), how long its collectives, its kernels (custom
calls: EQuARX's native quantize/decode) and its other compute ran, how long it ran nothing of
the call between its first and last operation, and when it finished. The spans go to --json.

`--plain` (processes meshes): every size is measured twice, back to back on the same processes'
hosts: joined by the project's launcher (`multiprocess.initialize`, which measures the link
right after joining), then joined as a user's own program would (`jax.distributed.initialize`
with gloo, nothing else: the first all-reduce traced measures the link). Each run has its own
table (speed-up against its own baseline); a third table gives every method's median joined
plainly / joined by the launcher (`plain_over_launcher` on the plain rows of the JSON, whose
rows carry `join`). Every worker checks that its processes lowered the same programs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from equarx_serve.arguments import UsageError, argument_type, int_at_least
from equarx_serve.bench import links, provenance
from equarx_serve.collectives.registry import MethodSpec, parse_method
from equarx_serve.distributed.cluster import Link
from equarx_serve.distributed.devices import with_huge_pages

if TYPE_CHECKING:
    from equarx_serve.distributed.multiprocess import Hosts

DEFAULT_SIZES = ("64KiB", "256KiB", "1MiB", "4MiB", "16MiB", "64MiB")
WORKER_TIMEOUT_S = 1800.0
BF16_BYTES = 2

_UNITS = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_SIZE = re.compile(r"(?P<count>\d+)\s*(?P<unit>[kmg]ib)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from `65536`, `64KiB`, `16MiB` or `1GiB` (a whole number of bf16 elements)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"invalid size {text!r}: use a byte count or a number with KiB, MiB or GiB"
        )
    size = int(match["count"]) * _UNITS[(match["unit"] or "").lower()]
    if size <= 0 or size % BF16_BYTES:
        raise ValueError(f"invalid size {text!r}: must be a positive, even number of bytes")
    return size


def format_size(size: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if size % _UNITS[unit.lower()] == 0:
            return f"{size // _UNITS[unit.lower()]}{unit}"
    return f"{size}B"


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What `run` measures; `repeats=None` is adaptive (see `allreduce_worker.py`)."""

    meshes: tuple[tuple[str, int], ...]  # (mode, N): ("devices", 4), ("processes", 2)
    sizes: tuple[int, ...]
    methods: tuple[MethodSpec, ...] | None = None  # None: every registered all-reduce
    repeats: int | None = None
    json_path: Path | None = None
    plot_path: Path | None = None
    seed: int = 0
    link: Link | None = None  # the processes' meshes on emulated hosts joined by this link
    pre_rotated: bool = False  # also time foldable methods on pre-rotated input (see above)
    timeline: bool = False  # trace one more call of each method on every process (see above)
    plain: bool = False  # also join every processes mesh as a plain program (see above)


PRE_ROTATED_SUFFIX = " [pre-rotated input]"


def resolve_methods(
    methods: Sequence[MethodSpec] | None, *, pre_rotated: bool = False, sizes: Sequence[int] = ()
) -> list[dict[str, object]]:
    """Checks names and options against the registry (imports JAX); UsageError if invalid.
    With `pre_rotated`, every method with a foldable rotation gets a second entry (its label +
    `PRE_ROTATED_SUFFIX`, `rotated_input` true); every size must then hold whole rotation
    blocks."""
    from equarx_serve.collectives import get_all_reduce, list_all_reduces

    specs = list(methods) if methods is not None else [parse_method(n) for n in list_all_reduces()]
    labels = [spec.label for spec in specs]
    if duplicates := sorted({label for label in labels if labels.count(label) > 1}):
        raise UsageError(f"method(s) given more than once: {', '.join(duplicates)}")
    resolved = []
    for spec in specs:
        try:
            ar = get_all_reduce(spec.name, **spec.options)
        except ValueError as e:
            raise UsageError(f"method {spec.label!r}: {e}") from None
        resolved.append(dataclasses.asdict(spec) | {"rotated_input": False})
        if pre_rotated and (rotation := ar.foldable_rotation) is not None:
            if bad := [s for s in sizes if not rotation.divides(s // BF16_BYTES)]:
                raise UsageError(
                    f"--pre-rotated: {spec.label} rotates groups of {rotation.block} elements; "
                    f"size(s) {', '.join(map(format_size, bad))} do not hold whole groups"
                )
            label = spec.label + PRE_ROTATED_SUFFIX
            resolved.append(dataclasses.asdict(spec) | {"label": label, "rotated_input": True})
    if pre_rotated and not any(m["rotated_input"] for m in resolved):
        raise UsageError("--pre-rotated: no method given has a foldable input rotation")
    return resolved


def _run_worker(
    mode: str,
    n: int,
    size: int,
    methods: list[dict[str, object]],
    config: BenchConfig,
    hosts: Hosts | None,
    join: str = "launcher",
) -> dict[str, object]:
    """One worker run (N processes, on `hosts` if given, joined as `join` says, or one process
    with N devices); the parsed result."""
    from equarx_serve.bench import allreduce_worker
    from equarx_serve.distributed import multiprocess

    devices = n if mode == "devices" else None
    command = allreduce_worker.command(
        size,
        methods,
        devices=devices,
        repeats=config.repeats,
        seed=config.seed,
        with_timeline=config.timeline,
        join=join,
    )
    if mode == "processes":
        outputs = multiprocess.run_local_processes(
            command, n, timeout_s=WORKER_TIMEOUT_S, hosts=hosts
        )
        return allreduce_worker.parse_result(outputs[0].stdout)
    env = with_huge_pages(os.environ)
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command[:3])} exited with {done.returncode}:\n{done.stderr[-4000:]}"
        )
    return allreduce_worker.parse_result(done.stdout)


def add_comparisons(result: dict[str, object]) -> None:
    """Adds baseline, speedup, bytes_ratio, byte_bound_efficiency, wire_match, and with a
    measured link (result["link"]) link_ms and link_efficiency, to every row of one result."""
    rows = result["rows"]
    unquantized = [row for row in rows if not row["quantized"]]
    baseline = min(unquantized, key=lambda row: row["median_ms"], default=None)
    for row in rows:
        row["wire_match"] = row["wire_bytes_hlo_total"] == row["wire_bytes_formula"]
        row["link_ms"] = links.link_time_ms(row["wire_bytes_hlo_total"], result.get("link"))
        row["link_efficiency"] = None if row["link_ms"] is None else row["link_ms"] / row[
            "median_ms"]  # fmt: skip
        row["baseline"] = row["speedup"] = row["bytes_ratio"] = None
        row["byte_bound_efficiency"] = None
        if baseline is not None:
            row["baseline"] = baseline["label"]
            row["speedup"] = baseline["median_ms"] / row["median_ms"]
            row["bytes_ratio"] = row["wire_bytes_hlo_total"] / max(
                baseline["wire_bytes_hlo_total"], 1
            )
            row["byte_bound_efficiency"] = row["speedup"] * row["bytes_ratio"]


def _render(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell, a rule under the header; the first two left-aligned."""
    lines = [header, *rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    lines.insert(1, ["-" * w for w in widths])
    text = []
    for line in lines:
        cells = enumerate(zip(line, widths, strict=True))
        text.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in cells))
    return "\n".join(text)


def format_timelines(mode: str, n: int, results: list[dict[str, object]], link: Link | None) -> str:
    """Every traced row's per-process summary (`timeline.py`), one table per mesh."""
    header = [
        "size",
        "method",
        "process",
        "start",
        "collective",
        "kernel",
        "compute",
        "idle",
        "end",
        "ready",
    ]
    lines = []
    for result in results:
        for row in result["rows"]:
            for process in (row.get("timeline") or {}).get("summary", []):
                busy = process["busy_ms"]
                lines.append(
                    [
                        format_size(result["size_bytes"]),
                        row["label"],
                        str(process["process"]),
                        f"{process['start_ms']:.1f}",
                        *(f"{busy[kind]:.1f}" for kind in ("collective", "kernel", "compute")),
                        f"{process['idle_ms']:.1f}",
                        f"{process['end_ms']:.1f}",
                        or_dash(process.get("ready_ms"), ".1f"),
                    ]
                )
    title = (
        f"== timeline of one call, {mesh_title(mode, n, link)}: ms from the call's earliest "
        "start on any process; collective/kernel/compute: time its ops of that kind ran; idle: "
        "between its first and last op, nothing of the call running; end: its last op ended; "
        "ready: its result was ready (after the last asynchronous kernel) =="
    )
    return "\n".join([title, _render(header, lines)])


def _span(values: list[float]) -> str:
    """`values` as "low-high" to two decimals, or one number where they print alike."""
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return low if low == high else f"{low}-{high}"


def mesh_title(mode: str, n: int, link: Link | None = None) -> str:
    if mode == "devices":
        return f"{n} devices (1 process)"
    if link is None:
        return f"{n} processes (gloo, loopback)"
    return f"{n} emulated hosts (gloo over TCP, links of {link})"


def _table_row(size: int, row: dict[str, object]) -> list[str]:
    wire_match = "yes" if row["wire_match"] else f"MISMATCH ({row['wire_bytes_formula']} B)"
    return [
        format_size(size),
        row["label"] + ("*" if row["label"] == row["baseline"] else ""),
        f"{row['median_ms']:.3f}",
        or_dash(row["speedup"], ".2f", "x"),
        f"{row['wire_bytes_hlo_total'] / 2**20:.3f}",
        or_dash(row["bytes_ratio"], ".3f"),
        percent(row["byte_bound_efficiency"]),
        or_dash(row["link_ms"], ".3f"),
        percent(row["link_efficiency"]),
        wire_match,
        f"{row['rel_rms']:.2e}",
        f"{row['max_abs']:.3g}",
        "yes" if row["identical"] else "NO",
    ]


def or_dash(value: float | None, spec: str, suffix: str = "") -> str:
    """`value` in the format `spec`, then `suffix`; "-" where there is none."""
    return "-" if value is None else format(value, spec) + suffix


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


_HEADER = ["size", "method", "median ms", "speed-up", "wire MiB", "bytes ratio", "vs bytes",
           "link ms", "vs link", "HLO = formula", "rel RMS", "max abs", "identical"]  # fmt: skip


def format_table(
    mode: str, n: int, results: Sequence[dict[str, object]], link: Link | None = None
) -> str:
    """The terminal table of one mesh's results (one per size); the baseline is marked *."""
    rows = [_table_row(r["size_bytes"], row) for r in results for row in r["rows"]]
    text = [
        f"\n== all-reduce, {mesh_title(mode, n, link)}, bf16; "
        "speed-up and bytes ratio vs the fastest unquantized method (*) ==",
        _render(_HEADER, rows),
    ]
    mismatches = [
        f"{format_size(r['size_bytes'])} {row['label']}"
        for r in results
        for row in r["rows"]
        if not row["wire_match"]
    ]
    if mismatches:
        text.append(
            "WARNING: the wire bytes counted in the compiled HLO differ from the method's "
            f"wire_bytes formula for: {'; '.join(mismatches)}"
        )
    return "\n".join(text)


# What the plot shows, one row of panels each: (row field, y label, reference line).
_PLOT_ROWS = (
    ("speedup", "speed-up vs fastest unquantized", 1.0),
    ("byte_bound_efficiency", "vs byte bound: speed-up x bytes ratio", 1.0),
    ("link_efficiency", "vs link: link-limited time / time", 1.0),
)


def write_plot(results: Sequence[dict[str, object]], path: Path, link: Link | None) -> None:
    """Per mesh (columns), against message size (log x), one line per method: the speed-up,
    the efficiency against the byte bound and, with a link, against the link; as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    meshes = list(dict.fromkeys((r["mode"], r["n"]) for r in results))
    plotted = [spec for spec in _PLOT_ROWS if any(
        row[spec[0]] is not None for r in results for row in r["rows"])]  # fmt: skip
    fig, axes = plt.subplots(len(plotted), len(meshes), squeeze=False,
                             figsize=(6 * len(meshes), 3.8 * len(plotted)))  # fmt: skip
    for col, (mode, n) in enumerate(meshes):
        mine = sorted((r for r in results if (r["mode"], r["n"]) == (mode, n)),
                      key=lambda r: r["size_bytes"])  # fmt: skip
        sizes = [r["size_bytes"] for r in mine]
        for ax, (field, ylabel, reference) in zip(axes[:, col], plotted, strict=True):
            series: dict[str, list[tuple[int, float]]] = {}
            for r in mine:
                for row in r["rows"]:
                    if row[field] is not None:
                        series.setdefault(row["label"], []).append((r["size_bytes"], row[field]))
            for label, points in series.items():
                ax.plot(*zip(*points, strict=True), marker="o", label=label)
            ax.axhline(reference, color="gray", linewidth=0.8, linestyle="--")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [format_size(s) for s in sizes])
            ax.set_xlabel("message size per device (bf16)")
            ax.set_ylabel(ylabel)
            ax.set_title(mesh_title(mode, n, link if mode == "processes" else None), fontsize=9)
            ax.grid(True, alpha=0.3)
    legend = {
        label: handle
        for ax in axes.flat
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True)
    }
    fig.legend(legend.values(), legend.keys(), loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_json(results: Sequence[dict[str, object]], config: BenchConfig, path: Path) -> None:
    """Every row, flattened with its mesh and size, the link measured on each emulated mesh,
    and the settings of the run."""
    import jax

    settings = {
        "meshes": [{"mode": mode, "n": n} for mode, n in config.meshes],
        "sizes_bytes": list(config.sizes),
        "methods": [
            {"label": row["label"], "name": row["name"], "options": row["options"]}
            for row in results[0]["rows"]
        ],
        "repeats": "adaptive" if config.repeats is None else config.repeats,
        "dtype": "bfloat16",
        "seed": config.seed,
        "baseline_rule": "fastest median among methods that do not quantize the message",
        "link": None if config.link is None else dataclasses.asdict(config.link),
        "jax_version": jax.__version__,
        "python_version": platform.python_version(),
        "host_cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    rows = [
        {"mode": r["mode"], "n": r["n"], "size_bytes": r["size_bytes"], "repeats": r["repeats"]}
        | {"join": r.get("join", "launcher")}
        | row
        for r in results
        for row in r["rows"]
    ]
    measured = {(r["mode"], r["n"]): r["link"] for r in results if r.get("link") is not None}
    link_measurements = [{"mode": mode, "n": n} | m for (mode, n), m in measured.items()]
    # one a worker: each size's processes measure the link when they start
    transport_probes = [
        {"mode": r["mode"], "n": r["n"], "size_bytes": r["size_bytes"], "join": r.get("join")}
        | r["transport_probe"]
        for r in results
        if r.get("transport_probe")
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "provenance": provenance.collect(link_measurements[0] if link_measurements else None),
        "settings": settings,
        "link_measurements": link_measurements,
        "transport_probes": transport_probes,
        "rows": rows,
    }
    path.write_text(json.dumps(document, indent=1) + "\n")


def joins(mode: str, config: BenchConfig) -> tuple[str, ...]:
    """How the worker's processes join on a mesh: the launcher's way, and with --plain also
    a plain program's (see the module doc)."""
    return ("launcher", "plain") if config.plain and mode == "processes" else ("launcher",)


def add_plain_over_launcher(results: Sequence[dict[str, object]]) -> None:
    """Sets `plain_over_launcher` (median joined plainly / joined by the launcher, same mesh,
    size and label) on every plain row."""
    launcher = {
        (r["mode"], r["n"], r["size_bytes"], row["label"]): row["median_ms"]
        for r in results
        if r["join"] == "launcher"
        for row in r["rows"]
    }
    for r in results:
        if r["join"] == "plain":
            for row in r["rows"]:
                key = (r["mode"], r["n"], r["size_bytes"], row["label"])
                row["plain_over_launcher"] = row["median_ms"] / launcher[key]


def format_plain_table(mode: str, n: int, results: Sequence[dict[str, object]], link) -> str:
    """Every method's median joined by the launcher and plainly, and their ratio."""
    header = ["size", "method", "launcher ms", "plain ms", "plain / launcher", "plain speed-up"]
    lines = [
        [
            format_size(r["size_bytes"]),
            row["label"],
            f"{row['median_ms'] / row['plain_over_launcher']:.3f}",
            f"{row['median_ms']:.3f}",
            f"{row['plain_over_launcher']:.3f}",
            or_dash(row["speedup"], ".2f", "x"),
        ]
        for r in results
        if r["join"] == "plain"
        for row in r["rows"]
    ]
    title = (
        f"\n== plain jax.distributed program vs the launcher, {mesh_title(mode, n, link)}: "
        "medians measured back to back in this run, same hosts and sizes =="
    )
    return "\n".join([title, _render(header, lines)])


def _measure_mesh(
    mode: str, n: int, methods: list[dict[str, object]], config: BenchConfig, bar
) -> list[dict[str, object]]:
    """Every size on one mesh (on emulated hosts when the config has a link, the link measured
    first), each way of joining (`joins`); one table printed for each. RuntimeError etc. when a
    worker or the cluster fails."""
    link = config.link if mode == "processes" else None
    mesh_results = []
    with links.hosts_for(n, link) as (hosts, measurement):
        for size in config.sizes:
            for join in joins(mode, config):
                bar.set_postfix_str(f"{mode}={n} {format_size(size)} {join}")
                result = _run_worker(mode, n, size, methods, config, hosts, join)
                result["mode"] = mode
                result["join"] = join
                result["link"] = measurement
                add_comparisons(result)
                mesh_results.append(result)
                bar.update(len(methods))
    for join in joins(mode, config):
        table = format_table(mode, n, [r for r in mesh_results if r["join"] == join], link)
        bar.write(table if not config.plain else f"{table}\n(joined by: {join})")
    if config.plain and mode == "processes":
        add_plain_over_launcher(mesh_results)
        bar.write(format_plain_table(mode, n, mesh_results, link))
    if config.timeline:
        bar.write(format_timelines(mode, n, mesh_results, link))
    rates = [r["transport_probe"]["bits_per_s"] / 1e9 for r in mesh_results
             if r.get("transport_probe")]  # fmt: skip
    if rates:
        sliced = ", ".join(
            f"{format_size(r['size_bytes'])} {row['label']} {row['slices']}"
            for r in mesh_results
            for row in r["rows"]
            if (row.get("slices") or 1) > 1
        )
        pieces = sorted(
            {row["gather_piece_bytes"] for r in mesh_results for row in r["rows"]} - {None, 0}
        )
        sends = any(row.get("send_pieces") for r in mesh_results for row in r["rows"])
        in_pieces = (
            "; two-shot's all-gather in pieces of at most "
            + ", ".join(format_size(p) for p in pieces)
            + (", its sends too" if sends else "")
        )
        bar.write(
            f"transport probe (what slice_bytes='auto' and two-shot's pieces go by): "
            f"{_span(rates)} Gbit/s sent per device (each size's processes measured it); "
            f"{'slices: ' + sliced if sliced else 'no row sliced'}{in_pieces if pieces else ''}"
        )
    return mesh_results


def run(config: BenchConfig) -> int:
    """Measures every (mesh, size), prints one table per mesh, writes JSON/plot if asked.
    Returns the exit code: 1 when a worker or the emulated cluster fails (its error is
    printed), else 0."""
    from tqdm import tqdm

    methods = resolve_methods(config.methods, pre_rotated=config.pre_rotated, sizes=config.sizes)
    results: list[dict[str, object]] = []
    total = sum(len(joins(mode, config)) for mode, _ in config.meshes)
    total *= len(config.sizes) * len(methods)
    with tqdm(total=total, unit="method", desc="all-reduce bench") as bar:
        for mode, n in config.meshes:
            try:
                results += _measure_mesh(mode, n, methods, config, bar)
            except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
                link = config.link if mode == "processes" else None
                bar.write(f"error: {mesh_title(mode, n, link)}: {e}", file=sys.stderr)
                return 1
    if config.json_path:
        write_json(results, config, config.json_path)
        print(f"wrote {config.json_path}")
    if config.plot_path:
        write_plot(results, config.plot_path, config.link)
        print(f"wrote {config.plot_path}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `bench allreduce`."""
    parser.add_argument(
        "--devices",
        nargs="+",
        type=argument_type(int_at_least(2)),
        default=[],
        metavar="N",
        help="one process with N host CPU devices (several N: one mesh each)",
    )
    parser.add_argument(
        "--processes",
        nargs="+",
        type=argument_type(int_at_least(2)),
        default=[],
        metavar="N",
        help="N local processes, one CPU device each, gloo (default: 2)",
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        type=argument_type(parse_size),
        metavar="SIZE",
        default=[parse_size(s) for s in DEFAULT_SIZES],
        help=f"bytes per device, e.g. 65536 64KiB 16MiB (default: {' '.join(DEFAULT_SIZES)})",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        type=argument_type(parse_method),
        metavar="METHOD",
        help="all-reduces, each NAME or NAME:key=value,... (default: every registered one)",
    )
    parser.add_argument(
        "--repeats",
        type=argument_type(int_at_least(1)),
        metavar="R",
        help="timed calls per method and size (default: adaptive, ~0.5 s per method, 5 to 50)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every row here")
    parser.add_argument("--plot", type=Path, metavar="PATH", help="write a speed-up plot (PNG)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the input data")
    parser.add_argument(
        "--pre-rotated",
        action="store_true",
        help="also time every method with a foldable input rotation as the model uses it: input "
        "already rotated, only the inverse transform (rows labelled "
        f"'{PRE_ROTATED_SUFFIX.strip()}')",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="after the timed rounds, trace one more call of each method on every process "
        "(--processes only) and print where its time went: collectives, kernels, other "
        "compute, idle (see bench/timeline.py); the spans go to --json",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="(--processes) also join every size's processes as a user's own program would "
        "(plain jax.distributed.initialize, no explicit link measurement), back to back with "
        "the launcher's, and print plain / launcher per method",
    )
    links.add_arguments(parser, argument_type)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    meshes = [("devices", n) for n in args.devices] + [("processes", n) for n in args.processes]
    meshes = list(dict.fromkeys(meshes)) or [("processes", 2)]
    if args.timeline and args.devices:
        raise UsageError("--timeline traces one device a process: use --processes, not --devices")
    try:
        link = links.link_from_args(args, processes=any(m == "processes" for m, _ in meshes))
    except ValueError as e:
        raise UsageError(str(e)) from None
    return BenchConfig(
        meshes=tuple(meshes),
        sizes=tuple(sorted(set(args.sizes))),
        methods=None if args.methods is None else tuple(args.methods),
        repeats=args.repeats,
        json_path=args.json,
        plot_path=args.plot,
        seed=args.seed,
        link=link,
        pre_rotated=args.pre_rotated,
        timeline=args.timeline,
        plain=args.plain,
    )
