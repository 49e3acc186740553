"""`collectives.exchange` (bytes between processes beside XLA) over socket pairs in one
process; every all-reduce's one-shot form (`one_shot_parts`, what the exchange carries)
against the method's own one-shot schedule on fake CPU devices; and where a prefill overlaps
by default (`overlap.auto_chunks`)."""

from __future__ import annotations

import socket
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_of
from jax import lax
from jax.sharding import PartitionSpec as P

from equarx_serve.arguments import chunks_or_auto
from equarx_serve.bench import prefill_timeline
from equarx_serve.collectives import exchange, get_all_reduce, overlap, transport
from equarx_serve.collectives.exchange import ByteExchange, NativeExchange

# Both implementations of the exchange; the native one where exchange.cc builds here.
KINDS = [
    ByteExchange,
    pytest.param(
        NativeExchange,
        marks=pytest.mark.skipif(
            not exchange.native_available(), reason="exchange.cc did not build (no compiler?)"
        ),
    ),
]


def connected_pair(kind) -> tuple:
    a, b = socket.socketpair()
    return kind(0, 2, {1: a}), kind(1, 2, {0: b})


@pytest.mark.parametrize("kind", KINDS)
def test_both_ends_get_every_payload_in_rank_order(kind):
    first, second = connected_pair(kind)
    for size in (1, 5, 3 << 20):  # up to several socket buffers
        payloads = [np.random.default_rng(r).integers(0, 256, size, np.uint8) for r in (0, 1)]
        seqs = [end.start(p.tobytes()) for end, p in zip((first, second), payloads, strict=True)]
        assert seqs[0] == seqs[1]
        for end, seq in zip((first, second), seqs, strict=True):
            np.testing.assert_array_equal(end.finish(seq), np.stack(payloads))
    assert first.sent_bytes == second.sent_bytes == 1 + 5 + (3 << 20)


@pytest.mark.skipif(not exchange.native_available(), reason="exchange.cc did not build")
def test_a_payload_of_another_size_is_refused_not_copied():
    first, second = connected_pair(NativeExchange)
    seq = first.start(b"abc")
    second.start(b"defg")
    with pytest.raises(RuntimeError, match="rank 1 sent 4 bytes, expected 3"):
        first.finish(seq)


@pytest.mark.skipif(not exchange.native_available(), reason="exchange.cc did not build")
def test_inside_a_program_the_custom_calls_give_the_python_exchanges_bits(monkeypatch):
    """One process, one device: the program's start/finish pair through each implementation
    (an exchange of one process returns its own payload), compute placed between them."""
    payload = jnp.arange(1000, dtype=jnp.uint8)

    def program(x):
        handle = exchange.start_exchange(x)
        second = exchange.start_exchange(x[::-1], handle)
        later = jnp.sum(x.astype(jnp.int32))
        got = exchange.finish_exchange(handle, x.size, later)
        return got, exchange.finish_exchange(second, x.size), handle, second

    results = []
    for ends in (ByteExchange(0, 1, {}), NativeExchange(0, 1, {})):
        monkeypatch.setattr(exchange, "_exchange", ends)
        traced = jax.jit(lambda x: program(x))  # a trace of its own: the exchange is read there
        results.append([np.asarray(r) for r in traced(payload)])
        text = traced.lower(payload).as_text()
        native = isinstance(ends, NativeExchange)
        assert ("equarx_exchange_start" in text) == native
    for py, native in zip(*results, strict=True):
        np.testing.assert_array_equal(py, native)
    np.testing.assert_array_equal(results[1][0], np.asarray(payload)[None])
    np.testing.assert_array_equal(results[1][1], np.asarray(payload)[::-1][None])


@pytest.mark.parametrize("kind", KINDS)
def test_exchanges_may_arrive_before_the_local_start_and_finish_in_any_order(kind):
    first, second = connected_pair(kind)
    early = [second.start(bytes([k]) * 7) for k in range(3)]
    late = [first.start(bytes([10 + k]) * 7) for k in range(3)]
    assert early == late == [0, 1, 2]
    for seq in (2, 0, 1):
        got = first.finish(seq)
        assert got[0].tolist() == [10 + seq] * 7 and got[1].tolist() == [seq] * 7


@pytest.mark.parametrize("kind", KINDS)
def test_a_closed_peer_fails_the_wait_instead_of_hanging(kind):
    a, b = socket.socketpair()
    end = kind(0, 2, {1: a})
    seq = end.start(b"x")
    b.close()
    with pytest.raises(RuntimeError, match="connection failed"):
        end.finish(seq, timeout_s=30)


@pytest.mark.parametrize("kind", KINDS)
def test_a_silent_peer_times_out(kind):
    a, _b = socket.socketpair()
    end = kind(0, 2, {1: a})
    with pytest.raises(TimeoutError, match="exchange 0"):
        end.finish(end.start(b"x"), timeout_s=0.2)


METHODS = [
    ("psum", {}, {}),
    ("psum-f32", {}, {}),
    ("ring", {}, {"schedule": "one-shot"}),
    ("equarx-int8", {"min_size_bytes": 0}, {"schedule": "one-shot"}),
    ("equarx-int8", {"min_size_bytes": 0, "kernel": "jnp"}, {"schedule": "one-shot"}),
    ("equarx-int8", {"min_size_bytes": 0, "rotation": None}, {"schedule": "one-shot"}),
    ("equarx-int8", {"min_size_bytes": 0, "bidirectional": True}, {"schedule": "one-shot"}),
]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(("name", "options", "reference"), METHODS)
def test_the_one_shot_form_gives_the_bits_of_the_one_shot_schedule(n, name, options, reference):
    """Its payload all-gathered by XLA and combined: the method's one-shot all-reduce, bit for
    bit, the same on every device (a message whose size needs padding: 3 x 100 x 640)."""
    ar = get_all_reduce(name, **options)
    own = (
        get_all_reduce(name, **{**options, **reference, "bidirectional": False})
        if reference
        else ar
    )
    x = jax.random.normal(jax.random.key(n), (n, 3, 100, 640), jnp.float32).astype(jnp.bfloat16)

    def via_parts(b):
        parts = ar.one_shot_parts(b[0], n)
        return parts.combine(lax.all_gather(parts.payload, "tp"))[None]

    def run(body):
        program = jax.shard_map(body, mesh=mesh_of(n), in_specs=P("tp"), out_specs=P("tp"))
        return np.asarray(jax.jit(program)(x).astype(jnp.float32))

    got = run(via_parts)
    np.testing.assert_array_equal(got, run(lambda b: own(b[0], "tp")[None]))
    for device in range(1, n):
        np.testing.assert_array_equal(got[device], got[0])


@pytest.fixture
def several_processes_on(monkeypatch):
    """As in a run of several processes, one device each, whose link measured `bits_per_s`."""

    def on(bits_per_s: float | None, processes: int = 2) -> None:
        monkeypatch.setattr(exchange, "available", lambda: True)
        monkeypatch.setattr(jax, "process_count", lambda: processes)
        link = None if bits_per_s is None else transport.LinkEstimate(bits_per_s, 2, 0.1, 0.001)
        monkeypatch.setattr(transport, "link", lambda: link)

    return on


def test_auto_chunks_overlap_only_two_processes_on_a_slow_link(several_processes_on):
    assert overlap.auto_chunks(2048) == 1  # this process alone: nothing to overlap
    several_processes_on(3e8)
    assert overlap.auto_chunks(2048) == overlap.AUTO_CHUNKS
    # chunks of at least AUTO_MIN_CHUNK_TOKENS; prompts shorter than AUTO_MIN_TOKENS whole
    assert overlap.auto_chunks(overlap.AUTO_MIN_TOKENS) == min(
        overlap.AUTO_CHUNKS, overlap.AUTO_MIN_TOKENS // overlap.AUTO_MIN_CHUNK_TOKENS
    )
    assert overlap.auto_chunks(overlap.AUTO_MIN_TOKENS - 1) == 1
    assert overlap.auto_chunks(512) == 1
    several_processes_on(3e8, processes=4)  # one exchange would send 2x an all-reduce's bytes
    assert overlap.auto_chunks(2048) == 1
    several_processes_on(10e9)  # loopback
    assert overlap.auto_chunks(2048) == 1
    several_processes_on(None)  # assumed: no link
    assert overlap.auto_chunks(2048) == 1


def test_the_chunk_count_argument_takes_auto():
    assert chunks_or_auto("auto") == "auto" and chunks_or_auto("4") == 4
    with pytest.raises(ValueError, match="integer >= 1"):
        chunks_or_auto("0")


@pytest.mark.parametrize("kind", KINDS)
def test_recorded_times_follow_each_exchange_in_order(kind):
    first, second = connected_pair(kind)
    first.record()
    seq = first.start(b"abc")
    second.start(b"def")
    first.finish(seq)
    second.finish(seq)  # our bytes arrived there; the sender thread notes `sent` right after
    time.sleep(0.2)
    (times,) = first.recorded()
    assert times.seq == seq and first.recorded() == []  # recording stopped
    assert times.started <= times.waited <= times.done
    assert times.arrived <= times.done and times.started <= times.sent


def test_a_timeline_names_one_layers_all_reduces_in_start_order():
    chunks, layers = 2, 3
    names = prefill_timeline.exchange_names(chunks)
    assert names == ["attn 0", "attn 1", "mlp 0", "mlp 1"]
    # [processes, exchanges, (started, arrived, waited, done)], 1 ms apart, process 1 0.5 ms late
    steps = np.arange(layers * len(names) * 4, dtype=float).reshape(-1, 4) * 1e-3
    times = np.stack([steps, steps + 5e-4])
    summary = prefill_timeline.summarize(times, chunks, layers)
    assert summary["layer"] == 1
    first = summary["exchanges"][0]
    assert (first["what"], first["process"], first["started"]) == ("attn 0", 0, 0.0)
    assert summary["exchanges"][len(names)]["started"] == 0.5  # process 1's first
    assert summary["blocked_ms"] == [layers * len(names) * 1.0] * 2
    assert len(prefill_timeline.format_summary("x", summary)) == 2 + 2 * len(names)


def test_timeline_times_survive_the_gather_exactly():
    times = np.array([[1796596980.262091, np.nan, 1796596980.5, 1796596981.0]])
    words = prefill_timeline.as_int32(times)
    assert words.dtype == np.int32
    np.testing.assert_allclose(prefill_timeline.from_int32(words), times, rtol=0, atol=1e-6)
    assert np.isnan(prefill_timeline.from_int32(words)[0, 1])
