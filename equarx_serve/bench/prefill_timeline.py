"""Where an overlapped prefill's all-reduces spend their time on each process, from the
exchange's own clock (`collectives.exchange.ExchangeTimes`).

`record(run)` runs one prefill with the exchange recording and returns, per exchange of that
prefill (in start order), when it was started, when its bytes had all arrived, when the program
asked for the result and when it had it (wall clock, so the processes on one machine line up).
`summarize(times, chunks, num_layers)` (times [processes, exchanges, 4]) keeps one layer of it,
the middle one, in ms from that layer's first start on any process, each exchange named as the
layer runs them (attn 0, attn 1, mlp 0, attn 2, mlp 1, ..., mlp K-1: `models.gemma3`
"Overlap"), and per process the whole prefill's time blocked in waits: the communication the
compute did not hide, as the program saw it. Between a start and its wait the program computed;
a wait that returns at once found the bytes already there.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from equarx_serve.collectives import exchange

STEPS = ("started", "arrived", "waited", "done")
_MISSING = -1  # a step that did not happen, in `as_int32`'s form


def record(run: Callable[[], None]) -> np.ndarray:
    """[exchanges, 4] times (s, wall clock: `STEPS`) of the exchanges `run` makes."""
    ends = exchange.get()
    ends.record()
    try:
        run()
    finally:
        times = ends.recorded()
    return np.array([[getattr(t, step) or np.nan for step in STEPS] for t in times])


def as_int32(times: np.ndarray) -> np.ndarray:
    """`record`'s times as whole microseconds in two int32 words each ([..., 2]): what
    `multihost_utils.process_allgather` carries exactly (it would narrow float64 wall-clock
    seconds to float32, ~2 minutes apart)."""
    us = np.where(np.isnan(times), _MISSING, np.round(np.nan_to_num(times) * 1e6)).astype(np.int64)
    return np.stack([us >> 31, us & (2**31 - 1)], axis=-1).astype(np.int32)


def from_int32(words: np.ndarray) -> np.ndarray:
    """`as_int32`'s inverse: seconds (NaN where a step did not happen)."""
    us = (words[..., 0].astype(np.int64) << 31) | words[..., 1].astype(np.int64)
    return np.where(us == _MISSING, np.nan, us / 1e6)


def exchange_names(chunks: int) -> list[str]:
    """One layer's all-reduces in the order they start."""
    names = []
    for step in range(chunks + 1):
        if step < chunks:
            names.append(f"attn {step}")
        if step > 0:
            names.append(f"mlp {step - 1}")
    return names


def summarize(times: np.ndarray, chunks: int, num_layers: int) -> dict[str, object]:
    """The middle layer's exchanges on every process and each process's blocked total (see
    the module doc); times [processes, exchanges, 4] as `record` gives them."""
    names = exchange_names(chunks)
    layer = num_layers // 2
    rows = times[:, layer * len(names) : (layer + 1) * len(names)]
    origin = np.nanmin(rows[..., 0])
    ms = lambda t: round(float((t - origin) * 1e3), 2)
    return {
        "layer": layer,
        "exchanges": [
            {"what": name, "process": p, **{s: ms(rows[p, i, k]) for k, s in enumerate(STEPS)}}
            for p in range(rows.shape[0])
            for i, name in enumerate(names)
        ],
        "blocked_ms": [round(float(np.sum(t[:, 3] - t[:, 2]) * 1e3), 1) for t in times],
    }


def format_summary(label: str, summary: dict[str, object]) -> list[str]:
    """A text table of one row's `summarize`."""
    lines = [
        f"  {label}: layer {summary['layer']}, ms from its first start; "
        f"blocked in waits over the whole prefill: "
        + ", ".join(f"p{p} {b} ms" for p, b in enumerate(summary["blocked_ms"])),
        f"    {'process':>7}  {'all-reduce':<10}" + "".join(f"{s:>9}" for s in STEPS),
    ]
    for e in summary["exchanges"]:
        cells = "".join(f"{e[s]:>9.1f}" for s in STEPS)
        lines.append(f"    {e['process']:>7}  {e['what']:<10}{cells}")
    return lines
