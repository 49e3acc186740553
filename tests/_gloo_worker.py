"""One process of multiprocess_test.py: all-reduces a rank-dependent input across processes.

    python tests/_gloo_worker.py --coordinator HOST:PORT --num-processes 2 --process-id I

Each process owns one CPU device; the collectives cross processes through gloo. Prints one JSON
line: the process's id and device count, the link `multiprocess.initialize` measured, and for
each all-reduce a checksum of its local output
and that output's relative RMS error against the exact (float64) sum.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from equarx_serve.collectives import AllReduce, get_all_reduce, transport
from equarx_serve.distributed import multiprocess

SHAPE = (32, 512)


def global_input(n: int) -> np.ndarray:
    """[n, *SHAPE]; device i's block has standard deviation 1 + i (every process builds it all)."""
    rng = np.random.default_rng(0)
    scale = (1.0 + np.arange(n)).reshape(n, 1, 1)
    return (rng.standard_normal((n, *SHAPE)) * scale).astype(np.float32)


def sharded_all_reduce(ar: AllReduce, mesh: Mesh):
    body = lambda b: ar(b[0], "tp")[None]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    multiprocess.add_process_flags(parser)
    args = parser.parse_args()
    multiprocess.initialize(args.coordinator, args.num_processes, args.process_id)

    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("tp",))
    x = global_input(n)
    sharding = NamedSharding(mesh, P("tp"))
    x_global = jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    exact = x.astype(np.float64).sum(axis=0)

    link = transport.link()  # measured by multiprocess.initialize
    report: dict[str, object] = {
        "process_id": args.process_id,
        "devices": n,
        "link": None if link is None else vars(link),
    }
    for name, options in (("equarx-int8", {"min_size_bytes": 0}), ("psum-f32", {})):
        ar = get_all_reduce(name, **options)
        (shard,) = sharded_all_reduce(ar, mesh)(x_global).addressable_shards
        local = np.asarray(shard.data)[0]
        error = np.linalg.norm(local.astype(np.float64) - exact) / np.linalg.norm(exact)
        report[name] = {
            "sha256": hashlib.sha256(local.tobytes()).hexdigest(),
            "rel_rms": float(error),
            "shard": int(shard.index[0].start),
        }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
