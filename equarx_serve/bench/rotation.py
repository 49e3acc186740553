"""What the Hadamard rotation costs: the transform alone, inside the all-reduce, and folded into
the model's weights; timed on XLA:CPU and counted in the program lowered for TPU.

    python -m equarx_serve.bench.rotation [--sizes 1MiB 4MiB 16MiB] [--devices 2]
                                          [--blocks 64 128 256] [--repeats 10] [--json PATH]

Every table is measured side by side in one run: `repeats` rounds, each running every variant
once in an order rotated by one per round; a call is timed with `perf_counter` around
`program(x).block_until_ready()` (compiled ahead of time, one untimed call first); medians.

1. The transform alone, one device: a bf16 message (`size` bytes) rotated in blocks of B
   into f32, as before (cast to f32, then the two radix-sqrt(B) stages, the "kronecker" form
   of `collectives.hadamard.block_hadamard`) and now (`block_hadamard` on the bf16 values:
   the dense [B, B] product up to B = 128, on the 16-bit values when the matrix is exact).
2. The inverse alone, one device: a decoded payload (int8 codes and scales, quantized from a
   bf16 message of `size` bytes) rotated back into bf16 in groups of 64, on the values
   (`decode` to f32, then the f32 product) and on the codes (`decode_rotated`: the codes'
   int8 product, then one pass that scales and mixes a group's blocks), as `equarx-int8`'s
   codec runs them, for each codec of `INVERSE_CODECS` (blocks of 64 with f32 scales, one
   block a group; two-shot's default, blocks of 32 with bf16 scales, two a group), all
   side by side.
3. Inside `equarx-int8` (block 64, default otherwise, size gate off) on `devices` fake CPU
   devices in one process (`ppermute` is a memory copy), the message LLM-activation-like
   (`allreduce_worker.activations`): without rotation; the rotation inside the collective in
   the Kronecker form (the all-reduce before); inside in the dense form (the all-reduce a
   user's shard_map gets); folded into the weights (only the inverse runs: what the model
   runs, `with_rotated_input()`), with the default schedule and its default place for the
   inverse, then one-shot and two-shot with the inverse on the values and on the codes, and
   two-shot with its default codec (block 32, bf16 scales, groups of 64) both ways.
4. The same programs lowered for TPU (no TPU needed; the quantizer's XLA path, since the
   Pallas kernel is opaque to the count): FLOPs and bytes accessed from XLA's HLO cost analysis.
   These are counts from XLA's generic cost model, not a TPU timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from equarx_serve.arguments import argument_type, int_at_least
from equarx_serve.bench.allreduce import format_size, parse_size

AXIS = "x"
QUANT_BLOCK = 64
SEED = 0
DEFAULT_SIZES = ("1MiB", "4MiB", "16MiB")
ALL_REDUCE_VARIANTS = (
    "no rotation",
    "inside, kronecker (before)",
    "inside, dense (now, standalone)",
    "folded, inverse only (now, model)",
)
ROTATION_GROUP = 64


@dataclasses.dataclass(frozen=True)
class InverseCodec:
    """A quantization codec whose decoded payloads are rotated back in groups of 64."""

    label: str
    block_size: int
    scale_dtype: str

    def options(self) -> dict[str, object]:
        return dict(
            block_size=self.block_size,
            scale_dtype=self.scale_dtype,
            rotation_block=ROTATION_GROUP,
        )


INVERSE_CODECS = (
    InverseCodec("block 64, f32 scales", 64, "float32"),
    InverseCodec("block 32, bf16 scales", 32, "bfloat16"),
)
# The folded form with the inverse placed explicitly: (label, schedule, inverse, codec).
INVERSE_VARIANTS = (
    ("folded, one-shot, inverse on values", "one-shot", "values", INVERSE_CODECS[0]),
    ("folded, one-shot, inverse on codes", "one-shot", "codes", INVERSE_CODECS[0]),
    ("folded, two-shot, inverse on values", "two-shot", "values", INVERSE_CODECS[0]),
    ("folded, two-shot, inverse on codes", "two-shot", "codes", INVERSE_CODECS[0]),
    ("folded, two-shot, block 32 bf16, on values", "two-shot", "values", INVERSE_CODECS[1]),
    ("folded, two-shot, block 32 bf16, on codes", "two-shot", "codes", INVERSE_CODECS[1]),
)
INVERSE_FORMS = ("values", "codes")


@dataclasses.dataclass(frozen=True)
class Timing:
    """Median milliseconds of each variant at one size (and block)."""

    size: int
    block: int
    median_ms: dict[str, float]


def _time_side_by_side(programs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    import numpy as np

    names = list(programs)
    for name in names:  # untimed: compile caches, first-touch allocations
        programs[name]().block_until_ready()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            programs[name]().block_until_ready()
            times[name].append(time.perf_counter() - started)
    return {name: float(np.median(t)) * 1e3 for name, t in times.items()}


def _time_functions(functions: dict[str, Callable[[Any], Any]], x: Any, repeats: int):
    """Median ms of each function of `x`, compiled ahead of time, timed side by side."""
    import jax

    programs = {}
    for name, function in functions.items():
        compiled = jax.jit(function).lower(x).compile()
        programs[name] = lambda compiled=compiled: compiled(x)
    return _time_side_by_side(programs, repeats)


def time_transform(sizes: Sequence[int], blocks: Sequence[int], repeats: int) -> list[Timing]:
    import jax.numpy as jnp
    import numpy as np

    from equarx_serve.collectives.hadamard import block_hadamard

    timings = []
    for size in sizes:
        x = jnp.asarray(np.random.default_rng(SEED).standard_normal(size // 2), jnp.bfloat16)
        for block in blocks:
            variants = {
                "before": lambda v, block=block: block_hadamard(
                    v.astype(jnp.float32).reshape(-1, block), form="kronecker"
                ),
                "now": lambda v, block=block: block_hadamard(v.reshape(-1, block)),
            }
            timings.append(Timing(size, block, _time_functions(variants, x, repeats)))
    return timings


def time_inverse(sizes: Sequence[int], repeats: int) -> list[Timing]:
    """One Timing per size, keyed "<codec label>: <form>" for every codec and form."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from equarx_serve.collectives import get_all_reduce
    from equarx_serve.collectives.hadamard import HadamardRotation
    from equarx_serve.kernels.block_quantize import quantize_chunk_xla

    rotation = HadamardRotation(ROTATION_GROUP)
    timings = []
    for size in sizes:
        message = np.random.default_rng(SEED).standard_normal(size // 2).astype(np.float32)
        programs = {}
        for inverse_codec in INVERSE_CODECS:
            block = inverse_codec.block_size
            method = get_all_reduce("equarx-int8", **inverse_codec.options())
            codec = method.codec(jnp.bfloat16)
            values = jnp.asarray(message.reshape(1, -1, block))
            payload = jax.jit(quantize_chunk_xla, static_argnums=1, static_argnames="scale_dtype")(
                values, 0, scale_dtype=jnp.dtype(inverse_codec.scale_dtype)
            )
            forms = {
                "values": lambda p, codec=codec: rotation.apply(
                    codec.decode(p, jnp.float32).reshape(-1), out_dtype=jnp.bfloat16
                ),
                "codes": lambda p, codec=codec: codec.decode_rotated(p, ROTATION_GROUP).astype(
                    jnp.bfloat16
                ),
            }
            for form, function in forms.items():
                compiled = jax.jit(function).lower(payload).compile()
                key = f"{inverse_codec.label}: {form}"
                programs[key] = lambda compiled=compiled, payload=payload: compiled(payload)
        timings.append(Timing(size, ROTATION_GROUP, _time_side_by_side(programs, repeats)))
    return timings


def _rotate_inside(plain: Any, form: str, x: Any, axis_name: str) -> Any:
    """The all-reduce as it was before: rotate the flat message in f32, reduce, rotate back."""
    import jax.numpy as jnp

    from equarx_serve.collectives.hadamard import block_hadamard

    rotate = lambda v: block_hadamard(v.reshape(-1, QUANT_BLOCK), form=form).reshape(-1)
    reduced = plain(rotate(x.reshape(-1).astype(jnp.float32)), axis_name)
    return rotate(reduced).reshape(x.shape).astype(x.dtype)


def all_reduce_bodies() -> dict[str, tuple[Callable[[Any], Any], bool]]:
    """variant -> (per-device body x -> reduced x, whether its input is rotated first)."""
    from equarx_serve.collectives import get_all_reduce

    rotated = get_all_reduce("equarx-int8", block_size=QUANT_BLOCK, min_size_bytes=0)
    plain = get_all_reduce("equarx-int8", block_size=QUANT_BLOCK, rotation=None, min_size_bytes=0)
    folded = rotated.with_rotated_input()
    bodies = {
        ALL_REDUCE_VARIANTS[0]: (lambda x: plain(x, AXIS), False),
        ALL_REDUCE_VARIANTS[1]: (lambda x: _rotate_inside(plain, "kronecker", x, AXIS), False),
        ALL_REDUCE_VARIANTS[2]: (lambda x: rotated(x, AXIS), False),
        ALL_REDUCE_VARIANTS[3]: (lambda x: folded(x, AXIS), True),
    }
    for label, schedule, inverse, inverse_codec in INVERSE_VARIANTS:
        ar = get_all_reduce(
            "equarx-int8",
            **inverse_codec.options(),
            schedule=schedule,
            inverse=inverse,
            min_size_bytes=0,
        ).with_rotated_input()
        bodies[label] = (lambda x, ar=ar: ar(x, AXIS), True)
    return bodies


def _sharded_program(body: Callable[[Any], Any], mesh: Any) -> Callable[[Any], Any]:
    import jax
    from jax.sharding import PartitionSpec as P

    return jax.jit(
        jax.shard_map(lambda b: body(b[0])[None], mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    )


def _inputs(size: int, devices: int) -> tuple[Any, Any]:
    """(the message [N, size / 2] bf16, the same rotated in blocks of QUANT_BLOCK)."""
    import jax
    import numpy as np

    from equarx_serve.bench.allreduce_worker import activations
    from equarx_serve.collectives.hadamard import HadamardRotation

    host = np.stack([activations(d, size // 2, SEED) for d in range(devices)])
    return host, np.asarray(jax.jit(HadamardRotation(QUANT_BLOCK).apply)(host))


def time_all_reduce(sizes: Sequence[int], devices: int, repeats: int) -> list[Timing]:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:devices]), (AXIS,))
    sharding = NamedSharding(mesh, P(AXIS))
    timings = []
    for size in sizes:
        message, rotated = (jax.device_put(a, sharding) for a in _inputs(size, devices))
        programs = {}
        for name, (body, takes_rotated) in all_reduce_bodies().items():
            x = rotated if takes_rotated else message
            compiled = _sharded_program(body, mesh).lower(x).compile()
            programs[name] = lambda compiled=compiled, x=x: compiled(x)
        timings.append(Timing(size, QUANT_BLOCK, _time_side_by_side(programs, repeats)))
    return timings


def tpu_costs(size: int, devices: int) -> dict[str, dict[str, float]]:
    """variant -> {"flops", "bytes_accessed"} of its program lowered for TPU, per device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = AbstractMesh((devices,), (AXIS,))
    x = jax.ShapeDtypeStruct(
        (devices, size // 2), jnp.bfloat16, sharding=NamedSharding(mesh, P(AXIS))
    )
    costs = {}
    for name, (body, _) in all_reduce_bodies().items():
        lowered = _sharded_program(body, mesh).trace(x).lower(lowering_platforms=("tpu",))
        analysis = lowered.cost_analysis()
        costs[name] = {
            "flops": float(analysis["flops"]),
            "bytes_accessed": float(analysis["bytes accessed"]),
        }
    return costs


def format_report(
    transform: list[Timing],
    inverse: list[Timing],
    all_reduce: list[Timing],
    costs: dict[str, dict[str, float]],
    *,
    devices: int,
    cost_size: int,
) -> str:
    lines = ["== the transform alone (one device; bf16 message -> rotated, f32) =="]
    lines.append(f"{'size':>8} {'B':>4} {'before':>10} {'now':>10} {'speed-up':>9}")
    for t in transform:
        before, now = t.median_ms["before"], t.median_ms["now"]
        lines.append(
            f"{format_size(t.size):>8} {t.block:>4} {before:>8.2f}ms {now:>8.2f}ms "
            f"{before / now:>8.2f}x"
        )
    lines += [
        "",
        "== the inverse alone (one device; int8 codes + scales -> rotated back in groups of "
        f"{ROTATION_GROUP}, bf16; x: against {INVERSE_CODECS[0].label} on the codes) ==",
        f"{'size':>8} {'codec':>24} {'values':>10} {'codes':>10} {'speed-up':>9} {'x':>6}",
    ]
    for t in inverse:
        base = t.median_ms[f"{INVERSE_CODECS[0].label}: codes"]
        for inverse_codec in INVERSE_CODECS:
            values, codes = (t.median_ms[f"{inverse_codec.label}: {f}"] for f in INVERSE_FORMS)
            lines.append(
                f"{format_size(t.size):>8} {inverse_codec.label:>24} {values:>8.2f}ms "
                f"{codes:>8.2f}ms {values / codes:>8.2f}x {codes / base:>5.2f}x"
            )
    lines += ["", f"== equarx-int8 (block {QUANT_BLOCK}), {devices} fake CPU devices =="]
    for t in all_reduce:
        base = t.median_ms[ALL_REDUCE_VARIANTS[0]]
        lines.append(f"{format_size(t.size)} (x: against {ALL_REDUCE_VARIANTS[0]})")
        for name, ms in t.median_ms.items():
            lines.append(f"{name:>40}: {ms:9.2f} ms ({ms / base:.2f}x)")
    lines += [
        "",
        f"== lowered for TPU, {format_size(cost_size)} message, per device "
        "(XLA's HLO cost analysis: counts, not a TPU timing) ==",
    ]
    base = costs[ALL_REDUCE_VARIANTS[0]]
    for name, c in costs.items():
        lines.append(
            f"{name:>40}: {c['flops'] / 1e6:9.1f} MFLOP ({c['flops'] / base['flops']:.2f}x), "
            f"{c['bytes_accessed'] / 2**20:8.1f} MiB accessed "
            f"({c['bytes_accessed'] / base['bytes_accessed']:.2f}x)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m equarx_serve.bench.rotation",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        type=argument_type(parse_size),
        help=f"message sizes per device (default: {' '.join(DEFAULT_SIZES)})",
    )
    parser.add_argument(
        "--devices", type=argument_type(int_at_least(2)), default=2, help="fake CPU devices"
    )
    parser.add_argument(
        "--blocks", nargs="+", type=argument_type(int_at_least(1)), default=[64, 128, 256]
    )
    parser.add_argument("--repeats", type=argument_type(int_at_least(1)), default=10)
    parser.add_argument("--json", type=Path, metavar="PATH")
    args = parser.parse_args(argv)
    sizes = args.sizes or [parse_size(s) for s in DEFAULT_SIZES]

    from equarx_serve.distributed.devices import set_host_device_count

    set_host_device_count(args.devices)
    transform = time_transform(sizes, args.blocks, args.repeats)
    inverse = time_inverse(sizes, args.repeats)
    all_reduce = time_all_reduce(sizes, args.devices, args.repeats)
    costs = tpu_costs(max(sizes), args.devices)
    report = format_report(
        transform, inverse, all_reduce, costs, devices=args.devices, cost_size=max(sizes)
    )
    print(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "transform": [dataclasses.asdict(t) for t in transform],
            "inverse": [dataclasses.asdict(t) for t in inverse],
            "all_reduce": [dataclasses.asdict(t) for t in all_reduce],
            "tpu_costs": {"size": max(sizes), "devices": args.devices, "programs": costs},
            "repeats": args.repeats,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
