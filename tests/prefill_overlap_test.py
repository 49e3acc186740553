"""The prefill's compute/communication overlap (`overlap_chunks`, `models.gemma3` "Overlap"):
the same values as whole messages, the same messages quantized, and the chunk all-reduces
kept apart in the compiled program. Tiny model, TP = 2 on fake CPU devices."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_of

from equarx_serve.bench.hlo_bytes import COLLECTIVE_KINDS
from equarx_serve.collectives import get_all_reduce
from equarx_serve.generation.prefill import PrefillEngine
from models.config import get_config
from models.gemma3 import (
    MIN_CHUNK_TOKENS,
    RowParallelReduction,
    TensorParallelGemma3,
    init_params,
    layers_hlo,
    mask_from_lengths,
)

CONFIG = get_config("tiny")
SEQ_LEN = 64
LENGTHS = (64, 37)  # a full prompt and a right-padded one
CHUNKS = 4
TP = 2
# One message is [2, 64, 64] f32 = 32 KiB and one chunk of it 8 KiB: a gate between the two
# passes the message and would stop its chunks.
GATE_BETWEEN = 16 << 10


@functools.cache
def params(dtype: jnp.dtype) -> dict:
    return init_params(CONFIG, jax.random.PRNGKey(0), dtype)


def batch() -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(0).integers(5, CONFIG.vocab_size, (len(LENGTHS), SEQ_LEN))
    mask = np.asarray(mask_from_lengths(np.asarray(LENGTHS), SEQ_LEN))
    return np.where(mask, tokens, 0).astype(np.int32), mask


@functools.cache
def model_and_params(all_reduce: str, chunks: int, dtype=jnp.float32, **options):
    model = TensorParallelGemma3(
        CONFIG, mesh_of(TP), get_all_reduce(all_reduce, **options), overlap_chunks=chunks
    )
    return model, model.shard_params(params(dtype))


@functools.cache
def prefill(all_reduce: str, chunks: int, dtype=jnp.float32, **options):
    """(logits [B, L, V] and the cache [B, L, K, H] at real tokens as f32 numpy, compiled HLO
    of the layers). A padding token's entries are never read (a decode step overwrites them
    before any query sees them) and differ: a chunk's padding queries see only its keys."""
    model, placed = model_and_params(all_reduce, chunks, dtype, **options)
    tokens, mask = batch()
    out = model(placed, tokens, mask)
    logits = np.asarray(model.gathered(out.logits), np.float32)
    hlo = model._forward[False, False].lower(placed, tokens, mask).compile().as_text()
    cache = jax.tree.map(lambda a: np.asarray(a, np.float32)[mask], out.cache)
    return logits[mask], cache, layers_hlo(hlo)


def quantized_transfers(hlo: str) -> int:
    """The collectives other than all-reduces (how `equarx-int8` moves its int8 payloads)."""
    return sum(hlo.count(f" {kind}(") for kind in COLLECTIVE_KINDS if kind != "all-reduce")


def rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("all_reduce", ["psum", "ring"])
def test_overlap_gives_the_logits_and_cache_of_whole_messages(all_reduce):
    whole, whole_cache, _ = prefill(all_reduce, 1)
    chunked, chunked_cache, _ = prefill(all_reduce, CHUNKS)
    # Every operation is per token or (attention) over the same keys: only the per-chunk
    # matmuls' rounding differs.
    np.testing.assert_allclose(chunked, whole, atol=1e-5, rtol=1e-5)
    close = functools.partial(np.testing.assert_allclose, atol=1e-5, rtol=1e-5)
    jax.tree.map(close, chunked_cache, whole_cache)


def test_overlap_in_bf16_is_bit_identical_with_psum():
    whole, _, _ = prefill("psum", 1, jnp.bfloat16)
    chunked, _, _ = prefill("psum", CHUNKS, jnp.bfloat16)
    np.testing.assert_array_equal(chunked, whole)


def test_every_chunk_has_its_own_all_reduce_in_the_compiled_program():
    """XLA would otherwise combine independent all-reduces into one (which waits for all its
    inputs); the chain keeps 2 per layer per chunk, none combined."""
    _, _, whole_hlo = prefill("psum", 1)
    _, _, chunked_hlo = prefill("psum", CHUNKS)
    per_layer = 2 * CONFIG.num_layers
    assert whole_hlo.count(" all-reduce(") == per_layer
    assert chunked_hlo.count(" all-reduce(") == per_layer * CHUNKS
    assert chunked_hlo.count("(f32[2,16,64]{2,1,0}, f32[2,16,64]") == 0  # no tuple all-reduce


def test_the_whole_message_decides_the_size_gate_and_the_folded_rotation():
    """A gate between the message and a chunk: the chunks are quantized as the message is
    (with the folded rotation's weights), not sent to psum for their own size."""
    options = dict(min_size_bytes=GATE_BETWEEN)
    whole, _, whole_hlo = prefill("equarx-int8", 1, **options)
    chunked, _, chunked_hlo = prefill("equarx-int8", CHUNKS, **options)
    exact, _, _ = prefill("psum", 1)
    transfers = quantized_transfers(whole_hlo)
    assert transfers > 0 and " all-reduce(" not in whole_hlo
    assert quantized_transfers(chunked_hlo) == CHUNKS * transfers
    assert " all-reduce(" not in chunked_hlo
    model, placed = model_and_params("equarx-int8", CHUNKS, **options)
    assert model.rotation is not None and "linear_rotated" in placed["layer_0"]["mlp"]
    # The chunks went through the method as if it had no gate: the bits of min_size_bytes=0.
    ungated, _, _ = prefill("equarx-int8", CHUNKS, min_size_bytes=0)
    np.testing.assert_array_equal(chunked, ungated)
    # Quantized either way, the same blocks (per token): the chunked logits differ from the
    # whole-message ones by int8 rounding flips (the matmuls' rounding differs), well under
    # the quantization's own error.
    quantization_error = rel_rms(whole, exact)
    assert quantization_error > 1e-3
    assert rel_rms(chunked, whole) < quantization_error / 2


def test_a_gated_message_stays_gated_in_chunks():
    options = dict(min_size_bytes=1 << 20)  # above the whole message: psum
    whole, _, _ = prefill("equarx-int8", 1, **options)
    chunked, _, chunked_hlo = prefill("equarx-int8", CHUNKS, **options)
    assert quantized_transfers(chunked_hlo) == 0
    assert chunked_hlo.count(" all-reduce(") == 2 * CONFIG.num_layers * CHUNKS
    np.testing.assert_allclose(chunked, whole, atol=1e-5, rtol=1e-5)


def test_capture_and_decode_are_not_chunked():
    """A traced prefill records one message per all-reduce; a decode step has one token."""
    whole_model, whole_params = model_and_params("psum", 1)
    model, placed = model_and_params("psum", CHUNKS)
    tokens, mask = batch()
    traced = model(placed, tokens, mask, capture=True)
    reference = whole_model(whole_params, tokens, mask, capture=True)
    for leaf in jax.tree.leaves(traced.trace, is_leaf=lambda x: isinstance(x, tuple)):
        assert len(leaf) == 1
    jax.tree.map(np.testing.assert_array_equal, traced.trace, reference.trace)

    lengths = np.asarray(LENGTHS) - 1
    step = model.decode(placed, traced.cache, tokens[:, 0], lengths)
    reference_step = whole_model.decode(whole_params, reference.cache, tokens[:, 0], lengths)
    np.testing.assert_array_equal(
        np.asarray(model.gathered(step.logits)),
        np.asarray(whole_model.gathered(reference_step.logits)),
    )


def test_chunk_bounds():
    reduction = RowParallelReduction(get_all_reduce("psum"), overlap_chunks=CHUNKS)
    assert reduction.chunk_bounds(64) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    # fewer chunks when they would be shorter than MIN_CHUNK_TOKENS; one for short prompts
    assert reduction.chunk_bounds(2 * MIN_CHUNK_TOKENS + 5) == [(0, 18), (18, 37)]
    assert reduction.chunk_bounds(MIN_CHUNK_TOKENS) == [(0, MIN_CHUNK_TOKENS)]
    assert reduction.chunk_bounds(1) == [(0, 1)]
    bounds = RowParallelReduction(get_all_reduce("psum"), overlap_chunks=3).chunk_bounds(100)
    assert bounds[0][0] == 0 and bounds[-1][1] == 100 and len(bounds) == 3
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert {stop - start for start, stop in bounds} <= {33, 34}
    assert RowParallelReduction(get_all_reduce("psum")).chunk_bounds(4096) == [(0, 4096)]


@pytest.mark.parametrize("chunks", [0, -1, 1.5, True, "4"])
def test_bad_overlap_chunks(chunks):
    with pytest.raises(ValueError, match="overlap_chunks must be an int >= 1"):
        TensorParallelGemma3(CONFIG, mesh_of(TP), overlap_chunks=chunks)


def test_engine_plumbs_overlap_chunks():
    engine = PrefillEngine(CONFIG, params(jnp.float32), tp=TP, overlap_chunks=CHUNKS)
    assert engine.model.overlap_chunks == CHUNKS
    assert engine.with_all_reduce("ring").model.overlap_chunks == CHUNKS
    assert engine.with_all_reduce("psum", overlap_chunks=1).model.overlap_chunks == 1
    whole = PrefillEngine(CONFIG, params(jnp.float32), tp=TP)
    tokens, _ = batch()
    prompts = [list(row[:length]) for row, length in zip(tokens, LENGTHS, strict=True)]
    np.testing.assert_allclose(
        np.asarray(engine.model.gathered(engine.prefill(prompts).logits)),
        np.asarray(whole.model.gathered(whole.prefill(prompts).logits)),
        atol=1e-5,
        rtol=1e-5,
    )
