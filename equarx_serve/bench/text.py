"""Plain-text tables for the benchmarks' terminal reports."""

from __future__ import annotations


def right_aligned(lines: list[list[str]]) -> list[str]:
    """`lines` (a header, then rows of cells) as text, each column right-aligned to its widest
    cell, with a rule under the header."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    lines.insert(1, ["-" * w for w in widths])
    return ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
