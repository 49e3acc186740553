"""Ahead-of-time lowering for TPU and NVIDIA GPU from any host, and what crosses devices.

    python -m equarx_serve.bench.lowering [--out docs/results/lowering.json]

Lowers, for an abstract TPU v5e and an abstract H100 (`jax.sharding.AbstractDevice` in an
`AbstractMesh`, under `use_abstract_mesh`; no accelerator needed):
  - the Pallas kernel (`kernels.block_quantize.accumulate_quantize`), alone and fed 2 payloads;
  - every registered all-reduce inside `shard_map` over N = 2, 4 and 8 devices, with its
    defaults and, where it has the option, `kernel="pallas"`, on a bf16 message of
    `MESSAGE_BYTES` a device (above every size gate);
  - the TP = 2 Gemma 3 270M prefill program with `equarx-int8` (a 2048-token bucket).

For each it records whether it lowered (or the error) and every collective of the lowered
StableHLO with its element type and result bytes: what the program puts on the wire, before
the target's compiler runs (which this host cannot run for TPU or GPU). The JSON feeds
`equarx-serve report`; `tests/aot_lowering_test.py` checks the same programs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from equarx_serve.bench import provenance

AXIS = "tp"
# The abstract devices lowered for: the kinds the paper and its users run on.
TARGETS = {
    "tpu": AbstractDevice(device_kind="TPU v5 lite", num_cores=None, platform="tpu"),
    "cuda": AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="cuda"),
}
DEVICE_COUNTS = (2, 4, 8)
MESSAGE_BYTES = 4 * 1024 * 1024  # a device's bf16 message: above every gate
PREFILL_TOKENS = 2048

_COLLECTIVE = re.compile(
    r'"stablehlo\.(?P<op>all_gather|all_reduce|collective_permute|all_to_all|reduce_scatter)"'
)
# The op's type, `: (operands) -> result`, on its own line or, after a region, on the line
# that closes it (`}) : ...`).
_SIGNATURE = re.compile(r"\)\s*->\s*(?P<result>tensor<[^>]*>|\([^)]*\))\s*$")
_TENSOR = re.compile(r"tensor<(?P<dims>(?:\d+x)*)(?P<dtype>[a-z]+\d*)>")
_BITS = {"i1": 8, "i8": 8, "ui8": 8, "i16": 16, "ui16": 16, "bf16": 16, "f16": 16}
_BITS.update({"i32": 32, "ui32": 32, "f32": 32, "i64": 64, "ui64": 64, "f64": 64})


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a lowered program: its op, the element type and bytes of a result."""

    op: str
    dtype: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One program lowered for one platform: `error` is None where it lowered."""

    program: str
    platform: str
    devices: int
    variant: str
    error: str | None
    collectives: tuple[Collective, ...] = ()

    @property
    def lowered(self) -> bool:
        return self.error is None

    def wire_bytes_by_dtype(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for c in self.collectives:
            totals[c.dtype] = totals.get(c.dtype, 0) + c.bytes
        return totals


def collectives_of(stablehlo: str) -> tuple[Collective, ...]:
    """Every collective in StableHLO text (generic form), one entry per tensor it returns."""
    found = []
    lines = stablehlo.splitlines()
    for i, line in enumerate(lines):
        if (match := _COLLECTIVE.search(line)) is None:
            continue
        closing = line if not line.rstrip().endswith("({") else _region_end(lines, i)
        signature = _SIGNATURE.search(closing)
        if signature is None:
            raise ValueError(f"no result type for collective {match['op']}: {line.strip()!r}")
        for tensor in _TENSOR.finditer(signature["result"]):
            elements = 1
            for dim in filter(None, tensor["dims"].split("x")):
                elements *= int(dim)
            bits = _BITS[tensor["dtype"]]
            found.append(Collective(match["op"], tensor["dtype"], elements * bits // 8))
    return tuple(found)


def _region_end(lines: list[str], start: int) -> str:
    """The line that closes the region opened at the end of lines[start] (`}) : ...`)."""
    indent = len(lines[start]) - len(lines[start].lstrip())
    for line in lines[start + 1 :]:
        if line.lstrip().startswith("})") and len(line) - len(line.lstrip()) == indent:
            return line
    raise ValueError(f"unclosed region after: {lines[start].strip()!r}")


def abstract_mesh(platform: str, devices: int) -> AbstractMesh:
    return AbstractMesh((devices,), (AXIS,), abstract_device=TARGETS[platform])


def lower(
    program: str, platform: str, devices: int, variant: str, build: Callable[[], object]
) -> Lowering:
    """`build()` -> a jitted function's `.trace(...)`, lowered for `platform` on an abstract
    mesh of `devices`; any error is recorded, not raised."""
    mesh = abstract_mesh(platform, devices)
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            text = build(mesh).lower(lowering_platforms=(platform,)).as_text()
    except Exception as error:  # recorded, not raised: which programs lower is the result
        return Lowering(program, platform, devices, variant, f"{type(error).__name__}: {error}")
    return Lowering(program, platform, devices, variant, None, collectives_of(text))


def kernel_program(num_received: int):
    """The Pallas kernel, sharded over the mesh, with `num_received` payloads."""
    from equarx_serve.kernels import block_quantize

    def build(mesh: AbstractMesh):
        rows = 1024 * mesh.size
        spec = NamedSharding(mesh, P(AXIS))
        local = jax.ShapeDtypeStruct((rows, 32), jnp.bfloat16, sharding=spec)
        q = jax.ShapeDtypeStruct((rows, 32), jnp.int8, sharding=spec)
        scale = jax.ShapeDtypeStruct((rows, 1), jnp.bfloat16, sharding=spec)

        def body(local, *received):
            pairs = tuple(zip(received[::2], received[1::2], strict=True))
            return block_quantize.accumulate_quantize(local, pairs, scale_dtype=jnp.bfloat16)

        sharded = jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
        return jax.jit(sharded).trace(local, *[q, scale] * num_received)

    return build


def all_reduce_program(name: str, options: dict[str, object]):
    """`get_all_reduce(name, **options)` on a bf16 message of MESSAGE_BYTES a device."""
    from equarx_serve.collectives import get_all_reduce

    all_reduce = get_all_reduce(name, **options)

    def build(mesh: AbstractMesh):
        shape = (mesh.size, MESSAGE_BYTES // 2)
        x = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, P(AXIS)))
        body = lambda block: all_reduce(block[0], AXIS)[None]
        sharded = jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
        return jax.jit(sharded).trace(x)

    return build


def prefill_program(method: str, tokens: int = PREFILL_TOKENS):
    """The tensor-parallel Gemma 3 270M prefill (`models.gemma3.TensorParallelGemma3`) of one
    `tokens`-long bucket, on abstract parameters of the checkpoint's shapes, in bf16."""
    from models.config import get_config
    from models.gemma3 import TensorParallelGemma3, param_shapes

    def build(mesh: AbstractMesh):
        model = TensorParallelGemma3(get_config("gemma3-270m"), mesh, method)
        checkpoint = jax.tree.map(
            lambda shape, sharding: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding),
            param_shapes(model.config),
            model.checkpoint_shardings(),
            is_leaf=lambda x: isinstance(x, tuple),
        )
        params = jax.eval_shape(model.fold_params, checkpoint)
        params = jax.tree.map(
            lambda p, sharding: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=sharding),
            params,
            model.param_shardings(),
        )
        replicated = NamedSharding(mesh, P())
        ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32, sharding=replicated)
        mask = jax.ShapeDtypeStruct((1, tokens), jnp.bool_, sharding=replicated)
        return jax.jit(lambda p, t, m: model(p, t, m, last_only=True)).trace(params, ids, mask)

    return build


def variants(name: str) -> dict[str, dict[str, object]]:
    """The option sets lowered for an all-reduce: its defaults, and kernel="pallas" where it
    has a `kernel` option."""
    from equarx_serve.collectives import get_all_reduce

    found = {"default": {}}
    if "kernel" in {f.name for f in dataclasses.fields(get_all_reduce(name))}:
        found["pallas"] = {"kernel": "pallas"}
    return found


def run_all(platforms: Sequence[str] = tuple(TARGETS)) -> list[Lowering]:
    from equarx_serve.collectives import list_all_reduces

    results = []
    for platform in platforms:
        for received in (0, 2):
            program = kernel_program(received)
            results.append(lower("kernel", platform, 2, f"received={received}", program))
        for name in list_all_reduces():
            for variant, options in variants(name).items():
                for devices in DEVICE_COUNTS:
                    program = all_reduce_program(name, options)
                    results.append(lower(name, platform, devices, variant, program))
        prefill = prefill_program("equarx-int8")
        results.append(lower("prefill gemma3-270m equarx-int8", platform, 2, "default", prefill))
    return results


def format_table(results: Sequence[Lowering]) -> str:
    lines = [f"{'program':<34} {'platform':<8} {'N':>2} {'variant':<12} {'lowered':<8} wire"]
    for r in results:
        wire = ", ".join(f"{d} {b / 2**20:.2f} MiB" for d, b in r.wire_bytes_by_dtype().items())
        status = "yes" if r.lowered else "NO"
        lines.append(
            f"{r.program:<34} {r.platform:<8} {r.devices:>2} {r.variant:<12} {status:<8} "
            f"{wire or (r.error or '-')[:80]}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--platforms", nargs="+", choices=tuple(TARGETS), default=list(TARGETS))
    args = parser.parse_args(argv)
    results = run_all(args.platforms)
    print(format_table(results))
    if args.out is not None:
        rows = [dataclasses.asdict(r) | {"lowered": r.lowered} for r in results]
        payload = {
            "provenance": provenance.collect(),
            "benchmark": "lowering",
            "message_bytes": MESSAGE_BYTES,
            "results": rows,
        }
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    return 0 if all(r.lowered for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
