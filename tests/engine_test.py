"""PrefillEngine on the "tiny" config over fake CPU devices: parity with the model called
directly, length buckets and compile reuse, and clear errors."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from conftest import mesh_of

from equarx_serve.collectives import get_all_reduce
from equarx_serve.engine import MIN_BUCKET, PrefillEngine, length_buckets
from models.config import get_config
from models.gemma3 import TensorParallelGemma3, init_params, mask_from_lengths

CONFIG = get_config("tiny")
PROMPT_LENGTHS = (5, 13, 9)  # one bucket (16), different lengths


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(5, CONFIG.vocab_size, size=n).tolist() for n in lengths]


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.PRNGKey(0))


@functools.cache
def _engine(max_length=64):
    mesh_of(2)  # skips without 2 devices
    return PrefillEngine(CONFIG, _params(), tp=2, all_reduce="psum-f32", max_length=max_length)


@functools.cache
def _direct_logits():
    """TensorParallelGemma3 on the unpadded batch (padded to the longest prompt only)."""
    model = TensorParallelGemma3(CONFIG, mesh_of(2), "psum-f32")
    params = model.shard_params(_params())
    prompts = _prompts(PROMPT_LENGTHS)
    seq_len = max(PROMPT_LENGTHS)
    tokens = np.zeros((len(prompts), seq_len), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    mask = mask_from_lengths(np.asarray(PROMPT_LENGTHS), seq_len)
    last = model(params, tokens, mask, last_only=True).logits
    full = model(params, tokens, mask, last_only=False).logits
    return np.asarray(last), np.asarray(full)


def test_last_token_logits_match_the_model():
    result = _engine().prefill(_prompts(PROMPT_LENGTHS))
    assert result.bucket == 16
    np.testing.assert_array_equal(result.lengths, PROMPT_LENGTHS)
    np.testing.assert_allclose(np.asarray(result.logits), _direct_logits()[0], atol=2e-5, rtol=2e-5)


def test_all_positions_match_the_model():
    result = _engine().prefill(_prompts(PROMPT_LENGTHS), last_only=False)
    logits = np.asarray(result.logits)
    assert logits.shape == (3, 16, CONFIG.vocab_size)
    full = _direct_logits()[1]
    for i, n in enumerate(PROMPT_LENGTHS):
        np.testing.assert_allclose(logits[i, :n], full[i, :n], atol=2e-5, rtol=2e-5)


def test_cache_is_sharded_and_bucket_sized():
    result = jax.block_until_ready(_engine().prefill(_prompts((7,))))  # a pytree
    k = result.cache["layer_0"]["k"]
    assert k.shape == (1, 16, CONFIG.num_kv_heads, CONFIG.head_dim)
    assert len(k.sharding.device_set) == 2
    assert len(result.cache) == CONFIG.num_layers


def test_lengths_in_one_bucket_compile_once():
    engine = PrefillEngine(CONFIG, _params(), tp=2, max_length=64)
    engine.prefill(_prompts((3, 11)))
    engine.prefill(_prompts((16, 1)))
    assert engine.num_compiled == 1
    engine.prefill(_prompts((17, 2)))  # bucket 32
    assert engine.num_compiled == 2
    engine.prefill(_prompts((20, 30)))
    assert engine.num_compiled == 2


def test_buckets():
    assert length_buckets(64) == (MIN_BUCKET, 32, 64)
    assert length_buckets(100) == (16, 32, 64, 100)
    engine = _engine()
    assert [engine.bucket_for(n) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        ([[]], "empty prompt"),
        ([[5, 6], []], "prompt 1: empty prompt"),
        ([], "empty batch"),
        ([[5] * 65], "longer than the maximum length 64"),
    ],
)
def test_bad_prompts(prompts, match):
    with pytest.raises(ValueError, match=match):
        _engine().prefill(prompts)


def test_tp_must_divide_heads():
    mesh_of(8)
    with pytest.raises(ValueError, match="must divide num_heads"):
        PrefillEngine(CONFIG, _params(), tp=8)
    with pytest.raises(ValueError, match="must divide num_heads"):
        PrefillEngine(CONFIG, _params(), tp=3)


def test_tp_beyond_devices():
    with pytest.raises(ValueError, match="devices"):
        PrefillEngine(CONFIG, _params(), tp=len(jax.devices()) + 1)


def test_from_name_random_init_is_deterministic_bf16():
    mesh_of(2)
    a = PrefillEngine.from_name("tiny", 2)
    b = a.with_all_reduce("psum-f32")
    assert a.info["source"] == "random-init"
    assert a.dtype == np.dtype("bfloat16")
    assert b.params is a.params
    prompts = _prompts((4, 9))
    np.testing.assert_array_equal(
        np.asarray(a.prefill(prompts).logits, np.float32),
        np.asarray(PrefillEngine.from_name("tiny", 2).prefill(prompts).logits, np.float32),
    )


def _relative_error(trace_site) -> float:
    return float(np.sqrt(np.sum(trace_site["error_sq"][0]) / np.sum(trace_site["exact_sq"][0])))


def test_capture_records_every_all_reduce_without_changing_the_logits():
    engine = _engine().with_all_reduce(get_all_reduce("equarx-int8", min_size_bytes=0))
    prompts = _prompts(PROMPT_LENGTHS)
    plain = engine.prefill(prompts)
    traced = engine.prefill(prompts, capture=True)
    assert plain.trace is None
    np.testing.assert_array_equal(np.asarray(traced.logits), np.asarray(plain.logits))
    assert set(traced.trace) == {f"layer_{i}" for i in range(CONFIG.num_layers)}
    for layer in traced.trace.values():
        for site in ("attn", "mlp"):
            (output,) = layer[site]["output"]
            assert output.shape == (len(prompts), 16, CONFIG.embed_dim)
            assert layer[site]["error_sq"][0].shape == (len(prompts), 16)
            assert int(np.sum(layer[site]["nonfinite"][0])) == 0
            # int8 with 256-element blocks: about 1% relative error, far above bf16 rounding.
            assert 1e-3 < _relative_error(layer[site]) < 0.05


def test_capture_of_the_f32_reference_shows_only_bf16_rounding():
    engine = PrefillEngine.from_name("tiny", tp=2, all_reduce="psum-f32", max_length=64)
    traced = engine.prefill(_prompts(PROMPT_LENGTHS), capture=True)
    for layer in traced.trace.values():
        for site in ("attn", "mlp"):
            assert _relative_error(layer[site]) < 2**-8  # one bf16 rounding of the exact sum
