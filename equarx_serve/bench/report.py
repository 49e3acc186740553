"""`equarx-serve report`: the docs' tables, rendered from the benchmarks' own JSON.

    equarx-serve report [RESULTS]                  print every table of RESULTS (docs/results)
    equarx-serve report [RESULTS] --update FILES   rewrite the generated blocks in FILES
    equarx-serve report [RESULTS] --check FILES    exit 1 when a block in FILES is stale

A generated block sits between two markers in a Markdown file:

    <!-- report:NAME -->
    ...
    <!-- /report:NAME -->

NAME is a JSON file's stem in RESULTS (`allreduce-n2-1gbit` renders
`allreduce-n2-1gbit.json`), or `headline`: the README's one table, built from the all-reduce,
prefill, eval and llama.cpp results that are present. Every table names its source JSON and that
run's provenance (bench/provenance.py: date, commit, machine, the link measured, the exact
command); a JSON written before provenance existed says "no provenance recorded", nothing
guessed. Links in a block are relative to the file that holds it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from equarx_serve.arguments import UsageError

DEFAULT_RESULTS = Path("docs/results")
BLOCK = re.compile(r"(<!-- report:([\w.-]+) -->\n)(.*?)(<!-- /report:\2 -->)", re.DOTALL)
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Source:
    """One results JSON: its path and its parsed document."""

    path: Path
    document: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.stem


@dataclasses.dataclass(frozen=True)
class Table:
    """A Markdown table: a header and rows of already formatted cells."""

    header: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.header) + " |", "|" + "---|" * len(self.header)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in self.rows])


def load(results: Path) -> dict[str, Source]:
    """Every *.json in `results`, by stem."""
    paths = sorted(results.glob("*.json"))
    return {p.stem: Source(p, json.loads(p.read_text())) for p in paths}


def kind_of(document: dict[str, Any]) -> str:
    """Which benchmark wrote `document`, from its own keys."""
    if document.get("benchmark") == "lowering":
        return "lowering"
    if "compute_floor" in document and "decode_weights" in document:
        return "eval-decode"
    if "compute_floor" in document and "methods" in document:
        return "eval"
    if "link_measurements" in document:
        plain = any(r.get("join") == "plain" for r in document["rows"])
        return "allreduce-plain" if plain else "allreduce"
    if "runs" in document and "link_measurement" in document:
        return "prefill"
    if "limits" in document and "machine" in document:
        return "compare"
    if "ttft" in document and "load" in document:
        return "serve"
    raise ValueError(f"not a result this report knows (keys: {sorted(document)[:8]})")


def _link(target: Path, base: Path) -> str:
    """`target` relative to the folder `base`, with forward slashes."""
    return Path(os.path.relpath(target, base)).as_posix()


def _rate(bits_per_s: float) -> str:
    return (
        f"{bits_per_s / 1e9:.3g} Gbit/s" if bits_per_s >= 1e9 else f"{bits_per_s / 1e6:.3g} Mbit/s"
    )


def _machine(m: dict[str, Any]) -> str:
    memory = f", {m['memory_bytes'] / 2**30:.0f} GiB" if m.get("memory_bytes") else ""
    cores = m.get("usable_cores") or m.get("cpu_count")
    return (f"{m.get('cpu', '?')}, {cores} cores{memory}, {m.get('system', '?')}, "
            f"jax {m.get('jax_version', '?')}, Python {m.get('python_version', '?')}")  # fmt: skip


def provenance_line(source: Source, base: Path) -> str:
    """The source JSON and where it came from, as one Markdown paragraph."""
    head = f"Source: [`{source.path.name}`]({_link(source.path, base)})"
    p = source.document.get("provenance")
    if p is None:
        return f"{head}: no provenance recorded (written before runs recorded their provenance)."
    commit = (p.get("commit") or "unknown")[:10] + (
        " (uncommitted changes)" if p.get("dirty") else ""
    )
    parts = [f"date {p['date']}", f"commit `{commit}`", f"machine: {_machine(p['machine'])}"]
    link = p.get("link_measured")
    if link:
        parts.append(f"link measured: {_rate(link['measured_bits_per_s'])} of "
                     f"{_rate(link['configured_bits_per_s'])} configured")  # fmt: skip
    else:
        parts.append("no link measured (no emulated hosts)")
    return f"{head}; " + "; ".join(parts) + f"; command: `{p['command']}`."


def _num(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _speedup_over(rows: list[dict[str, Any]], row: dict[str, Any], label: str) -> float | None:
    """`label`'s median / `row`'s median, both measured in the same run; None without it."""
    other = next((r for r in rows if r["label"] == label), None)
    return None if other is None else other["median_ms"] / row["median_ms"]


def allreduce_table(document: dict[str, Any]) -> Table:
    """Per mesh, size and method: median, speed-up over the ring, wire bytes, link efficiency,
    error."""
    header = ["mesh", "MiB/device", "method", "median ms", "vs ring", "wire MiB/dev", "vs link",
              "rel RMS"]  # fmt: skip
    rows = []
    for r in document["rows"]:
        group = [
            o for o in document["rows"] if (o["n"], o["size_bytes"]) == (r["n"], r["size_bytes"])
        ]
        rows.append([f"{r['mode']} N={r['n']}", f"{r['size_bytes'] / MIB:g}", r["label"],
                     f"{r['median_ms']:.1f}", _num(_speedup_over(group, r, "ring"), ".2f", "x"),
                     f"{r['wire_bytes_hlo_total'] / MIB:.2f}", _pct(r.get("link_efficiency")),
                     _num(r.get("rel_rms"), ".2e")])  # fmt: skip
    return Table(header, rows)


def allreduce_plain_table(document: dict[str, Any]) -> Table:
    """`bench allreduce --plain`: per mesh, size and method, the median joined by the launcher
    and by a plain `jax.distributed` program (same processes, back to back), their ratio, and
    each one's speed-up over the ring joined the same way."""
    header = ["mesh", "MiB/device", "method", "launcher ms", "plain ms", "plain / launcher",
              "plain vs ring", "launcher vs ring", "plain vs link"]  # fmt: skip
    rows = []
    plain = [r for r in document["rows"] if r["join"] == "plain"]
    for r in plain:
        key = (r["n"], r["size_bytes"])
        same = [o for o in document["rows"] if (o["n"], o["size_bytes"]) == key]
        by_join = {j: [o for o in same if o["join"] == j] for j in ("plain", "launcher")}
        launcher = next(o for o in by_join["launcher"] if o["label"] == r["label"])
        rows.append([f"{r['mode']} N={r['n']}", f"{r['size_bytes'] / MIB:g}", r["label"],
                     f"{launcher['median_ms']:.1f}", f"{r['median_ms']:.1f}",
                     f"{r['median_ms'] / launcher['median_ms']:.3f}",
                     _num(_speedup_over(by_join["plain"], r, "ring"), ".2f", "x"),
                     _num(_speedup_over(by_join["launcher"], launcher, "ring"), ".2f", "x"),
                     _pct(r.get("link_efficiency"))])  # fmt: skip
    return Table(header, rows)


def prefill_table(document: dict[str, Any]) -> Table:
    """Per prompt length and method: median, speed-up over the (unoverlapped) ring, time over
    the compute alone, the all-reduce time left exposed, the share of its bytes' link time
    the overlap hid, and (overlapped rows with a timeline) each process's time blocked waiting
    for the exchange's bytes over one prefill; the compute alone (no all-reduce) as its own
    row."""
    header = ["tokens", "method", "median ms", "vs ring", "vs compute", "exposed all-reduce ms",
              "wire MiB/dev", "link ms", "hidden", "blocked in waits ms"]  # fmt: skip
    rows = []
    for run in document["runs"]:
        tokens, compute = run["seq_len"], run["no_reduce"]["median_ms"]
        group = [r for r in document["rows"] if r["seq_len"] == tokens]
        rows.append([str(tokens), "compute alone (no all-reduce)", f"{compute:.1f}", "-",
                     "1.00x", "0", "0", "-", "-", "-"])  # fmt: skip
        for r in group:
            link_ms = r.get("link_ms")
            hidden = 1 - r["ar_ms"] / link_ms if link_ms else None
            label = r["label"] + (" (default)" if r["label"] == default_label(run) else "")
            rows.append([str(tokens), label, f"{r['median_ms']:.1f}",
                         _num(_speedup_over(group, r, "ring"), ".2f", "x"),
                         f"{r['median_ms'] / compute:.2f}x", f"{r['ar_ms']:.1f}",
                         f"{r['wire_bytes_hlo_total'] / MIB:.1f}", _num(link_ms, ".1f"),
                         _pct(hidden), _blocked(r)])  # fmt: skip
    return Table(header, rows)


def _blocked(row: dict[str, Any]) -> str:
    """A prefill row's per-process blocked time ("p0 / p1 ..."), "-" without a timeline."""
    timeline = row.get("timeline")
    if not timeline:
        return "-"
    return " / ".join(f"{ms:.1f}" for ms in timeline["blocked_ms"])


def default_label(run: dict[str, Any]) -> str:
    """The row of `METHOD` as the engines run it by default: overlapped in the chunks
    overlap_chunks="auto" chose for the run (`auto_overlap_chunks`), else whole."""
    chunks = run.get("auto_overlap_chunks", 1)
    return METHOD if chunks == 1 else f"{METHOD}/overlap={chunks}"


def eval_table(document: dict[str, Any]) -> Table:
    """Per method (and the float32 compute floor): perplexity, KL to bf16 psum, KL as a multiple
    of the floor's, top-1 agreement."""
    header = ["method", "perplexity", "KL mean", "KL / floor", "top-1 agreement", "KL p99"]
    entries = [("float32 compute (noise floor)", document["compute_floor"])]
    entries += list(document["methods"].items())
    rows = [[label, f"{m['perplexity']:.3f}", f"{m['kl_mean']:.2e}",
             _num(m.get("kl_mean_vs_floor"), ".2f", "x"), _pct4(m["top1_agreement"]),
             f"{m['kl_p99']:.2e}"] for label, m in entries]  # fmt: skip
    return Table(header, rows)


def eval_decode_table(document: dict[str, Any]) -> Table:
    """`eval --weights gguf`: the teacher-forced decode steps on the GGUF blocks against the
    bf16 decode and the exact (float32) checkpoint, and bf16 against exact (the floor)."""
    decode = document["decode_weights"]
    header = ["decode weights", "against", "KL mean", "top-1 agreement", "max abs logit diff"]
    entries = [
        ("GGUF blocks (int8 form)", "bf16 decode", decode["vs_bf16"]["gguf"]),
        ("GGUF blocks (int8 form)", "exact checkpoint (float32)", decode["vs_float32"]["gguf"]),
        ("bf16 (the floor)", "exact checkpoint (float32)", decode["vs_float32"]["bf16"]),
    ]
    rows = [[weights, against, f"{m['kl']:.2e}", _pct4(m["top1"]), f"{m['max_abs']:.3f}"]
            for weights, against, m in entries]  # fmt: skip
    return Table(header, rows)


def _pct4(value: float) -> str:
    return f"{100 * value:.2f}%"


def lowering_table(document: dict[str, Any]) -> Table:
    """Per program, platform, device count and variant: lowered or not, and what its
    collectives carry."""
    header = ["program", "platform", "N", "variant", "lowered", "wire (collective results)"]
    rows = []
    for r in document["results"]:
        by_dtype: dict[str, int] = {}
        for c in r["collectives"]:
            by_dtype[c["dtype"]] = by_dtype.get(c["dtype"], 0) + c["bytes"]
        wire = ", ".join(f"{d} {b / MIB:.2f} MiB" for d, b in by_dtype.items())
        status = "yes" if r["lowered"] else f"no: {(r['error'] or '')[:60]}"
        rows.append([r["program"], r["platform"], str(r["devices"]), r["variant"], status,
                     wire or "-"])  # fmt: skip
    return Table(header, rows)


def compare_table(document: dict[str, Any]) -> Table:
    """Each workload's two sides: prefill's median time, decode's tokens/s (all sequences and
    one), and this project's speed over llama.cpp's on it (>1: faster)."""
    header = [
        "workload",
        "side",
        "median ms",
        "tokens/s",
        "tokens/s a sequence",
        "speed vs llama.cpp",
    ]
    theirs = {r["workload"]: r for r in document["rows"] if r["side"].startswith("llama.cpp")}
    rows = []
    for r in document["rows"]:
        other = theirs.get(r["workload"])
        ratio = None
        if other is not None and other is not r:
            if "median_ms" in r:
                ratio = other["median_ms"] / r["median_ms"]
            else:
                ratio = r["tokens_per_s"] / other["tokens_per_s"]
        rows.append([r["workload"], r["side"], _num(r.get("median_ms"), ".1f"),
                     _num(r.get("tokens_per_s"), ".1f"),
                     _num(r.get("tokens_per_s_per_sequence"), ".1f"),
                     _num(ratio, ".2f", "x")])  # fmt: skip
    return Table(header, rows)


def served_table(document: dict[str, Any]) -> Table:
    """`bench compare --serve-clients`: each server at each concurrency (output tokens/s from
    usage, latency, time to first token, a stream's decode rate where its stream carries
    usage), then the project's in-process Generator on the same prompts."""
    served = document.get("served")
    if not served:
        raise ValueError("this bench compare run has no serving comparison (--serve-clients)")
    header = ["clients", "server", "output tokens/s", "speed vs llama-cpp-python server",
              "latency p50 / p99 s", "TTFT p50 / p99 s", "decode tokens/s a stream",
              "errors"]  # fmt: skip
    levels = served["levels"]
    ours = levels[0]["server"]  # the project's server comes first
    theirs = {x["clients"]: x for x in levels if x["server"] != ours}
    rows = []
    for x in sorted(levels, key=lambda x: (x["clients"], x["server"] != ours)):
        other = theirs.get(x["clients"])
        ratio = None if other is None or other is x else (
            x["output_tokens_per_s"] / other["output_tokens_per_s"])  # fmt: skip
        rows.append([str(x["clients"]), x["server"], _num(x["output_tokens_per_s"], ".1f"),
                     _num(ratio, ".2f", "x"),
                     f"{x['latency_p50_s']:.2f} / {x['latency_p99_s']:.2f}",
                     f"{x['ttft_p50_s']:.2f} / {x['ttft_p99_s']:.2f}",
                     _num(x["stream_decode_tokens_per_s"], ".1f"), str(x["errors"])])  # fmt: skip
    generate = served["generate_decode_tokens_per_s"]
    rows.append(["1", "the Generator in-process, same prompts", "-", "-", "-", "-",
                 _num(generate, ".1f"), "-"])  # fmt: skip
    return Table(header, rows)


def serve_table(document: dict[str, Any]) -> Table:
    """Time to first token of the long prompt per served method (`bench serve`), and each one's
    speed-up over the first, measured in the same run."""
    ttft = document["ttft"]
    first = next(iter(ttft), "")
    header = ["server", "prompt tokens", "TTFT median s", f"speed-up vs `{first}`", "runs s"]
    rows = [[label, str(t["prompt_tokens"]), f"{t['median_s']:.2f}",
             f"{ttft[first]['median_s'] / t['median_s']:.2f}x",
             ", ".join(f"{s:.2f}" for s in t["seconds"])] for label, t in ttft.items()]  # fmt: skip
    return Table(header, rows)


RENDERERS: dict[str, Callable[[dict[str, Any]], Table]] = {
    "allreduce": allreduce_table,
    "allreduce-plain": allreduce_plain_table,
    "prefill": prefill_table,
    "eval": eval_table,
    "eval-decode": eval_decode_table,
    "lowering": lowering_table,
    "compare": compare_table,
    "serve": serve_table,
}


def render_source(source: Source, base: Path) -> str:
    """One JSON's table and its provenance, as Markdown."""
    table = RENDERERS[kind_of(source.document)](source.document)
    return table.markdown() + "\n\n" + provenance_line(source, base)


METHOD = "equarx-int8"
# Which results the headline reads, in its order: (stem pattern, what, anchor in
# benchmarks.md). The prefill's: the 2048-token TP = 2 runs (the others are in benchmarks.md).
HEADLINE = (
    (r"allreduce-n\d+-.*", "all-reduce, {mesh}, {size} MiB/device, {link} link", "all-reduce"),
    (r"prefill-tp2-\d+mbit", "prefill, {tokens} tokens, TP={tp}, {link} link", "prefill"),
    ("eval-tp2-default", "quality, 270M at TP=2 (KL to bf16 psum)", "quality-eval"),
    ("compare-llama-cpp", "against llama.cpp, same GGUF, 2 threads vs TP=2", "against-llamacpp"),
)


def _configured(document: dict[str, Any]) -> str:
    link = document["provenance"].get("link_measured") if "provenance" in document else None
    return _rate(link["configured_bits_per_s"]) if link else "loopback"


def _allreduce_cells(document: dict[str, Any]) -> tuple[dict[str, str], str]:
    rows = document["rows"]
    size = max(r["size_bytes"] for r in rows)
    group = [r for r in rows if r["size_bytes"] == size]
    ours = next(r for r in group if r["label"] == METHOD)
    ring = _num(_speedup_over(group, ours, "ring"), ".2f", "x")
    text = f"{ring} over the 16-bit ring; {_pct(ours.get('link_efficiency'))} of the link"
    what = {"mesh": f"N={ours['n']}", "size": f"{size / MIB:g}", "link": _configured(document)}
    return what, text


def _prefill_cells(document: dict[str, Any]) -> tuple[dict[str, str], str]:
    run = max(document["runs"], key=lambda run: run["seq_len"])
    group = [r for r in document["rows"] if r["seq_len"] == run["seq_len"]]
    ours = next((r for r in group if r["label"] == default_label(run)), None)
    ours = ours or next(r for r in group if r["label"].startswith(METHOD))  # no default row
    ring = _num(_speedup_over(group, ours, "ring"), ".2f", "x")
    text = f"{ring} over the 16-bit ring"
    if ours["label"] != METHOD and ours.get("overlap_chunks", 1) > 1:
        overlapped = f"ring/overlap={ours['overlap_chunks']}"
        text += f" ({_num(_speedup_over(group, ours, overlapped), '.2f', 'x')} over it overlapped)"
    compute = ours["median_ms"] / run["no_reduce"]["median_ms"]
    what = {"tokens": str(run["seq_len"]), "tp": str(document["settings"]["tp"]),
            "link": _configured(document)}  # fmt: skip
    return what, f"{text}; {compute:.2f}x the compute alone"


def _eval_cells(document: dict[str, Any]) -> tuple[dict[str, str], str]:
    m = document["methods"][METHOD]
    text = (f"KL {m['kl_mean']:.1e} = {m['kl_mean_vs_floor']:.2f}x the bf16 noise floor; "
            f"top-1 agreement {_pct4(m['top1_agreement'])}")  # fmt: skip
    return {}, text


def _compare_cells(document: dict[str, Any]) -> tuple[dict[str, str], str]:
    """The longest prefill's and batch-1 decode's speed over llama.cpp's (>1: faster)."""
    ours = {r["workload"]: r for r in document["rows"] if r["side"].startswith("this project")}
    theirs = {r["workload"]: r for r in document["rows"] if r["side"].startswith("llama.cpp")}
    parts = []
    prefills = [w for w in ours if w.startswith("prefill") and w in theirs]
    if prefills:
        longest = max(prefills, key=lambda w: int(w.split()[-1]))
        ratio = theirs[longest]["median_ms"] / ours[longest]["median_ms"]
        parts.append(f"{longest} tokens {ratio:.2f}x")
    if "decode batch 1" in ours and "decode batch 1" in theirs:
        ratio = ours["decode batch 1"]["tokens_per_s"] / theirs["decode batch 1"]["tokens_per_s"]
        parts.append(f"decode batch 1 {ratio:.2f}x")
    return {}, "; ".join(parts) + " llama.cpp's speed" if parts else "no comparable rows"


CELLS = {"allreduce": _allreduce_cells, "prefill": _prefill_cells, "eval": _eval_cells,
         "compare": _compare_cells}  # fmt: skip


def headline(sources: dict[str, Source], base: Path, docs: Path) -> str:
    """The README's table: one row a headline result present in `sources`, each result linking
    to its benchmark's section in docs/benchmarks.md, then every source's provenance."""
    rows, used = [], []
    for pattern, what, anchor in HEADLINE:
        for name in sorted(n for n in sources if re.fullmatch(pattern, n)):
            source = sources[name]
            fields, text = CELLS[kind_of(source.document)](source.document)
            how = f"{_link(docs / 'benchmarks.md', base)}#{anchor}"
            rows.append([what.format(**fields), f"[{text}]({how})",
                         f"[`{source.path.name}`]({_link(source.path, base)})"])  # fmt: skip
            used.append(source)
    table = Table(["measured", METHOD, "source"], rows).markdown()
    return table + "\n\n" + "\n\n".join(provenance_line(s, base) for s in used)


# Blocks `NAME.PART`: another table of the same result.
PARTS: dict[str, Callable[[dict[str, Any]], Table]] = {"served": served_table}


def render_block(name: str, sources: dict[str, Source], markdown_file: Path) -> str:
    """The text of block `name` (a result's stem, or `stem.part`) for a block in
    `markdown_file`."""
    base = markdown_file.parent
    if name == "headline":
        docs = next(iter(sources.values())).path.parent.parent
        return headline(sources, base, docs)
    stem, _, part = name.partition(".")
    if stem not in sources:
        raise ValueError(f"{markdown_file}: block {name!r}: no {stem}.json in the results")
    if not part:
        return render_source(sources[stem], base)
    if part not in PARTS:
        raise ValueError(f"{markdown_file}: block {name!r}: no part {part!r} ({sorted(PARTS)})")
    source = sources[stem]
    return PARTS[part](source.document).markdown() + "\n\n" + provenance_line(source, base)


def updated(text: str, sources: dict[str, Source], markdown_file: Path) -> str:
    """`text` with every generated block rendered anew."""

    def replace(match: re.Match[str]) -> str:
        body = render_block(match.group(2), sources, markdown_file)
        return f"{match.group(1)}{body}\n{match.group(4)}"

    return BLOCK.sub(replace, text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="?", type=Path, default=DEFAULT_RESULTS,
                        help=f"folder of results JSON (default: {DEFAULT_RESULTS})")  # fmt: skip
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--update", nargs="+", type=Path, metavar="FILE",
                      help="rewrite the generated blocks in these Markdown files")  # fmt: skip
    mode.add_argument("--check", nargs="+", type=Path, metavar="FILE",
                      help="exit 1 when a generated block in these files is stale")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Prints every table, or updates or checks the blocks of the files named; a missing
    folder, file or result is a usage error."""
    try:
        return _run(args)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(str(e)) from None


def _run(args: argparse.Namespace) -> int:
    sources = load(args.results)
    if not sources:
        raise ValueError(f"{args.results}: no *.json results")
    files: Sequence[Path] = args.update or args.check or []
    if not files:
        for source in sources.values():
            print(f"## {source.name}\n\n{render_source(source, Path.cwd())}\n")
        return 0
    stale = []
    for path in files:
        text = path.read_text()
        new = updated(text, sources, path)
        if new != text:
            stale.append(path)
            if args.update:
                path.write_text(new)
    verb = "updated" if args.update else "stale"
    for path in stale:
        print(f"{verb}: {path}")
    return 1 if stale and args.check else 0
