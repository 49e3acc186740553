"""The model's vocab-parallel outputs on the tiny random-init model: its logits leave split over
the vocabulary, and its sampler and sampling decode step (one program: decode, then sampling on
the sharded logits) draw the tokens that `sampling.sample_tokens` draws from the gathered logits;
the blocked local attention of a decode step equals the masked full one (a cache longer than
the window)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import AXIS, mesh_of
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from equarx_serve.generation.sampling import sample_tokens
from models.config import get_config
from models.gemma3 import SamplingInputs, TensorParallelGemma3, init_params

CAPACITY = 32  # > the tiny model's window (8): local decode reads only its last 8 entries
ROWS = 3


@functools.cache
def model_and_params(tp: int):
    config = get_config("tiny")
    model = TensorParallelGemma3(config, mesh_of(tp), "psum-f32")
    return model, model.shard_params(init_params(config, jax.random.key(0)))


def prefilled_cache(model, params, lengths):
    """The cache of right-padded prompts of `lengths` tokens, grown to CAPACITY positions."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, model.config.vocab_size, (ROWS, CAPACITY)).astype(np.int32)
    mask = np.arange(CAPACITY)[None, :] < np.asarray(lengths)[:, None]
    out = model(params, np.where(mask, tokens, 0), mask)
    sharding = NamedSharding(model.mesh, model.cache_spec)
    return jax.tree.map(lambda x: jax.device_put(x, sharding), out.cache), tokens


def sampling_inputs(mode: str) -> SamplingInputs:
    temperature = {"greedy": [0.0, 0.0, 0.0]}.get(mode, [0.7, 1.3, 0.0])
    return SamplingInputs(
        temperature=jnp.asarray(temperature, jnp.float32),
        top_k=jnp.asarray([5, 0, 3] if mode == "top_k" else [0, 0, 0], jnp.int32),
        top_p=jnp.asarray([0.8, 0.95, 1.0] if mode == "top_p" else [1.0] * 3, jnp.float32),
        seeds=jnp.asarray([7, 8, 9], jnp.uint32),
        steps=jnp.asarray([0, 4, 2], jnp.int32),
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_leave_split_over_the_vocabulary(tp):
    model, params = model_and_params(tp)
    tokens = np.arange(1, 21, dtype=np.int32).reshape(2, 10)
    out = model(params, tokens, last_only=True)
    assert out.logits.shape == (2, model.config.vocab_size)
    assert out.logits.sharding.is_equivalent_to(NamedSharding(model.mesh, P(None, AXIS)), 2)
    assert {s.data.shape for s in out.logits.addressable_shards} == {
        (2, model.config.vocab_size // tp)
    }


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(("mode", "max_k"), [("greedy", 0), ("top_k", 8), ("top_p", 0)])
def test_sampling_decode_step_draws_what_sampling_the_gathered_logits_draws(tp, mode, max_k):
    model, params = model_and_params(tp)
    lengths = np.array([20, 9, 27], np.int32)  # all past the window
    sampling = sampling_inputs(mode)
    cache, tokens = prefilled_cache(model, params, lengths)
    step_tokens = jnp.asarray(tokens[np.arange(ROWS), lengths])
    copy = jax.tree.map(jnp.copy, cache)
    plain = model.decode(params, copy, step_tokens, jnp.asarray(lengths))
    want = sample_tokens(np.asarray(plain.logits), *sampling.arrays(), mode=mode, max_k=max_k)
    got = model.sampling_decoder(mode, max_k)(
        params, cache, step_tokens, jnp.asarray(lengths), sampling
    )
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want))
    separate = model.sampler(mode, max_k)(plain.logits, sampling)
    np.testing.assert_array_equal(np.asarray(separate), np.asarray(want))
    for layer, kv in got.cache.items():  # the same k/v written
        np.testing.assert_array_equal(np.asarray(kv["k"]), np.asarray(plain.cache[layer]["k"]))


@pytest.mark.parametrize("tp", [1, 2])
def test_decode_over_the_window_equals_prefill_of_the_longer_prompt(tp):
    """The decode step's logits (local layers read only the window's cache entries) equal the
    prefill's at the same position, with a cache longer than the window."""
    model, params = model_and_params(tp)
    lengths = np.array([20, 9, 27], np.int32)
    cache, tokens = prefilled_cache(model, params, lengths)
    step = model.decode(params, cache, tokens[np.arange(ROWS), lengths], lengths)
    mask = np.arange(CAPACITY)[None, :] <= lengths[:, None]
    full = model(params, np.where(mask, tokens, 0), mask)
    want = np.asarray(full.logits)[np.arange(ROWS), lengths]
    np.testing.assert_allclose(np.asarray(step.logits), want, atol=2e-5, rtol=2e-5)
