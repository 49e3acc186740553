"""`equarx-serve report` on recorded results (tests/data/report/: JSON the benchmarks wrote, and
one eval JSON from before runs recorded provenance): the tables render with their source and
provenance, ratios are computed from the rows of one run, a JSON without provenance says so,
and --update / --check rewrite and police the generated blocks of a Markdown file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from equarx_serve import cli
from equarx_serve.bench import report

DATA = Path(__file__).parent / "data" / "report"


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """A docs/ folder with the recorded results in docs/results/."""
    folder = tmp_path / "docs" / "results"
    shutil.copytree(DATA, folder)
    return folder


def _rows(name: str) -> list[dict]:
    return json.loads((DATA / f"{name}.json").read_text())["rows"]


def test_every_recorded_result_has_a_kind():
    kinds = {s.name: report.kind_of(s.document) for s in report.load(DATA).values()}
    assert kinds == {
        "allreduce-n2-1gbit": "allreduce",
        "allreduce-plain-n2-1gbit": "allreduce-plain",
        "compare-llama-cpp": "compare",
        "eval-tp2-no-provenance": "eval",
        "lowering": "lowering",
        "prefill-tp2-300mbit": "prefill",
    }


def test_allreduce_table_has_the_speedup_over_the_ring_from_the_same_run():
    rows = _rows("allreduce-n2-1gbit")
    size = max(r["size_bytes"] for r in rows)
    by_label = {r["label"]: r for r in rows if r["size_bytes"] == size}
    expected = by_label["ring"]["median_ms"] / by_label["equarx-int8"]["median_ms"]
    table = report.allreduce_table(json.loads((DATA / "allreduce-n2-1gbit.json").read_text()))
    cells = next(r for r in table.rows if r[1] == f"{size / 2**20:g}" and r[2] == "equarx-int8")
    assert cells[4] == f"{expected:.2f}x"


def test_plain_table_sets_each_join_against_the_launcher_and_its_own_ring():
    rows = _rows("allreduce-plain-n2-1gbit")
    size = max(r["size_bytes"] for r in rows)
    by = {(r["join"], r["label"]): r for r in rows if r["size_bytes"] == size}
    document = json.loads((DATA / "allreduce-plain-n2-1gbit.json").read_text())
    table = report.allreduce_plain_table(document)
    cells = next(r for r in table.rows if r[1] == f"{size / 2**20:g}" and r[2] == "equarx-int8")
    plain, launcher = by[("plain", "equarx-int8")], by[("launcher", "equarx-int8")]
    assert cells[5] == f"{plain['median_ms'] / launcher['median_ms']:.3f}"
    assert cells[6] == f"{by[('plain', 'ring')]['median_ms'] / plain['median_ms']:.2f}x"
    assert cells[7] == f"{by[('launcher', 'ring')]['median_ms'] / launcher['median_ms']:.2f}x"
    assert len(table.rows) == sum(r["join"] == "plain" for r in rows)


def test_compare_table_has_each_sides_number_and_the_ratio_from_the_same_run():
    document = json.loads((DATA / "compare-llama-cpp.json").read_text())
    by_side = {(r["workload"], r["side"].startswith("this project")): r for r in document["rows"]}
    table = report.compare_table(document)
    ours = {r[0]: r for r in table.rows if r[1].startswith("this project")}
    prefill = (
        by_side[("prefill 512", False)]["median_ms"] / by_side[("prefill 512", True)]["median_ms"]
    )
    decode = (by_side[("decode batch 1", True)]["tokens_per_s"]
              / by_side[("decode batch 1", False)]["tokens_per_s"])  # fmt: skip
    assert ours["prefill 512"][5] == f"{prefill:.2f}x"
    assert ours["decode batch 1"][5] == f"{decode:.2f}x"
    assert ours["decode batch 1"][3] == f"{by_side[('decode batch 1', True)]['tokens_per_s']:.1f}"
    assert not any("None" in cell or "[" in cell for row in table.rows for cell in row)


def test_prefill_table_shows_each_process_blocked_time_where_a_timeline_was_recorded():
    document = json.loads((DATA / "prefill-tp2-300mbit.json").read_text())
    document["rows"][1]["timeline"] = {"layer": 9, "exchanges": [], "blocked_ms": [38.8, 3.6]}
    table = report.prefill_table(document)
    column = table.header.index("blocked in waits ms")
    by_method = {r[1].removesuffix(" (default)"): r[column] for r in table.rows}
    assert by_method[document["rows"][1]["label"]] == "38.8 / 3.6"
    assert by_method["ring"] == "-" and by_method["compute alone (no all-reduce)"] == "-"


def test_provenance_names_source_commit_machine_link_and_command():
    source = report.load(DATA)["allreduce-n2-1gbit"]
    p = source.document["provenance"]
    line = report.provenance_line(source, DATA)
    assert "[`allreduce-n2-1gbit.json`](allreduce-n2-1gbit.json)" in line
    assert p["commit"][:10] in line and p["date"] in line and p["command"] in line
    assert "link measured: " in line and p["machine"]["cpu"] in line


def test_a_result_without_provenance_says_so():
    source = report.load(DATA)["eval-tp2-no-provenance"]
    text = report.render_source(source, DATA)
    assert "no provenance recorded" in text
    assert "commit" not in text and "date" not in text


def test_headline_reads_every_result_and_links_to_how_it_was_measured(results: Path):
    readme = results.parent.parent / "README.md"
    text = report.render_block("headline", report.load(results), readme)
    assert "over the 16-bit ring" in text and "of the link" in text
    assert "(docs/benchmarks.md#all-reduce)" in text and "(docs/benchmarks.md#prefill)" in text
    assert "(docs/results/prefill-tp2-300mbit.json)" in text


def _markdown(path: Path) -> Path:
    path.write_text(
        "# Results\n\n<!-- report:allreduce-n2-1gbit -->\nold\n<!-- /report:allreduce-n2-1gbit -->"
        "\n\ntext kept\n\n<!-- report:lowering -->\n<!-- /report:lowering -->\n"
    )
    return path


def test_update_writes_the_blocks_and_check_then_passes(results: Path, capsys):
    page = _markdown(results.parent / "benchmarks.md")
    assert cli.main(["report", str(results), "--check", str(page)]) == 1
    assert cli.main(["report", str(results), "--update", str(page)]) == 0
    text = page.read_text()
    assert "old" not in text and "text kept" in text
    assert "[`lowering.json`](results/lowering.json)" in text
    assert "| processes N=2 | 64 | equarx-int8 |" in text
    assert cli.main(["report", str(results), "--check", str(page)]) == 0
    assert f"stale: {page}" in capsys.readouterr().out


def test_check_fails_when_a_result_changed_after_the_update(results: Path):
    page = _markdown(results.parent / "benchmarks.md")
    assert cli.main(["report", str(results), "--update", str(page)]) == 0
    path = results / "allreduce-n2-1gbit.json"
    document = json.loads(path.read_text())
    document["rows"][0]["median_ms"] *= 2
    path.write_text(json.dumps(document))
    assert cli.main(["report", str(results), "--check", str(page)]) == 1


def test_a_block_naming_no_result_is_a_usage_error(results: Path):
    page = results.parent / "page.md"
    page.write_text("<!-- report:missing -->\n<!-- /report:missing -->\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", str(results), "--check", str(page)])
    assert exit_info.value.code == 2


def test_report_prints_every_table(results: Path, capsys):
    assert cli.main(["report", str(results)]) == 0
    out = capsys.readouterr().out
    for name in ("allreduce-n2-1gbit", "eval-tp2-no-provenance", "lowering", "prefill-tp2-300mbit"):
        assert f"## {name}" in out


def test_an_eval_with_decode_weights_renders_its_decode_section():
    scores = lambda kl, top1: {"kl": kl, "top1": top1, "max_abs": 0.5, "steps": 256}
    document = {
        "compute_floor": {},
        "methods": {},
        "decode_weights": {
            "vs_bf16": {"gguf": scores(1e-3, 0.98)},
            "vs_float32": {"bf16": scores(2e-3, 0.97), "gguf": scores(5e-4, 0.99)},
        },
    }
    assert report.kind_of(document) == "eval-decode"
    table = report.eval_decode_table(document)
    assert [row[:3] for row in table.rows] == [
        ["GGUF blocks (int8 form)", "bf16 decode", "1.00e-03"],
        ["GGUF blocks (int8 form)", "exact checkpoint (float32)", "5.00e-04"],
        ["bf16 (the floor)", "exact checkpoint (float32)", "2.00e-03"],
    ]
    assert table.rows[1][3] == "99.00%"


def _level(server: str, clients: int, tokens_per_s: float, stream: float | None) -> dict:
    return {"server": server, "clients": clients, "output_tokens_per_s": tokens_per_s,
            "latency_p50_s": 2.0, "latency_p99_s": 3.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.25,
            "stream_decode_tokens_per_s": stream, "errors": 0}  # fmt: skip


def test_the_served_part_of_a_compare_renders_in_its_own_block(results: Path):
    path = results / "compare-llama-cpp.json"
    document = json.loads(path.read_text())
    levels = [_level("equarx-serve", 1, 30.0, 31.0), _level("llama", 1, 40.0, None),
              _level("equarx-serve", 4, 80.0, 25.0), _level("llama", 4, 40.0, None)]  # fmt: skip
    document["served"] = {"levels": levels, "generate_decode_tokens_per_s": 32.0}
    path.write_text(json.dumps(document))
    rows = report.served_table(document).rows
    assert [row[:4] for row in rows] == [
        ["1", "equarx-serve", "30.0", "0.75x"], ["1", "llama", "40.0", "-"],
        ["4", "equarx-serve", "80.0", "2.00x"], ["4", "llama", "40.0", "-"],
        ["1", "the Generator in-process, same prompts", "-", "-"],
    ]  # fmt: skip
    assert rows[0][4:] == ["2.00 / 3.00", "0.10 / 0.25", "31.0", "0"] and rows[-1][6] == "32.0"
    page = results.parent / "page.md"
    page.write_text(
        "<!-- report:compare-llama-cpp.served -->\n<!-- /report:compare-llama-cpp.served -->\n"
    )
    assert cli.main(["report", str(results), "--update", str(page)]) == 0
    assert "| 4 | equarx-serve | 80.0 | 2.00x |" in page.read_text()
    page.write_text(
        "<!-- report:compare-llama-cpp.nope -->\n<!-- /report:compare-llama-cpp.nope -->\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", str(results), "--check", str(page)])
    assert exit_info.value.code == 2


def test_serve_table_has_each_servers_ttft_and_its_speedup_over_the_first():
    ttft = {
        "ring/overlap=1": {"prompt_tokens": 2000, "seconds": [8.0, 9.0, 7.5], "median_s": 8.0},
        "ring/overlap=auto": {"prompt_tokens": 2000, "seconds": [5.0, 5.5, 4.0], "median_s": 5.0},
    }
    table = report.serve_table({"ttft": ttft, "load": []})
    assert table.header[3] == "speed-up vs `ring/overlap=1`"
    assert table.rows[1] == ["ring/overlap=auto", "2000", "5.00", "1.60x", "5.00, 5.50, 4.00"]
