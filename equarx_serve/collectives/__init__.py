"""Pluggable all-reduces for `jax.shard_map`, chosen by name.

    from equarx_serve.collectives import get_all_reduce
    ar = get_all_reduce("equarx-int8", block_size=256)
    y = ar(x, "tp")  # inside jax.shard_map; same shape and dtype as lax.psum(x, "tp")

Registered: psum, psum-f32, ring, naive-int8, equarx-int8. Importing this package does not
import JAX (the command line parses method specs first); `AllReduce` and the implementations
load on first use.
"""

from equarx_serve.collectives.registry import (
    MethodSpec,
    get_all_reduce,
    list_all_reduces,
    parse_method,
    register_all_reduce,
)

__all__ = [
    "AllReduce",
    "MethodSpec",
    "get_all_reduce",
    "list_all_reduces",
    "parse_method",
    "register_all_reduce",
]


def __getattr__(name: str) -> object:
    if name == "AllReduce":
        from equarx_serve.collectives.base import AllReduce

        return AllReduce
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
