"""A pairwise swap (the shift by N / 2) travels in pieces of at most `SWAP_PIECE_BYTES`, each its
own collective, and arrives whole: the same bytes, and the same all-reduce bits, as in one."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import AXIS, llm_activations, mesh_of
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from equarx_serve.collectives import get_all_reduce, ring


def _program(fn, n: int):
    return jax.jit(jax.shard_map(fn, mesh=mesh_of(n), in_specs=P(AXIS), out_specs=P(AXIS)))


def _put(x: np.ndarray, n: int) -> jax.Array:
    return jax.device_put(x, NamedSharding(mesh_of(n), P(AXIS)))


@pytest.mark.parametrize(("shift", "collectives"), [(1, 1), (2, 3), (3, 1)])
def test_a_swap_travels_in_pieces_and_arrives_whole(monkeypatch, shift, collectives):
    monkeypatch.setattr(ring, "SWAP_PIECE_BYTES", 1000)
    data = (np.arange(4 * 2500) % 251).astype(np.uint8).reshape(4, 2500)
    program = _program(lambda b: ring.permute_shift(b[0], AXIS, 4, shift)[0][None], 4)
    x = _put(data, 4)
    np.testing.assert_array_equal(np.asarray(program(x)), np.roll(data, shift, axis=0))
    hlo = program.lower(x).compile().as_text()
    assert hlo.count(" collective-permute(") == collectives  # 2500 bytes: 1000 + 1000 + 500


@pytest.mark.parametrize("method", ["equarx-int8", "ring"])
def test_all_reduce_bits_do_not_depend_on_the_swap_pieces(monkeypatch, method):
    ar = get_all_reduce(method, min_size_bytes=0) if method != "ring" else get_all_reduce(method)
    x = _put(llm_activations(4, tokens=64, hidden=1024).astype(jax.numpy.bfloat16), 4)

    def run(piece_bytes: int) -> tuple[np.ndarray, str]:
        monkeypatch.setattr(ring, "SWAP_PIECE_BYTES", piece_bytes)
        program = _program(lambda b: ar(b[0], AXIS)[None], 4)
        return np.asarray(program(x)), program.lower(x).compile().as_text()

    whole, whole_hlo = run(1 << 30)
    pieces, pieces_hlo = run(4096)
    np.testing.assert_array_equal(pieces, whole)
    assert pieces_hlo.count(" collective-permute(") > whole_hlo.count(" collective-permute(")
