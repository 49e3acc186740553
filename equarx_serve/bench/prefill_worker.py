"""One prefill measurement: every all-reduce method at one prompt length, on one TP mesh.

Started by `equarx-serve bench prefill` (see `prefill.py`), one run per sequence length:

    python -m equarx_serve.bench.prefill_worker --model tiny --devices 2 --seq-len 128 \\
        --methods '[{"label": "psum", "name": "psum", "options": {}}]'

`--devices N`: one process, N host CPU devices. Without it, one CPU device per process, joined
by `jax.distributed` over gloo (`--coordinator`, `--num-processes`, `--process-id`); TP = N.

The model (`PrefillEngine.from_name`, bf16 parameters) is loaded and sharded once; each method
gets an engine on the same sharded parameters, plus one on NO-REDUCE: an all-reduce that
returns its input unchanged (numerically wrong, the same compute without the collectives),
whose time is the prefill's compute. With `--overlap-chunks` K > 1 (1 is always measured),
every method and NO-REDUCE also get an engine whose layers run their row-parallel sections on
K token chunks (`models.gemma3`, "Overlap"), labelled `<label>/overlap=K`. Input: `batch`
prompts of `seq_len` random token ids (fixed seed; the special ids of the tokenizer and ids 0-4
are never drawn), right-padded to the engine's bucket (= seq_len when it is a power of two
>= 16), logits at the last token only.

What is timed: each method's ahead-of-time compiled prefill program (the HLO gives the wire
bytes and collective counts), run once untimed (its logits are compared with psum's), then once
timed (the warm-up that sizes the adaptive repeat count). Then `repeats` rounds, each running
every program once in an order rotated by one per round; a call is `perf_counter` around
`block_until_ready` of `program(params, tokens, mask)` (logits and KV cache), after all
processes meet at a barrier. Across processes, a call's time is the slowest process's. Each
process reports its peak resident memory (`ru_maxrss`).

Process 0 prints the result as one JSON line, prefixed with `RESULT_MARKER`, on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import resource
import time
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from equarx_serve.arguments import chunks_or_auto
from equarx_serve.bench import prefill_timeline
from equarx_serve.bench.allreduce_worker import (
    RESULT_MARKER,
    gather_processes,
    parse_result,
    time_side_by_side,
)
from equarx_serve.bench.hlo_bytes import COLLECTIVE_KINDS, collective_wire_bytes
from equarx_serve.collectives import AllReduce, exchange, get_all_reduce, overlap
from equarx_serve.distributed import multiprocess
from equarx_serve.generation.prefill import PrefillEngine
from models.gemma3 import layers_hlo

__all__ = ["RESULT_MARKER", "NoReduce", "command", "measure", "parse_result"]

MODULE = "equarx_serve.bench.prefill_worker"
NO_REDUCE = "no-reduce"
OVERLAP_LABEL = "{label}/overlap={chunks}"
LOWEST_TOKEN_ID = 5  # never draw <pad> <eos> <bos> <unk> <mask> (ids 0-4)

# Adaptive repeats: about TARGET_S of timed calls per program (from the slowest warm-up).
TARGET_S = 3.0
MIN_REPEATS, MAX_REPEATS = 3, 20


@dataclasses.dataclass(frozen=True)
class NoReduce(AllReduce):
    """Returns the partial sum unchanged: the prefill's compute without its collectives.
    Numerically wrong; for timing only, and not registered."""

    name: ClassVar[str] = NO_REDUCE

    def reduce(self, x: jax.Array, axis_name: str, axis_size: int) -> jax.Array:
        return x

    def wire_bytes(self, num_elements: int, dtype: jnp.dtype, axis_size: int) -> int:
        return 0

    def one_shot_parts(self, x: jax.Array, axis_size: int) -> None:
        return None  # nothing to exchange


def random_prompts(
    batch: int, seq_len: int, vocab_size: int, special_ids: Sequence[int], seed: int
) -> list[list[int]]:
    """`batch` lists of `seq_len` ids in [LOWEST_TOKEN_ID, vocab_size), none in special_ids."""
    rng = np.random.default_rng(seed)
    excluded = np.asarray(sorted(set(special_ids)), np.int64)
    tokens = rng.integers(LOWEST_TOKEN_ID, vocab_size, size=(batch, seq_len))
    while (bad := np.isin(tokens, excluded)).any():
        tokens[bad] = rng.integers(LOWEST_TOKEN_ID, vocab_size, size=int(bad.sum()))
    return tokens.tolist()


def _collective_counts(hlo_text: str) -> dict[str, int]:
    """How many collective instructions of each kind the HLO has (async pairs once)."""
    counts: dict[str, int] = {}
    for line in hlo_text.splitlines():
        for kind in COLLECTIVE_KINDS:
            if f" {kind}(" in line or f" {kind}-start(" in line:
                counts[kind] = counts.get(kind, 0) + 1
    return counts


def overlap_label(label: str, chunks: int) -> str:
    """A row's label: the method's, and the overlap's chunk count unless 1."""
    return label if chunks == 1 else OVERLAP_LABEL.format(label=label, chunks=chunks)


def measure(
    model: str,
    methods: Sequence[dict],
    *,
    seq_len: int,
    batch: int,
    repeats: int | None,
    seed: int,
    checkpoint: str | None = None,
    tokenizer: str | None = None,
    overlap_chunks: Sequence[int | str] = (1,),
) -> dict[str, object]:
    """Times every method (dicts of label, name, options) and no-reduce, at every chunk count
    of `overlap_chunks`; see module doc."""
    tp = jax.device_count()
    load_start = time.perf_counter()
    base = PrefillEngine.from_name(model, tp, "psum", checkpoint, tokenizer)
    load_s = time.perf_counter() - load_start
    config = base.config
    special = [] if base.tokenizer is None else list(base.tokenizer.special_tokens.values())
    prompts = random_prompts(batch, seq_len, config.vocab_size, special, seed)
    tokens, mask, bucket = base.prepare(prompts)
    num_elements = batch * bucket * config.embed_dim  # one all-reduce message, per device
    num_reductions = 2 * config.num_layers  # attention output and MLP output of every layer

    auto = overlap.auto_chunks(bucket)  # what "auto" (the engines' default) runs here
    all_chunks = sorted({1, *(auto if chunks == "auto" else chunks for chunks in overlap_chunks)})
    engines, chunks_of = _engines(base, methods, all_chunks)
    inputs = _Inputs(tokens, mask, bucket, batch, num_elements, num_reductions)
    programs, rows = {}, {}
    reference = None
    for label, engine in engines.items():
        programs[label], rows[label], logits = _compile_and_check(engine, inputs, reference)
        rows[label] = {"label": label, "overlap_chunks": chunks_of[label], **rows[label]}
        if reference is None:
            reference = logits  # the first method (psum by default)

    def timed(label: str) -> float:
        multihost_utils.sync_global_devices("prefill-bench")
        engine = engines[label]
        start = time.perf_counter()
        jax.block_until_ready(programs[label](engine.params, tokens, mask))
        return time.perf_counter() - start

    repeats, timings = time_side_by_side(
        list(programs),
        timed,
        repeats,
        target_s=TARGET_S,
        min_repeats=MIN_REPEATS,
        max_repeats=MAX_REPEATS,
    )
    for label, stats in timings.items():
        rows[label].update(stats)
    _add_timelines(rows, programs, engines, inputs, config.num_layers)
    max_rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    peak_mib = gather_processes(np.array([max_rss_kib / 1024.0]))[:, 0]
    no_reduce = {str(chunks): rows.pop(overlap_label(NO_REDUCE, chunks)) for chunks in all_chunks}
    return {
        "model": model,
        "model_info": base.info,
        "tp": tp,
        "num_processes": jax.process_count(),
        "batch": batch,
        "seq_len": seq_len,
        "bucket": bucket,
        "dtype": str(jnp.dtype(base.dtype)),
        "message_elements": num_elements,
        "message_bytes": num_elements * jnp.dtype(base.dtype).itemsize,
        "repeats": repeats,
        "load_s": load_s,
        "peak_rss_mib": [round(float(m), 1) for m in peak_mib],
        "no_reduce": no_reduce.pop("1"),  # the compute alone, whole messages
        "no_reduce_overlap": no_reduce,  # {"K": the same, on K token chunks}, K > 1
        "auto_overlap_chunks": auto,  # the chunks overlap_chunks="auto" chose for this run
        "rows": list(rows.values()),
    }


def _add_timelines(
    rows: dict[str, dict],
    programs: dict[str, jax.stages.Compiled],
    engines: dict[str, PrefillEngine],
    inputs: _Inputs,
    num_layers: int,
) -> None:
    """Every row whose all-reduces went through the exchange (overlapped, across processes):
    one more prefill, its exchanges recorded on every process (`prefill_timeline`)."""
    for label, row in rows.items():
        if "exchange" not in row["wire_bytes_hlo"] or label.startswith(NO_REDUCE):
            continue
        engine = engines[label]
        multihost_utils.sync_global_devices("prefill-timeline")
        call = functools.partial(programs[label], engine.params, inputs.tokens, inputs.mask)
        local = prefill_timeline.record(lambda call=call: jax.block_until_ready(call()))
        times = prefill_timeline.from_int32(gather_processes(prefill_timeline.as_int32(local)))
        row["timeline"] = prefill_timeline.summarize(times, row["overlap_chunks"], num_layers)


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """One prefill's padded batch and the size of its all-reduce messages."""

    tokens: jax.Array  # [batch, bucket] int32
    mask: jax.Array  # [batch, bucket] bool
    bucket: int
    batch: int
    num_elements: int  # one all-reduce message, per device
    num_reductions: int  # attention output and MLP output of every layer


def _engines(
    base: PrefillEngine, methods: Sequence[dict], all_chunks: Sequence[int]
) -> tuple[dict[str, PrefillEngine], dict[str, int]]:
    """An engine for every method and no-reduce at every chunk count, by row label; and each
    row's chunk count."""
    all_reduces = [(m["label"], get_all_reduce(m["name"], **m["options"])) for m in methods]
    engines, chunks_of = {}, {}
    for chunks in all_chunks:
        for label, ar in [*all_reduces, (NO_REDUCE, NoReduce())]:
            key = overlap_label(label, chunks)
            engines[key] = base.with_all_reduce(ar, overlap_chunks=chunks)
            chunks_of[key] = chunks
    return engines, chunks_of


def _compile_and_check(
    engine: PrefillEngine, inputs: _Inputs, reference: np.ndarray | None
) -> tuple[jax.stages.Compiled, dict[str, object], np.ndarray]:
    """Compiles one engine's prefill, runs it once: (its program, what its row records of
    the program and its wire bytes and of its logits against `reference`, its logits)."""
    tp = jax.device_count()
    start = time.perf_counter()
    program = engine.compile(inputs.bucket, inputs.batch, last_only=True)
    compile_s = time.perf_counter() - start
    hlo = layers_hlo(program.hlo_text())  # the all-reduces, not the vocab-parallel head's
    hlo_bytes = collective_wire_bytes(hlo, tp)
    ar = engine.all_reduce
    exchanged = exchange.sent_bytes()
    split = program.compiled(engine.params, inputs.tokens, inputs.mask).logits
    logits = np.asarray(engine.model.gathered(split).addressable_data(0), np.float32)
    if exchanged_bytes := exchange.sent_bytes() - exchanged:  # beside XLA (`overlap`)
        hlo_bytes["exchange"] = exchanged_bytes
    reference = logits if reference is None else reference
    err = logits - reference
    reductions = 0 if isinstance(ar, NoReduce) else inputs.num_reductions
    row = {
        "name": ar.name,
        "options": ar.options(),
        "gated": ar.is_gated(inputs.num_elements, engine.dtype),
        "quantized": ar.quantizes(inputs.num_elements, engine.dtype),
        "compile_s": compile_s,
        "num_reductions": reductions,
        "hlo_collectives": _collective_counts(hlo),
        "wire_bytes_hlo": hlo_bytes,
        "wire_bytes_hlo_total": sum(hlo_bytes.values()),
        "wire_bytes_formula": reductions * ar.wire_bytes(inputs.num_elements, engine.dtype, tp),
        # From the HLO before optimization: XLA:CPU widens 16-bit all-reduces to f32 (the
        # optimized HLO), TPU and GPU reduce bf16 as bf16.
        "wire_bytes_projection": sum(
            collective_wire_bytes(layers_hlo(program.lowered_hlo), tp).values()
        ),
        "logits_rel_rms_vs_first": float(np.linalg.norm(err) / np.linalg.norm(reference)),
        "logits_max_abs_vs_first": float(np.abs(err).max()),
        "top1_agree_vs_first": float((logits.argmax(-1) == reference.argmax(-1)).mean()),
    }
    return program.compiled, row, logits


def command(
    model: str,
    methods: Sequence[dict],
    *,
    seq_len: int,
    batch: int,
    devices: int | None,
    repeats: int | None,
    seed: int,
    checkpoint: str | None = None,
    tokenizer: str | None = None,
    overlap_chunks: Sequence[int | str] = (1,),
) -> list[str]:
    """The command line that runs this module (process flags are added by the launcher)."""
    args = ["--model", model, "--methods", json.dumps(list(methods))]
    args += ["--overlap-chunks", *map(str, overlap_chunks)]
    args += ["--seq-len", str(seq_len), "--batch", str(batch), "--seed", str(seed)]
    if devices is not None:
        args += ["--devices", str(devices)]
    if repeats is not None:
        args += ["--repeats", str(repeats)]
    if checkpoint is not None:
        args += ["--checkpoint", str(checkpoint), "--tokenizer", str(tokenizer)]
    return multiprocess.python_module_command(MODULE, *args)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--methods", type=json.loads, required=True, help="JSON list of methods")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--devices", type=int, help="N host devices in this one process")
    parser.add_argument("--repeats", type=int, help="timed rounds (default: adaptive)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overlap-chunks", type=chunks_or_auto, nargs="+", default=[1])
    parser.add_argument("--checkpoint")
    parser.add_argument("--tokenizer")
    multiprocess.add_process_flags(parser)
    args = parser.parse_args(argv)

    jax.config.update("jax_platforms", "cpu")
    if args.devices is not None:
        jax.config.update("jax_num_cpu_devices", args.devices)
    elif args.num_processes > 1:
        jax.config.update("jax_num_cpu_devices", 1)  # one device per process, whatever XLA_FLAGS
        multiprocess.initialize(args.coordinator, args.num_processes, args.process_id)
    expected = args.devices if args.devices is not None else args.num_processes
    if jax.device_count() != expected:
        raise RuntimeError(f"expected {expected} devices, JAX has {jax.device_count()}")
    result = measure(
        args.model,
        args.methods,
        seq_len=args.seq_len,
        batch=args.batch,
        repeats=args.repeats,
        seed=args.seed,
        checkpoint=args.checkpoint,
        tokenizer=args.tokenizer,
        overlap_chunks=args.overlap_chunks,
    )
    if jax.process_index() == 0:
        print(RESULT_MARKER, json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
