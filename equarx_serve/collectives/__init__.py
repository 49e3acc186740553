"""Pluggable all-reduces for `jax.shard_map`, chosen by name.

    from equarx_serve.collectives import get_all_reduce
    ar = get_all_reduce("equarx-int8", block_size=256)
    y = ar(x, "tp")  # inside jax.shard_map; same shape and dtype as lax.psum(x, "tp")

Registered: psum, psum-f32, ring, naive-int8, equarx-int8. Importing this package does not
import JAX (the command line parses method specs first); `AllReduce` and the implementations
load on first use.

Several processes (`jax.distributed.initialize`): the link-dependent defaults (slices, two-shot's
pieces) go by the link between the processes, which the first all-reduce traced measures
(collective, ~0.1-2 s); `measure_link()` measures it at a point of the program's choosing (every
process calls it), `with assume_link(estimate):` traces as if it had found `estimate` (None: no
link, no measurement). See `transport` and docs/own-program.md.
"""

from equarx_serve.collectives.registry import (
    MethodSpec,
    get_all_reduce,
    list_all_reduces,
    parse_method,
    register_all_reduce,
)
from equarx_serve.collectives.transport import LinkEstimate
from equarx_serve.collectives.transport import assume as assume_link
from equarx_serve.collectives.transport import measure as measure_link

__all__ = [
    "AllReduce",
    "LinkEstimate",
    "MethodSpec",
    "assume_link",
    "get_all_reduce",
    "list_all_reduces",
    "measure_link",
    "parse_method",
    "register_all_reduce",
]


def __getattr__(name: str) -> object:
    if name == "AllReduce":
        from equarx_serve.collectives.base import AllReduce

        return AllReduce
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
