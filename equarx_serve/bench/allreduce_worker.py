"""One all-reduce measurement: every method at one message size on one mesh of N devices.

Started by `equarx-serve bench allreduce` (see `allreduce.py`), one run per (N, size):

    python -m equarx_serve.bench.allreduce_worker --devices 4 --size-bytes 1048576 \\
        --methods '[{"label": "psum", "name": "psum", "options": {}}]'

`--devices N`: one process, N host CPU devices (`jax_num_cpu_devices`). Without it, one CPU
device per process, joined by `jax.distributed` over gloo (`--coordinator`, `--num-processes`,
`--process-id`; see `equarx_serve.distributed.multiprocess`). The mesh is 1-D, axis "x".
`--join plain`: the processes join as a user's own program would, with gloo and
`jax.distributed.initialize` and nothing else (no `multiprocess.initialize`, no explicit link
measurement: the first all-reduce traced measures it, see `collectives.transport`).

Every process lowers the same programs, or the run would hang: each method's lowered text is
hashed on every process, and a run whose processes lowered different text fails (all of them
raise), naming the methods; the row keeps the hash (`program_sha256`).

Input: a [N, L] bf16 array sharded over "x", L = size / 2 bytes, LLM-activation-like and
different on every device (`activations`). Reference: the same sum in f32 with an f32 output
(`psum-f32` before its final cast to bf16). A method entry with `"rotated_input": true` is the
method's `with_rotated_input()` (how the model calls it) on that input rotated by its
`foldable_rotation` in bf16 (what folded weights produce); its reference is `exact_sum` of
that input (the f32 sum, rotated back).

What is timed: each method is `jit(shard_map(lambda b: ar(b[0], "x")[None]))` with in and out
specs P("x") (every device's output is kept), compiled ahead of time (its HLO gives the wire
bytes), run once untimed (that output gives the errors), then once timed (the warm-up that sizes
the adaptive repeat count). Then `repeats` rounds, each running every method once, in an order
rotated by one per round. A call is timed with `perf_counter` around
`program(x).block_until_ready()`: dispatch, the collectives and all quantize/accumulate compute,
until this process's output is ready. Before each call a tiny psum (untimed) lines the
processes up. Across processes, a call's time is the slowest process's. With `--timeline` (one
device a process), one more call of each method, after the timed rounds, is traced with
`jax.profiler` on every process: its row gets `timeline` (`timeline.py`: every process's spans
of collectives, kernels and other compute, and their summaries).

Process 0 prints the result as one JSON line, prefixed with `RESULT_MARKER`, on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from equarx_serve.bench import timeline
from equarx_serve.bench.hlo_bytes import collective_wire_bytes
from equarx_serve.collectives import get_all_reduce, transport
from equarx_serve.collectives.equarx import EquarxInt8, RotatedInput
from equarx_serve.collectives.ring import RingAllReduce
from equarx_serve.distributed import multiprocess

MODULE = "equarx_serve.bench.allreduce_worker"
RESULT_MARKER = "EQUARX_BENCH_RESULT"
AXIS = "x"
JOINS = ("launcher", "plain")  # --join: how several processes join (see the module doc)

CHANNELS = 1024  # activations are rows of this many channels
NUM_OUTLIER_CHANNELS = 8
OUTLIER_GAIN = (20.0, 100.0)

# Adaptive repeats: about TARGET_S of timed calls per method (from the mean warm-up time).
TARGET_S = 0.5
MIN_REPEATS, MAX_REPEATS = 5, 50


def activations(device: int, num_elements: int, seed: int) -> np.ndarray:
    """Device `device`'s input, [num_elements] bf16: rows of `CHANNELS` channels, each a standard
    normal times a per-channel scale (log-normal, sigma 0.5), with `NUM_OUTLIER_CHANNELS`
    channels 20-100x larger. Scales are shared by all devices, values are not."""
    shared = np.random.default_rng(seed)
    scale = shared.lognormal(0.0, 0.5, CHANNELS)
    outliers = shared.choice(CHANNELS, NUM_OUTLIER_CHANNELS, replace=False)
    scale[outliers] *= shared.uniform(*OUTLIER_GAIN, NUM_OUTLIER_CHANNELS)
    values = np.random.default_rng([seed, device]).standard_normal(num_elements, np.float32)
    values *= np.resize(scale.astype(np.float32), num_elements)
    return values.astype(jnp.bfloat16)


def adaptive_repeats(
    warm_s: Sequence[float],
    *,
    target_s: float = TARGET_S,
    min_repeats: int = MIN_REPEATS,
    max_repeats: int = MAX_REPEATS,
) -> int:
    """Rounds for about `target_s` of timing per method, in [min_repeats, max_repeats]."""
    mean_s = max(sum(warm_s) / len(warm_s), 1e-9)
    return min(max_repeats, max(min_repeats, math.ceil(target_s / mean_s)))


def time_side_by_side(
    labels: Sequence[str],
    timed: Callable[[str], float],
    repeats: int | None,
    **adaptive: float,
) -> tuple[int, dict[str, dict[str, object]]]:
    """Times every label side by side: one warm-up call each (sizing `repeats` when None, see
    `adaptive_repeats`, which takes `adaptive`), then `repeats` rounds, each calling every label
    once in an order rotated by one per round. Across processes a call's time is the slowest
    process's. Returns (repeats, {label: {median_ms, p10_ms, p90_ms, times_ms}})."""
    warm_s = gather_processes(np.array([timed(label) for label in labels], np.float64))
    if repeats is None:
        repeats = adaptive_repeats(warm_s.max(axis=0).tolist(), **adaptive)
    local_s = np.zeros((len(labels), repeats), np.float64)
    for r in range(repeats):
        shift = r % len(labels)
        for label in labels[shift:] + labels[:shift]:
            local_s[labels.index(label), r] = timed(label)
    times_ms = gather_processes(local_s).max(axis=0) * 1e3
    stats = {}
    for label, times in zip(labels, times_ms, strict=True):
        p10, median, p90 = np.percentile(times, [10, 50, 90])
        stats[label] = {
            "median_ms": float(median),
            "p10_ms": float(p10),
            "p90_ms": float(p90),
            "times_ms": np.round(times, 4).tolist(),
        }
    return repeats, stats


def _lower(fn: Callable, mesh: Mesh, x: jax.Array) -> jax.stages.Lowered:
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    return jax.jit(mapped).lower(x)


def _compile(fn: Callable, mesh: Mesh, x: jax.Array) -> jax.stages.Compiled:
    return _lower(fn, mesh, x).compile()


def same_program_everywhere(label: str, lowered_text: str) -> str:
    """The SHA-256 of `lowered_text`, checked equal on every process (collective): processes
    whose programs differ would wait on each other's collectives forever. RuntimeError on every
    process where they differ."""
    digest = hashlib.sha256(lowered_text.encode()).digest()
    digests = gather_processes(np.frombuffer(digest, np.uint8))
    if not (digests == digests[0]).all():
        different = [p for p in range(len(digests)) if (digests[p] != digests[0]).any()]
        raise RuntimeError(
            f"{label}: process(es) {different} lowered a different program than process 0"
        )
    return digest.hex()


def gather_processes(local: np.ndarray) -> np.ndarray:
    """Every process's `local` (same shape everywhere), stacked: [processes, *shape]."""
    return np.asarray(multihost_utils.process_allgather(local)).reshape(-1, *local.shape)


def _device_stats(out: jax.Array, reference: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """Per local device: [sum sq error, sum sq reference, max abs error] and a 128-bit digest
    of the output bytes (as 4 uint32), to compare replicas across processes."""
    ref_shards = {s.device: s.data for s in reference.addressable_shards}
    stats, digests = [], []
    for shard in out.addressable_shards:
        y = np.asarray(shard.data)
        ref = np.asarray(ref_shards[shard.device], np.float64)
        err = y.astype(np.float64) - ref
        stats.append([err.ravel() @ err.ravel(), ref.ravel() @ ref.ravel(), np.abs(err).max()])
        digest = hashlib.blake2b(y.tobytes(), digest_size=16).digest()
        digests.append(np.frombuffer(digest, np.uint32))
    return np.asarray(stats, np.float32), np.stack(digests)


def _errors(out: jax.Array, reference: jax.Array) -> dict[str, float | bool]:
    """Relative RMS error and max abs error over all devices' outputs, and whether all
    devices' outputs are bit-identical."""
    stats, digests = _device_stats(out, reference)
    stats = gather_processes(stats).reshape(-1, 3).astype(np.float64)
    digests = gather_processes(digests).reshape(-1, 4)
    return {
        "rel_rms": float(math.sqrt(stats[:, 0].sum() / stats[:, 1].sum())),
        "max_abs": float(stats[:, 2].max()),
        "identical": bool((digests == digests[0]).all()),
    }


def measure(
    methods: Sequence[dict],
    size_bytes: int,
    repeats: int | None,
    seed: int,
    *,
    with_timeline: bool = False,
    join: str = "launcher",
) -> dict[str, object]:
    """Times and checks every method (dicts of label, name, options) at one size; see module doc.
    `with_timeline` (one device a process): then traces one more call of each (`timeline`)."""
    if with_timeline and jax.process_count() != jax.device_count():
        raise ValueError("a timeline needs one device a process (--processes)")
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    n, num_elements = mesh.size, size_bytes // 2
    x = jax.make_array_from_callback(
        (n, num_elements),
        NamedSharding(mesh, P(AXIS)),
        lambda index: activations(index[0].start, num_elements, seed)[None],
    )
    reference = _compile(lambda b: lax.psum(b[0].astype(jnp.float32), AXIS)[None], mesh, x)(x)
    token = jax.make_array_from_callback(
        (n,), NamedSharding(mesh, P(AXIS)), lambda index: np.ones(1, np.float32)
    )
    barrier = _compile(lambda t: lax.psum(t, AXIS), mesh, token)

    def timed(program: jax.stages.Compiled, inputs: jax.Array) -> float:
        barrier(token).block_until_ready()
        start = time.perf_counter()
        program(inputs).block_until_ready()
        return time.perf_counter() - start

    programs: dict[str, tuple[jax.stages.Compiled, jax.Array]] = {}
    rows: dict[str, dict[str, object]] = {}
    for method in methods:
        label = method["label"]
        program, inputs, rows[label] = _compile_and_check(method, mesh, x, reference)
        programs[label] = (program, inputs)

    repeats, timings = time_side_by_side(
        list(programs), lambda label: timed(*programs[label]), repeats
    )
    for label, stats in timings.items():
        rows[label].update(stats)
    if with_timeline:
        _add_timelines(programs, rows, lambda: barrier(token).block_until_ready())
    return {
        "n": n,
        "num_processes": jax.process_count(),
        "join": join,
        "size_bytes": size_bytes,
        "repeats": repeats,
        "transport_probe": None if (probe := transport.link()) is None else vars(probe),
        "rows": list(rows.values()),
    }


def _compile_and_check(
    method: dict, mesh: Mesh, x: jax.Array, reference: jax.Array
) -> tuple[jax.stages.Compiled, jax.Array, dict[str, object]]:
    """One method's program (checked to be the same on every process), its input (x, or x
    rotated for a method that takes a rotated input) and what its row records of its wire
    bytes and of its result against the exact sum."""
    label, n, num_elements = method["label"], mesh.size, x.shape[1]
    ar = get_all_reduce(method["name"], **method["options"])
    inputs, expected = x, reference
    if method.get("rotated_input"):
        inputs = _compile(lambda b, r=ar.foldable_rotation: r.apply(b[0])[None], mesh, x)(x)
        ar = ar.with_rotated_input()
        expected = _compile(lambda b, ar=ar: ar.exact_sum(b[0], AXIS)[None], mesh, x)(inputs)
    lowered = _lower(lambda b, ar=ar: ar(b[0], AXIS)[None], mesh, inputs)
    program_sha256 = same_program_everywhere(label, lowered.as_text())
    program = lowered.compile()
    hlo_bytes = collective_wire_bytes(program.as_text(), n)
    row = {
        "label": label,
        "name": method["name"],
        "options": ar.options(),
        "rotated_input": bool(method.get("rotated_input")),
        "quantized": ar.quantizes(num_elements, jnp.bfloat16),
        "wire_bytes_hlo": hlo_bytes,
        "wire_bytes_hlo_total": sum(hlo_bytes.values()),
        "wire_bytes_formula": ar.wire_bytes(num_elements, jnp.bfloat16, n),
        "slices": _slices(ar, num_elements, n),
        "gather_piece_bytes": _gather_piece_bytes(ar, n),
        "send_pieces": _sends_in_pieces(ar, n),
        "program_sha256": program_sha256,
        **_errors(program(inputs), expected),
    }
    return program, inputs, row


def _add_timelines(
    programs: dict[str, tuple[jax.stages.Compiled, jax.Array]],
    rows: dict[str, dict[str, object]],
    barrier: Callable[[], object],
) -> None:
    """Traces one more call of each program, after the barrier, into its row's "timeline"."""
    for label, (program, inputs) in programs.items():
        ready_ns = []

        def call(program=program, inputs=inputs, ready_ns=ready_ns) -> None:
            barrier()
            program(inputs).block_until_ready()
            ready_ns.append(time.time_ns())  # the profiler's clock: wall time

        spans = timeline.trace_call(call, program.as_text())
        rows[label]["timeline"] = _timeline(spans, ready_ns[0])


def _timeline(own: list[timeline.Span], ready_ns: int) -> dict[str, object] | None:
    """This process's spans of one call and when its result was ready -> on process 0, the
    timeline row of every process (collective: all processes call this): spans in ms from the
    call's earliest start, and summaries."""
    gathered = _all_processes({"spans": [dataclasses.asdict(s) for s in own], "ready": ready_ns})
    processes = [[timeline.Span(**span) for span in each["spans"]] for each in gathered]
    summaries = timeline.summarize(processes, [each["ready"] for each in gathered])
    if jax.process_index() != 0 or not summaries:
        return None
    origin = timeline.earliest_start_ns(processes)
    return {
        "processes": [timeline.to_json(spans, origin) for spans in processes],
        "summary": [dataclasses.asdict(s) for s in summaries],
    }


def _all_processes(value: object) -> list[object]:
    """Every process's JSON value, in process order (collective)."""
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = gather_processes(np.array([data.size], np.int64)).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    gathered = gather_processes(padded)
    return [json.loads(bytes(gathered[p, : sizes[p]])) for p in range(len(sizes))]


def _method_of(ar: object) -> object:
    """The all-reduce that runs: a model's form (`RotatedInput`) runs its method's lanes."""
    return ar.method if isinstance(ar, RotatedInput) else ar


def _slices(ar: object, num_elements: int, n: int) -> int | None:
    """The pipeline slices a ring-engine method cuts this message into (None for others)."""
    ar = _method_of(ar)
    if isinstance(ar, EquarxInt8):
        ar = ar.for_axis_size(n)
    if not isinstance(ar, RingAllReduce):
        return None
    return ar.slices_for(num_elements, jnp.bfloat16, n)


def _two_shot(ar: object, n: int) -> EquarxInt8 | None:
    """The `equarx-int8` method of `ar` where it runs two-shot over `n` devices, else None."""
    ar = _method_of(ar)
    return ar if isinstance(ar, EquarxInt8) and ar.schedule_for(n) == "two-shot" else None


def _gather_piece_bytes(ar: object, n: int) -> int | None:
    """The most payload bytes of a piece of two-shot's all-gather for an `equarx-int8` method
    that runs two-shot here (0: whole chunks), else None."""
    return None if (two_shot := _two_shot(ar, n)) is None else two_shot.gather_piece_bytes()


def _sends_in_pieces(ar: object, n: int) -> bool | None:
    """Whether two-shot's encode and reduce-scatter go in those pieces too, for an
    `equarx-int8` method that runs two-shot here, else None."""
    return None if (two_shot := _two_shot(ar, n)) is None else two_shot.sends_in_pieces()


def command(
    size_bytes: int,
    methods: Sequence[dict],
    *,
    devices: int | None,
    repeats: int | None,
    seed: int,
    with_timeline: bool = False,
    join: str = "launcher",
) -> list[str]:
    """The command line that runs this module (process flags are added by the launcher)."""
    args = ["--size-bytes", str(size_bytes), "--methods", json.dumps(list(methods))]
    args += ["--seed", str(seed), "--join", join]
    if with_timeline:
        args.append("--timeline")
    if devices is not None:
        args += ["--devices", str(devices)]
    if repeats is not None:
        args += ["--repeats", str(repeats)]
    return multiprocess.python_module_command(MODULE, *args)


def parse_result(stdout: str) -> dict[str, object]:
    """The result that process 0 printed, from its stdout (other lines are ignored)."""
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARKER + " "):
            return json.loads(line.removeprefix(RESULT_MARKER + " "))
    raise RuntimeError(f"no {RESULT_MARKER} line in the worker's output:\n{stdout[-2000:]}")


def join_plainly(coordinator: str, num_processes: int, process_id: int) -> None:
    """What a user's own CPU program does to join (docs/own-program.md), and nothing else."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-bytes", type=int, required=True, help="message bytes per device")
    parser.add_argument("--methods", type=json.loads, required=True, help="JSON list of methods")
    parser.add_argument("--devices", type=int, help="N host devices in this one process")
    parser.add_argument("--repeats", type=int, help="timed rounds (default: adaptive)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeline", action="store_true", help="trace one more call of each")
    parser.add_argument(
        "--join",
        choices=JOINS,
        default="launcher",
        help="how several processes join: the project's launcher, or a plain user's program",
    )
    multiprocess.add_process_flags(parser)
    args = parser.parse_args(argv)

    jax.config.update("jax_platforms", "cpu")
    if args.devices is not None:
        jax.config.update("jax_num_cpu_devices", args.devices)
    elif args.num_processes > 1 and args.join == "plain":
        join_plainly(args.coordinator, args.num_processes, args.process_id)
    elif args.num_processes > 1:
        multiprocess.initialize(args.coordinator, args.num_processes, args.process_id)
    expected = args.devices if args.devices is not None else args.num_processes
    if jax.device_count() != expected:
        raise RuntimeError(f"expected {expected} devices, JAX has {jax.device_count()}")
    result = measure(
        args.methods,
        args.size_bytes,
        args.repeats,
        args.seed,
        with_timeline=args.timeline,
        join=args.join,
    )
    if jax.process_index() == 0:
        print(RESULT_MARKER, json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
