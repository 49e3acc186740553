"""One process of own_program_test.py: a user's own program, joined with plain
`jax.distributed.initialize` (gloo on CPU) and nothing else of the project's launcher.

    python tests/_plain_worker.py --coordinator HOST:PORT --num-processes 2 --process-id I

Prints one JSON line: the link `transport` held before the first all-reduce was traced (None:
nothing measured yet), the link after it, and the SHA-256 of the lowered text of that
all-reduce's program (every process must have traced the same one).
"""

from __future__ import annotations

import argparse
import hashlib
import json

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from equarx_serve.collectives import get_all_reduce, transport

SHAPE = (8, 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    args = parser.parse_args()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        args.coordinator, num_processes=args.num_processes, process_id=args.process_id
    )
    before = transport._measured  # what a test may read: nothing measured yet
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    ar = get_all_reduce("equarx-int8")
    body = lambda b: ar(b[0], "tp")[None]
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    n = len(mesh.devices)
    sharding = NamedSharding(mesh, P("tp"))
    x = jax.make_array_from_callback(
        (n, *SHAPE), sharding, lambda index: np.ones((1, *SHAPE), jax.numpy.bfloat16)
    )
    lowered = program.lower(x)
    (shard,) = lowered.compile()(x).addressable_shards
    link = transport.link()
    report = {
        "process_id": args.process_id,
        "measured_before": isinstance(before, transport.LinkEstimate),
        "link": None if link is None else vars(link),
        "program_sha256": hashlib.sha256(lowered.as_text().encode()).hexdigest(),
        "sum": float(np.asarray(shard.data, np.float32).mean()),
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
