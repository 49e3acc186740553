"""Where the measured link is slow, two-shot's reduce, all-gather and decode go in pieces of a
lane's rows (at most `GATHER_PIECE_BYTES` of payload each), and the call's first chunk travels
as its first piece and the rest; where it is slower still, every chunk sent travels in the
pieces: more collectives and kernel calls, the same all-reduce bits as in one piece, which is
what a fast link or no measured link gets."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import AXIS, llm_activations, mesh_of
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from equarx_serve.bench import allreduce_worker
from equarx_serve.collectives import get_all_reduce, ring, transport
from equarx_serve.kernels import one_shot


@given(
    groups=st.integers(1, 5000),
    group_rows=st.sampled_from([1, 2, 4]),
    row_bytes=st.sampled_from([34, 66, 68]),
    piece_bytes=st.integers(0, 1 << 20),
)
def test_the_pieces_cover_the_rows_in_order_in_whole_groups_within_the_limit(
    groups, group_rows, row_bytes, piece_bytes
):
    rows = groups * group_rows
    pieces = ring._gather_pieces(rows, row_bytes, group_rows, piece_bytes)
    ends = [first + count for first, count in pieces]
    assert [first for first, _ in pieces] == [0, *ends[:-1]] and ends[-1] == rows
    assert all(count > 0 and count % group_rows == 0 for _, count in pieces)
    largest = max(count for _, count in pieces)
    assert largest - min(count for _, count in pieces) <= group_rows  # as even as groups allow
    if piece_bytes == 0:
        assert pieces == [(0, rows)]
    else:  # within the limit but for one group (at least one group a piece)
        assert largest * row_bytes <= piece_bytes + group_rows * row_bytes


def _link(gbit_per_s: float) -> transport.LinkEstimate:
    return transport.LinkEstimate(gbit_per_s * 1e9, devices=4, probe_seconds=0.1, empty_seconds=0)


def test_only_a_slow_measured_link_gets_pieces():
    ar = get_all_reduce("equarx-int8")
    assert ar.gather_piece_bytes() == 0 and not ar.sends_in_pieces()  # fake devices: unmeasured
    piece = ring.GATHER_PIECE_BYTES
    for rate, pieces, sends in ((0.8, piece, True), (2.0, piece, False), (5.3, 0, False)):
        with transport.assume(_link(rate)):
            assert ar.gather_piece_bytes() == pieces and ar.sends_in_pieces() == sends


def _run(ar, x: jax.Array, n: int) -> tuple[np.ndarray, str]:
    fn = lambda b: ar(b[0], AXIS)[None]
    program = jax.jit(jax.shard_map(fn, mesh=mesh_of(n), in_specs=P(AXIS), out_specs=P(AXIS)))
    return np.asarray(program(x)), program.lower(x).compile().as_text()


@pytest.mark.parametrize("options", [{}, {"num_slices": 2}, {"bidirectional": True}])
@pytest.mark.parametrize("gbit_per_s", [0.8, 2.0])  # sends in pieces too, or whole
def test_all_reduce_bits_do_not_depend_on_the_gather_pieces(monkeypatch, options, gbit_per_s):
    if not (one_shot.quantizes_chunks(32, 64) and one_shot.decodes_each(32, 64)):
        pytest.skip("the two-shot kernels do not run on this CPU")
    ar = get_all_reduce("equarx-int8", min_size_bytes=0, **options)
    n = 4
    x = llm_activations(n, tokens=64, hidden=1024).astype(jax.numpy.bfloat16)
    x = jax.device_put(x, NamedSharding(mesh_of(n), P(AXIS)))
    monkeypatch.setattr(ring, "GATHER_PIECE_BYTES", 2000)  # 17 KiB chunk payloads: 9 pieces
    whole, whole_hlo = _run(ar, x, n)  # no link measured: one piece
    with transport.assume(_link(gbit_per_s)):
        pieces, pieces_hlo = _run(ar, x, n)
        sends_in_pieces = ar.sends_in_pieces()
    np.testing.assert_array_equal(pieces, whole)
    gathers, permutes = (
        [hlo.count(f" {op}(") for hlo in (whole_hlo, pieces_hlo)]
        for op in ("all-gather", "collective-permute")
    )
    pieces_a_lane = gathers[1] // gathers[0]
    assert pieces_a_lane > 1 and gathers[1] == pieces_a_lane * gathers[0]
    if sends_in_pieces:  # every chunk sent in the pieces that are all-gathered
        assert permutes[1] == pieces_a_lane * permutes[0]
    else:  # whole chunks, but the call's first one as its first piece and the rest
        assert permutes[1] == permutes[0] + 1
    into = f'custom_call_target="{one_shot.DECODE_EACH_INTO.target}"'
    assert into in pieces_hlo and into not in whole_hlo


def test_the_bench_reports_the_pieces_two_shot_runs_in():
    ar = get_all_reduce("equarx-int8")
    assert allreduce_worker._gather_piece_bytes(ar, 2) is None  # one-shot: no all-gather pieces
    assert allreduce_worker._gather_piece_bytes(get_all_reduce("ring"), 4) is None
    assert allreduce_worker._gather_piece_bytes(ar.with_rotated_input(), 4) == 0
    assert allreduce_worker._sends_in_pieces(ar, 2) is None
    assert allreduce_worker._sends_in_pieces(ar.with_rotated_input(), 4) is False
    with transport.assume(_link(0.8)):
        assert allreduce_worker._gather_piece_bytes(ar, 4) == ring.GATHER_PIECE_BYTES
        assert allreduce_worker._sends_in_pieces(ar, 4) is True
