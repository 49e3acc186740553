"""`equarx-serve bench prefill`: tensor-parallel Gemma 3 prefill latency per all-reduce method.

For every sequence length, one worker run (`prefill_worker.py`, which documents exactly what
is timed) loads the model (bf16 parameters), shards it over TP devices (one process with TP
host CPU devices, or `--processes N`: N local processes over gloo, TP = N; with `--link RATE`
on N emulated hosts joined by links of that rate, the link measured first: see `links.py`) and
times the prefill of `batch` random prompts (logits at the last token) with every method,
interleaved. Reported per row:

  median ms     of the timed prefills (p10 and p90 too), the slowest process's time
  speed-up      the baseline's median / this method's median, where the BASELINE (*) is the
                fastest unquantized method: the lowest median among the methods that do not
                quantize this prefill's messages (psum, psum-f32, ring, or a gated one)
  AR share      MEASURED: (t_method - t_no_reduce) / t_method, where NO-REDUCE is the same
                program with every all-reduce replaced by the identity (the compute alone);
                AR ms = t_method - t_no_reduce (with --overlap-chunks, against the no-reduce
                program of the same chunks: the all-reduce time the overlap leaves exposed)
  overlap       --overlap-chunks K: rows `<method>/overlap=K` run the layers' row-parallel
                sections on K token chunks, so that one chunk's all-reduce can be on the wire
                while the next chunk's compute runs (`models.gemma3`, "Overlap")
  vs bytes      efficiency against the byte bound: speed-up / the speed-up the bytes alone
                would give, t_base / (t_no_reduce + AR ms of the baseline x bytes ratio), with
                bytes ratio = wire bytes / the baseline's (the compute does not shrink)
  vs link       with --link: the time the wire bytes need at the MEASURED link rate / AR ms
  gated         the method sent a message this size to plain psum (equarx-int8's
                min_size_bytes gate; pass e.g. equarx-int8:min_size_bytes=0 to turn it off)
  wire MiB      bytes each device sends per prefill, from the compiled HLO (XLA:CPU widens
                bf16 all-reduces to f32), and the model's reductions (2 per layer)
  logits        relative RMS and top-1 agreement of the last-token logits against psum

PROJECTION (not measured): t_proj = t_no_reduce (measured here) + wire bytes / link bandwidth,
with the wire bytes of the program before XLA:CPU's widening (bf16 all-reduces as bf16), for the
links in `LINKS`. It ignores the device cost of quantizing, per-message latency and any
overlap of communication with compute, and takes the CPU's compute time as the device's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from equarx_serve.arguments import UsageError, argument_type, chunks_or_auto, int_at_least
from equarx_serve.bench import links, provenance
from equarx_serve.bench.allreduce import or_dash, percent, resolve_methods
from equarx_serve.collectives.registry import MethodSpec, parse_method
from equarx_serve.distributed.cluster import Link
from equarx_serve.distributed.devices import with_huge_pages

if TYPE_CHECKING:
    from equarx_serve.distributed.multiprocess import Hosts

DEFAULT_MODEL = "gemma3-270m"
DEFAULT_SEQ_LENS = (128, 512, 2048)
MAX_SEQ_LEN = 4096
DEFAULT_METHODS = ("psum", "equarx-int8:min_size_bytes=0")
BASELINE = "psum"
WORKER_TIMEOUT_S = 3600.0

# Link bandwidth per direction, bytes/s, for the PROJECTION.
LINKS = {
    "TPU v5e ICI": {
        "bytes_per_s": 45e9,
        "note": "ASSUMPTION: ~45 GB/s per direction per ICI link",
    },
    "NVLink 4 (H100)": {"bytes_per_s": 450e9, "note": "450 GB/s per direction"},
    "PCIe Gen4 x16": {"bytes_per_s": 25e9, "note": "~25 GB/s per direction"},
}
PROJECTION_NOTE = (
    "PROJECTION, not a measurement: t_proj = t_no_reduce measured on this CPU + comm, "
    "comm = wire bytes (bf16 all-reduces counted as bf16) / link bandwidth. Ignores the "
    "device's cost of quantizing, per-message latency and communication/compute overlap; "
    "the CPU's compute time stands in for the device's (an accelerator computes far faster, "
    "so comm is a larger share there: combine comm ms with a device's own compute time)."
)


@dataclasses.dataclass(frozen=True)
class PrefillBenchConfig:
    """What `run` measures; `repeats=None` is adaptive (see `prefill_worker.py`)."""

    model: str = DEFAULT_MODEL
    tp: int = 2
    processes: int | None = None  # N local processes (tp = N); None: one process, tp devices
    batch: int = 1
    seq_lens: tuple[int, ...] = DEFAULT_SEQ_LENS
    methods: tuple[MethodSpec, ...] = ()
    repeats: int | None = None
    checkpoint: Path | None = None
    tokenizer: Path | None = None
    json_path: Path | None = None
    plot_path: Path | None = None
    seed: int = 0
    # One process of a multi-host run (each host runs the same command with its own id; tp =
    # num_processes, one device per process; process 0 prints the tables and writes the files).
    coordinator: str | None = None
    process_id: int = 0
    link: Link | None = None  # with processes: on emulated hosts joined by this link
    # token chunks of the overlap to measure (1: none; "auto": the engines' default)
    overlap_chunks: tuple[int | str, ...] = (1,)


def _validate(config: PrefillBenchConfig) -> list[dict[str, object]]:
    """Checks the settings (imports JAX); UsageError if invalid. Returns the methods."""
    from models.config import get_config
    from models.gemma3 import ShardLayout

    try:
        model_config = get_config(config.model)
        ShardLayout.create(model_config, config.tp)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if (config.checkpoint is None) != (config.tokenizer is None):
        raise UsageError("--checkpoint and --tokenizer go together")
    methods = resolve_methods(config.methods)
    if BASELINE not in [m["label"] for m in methods]:
        raise UsageError(f"the methods must include {BASELINE!r} (the baseline)")
    return methods


def _run_worker(
    seq_len: int,
    methods: list[dict[str, object]],
    config: PrefillBenchConfig,
    hosts: Hosts | None = None,
) -> dict[str, object] | None:
    """One worker run for one sequence length (--processes on `hosts` if given); the parsed
    result (None on a multi-host process other than 0, which reports nothing)."""
    from equarx_serve.bench import prefill_worker
    from equarx_serve.distributed import multiprocess

    command = prefill_worker.command(
        config.model,
        methods,
        seq_len=seq_len,
        batch=config.batch,
        devices=None if config.processes or config.coordinator else config.tp,
        repeats=config.repeats,
        seed=config.seed,
        checkpoint=config.checkpoint,
        tokenizer=config.tokenizer,
        overlap_chunks=config.overlap_chunks,
    )
    if config.coordinator:
        command += ["--coordinator", config.coordinator, "--num-processes", str(config.tp)]
        command += ["--process-id", str(config.process_id)]
    elif config.processes:
        outputs = multiprocess.run_local_processes(
            command, config.processes, timeout_s=WORKER_TIMEOUT_S, hosts=hosts
        )
        return prefill_worker.parse_result(outputs[0].stdout)
    env = with_huge_pages(os.environ)
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command[:3])} exited with {done.returncode}:\n{done.stderr[-4000:]}"
        )
    return prefill_worker.parse_result(done.stdout) if config.process_id == 0 else None


def add_comparisons(result: dict[str, object]) -> None:
    """Adds the baseline, speedup, ar_share, ar_ms, byte_bound_efficiency, link_ms,
    link_efficiency and hidden_fraction (None without a measured link, result["link"]),
    vs_compute (over the compute alone, whole messages) and the PROJECTION (vs psum) to every
    row of one result. A row's compute is the no-reduce time of its own
    overlap chunks (`no_reduce_time_ms`)."""
    rows = result["rows"]
    unquantized = [row for row in rows if not row["quantized"]]
    baseline = min(unquantized, key=lambda row: row["median_ms"])  # psum is always measured
    ar_base = baseline["median_ms"] - no_reduce_time_ms(result, baseline)
    for row in rows:
        t_none = no_reduce_time_ms(result, row)
        row["baseline"] = baseline["label"]
        row["speedup"] = baseline["median_ms"] / row["median_ms"]
        row["ar_ms"] = row["median_ms"] - t_none
        row["ar_share"] = row["ar_ms"] / row["median_ms"]
        bytes_ratio = row["wire_bytes_hlo_total"] / baseline["wire_bytes_hlo_total"]
        t_byte_bound = t_none + ar_base * bytes_ratio
        row["byte_bound_efficiency"] = row["speedup"] / (baseline["median_ms"] / t_byte_bound)
        row["link_ms"] = links.link_time_ms(row["wire_bytes_hlo_total"], result.get("link"))
        measurable = row["link_ms"] is not None and row["ar_ms"] > 0
        row["link_efficiency"] = row["link_ms"] / row["ar_ms"] if measurable else None
        # With overlap, the all-reduce time the compute does not hide (ar_ms: exposed) is less
        # than its bytes' link time: the hidden fraction is 1 - exposed / link time.
        row["hidden_fraction"] = 1 - row["ar_ms"] / row["link_ms"] if row["link_ms"] else None
        row["vs_compute"] = row["median_ms"] / result["no_reduce"]["median_ms"]
        row["PROJECTION"] = _projection(row, rows, result["no_reduce"]["median_ms"])


def no_reduce_time_ms(result: dict[str, object], row: dict[str, object]) -> float:
    """The median of the no-reduce program with the row's overlap chunks (the whole-message
    one for rows without overlap)."""
    chunks = row.get("overlap_chunks", 1)
    no_reduce = result["no_reduce"] if chunks == 1 else result["no_reduce_overlap"][str(chunks)]
    return no_reduce["median_ms"]


def _projection(row: dict, rows: list[dict], t_none: float) -> dict[str, dict[str, float]]:
    """t_proj per link in LINKS (see the module doc), with its speed-up over psum's t_proj."""
    psum = next(r for r in rows if r["label"] == BASELINE)
    projection = {}
    for link, spec in LINKS.items():
        comm_ms = row["wire_bytes_projection"] / spec["bytes_per_s"] * 1e3
        psum_ms = t_none + psum["wire_bytes_projection"] / spec["bytes_per_s"] * 1e3
        projection[link] = {
            "comm_ms": comm_ms,
            "t_proj_ms": t_none + comm_ms,
            "speedup_vs_psum": psum_ms / (t_none + comm_ms),
            "share": comm_ms / (t_none + comm_ms),
        }
    return projection


def _format(lines: list[list[str]], left: int = 2) -> list[str]:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    lines.insert(1, ["-" * w for w in widths])
    return [
        "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(
            zip(line, widths, strict=True)))
        for line in lines
    ]  # fmt: skip


def _mode(config: PrefillBenchConfig) -> str:
    if config.coordinator:
        return "multi-host"
    return "processes" if config.processes else "devices"


def mesh_title(config: PrefillBenchConfig) -> str:
    if config.coordinator:
        return f"TP={config.tp} over {config.tp} processes (gloo, coordinator {config.coordinator})"
    if config.processes and config.link:
        return (f"TP={config.processes} over {config.processes} emulated hosts (gloo over TCP, "
                f"links of {config.link})")  # fmt: skip
    if config.processes:
        return f"TP={config.processes} over {config.processes} processes (gloo, loopback)"
    return f"TP={config.tp} over {config.tp} devices (1 process)"


def _timelines(results: Sequence[dict[str, object]]) -> list[str]:
    """Each overlapped row's timeline of one layer (`prefill_timeline`), where recorded."""
    from equarx_serve.bench import prefill_timeline

    text = []
    for r in results:
        for row in r["rows"]:
            if row.get("timeline"):
                label = f"{r['seq_len']} tokens, {row['label']}"
                text += prefill_timeline.format_summary(label, row["timeline"])
    if text:
        text.insert(
            0,
            "\n== timeline of one layer of one overlapped prefill, per process "
            "(the exchange's clock: started, bytes all arrived, waited for, done) ==",
        )
    return text


def format_tables(results: Sequence[dict[str, object]], config: PrefillBenchConfig) -> str:
    """The measured table, the PROJECTION table and peak memory."""
    first = results[0]
    text = [
        f"\n== prefill, {config.model} ({first['dtype']}), {mesh_title(config)}, "
        f"batch {config.batch}, last-token logits; MEASURED on CPU; speed-up vs the fastest "
        "unquantized method (*) =="
    ]
    header = ["seq", "method", "median ms", "p10-p90 ms", "speed-up", "vs compute",
              "AR share", "AR ms", "wire MiB/dev", "vs bytes", "link ms", "vs link", "hidden",
              "reductions", "HLO collectives", "logits relRMS", "top-1"]  # fmt: skip
    lines = [header]
    for r in results:
        for row in r["rows"]:
            label = row["label"] + ("*" if row["label"] == row["baseline"] else "")
            label += " (GATED->psum)" if row["gated"] else ""
            hlo = ", ".join(f"{n} {k}" for k, n in sorted(row["hlo_collectives"].items()))
            lines.append([
                str(r["seq_len"]), label, f"{row['median_ms']:.1f}",
                f"{row['p10_ms']:.1f}-{row['p90_ms']:.1f}", f"{row['speedup']:.3f}x",
                f"{row['vs_compute']:.2f}x", f"{100 * row['ar_share']:.1f}%",
                f"{row['ar_ms']:.1f}", f"{row['wire_bytes_hlo_total'] / 2**20:.2f}",
                percent(row["byte_bound_efficiency"]),
                or_dash(row["link_ms"], ".1f"), percent(row["link_efficiency"]),
                percent(row["hidden_fraction"]), str(row["num_reductions"]), hlo,
                f"{row['logits_rel_rms_vs_first']:.2e}", f"{row['top1_agree_vs_first']:.2f}",
            ])  # fmt: skip
        no_reduce = [("", r["no_reduce"])]
        no_reduce += [(f"/overlap={k}", nr) for k, nr in r.get("no_reduce_overlap", {}).items()]
        for suffix, nr in no_reduce:
            lines.append([
                str(r["seq_len"]), f"(no-reduce{suffix}: compute only)", f"{nr['median_ms']:.1f}",
                f"{nr['p10_ms']:.1f}-{nr['p90_ms']:.1f}", "", "", "", "", "0", "", "", "", "",
                "0", "", "", "",
            ])  # fmt: skip
    text += _format(lines)
    text += _timelines(results)
    gated = sorted({row["label"] for r in results for row in r["rows"] if row["gated"]})
    if gated:
        text.append(
            f"GATED: {', '.join(gated)} sent these messages to plain psum (size gate "
            "min_size_bytes); add min_size_bytes=0 to quantize them."
        )
    text.append(f"\n== PROJECTION (not measured), {mesh_title(config)} ==")
    for link, spec in LINKS.items():
        text.append(f"  {link}: {spec['note']}")
    header = ["seq", "method", "proj wire MiB/dev"]
    for link in LINKS:
        header += [f"{link} ms", "comm ms", "vs psum"]
    lines = [header]
    for r in results:
        for row in r["rows"]:
            line = [str(r["seq_len"]), row["label"], f"{row['wire_bytes_projection'] / 2**20:.2f}"]
            for link in LINKS:
                p = row["PROJECTION"][link]
                line += [
                    f"{p['t_proj_ms']:.1f}",
                    f"{p['comm_ms']:.3f}",
                    f"{p['speedup_vs_psum']:.3f}x",
                ]
            lines.append(line)
    text += _format(lines)
    text.append(PROJECTION_NOTE)
    text.append("\npeak memory (ru_maxrss) per process:")
    for r in results:
        mems = ", ".join(f"p{i} {m:.0f} MiB" for i, m in enumerate(r["peak_rss_mib"]))
        text.append(f"  seq {r['seq_len']}: {mems}")
    return "\n".join(text)


def write_plot(results: Sequence[dict[str, object]], path: Path) -> None:
    """Against sequence length, per method: latency (and no-reduce's), the all-reduce share,
    and the efficiencies against the byte bound (solid) and, with a link, the link (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    seq = [r["seq_len"] for r in results]
    fig, (ax_t, ax_s, ax_e) = plt.subplots(1, 3, figsize=(18, 4.5))
    for label in [row["label"] for row in results[0]["rows"]]:
        rows = [next(row for row in r["rows"] if row["label"] == label) for r in results]
        line = ax_t.plot(seq, [row["median_ms"] for row in rows], marker="o", label=label)[0]
        ax_s.plot(seq, [100 * row["ar_share"] for row in rows], marker="o", label=label)
        ax_e.plot(seq, [100 * row["byte_bound_efficiency"] for row in rows], marker="o",
                  color=line.get_color(), label=f"{label} vs bytes")  # fmt: skip
        if any(row["link_efficiency"] is not None for row in rows):
            link_efficiency = [row["link_efficiency"] for row in rows]
            ax_e.plot(seq, [None if e is None else 100 * e for e in link_efficiency],
                      marker="s", linestyle="--", color=line.get_color(),
                      label=f"{label} vs link")  # fmt: skip
    ax_t.plot(seq, [r["no_reduce"]["median_ms"] for r in results], marker="x", linestyle="--",
              color="gray", label="no-reduce (compute only)")  # fmt: skip
    ax_e.set_ylabel("efficiency, % (vs byte bound; vs link)")
    for ax in (ax_t, ax_s, ax_e):
        ax.set_xscale("log", base=2)
        ax.set_xticks(seq, [str(s) for s in seq])
        ax.set_xlabel("prompt length (tokens)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_t.set_yscale("log")
    ax_t.set_ylabel("prefill median ms")
    ax_s.set_ylabel("all-reduce share of prefill, % (measured)")
    fig.suptitle(f"{results[0]['model']} prefill, TP={results[0]['tp']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_json(
    results: Sequence[dict[str, object]], config: PrefillBenchConfig, path: Path
) -> None:
    """Every number, plus the settings of the run."""
    import jax

    first = results[0]
    settings = {
        "model": config.model,
        "model_info": first["model_info"],
        "weights_sha256": first["model_info"].get("weights_sha256"),
        "dtype": first["dtype"],
        "tp": first["tp"],
        "processes": first["num_processes"],
        "mode": _mode(config),
        "batch": config.batch,
        "seq_lens": list(config.seq_lens),
        "methods": [
            {"label": row["label"], "name": row["name"], "options": row["options"]}
            for row in first["rows"]
        ],
        "baseline_rule": "fastest median among methods that do not quantize the messages",
        "projection_baseline": BASELINE,
        "link": None if config.link is None else dataclasses.asdict(config.link),
        "overlap_chunks": list(config.overlap_chunks),
        "repeats": "adaptive" if config.repeats is None else config.repeats,
        "seed": config.seed,
        "links": LINKS,
        "projection_note": PROJECTION_NOTE,
        "jax_version": jax.__version__,
        "python_version": platform.python_version(),
        "host_cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    rows, runs = [], []
    for r in results:
        common = {k: r[k] for k in ("seq_len", "bucket", "repeats", "message_bytes")}
        rows += [common | row for row in r["rows"]]
        runs.append({k: v for k, v in r.items() if k not in ("rows", "model_info")})
    document = {"provenance": provenance.collect(first.get("link")), "settings": settings,
                "link_measurement": first.get("link"), "rows": rows, "runs": runs}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")


def run(config: PrefillBenchConfig) -> int:
    """Measures every sequence length, prints the tables, writes JSON/plot if asked.
    Returns the exit code: 1 when a worker or the emulated cluster fails (its error is
    printed), else 0."""
    methods = _validate(config)
    try:
        results = _measure(methods, config)
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not results:
        print(f"process {config.process_id}: done; process 0 prints the results")
        return 0
    print(format_tables(results, config))
    if config.json_path:
        write_json(results, config, config.json_path)
        print(f"wrote {config.json_path}")
    if config.plot_path:
        write_plot(results, config.plot_path)
        print(f"wrote {config.plot_path}")
    return 0


def _measure(
    methods: list[dict[str, object]], config: PrefillBenchConfig
) -> list[dict[str, object]]:
    """Every sequence length (on emulated hosts with a link, measured first); the results of
    process 0 (none on the other processes of a multi-host run)."""
    from tqdm import tqdm

    results = []
    with (
        links.hosts_for(config.processes, config.link) as (hosts, measurement),
        tqdm(total=len(config.seq_lens), unit="seq len", desc="prefill bench") as bar,
    ):
        for seq_len in config.seq_lens:
            bar.set_postfix_str(f"seq {seq_len}")
            try:
                result = _run_worker(seq_len, methods, config, hosts)
            except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
                raise type(e)(f"seq {seq_len}: {e}") from e
            bar.update(1)
            if result is not None:
                result["link"] = measurement
                add_comparisons(result)
                results.append(result)
    return results


def _seq_len(text: str) -> int:
    value = int_at_least(1)(text)
    if value > MAX_SEQ_LEN:
        raise ValueError(f"invalid sequence length {value}: at most {MAX_SEQ_LEN}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `bench prefill`."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="config name (default: %(default)s"
                        ", real weights; other names are random-init)")  # fmt: skip
    parser.add_argument(
        "--tp",
        type=argument_type(int_at_least(1)),
        metavar="N",
        help="tensor-parallel degree: N host CPU devices in one process (default: 2)",
    )
    parser.add_argument(
        "--processes",
        type=argument_type(int_at_least(2)),
        metavar="N",
        help="N local processes, one CPU device each, gloo; TP = N",
    )
    parser.add_argument("--batch", type=argument_type(int_at_least(1)), default=1, metavar="B")
    parser.add_argument(
        "--seq-lens",
        nargs="+",
        type=argument_type(_seq_len),
        default=list(DEFAULT_SEQ_LENS),
        metavar="L",
        help=f"prompt lengths, up to {MAX_SEQ_LEN} (default: "
        f"{' '.join(map(str, DEFAULT_SEQ_LENS))})",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        type=argument_type(parse_method),
        default=[],
        metavar="METHOD",
        help=f"all-reduces, each NAME or NAME:key=value,..., measured in addition to "
        f"{' '.join(DEFAULT_METHODS)}",
    )
    parser.add_argument(
        "--repeats",
        type=argument_type(int_at_least(1)),
        metavar="R",
        help="timed rounds (default: adaptive, ~3 s per method, 3 to 20)",
    )
    parser.add_argument("--checkpoint", type=Path, metavar="PATH", help="orbax checkpoint folder")
    parser.add_argument("--tokenizer", type=Path, metavar="PATH", help="its tokenizer.model")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every number here")
    parser.add_argument("--plot", type=Path, metavar="PATH", help="write a latency plot (PNG)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument(
        "--overlap-chunks",
        nargs="+",
        type=argument_type(chunks_or_auto),
        default=[1],
        metavar="K",
        help="also measure every method with its layers on K token chunks whose all-reduces "
        "overlap compute, rows METHOD/overlap=K; 'auto': the count the engines' default "
        "chooses for this run (default: 1, none)",
    )
    links.add_arguments(parser, argument_type)
    hosts = parser.add_argument_group(
        "several hosts", "run the same command on every host, each with its own --process-id"
    )
    hosts.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    hosts.add_argument("--num-processes", type=argument_type(int_at_least(2)), metavar="N",
                       help="processes in all, one CPU device each; TP = N")  # fmt: skip
    hosts.add_argument("--process-id", type=argument_type(int_at_least(0)), default=0,
                       metavar="I", help="this process, 0 to N-1 (default: 0)")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> PrefillBenchConfig:
    if (args.coordinator is None) != (args.num_processes is None):
        raise UsageError("--coordinator and --num-processes go together")
    if args.coordinator and (args.processes or args.tp not in (None, args.num_processes)):
        raise UsageError("with --coordinator, TP = --num-processes: drop --processes and --tp")
    if args.coordinator and args.process_id >= args.num_processes:
        raise UsageError(f"--process-id must be < --num-processes ({args.num_processes})")
    if args.processes and args.tp not in (None, args.processes):
        raise UsageError(f"--tp {args.tp} conflicts with --processes {args.processes} (TP = N)")
    try:
        link = links.link_from_args(args, processes=bool(args.processes))
    except ValueError as e:
        raise UsageError(str(e)) from None
    methods = [parse_method(m) for m in DEFAULT_METHODS]
    labels = {m.label for m in methods}
    methods += [m for m in args.methods if m.label not in labels]
    return PrefillBenchConfig(
        model=args.model,
        tp=args.num_processes or args.processes or args.tp or 2,
        processes=args.processes,
        batch=args.batch,
        seq_lens=tuple(sorted(set(args.seq_lens))),
        methods=tuple(methods),
        repeats=args.repeats,
        checkpoint=args.checkpoint,
        tokenizer=args.tokenizer,
        json_path=args.json,
        plot_path=args.plot,
        seed=args.seed,
        link=link,
        overlap_chunks=tuple(dict.fromkeys([1, *args.overlap_chunks])),
        coordinator=args.coordinator,
        process_id=args.process_id,
    )
