"""The eval report in four forms: a terminal table, JSON (every number and the settings),
Markdown, and a PNG of the per-layer all-reduce error by method."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from equarx_serve.bench import provenance

FLOOR_LABEL = "float32 model (compute floor)"

# (header, key, format) of the summary table, in order.
COLUMNS = (
    ("method", None, "{}"),
    ("ppl", "perplexity", "{:.4f}"),
    ("Δppl", "ppl_rel_change", "{:+.3%}"),
    ("KL mean", "kl_mean", "{:.2e}"),
    ("KL/floor", "kl_mean_vs_floor", "{:.2f}x"),
    ("KL to f32", "kl_to_float32", "{:.2e}"),
    ("KL p99", "kl_p99", "{:.2e}"),
    ("KL max", "kl_max", "{:.2e}"),
    ("top-1", "top1_agreement", "{:.2%}"),
    ("miss/floor", "top1_disagreement_vs_floor", "{:.2f}x"),
    ("top-5", "top5_overlap", "{:.2%}"),
    ("logit max|Δ|", "logit_max_abs_error", "{:.3f}"),
    ("logit mean|Δ|", "logit_mean_abs_error", "{:.4f}"),
    ("cosine", "logit_cosine_mean", "{:.6f}"),
    ("AR err last", "final_layer_error", "{:.2%}"),
    ("AR born max", "born_error_max", "{:.2%}"),
    ("greedy", "greedy_matched_mean", "{:.1f}"),
    ("greedy ±", "greedy_matched_stderr", "{:.1f}"),
    ("non-finite", "nonfinite", "{}"),
)
LEGEND = (
    "Against the reference ({reference}, BF16 model) over {scored} scored tokens. The compute "
    "floor is the same model computed in float32 (with {reference}): the difference bf16 "
    "arithmetic alone makes. Δppl: relative perplexity change. KL: KL(reference || method), "
    "nats per token; KL/floor: as a multiple of the floor's; KL to f32: KL(float32 model || "
    "method), the distance from the higher-precision model. top-1: argmax agreement; "
    "miss/floor: top-1 disagreement as a multiple of the floor's; top-5: overlap of the five "
    "most likely tokens. AR err last: relative error of the last all-reduce's output against "
    "the reference run's (accumulated through all layers); AR born max: the largest error one "
    "all-reduce adds to its own exact f32 sum. greedy: tokens of {greedy_tokens} greedily "
    "generated ones that match the reference's before the first divergence (mean over "
    "{greedy_prompts} prompts, ± its standard error). non-finite: NaN/Inf in logits and "
    "all-reduce outputs."
)


def rows(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, numbers) of the reference, the compute floor, then every other method."""
    reference, *others = report["methods"].items()
    return [reference, (FLOOR_LABEL, report["compute_floor"]), *others]


def _cells(report: dict[str, Any]) -> list[list[str]]:
    cells = []
    for label, numbers in rows(report):
        row = [label]
        for _, key, fmt in COLUMNS[1:]:
            value = numbers.get(key)
            row.append("-" if value is None else fmt.format(value))
        cells.append(row)
    return cells


def _legend(report: dict[str, Any]) -> str:
    settings = report["settings"]
    return LEGEND.format(
        reference=report["reference"],
        scored=settings["scored_tokens"],
        greedy_tokens=settings["greedy"]["tokens"],
        greedy_prompts=settings["greedy"]["prompts"],
    )


def _title(report: dict[str, Any]) -> str:
    s = report["settings"]
    return (
        f"{s['model']} at TP={s['tp']}, {s['num_seqs']} x {s['seq_len']} tokens of "
        f"{s['corpus']['name']}"
    )


def _aligned(headers: list[str], cells: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [headers, *cells]) for i in range(len(headers))]
    lines = []
    for row in [headers, *cells]:
        first, *rest = zip(row, widths, strict=True)
        lines.append("  ".join([first[0].ljust(first[1]), *(c.rjust(w) for c, w in rest)]))
    return lines


def decode_weights_cells(decode: dict[str, Any]) -> list[list[str]]:
    """The `--weights gguf` section's rows: (decode weights, against, KL, top-1, max |diff|)."""
    rows = [
        ("gguf blocks", "bf16", decode["vs_bf16"]["gguf"]),
        ("gguf blocks", "exact (float32)", decode["vs_float32"]["gguf"]),
        ("bf16 (the floor)", "exact (float32)", decode["vs_float32"]["bf16"]),
    ]
    return [
        [weights, against, f"{s['kl']:.2e}", f"{s['top1']:.3f}", f"{s['max_abs']:.3f}"]
        for weights, against, s in rows
    ]


DECODE_HEADERS = ["decode weights", "against", "KL", "top-1 agree", "max |diff|"]


def format_table(report: dict[str, Any]) -> str:
    """The summary as aligned text columns (and the decode weights' section, if scored)."""
    headers = [header for header, _, _ in COLUMNS]
    lines = [_title(report), "", *_aligned(headers, _cells(report))]
    if decode := report.get("decode_weights"):
        lines += [
            "",
            f"decode steps, teacher-forced: {decode['prompts']} prompts of "
            f"{decode['prompt_len']} tokens x {decode['steps']} steps "
            f"(gguf KL to exact: {decode['gguf_kl_to_float32_over_floor']:.2f}x the floor's)",
            *_aligned(DECODE_HEADERS, decode_weights_cells(decode)),
        ]
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"provenance": provenance.collect()} | report
    path.write_text(json.dumps(document, indent=2) + "\n")


def format_markdown(report: dict[str, Any], plot_path: Path | None = None) -> str:
    s = report["settings"]
    lines = [f"# Quality of the all-reduce methods: {_title(report)}", ""]
    lines += ["| " + " | ".join(h for h, _, _ in COLUMNS) + " |"]
    lines += ["|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in _cells(report)]
    lines += ["", _legend(report), ""]
    if plot_path is not None:
        lines += [f"![per-layer all-reduce error]({plot_path.name})", ""]
    lines += ["## Settings", ""]
    lines += [
        f"- model: `{s['model']}` ({s['dtype']}), weights: "
        f"`{s['model_info'].get('weights_sha256', s['model_info'].get('source', '?'))}`",
        f"- TP = {s['tp']} on {', '.join(s['devices'])}",
        f"- corpus: {s['corpus']['name']}, {s['corpus']['tokens']} tokens, "
        f"sha256 `{s['corpus']['sha256'][:16]}`",
        f"- {s['num_seqs']} windows x {s['seq_len']} tokens, batch {s['batch_size']}, "
        f"{s['scored_tokens']} scored tokens",
        f"- compute floor: the model in {s['compute_floor']['dtype']}, "
        f"all-reduce `{s['compute_floor']['all_reduce']}`",
        f"- size gate: {s['size_gate']}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in s['versions'].items())}",
        f"- {s['date']}, {s['wall_s']} s",
        "",
        "| method | all-reduce | options |",
        "|---|---|---|",
    ]
    for label, method in s["methods"].items():
        options = ", ".join(f"{k}={v}" for k, v in method["options"].items()) or "-"
        lines.append(f"| {label} | `{method['name']}` | {options} |")
    return "\n".join(lines) + "\n"


def write_markdown(report: dict[str, Any], path: Path, plot_path: Path | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_markdown(report, plot_path))


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Two panels over depth (every row-parallel all-reduce, attention then MLP per layer): the
    error each all-reduce adds to its own exact sum, and the error accumulated by then."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (born_ax, error_ax) = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for label, numbers in rows(report):
        sites = numbers["per_layer"]
        x = [site["layer"] + (0.5 if site["kind"] == "mlp" else 0.0) for site in sites]
        style = {"marker": ".", "label": label}
        born_ax.plot(x, [max(site["born_error"], 1e-7) for site in sites], **style)
        error_ax.plot(x, [max(site["error"], 1e-7) for site in sites], **style)
    born_ax.set_title("born: one all-reduce's error vs its exact f32 sum")
    error_ax.set_title(f"accumulated: output vs the {report['reference']} run's")
    for ax in (born_ax, error_ax):
        ax.set_yscale("log")
        ax.set_xlabel("layer (attention at n, MLP at n + 0.5)")
        ax.grid(True, which="both", alpha=0.3)
    born_ax.set_ylabel("relative L2 error (exact 0 drawn at 1e-7)")
    error_ax.legend(fontsize=8)
    fig.suptitle(_title(report), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
