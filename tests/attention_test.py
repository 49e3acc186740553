"""Blocked sliding-window attention (`models/attention.py`) against the masked full attention
the model computes today (`models.gemma3.Attention.__call__` with gemma's masks): prefill on
shapes around block edges, padding on either side, GQA/MQA, soft-capping, f32 and bf16; decode
over the cache's window; the work it saves (XLA's FLOP count)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention
from models.attention import window_reach
from models.gemma3 import (
    K_MASK,
    causal_attention_mask,
    positions_from_mask,
    sliding_window_mask,
)

HEAD_DIM = 16

# Jitted: op by op, each call would compile dozens of small programs.
local_attention = jax.jit(
    attention.local_attention, static_argnames=("window", "softcap", "block_size")
)
local_decode_attention = jax.jit(
    attention.local_decode_attention, static_argnames=("window", "softcap")
)
masked_attention = jax.jit(attention.masked_attention, static_argnames="softcap")


@functools.partial(jax.jit, static_argnums=4)
def _gemma_attention(query, key, value, mask, softcap):
    """The body of `models.gemma3.Attention.__call__` after the projections, as written there:
    grouped logits, soft-cap, mask, softmax in the inputs' dtype, weighted values."""
    b, t, n, h = query.shape
    k = key.shape[2]
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", query.reshape(b, t, k, n // k, h), key)
    logits = logits.reshape(b, t, n, -1)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    logits = jnp.where(mask[:, :, None, :], logits, K_MASK)
    probs = jax.nn.softmax(logits, axis=-1).astype(key.dtype)
    probs = probs.reshape(b, t, k, n // k, -1)
    return jnp.einsum("BTKGS,BSKH->BTKGH", probs, value).reshape(b, t, n, h)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _reference_prefill(query, key, value, input_mask, window, softcap):
    """Gemma's local-layer prefill: causal mask over real tokens times the sliding window on
    positions, over all T keys."""
    positions = positions_from_mask(input_mask)
    mask = causal_attention_mask(input_mask) * sliding_window_mask(positions, window)
    return _gemma_attention(query, key, value, mask, softcap)


def _inputs(batch, seq, heads, kv_heads, dtype, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    shape_q, shape_kv = (batch, seq, heads, HEAD_DIM), (batch, seq, kv_heads, HEAD_DIM)
    q, k, v = (rng.standard_normal(s) * scale for s in (shape_q, shape_kv, shape_kv))
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


def _padded_mask(lengths, seq, side):
    """[B, seq] input mask: each row's real tokens contiguous, padded on `side`."""
    index = np.arange(seq)[None, :]
    lengths = np.asarray(lengths)[:, None]
    mask = index < lengths if side == "right" else index >= seq - lengths
    return jnp.asarray(mask)


def _assert_real_rows_close(got, want, input_mask, atol):
    real = np.asarray(input_mask)
    np.testing.assert_allclose(
        np.asarray(got, np.float32)[real], np.asarray(want, np.float32)[real], atol=atol, rtol=0
    )


# (seq, window, block): T a multiple of the block and not, windows at, below and above a block
# (reach R = 1, 2, ...), a window of 1, a window longer than the sequence, blocks of 1.
SHAPES = [
    (16, 8, None),
    (17, 8, None),
    (15, 8, 8),
    (33, 8, 4),
    (33, 8, 5),
    (40, 9, 8),
    (40, 10, 8),
    (20, 1, None),
    (12, 64, None),
    (9, 4, 1),
]


@pytest.mark.parametrize(("seq", "window", "block"), SHAPES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 1), (2, 2)])
def test_prefill_equals_masked_full_attention_f32(seq, window, block, heads, kv_heads):
    query, key, value = _inputs(2, seq, heads, kv_heads, jnp.float32, seed=seq + window)
    input_mask = jnp.ones((2, seq), bool)
    want = _reference_prefill(query, key, value, input_mask, window, None)
    got = local_attention(
        query, key, value, positions_from_mask(input_mask), input_mask,
        window=window, block_size=block,
    )  # fmt: skip
    assert got.shape == want.shape and got.dtype == want.dtype
    _assert_real_rows_close(got, want, input_mask, atol=2e-6)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize(("seq", "window", "block"), [(33, 8, 4), (40, 10, 8), (17, 8, None)])
def test_prefill_with_padding_equals_at_real_tokens(side, seq, window, block):
    """Prompts of different lengths in one batch, padded on either side: every real query's
    output equals gemma's (padding queries' outputs are unspecified, as gemma's)."""
    lengths = [seq, seq - 1, window + 1, 1]
    query, key, value = _inputs(len(lengths), seq, 4, 2, jnp.float32, seed=7)
    input_mask = _padded_mask(lengths, seq, side)
    want = _reference_prefill(query, key, value, input_mask, window, None)
    got = local_attention(
        query, key, value, positions_from_mask(input_mask), input_mask,
        window=window, block_size=block,
    )  # fmt: skip
    _assert_real_rows_close(got, want, input_mask, atol=2e-6)


def test_prefill_soft_cap_applies_before_the_mask():
    """Large logits (x10) so that a soft-cap of 5 changes the softmax."""
    query, key, value = _inputs(2, 29, 4, 2, jnp.float32, seed=3, scale=3.0)
    input_mask = _padded_mask([29, 20], 29, "right")
    positions = positions_from_mask(input_mask)
    want = _reference_prefill(query, key, value, input_mask, 8, 5.0)
    uncapped = _reference_prefill(query, key, value, input_mask, 8, None)
    assert np.abs(np.asarray(want - uncapped)).max() > 0.1  # the cap matters here
    got = local_attention(query, key, value, positions, input_mask, window=8, softcap=5.0)
    # Peaked softmaxes: the sums' order shows a little more than with O(1) logits.
    _assert_real_rows_close(got, want, input_mask, atol=1e-5)


def test_prefill_bf16_within_bf16_rounding():
    """bf16 in, bf16 out: against the bf16 reference within a few bf16 ulps of O(1) values,
    and no further from the f32 reference than the bf16 reference is (x2)."""
    q32, k32, v32 = _inputs(2, 70, 4, 1, jnp.float32, seed=11)
    query, key, value = (a.astype(jnp.bfloat16) for a in (q32, k32, v32))
    input_mask = _padded_mask([70, 45], 70, "right")
    positions = positions_from_mask(input_mask)
    want = _reference_prefill(query, key, value, input_mask, 16, None)
    exact = _reference_prefill(*(a.astype(jnp.float32) for a in (query, key, value)),
                               input_mask, 16, None)  # fmt: skip
    got = local_attention(query, key, value, positions, input_mask, window=16, block_size=16)
    assert got.dtype == jnp.bfloat16
    _assert_real_rows_close(got, want, input_mask, atol=3e-2)
    real = np.asarray(input_mask)
    err_got = np.abs(np.asarray(got, np.float32) - np.asarray(exact))[real].max()
    err_want = np.abs(np.asarray(want, np.float32) - np.asarray(exact))[real].max()
    assert err_got <= 2 * err_want + 1e-3


def test_masked_attention_is_the_models_computation():
    """`masked_attention` (the global layers' path) is gemma's, bit for bit."""
    query, key, value = _inputs(2, 21, 4, 2, jnp.float32, seed=5)
    input_mask = _padded_mask([21, 13], 21, "left")
    mask = causal_attention_mask(input_mask)
    np.testing.assert_array_equal(
        np.asarray(masked_attention(query, key, value, mask, softcap=30.0)),
        np.asarray(_gemma_attention(query, key, value, mask, 30.0)),
    )


@pytest.mark.parametrize("window", [8, 5, 1, 40, 100])  # 40, 100: the whole cache
def test_decode_reads_the_window_and_equals_full_cache_attention(window):
    """One new token per row at different positions (start, inside the first window, past it,
    the cache's last index) over a cache of 40: equal to gemma's decode mask (key index <=
    position) times the sliding window over the whole cache."""
    capacity, positions = 40, jnp.asarray([0, 3, 8, 21, 39], jnp.int32)
    batch = positions.shape[0]
    query, _, _ = _inputs(batch, 1, 4, 2, jnp.float32, seed=window)
    _, key_cache, value_cache = _inputs(batch, capacity, 4, 2, jnp.float32, seed=window + 1)
    key_positions = jnp.arange(capacity)[None, :]
    mask = key_positions[:, None, :] <= positions[:, None, None]  # [B, 1, S]
    mask = mask * sliding_window_mask(positions[:, None], window, key_positions)
    want = _gemma_attention(query, key_cache, value_cache, mask, None)
    got = local_decode_attention(query, key_cache, value_cache, positions, window=window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=0)


def test_decode_ignores_cache_entries_outside_the_window():
    """Garbage (NaN) outside each row's window changes nothing: those entries are not read."""
    window, capacity = 6, 32
    positions = jnp.asarray([5, 17, 31], jnp.int32)
    query, _, _ = _inputs(3, 1, 4, 1, jnp.float32, seed=2)
    _, key_cache, value_cache = _inputs(3, capacity, 4, 1, jnp.float32, seed=3)
    index = np.arange(capacity)[None, :]
    outside = (index > np.asarray(positions)[:, None]) | (
        index <= np.asarray(positions)[:, None] - window
    )
    poison = jnp.asarray(outside)[:, :, None, None]
    clean = local_decode_attention(query, key_cache, value_cache, positions, window=window)
    dirty = local_decode_attention(
        query,
        jnp.where(poison, jnp.nan, key_cache),
        jnp.where(poison, jnp.nan, value_cache),
        positions,
        window=window,
    )
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))


def test_prefill_flops_scale_with_the_window():
    """XLA's FLOP count of the compiled attention at Gemma 3 270M's shapes per device (2 query
    heads, 1 KV head, H = 256), T = 2048, W = 512: the blocked one does well under the full
    one's work (logits and weighted values over (R + 1) C = 768 keys instead of 2048)."""
    t, window = 2048, 512
    q = jax.ShapeDtypeStruct((1, t, 2, 256), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 1, 256), jnp.float32)
    mask_shape = jax.ShapeDtypeStruct((1, t), jnp.bool_)
    pos_shape = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def full(query, key, value, positions, input_mask):
        mask = causal_attention_mask(input_mask) * sliding_window_mask(positions, window)
        return attention.masked_attention(query, key, value, mask)

    def blocked(query, key, value, positions, input_mask):
        return attention.local_attention(query, key, value, positions, input_mask, window=window)

    def flops(fn):
        compiled = jax.jit(fn).lower(q, kv, kv, pos_shape, mask_shape).compile()
        return compiled.cost_analysis()["flops"]

    assert window_reach(window, 256) == 2
    assert flops(blocked) < 0.5 * flops(full)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0}, "sliding window must be an int >= 1"),
        ({"window": 8, "block_size": 0}, "block_size must be an int >= 1"),
    ],
)
def test_bad_arguments(kwargs, message):
    query, key, value = _inputs(1, 8, 4, 2, jnp.float32)
    input_mask = jnp.ones((1, 8), bool)
    with pytest.raises(ValueError, match=message):
        local_attention(query, key, value, positions_from_mask(input_mask), input_mask, **kwargs)


def test_bad_shapes():
    query, key, value = _inputs(1, 8, 4, 2, jnp.float32)
    input_mask = jnp.ones((1, 8), bool)
    with pytest.raises(ValueError, match="positions and input_mask must be"):
        local_attention(query, key, value, jnp.zeros((1, 7), jnp.int32), input_mask, window=4)
    with pytest.raises(ValueError, match="key and value must be"):
        local_attention(query, key[:, :7], value, positions_from_mask(input_mask), input_mask,
                        window=4)  # fmt: skip
    with pytest.raises(ValueError, match="positions must be"):
        local_decode_attention(query[:, :1], key, value, jnp.zeros((2,), jnp.int32), window=4)
