"""Pluggable all-reduces for `jax.shard_map`, chosen by name.

    from equarx_serve.collectives import get_all_reduce
    ar = get_all_reduce("equarx-int8", block_size=256)
    y = ar(x, "tp")  # inside jax.shard_map; same shape and dtype as lax.psum(x, "tp")

Registered: psum, psum-f32, ring, naive-int8, equarx-int8.
"""

from equarx_serve.collectives import baselines, equarx  # noqa: F401  (register themselves)
from equarx_serve.collectives.base import (
    AllReduce,
    get_all_reduce,
    list_all_reduces,
    register_all_reduce,
)

__all__ = ["AllReduce", "get_all_reduce", "list_all_reduces", "register_all_reduce"]
