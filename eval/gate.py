"""The quality regression gate: limits from a TOML file, checked against an eval report.

A thresholds file names methods (the labels `equarx-serve eval` runs them under) and, for
each, limits on the numbers of its report, spelled `max_<number>` or `min_<number>`; the
table `[all]` applies to every method in the report, `[compute_floor]` to the float32 model's
numbers (the floor itself). Limits can be relative to the floor (`*_vs_floor`,
`top1_agreement_below_floor`, see `eval.metrics`):

    [all]
    max_nonfinite = 0

    [methods."equarx-int8"]
    max_ppl_rel_change = 0.003        # perplexity within 0.3% of the reference's
    min_ppl_rel_change = -0.003
    max_kl_mean_vs_floor = 2.0        # at most twice the KL bf16 arithmetic alone makes
    max_top1_agreement_below_floor = 0.01

`equarx-serve eval --check FILE` evaluates every method the file names (besides the ones on
the command line), prints each check with its measured value and limit, and exits 1 when
one fails. The file is validated before anything runs: an unknown number or a malformed
limit is a usage error.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any

# The numbers a limit may name: every scalar of a method's report (eval.metrics).
CHECKABLE = (
    "perplexity",
    "ppl_abs_change",
    "ppl_rel_change",
    "kl_mean",
    "kl_p99",
    "kl_max",
    "top1_agreement",
    "kl_mean_vs_floor",
    "top1_disagreement_vs_floor",
    "top1_agreement_below_floor",
    "top5_overlap",
    "logit_max_abs_error",
    "logit_mean_abs_error",
    "logit_cosine_mean",
    "logit_cosine_min",
    "nonfinite_logits",
    "nonfinite_all_reduce",
    "nonfinite",
    "born_error_max",
    "final_layer_error",
    "greedy_matched_mean",
    "greedy_matched_stderr",
    "greedy_matched_fraction",
    "greedy_identical",
)
ALL = "all"
FLOOR = "compute_floor"  # the table of limits on the floor's own numbers


@dataclasses.dataclass(frozen=True)
class Limit:
    method: str  # a method label, ALL or FLOOR
    number: str  # a key of CHECKABLE
    bound: str  # "max" | "min"
    value: float


@dataclasses.dataclass(frozen=True)
class Check:
    method: str
    limit: Limit
    measured: float | None  # None: the report has no such number for this method

    @property
    def passed(self) -> bool:
        if self.measured is None or math.isnan(self.measured):
            return False
        if self.limit.bound == "max":
            return self.measured <= self.limit.value
        return self.measured >= self.limit.value

    def describe(self) -> str:
        status = "PASS" if self.passed else "FAIL"
        sign = "<=" if self.limit.bound == "max" else ">="
        measured = "not measured" if self.measured is None else f"{self.measured:.6g}"
        return (
            f"{status}  {self.method:<28} {self.limit.number:<22} {measured:>12} "
            f"{sign} {self.limit.value:.6g}"
        )


def _parse_limits(table: Any, method: str, path: Path) -> list[Limit]:
    if not isinstance(table, dict):
        raise ValueError(f"{path}: [{method}] must be a table of max_*/min_* limits")
    limits = []
    for key, value in table.items():
        bound, _, number = key.partition("_")
        if bound not in ("max", "min") or number not in CHECKABLE:
            raise ValueError(
                f"{path}: [{method}] {key!r} is not a limit; use max_<number> or min_<number> "
                f"with one of: {', '.join(CHECKABLE)}"
            )
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{path}: [{method}] {key} must be a number, got {value!r}")
        limits.append(Limit(method, number, bound, float(value)))
    return limits


def load_thresholds(path: Path) -> list[Limit]:
    """Every limit in the file, validated (ValueError says what and where)."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such thresholds file") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML ({e})") from None
    unknown = sorted(set(data) - {ALL, FLOOR, "methods"})
    if unknown:
        raise ValueError(
            f'{path}: unknown table(s) {unknown}; use [all], [{FLOOR}] and [methods."NAME"]'
        )
    limits = _parse_limits(data.get(ALL, {}), ALL, path)
    limits += _parse_limits(data.get(FLOOR, {}), FLOOR, path)
    methods = data.get("methods", {})
    if not isinstance(methods, dict):
        raise ValueError(f'{path}: methods must be tables, [methods."NAME"]')
    for method, table in methods.items():
        limits += _parse_limits(table, method, path)
    if not limits:
        raise ValueError(f"{path}: no limits in it")
    return limits


def methods_named(limits: list[Limit]) -> list[str]:
    """The method labels the limits need evaluated, in file order."""
    named = (limit.method for limit in limits if limit.method not in (ALL, FLOOR))
    return list(dict.fromkeys(named))


def check(report: dict[str, Any], limits: list[Limit]) -> list[Check]:
    """Every limit against the report (`[all]` limits once per method in the report)."""
    checks = []
    for limit in limits:
        if limit.method == FLOOR:
            numbered = [(FLOOR, report.get(FLOOR, {}))]
        else:
            methods = list(report["methods"]) if limit.method == ALL else [limit.method]
            numbered = [(method, report["methods"].get(method, {})) for method in methods]
        for method, numbers in numbered:
            value = numbers.get(limit.number)
            checks.append(Check(method, limit, None if value is None else float(value)))
    return checks
