"""PrefillEngine on the "tiny" config over fake CPU devices: parity with the model called
directly, length buckets and compile reuse, and clear errors."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from conftest import mesh_of

from equarx_serve.collectives import get_all_reduce
from equarx_serve.collectives.hadamard import HadamardRotation
from equarx_serve.generation.prefill import MIN_BUCKET, PrefillEngine, length_buckets
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
            # int8: about 1% relative error on this random-init model, far above bf16 rounding.
            assert 1e-3 < _relative_error(layer[site]) < 0.05


def test_capture_of_the_f32_reference_shows_only_bf16_rounding():
    engine = PrefillEngine.from_name("tiny", tp=2, all_reduce="psum-f32", max_length=64)
    traced = engine.prefill(_prompts(PROMPT_LENGTHS), capture=True)
    for layer in traced.trace.values():
        for site in ("attn", "mlp"):
            assert _relative_error(layer[site]) < 2**-8  # one bf16 rounding of the exact sum


# -- the all-reduce's rotation folded into the weights -------------------------------------------


def _leaf_paths(tree) -> list[str]:
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return ["/".join(str(k.key) for k in path) for path, _ in paths]


def test_engines_share_the_checkpoint_and_one_set_of_rotated_copies_per_rotation():
    base = _engine()
    folded = base.with_all_reduce(get_all_reduce("equarx-int8", min_size_bytes=0))
    gated = base.with_all_reduce(get_all_reduce("equarx-int8"))  # the same rotation
    other = base.with_all_reduce(get_all_reduce("equarx-int8", rotation_block=32))
    inside = base.with_all_reduce(get_all_reduce("equarx-int8", fold_rotation=False))
    plain = folded.with_all_reduce("psum")
    assert folded.model.rotation == HadamardRotation(64) and inside.model.rotation is None
    assert gated.params is folded.params and other.params is not folded.params
    assert inside.params is base.params and plain.params is base.params
    assert folded.checkpoint_params is base.checkpoint_params
    # The checkpoint's arrays themselves, plus a rotated copy beside each row-parallel weight.
    added = sorted(set(_leaf_paths(folded.params)) - set(_leaf_paths(base.params)))
    assert added == sorted(
        f"layer_{i}/{weight}"
        for i in range(CONFIG.num_layers)
        for weight in ("attn/attn_vec_einsum/w_rotated", "mlp/linear_rotated")
    )
    for path, leaf in jax.tree_util.tree_flatten_with_path(base.params)[0]:
        node = folded.params
        for key in path:
            node = node[key.key]
        assert node is leaf
    for i in range(CONFIG.num_layers):
        layer = folded.params[f"layer_{i}"]
        for original, rotated in (
            (layer["attn"]["attn_vec_einsum"]["w"], layer["attn"]["attn_vec_einsum"]["w_rotated"]),
            (layer["mlp"]["linear"], layer["mlp"]["linear_rotated"]),
        ):
            assert rotated.sharding == original.sharding and rotated.dtype == original.dtype
            np.testing.assert_allclose(
                np.asarray(rotated), np.asarray(HadamardRotation(64).apply(original)), atol=1e-6
            )


def test_a_rotation_block_that_does_not_divide_the_width_is_not_folded():
    wide = _engine().with_all_reduce(get_all_reduce("equarx-int8", rotation_block=128))
    assert CONFIG.embed_dim % 128 and wide.model.rotation is None
    assert wide.params is _engine().params  # the all-reduce rotates its input itself


def test_a_folded_model_runs_gated_messages_on_the_original_weights():
    """Messages below the size gate (here every one) use the checkpoint's weights and psum: the
    folded model prefills and decodes with the bits of the plain one."""
    base = _engine().with_all_reduce("psum")
    folded = base.with_all_reduce(get_all_reduce("equarx-int8"))
    assert folded.model.rotation is not None
    prompts = _prompts(PROMPT_LENGTHS)
    lengths = np.asarray(PROMPT_LENGTHS)
    outputs = []
    for engine in (base, folded):
        result = engine.prefill(prompts)
        step = engine.model.decode(engine.params, result.cache, np.array([7, 8, 9]), lengths)
        outputs.append((np.asarray(result.logits), np.asarray(step.logits)))
    (prefill, decode), (folded_prefill, folded_decode) = outputs
    np.testing.assert_array_equal(folded_prefill, prefill)
    np.testing.assert_array_equal(folded_decode, decode)


def test_a_folded_model_runs_quantized_messages_on_the_rotated_weights():
    """What the rotated copies change: with every message quantized, the folded model and the
    one rotating inside the all-reduce compute the same function up to rounding (the int8
    roundings of the two differ in a few elements, so: close, not equal)."""
    base = _engine()
    folded = base.with_all_reduce(get_all_reduce("equarx-int8", min_size_bytes=0))
    inside = base.with_all_reduce(
        get_all_reduce("equarx-int8", min_size_bytes=0, fold_rotation=False)
    )
    prompts = _prompts(PROMPT_LENGTHS)
    plain = np.asarray(base.prefill(prompts).logits)
    got = np.asarray(folded.prefill(prompts).logits)
    want = np.asarray(inside.prefill(prompts).logits)
    assert not np.array_equal(got, plain)  # quantized, so not psum's bits
    scale = np.abs(plain).max()
    assert np.abs(got - want).max() < 0.05 * scale
    assert np.abs(got - plain).max() < 0.05 * scale
