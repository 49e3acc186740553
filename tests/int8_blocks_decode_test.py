"""Decode steps on weights in int8 blocks (`models.gemma3.BLOCKS`, `int8_blocks=True`) against
the same weights in bf16, on the tiny random-init model; the GGUF loader of those blocks and the
engine's `weights` option on the real 270M file where it is installed."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_of
from jax.sharding import NamedSharding

from equarx_serve.kernels import block_gemv
from models.config import get_config
from models.gemma3 import BLOCKS, TensorParallelGemma3, block_partition_specs, init_params

CAPACITY = 32
ROWS = 3


def _quantized(weight: np.ndarray, group: int, offsets: bool) -> tuple[dict, np.ndarray]:
    """weight [..., O, I] -> (its int8 blocks, the weight they stand for, exactly in bf16):
    power-of-two scales, so that scale * value is a bf16 number; with `offsets`, values in
    [0, 15] less an offset of 8 scales (as Q4_K's minima)."""
    *lead, o, i = weight.shape
    grouped = weight.reshape(*lead, o, i // group, group)
    top = np.abs(grouped).max(-1, keepdims=True) + 1e-12
    levels = 7 if offsets else 127
    scales = np.exp2(np.ceil(np.log2(top / levels))).astype(np.float32)
    values = np.clip(np.round(grouped / scales), -levels, levels)
    blocks = {"scales": scales[..., 0]}
    if offsets:
        values = values + 8  # [1, 15]
        blocks["offsets"] = (8 * scales[..., 0]).astype(np.float32)
    blocks["values"] = values.reshape(weight.shape).astype(np.int8)
    dequantized = (values - (8 if offsets else 0)) * scales
    return blocks, dequantized.reshape(weight.shape).astype(np.float32)


def _blocks_and_params(config, params):
    """The tiny model's weights quantized into the BLOCKS tree (q, k, v and the head at G = 32,
    attn_out with offsets, gating and linear at G = 16), and the bf16 parameters holding the
    very weights the blocks stand for."""
    params = jax.tree.map(np.asarray, params)
    n, k, d, h = config.num_heads, config.num_kv_heads, config.embed_dim, config.head_dim
    blocks = {}
    blocks["head"], params["embedder"]["input_embedding"] = _quantized(
        params["embedder"]["input_embedding"], 32, False
    )
    for i in range(config.num_layers):
        layer = params[f"layer_{i}"]
        attn, mlp = layer["attn"], layer["mlp"]
        q_w, kv_w = attn["q_einsum"]["w"], attn["kv_einsum"]["w"]  # [N, D, H], [2, K, D, H]
        to_rows = lambda w, heads: w.transpose(0, 2, 1).reshape(heads * h, d)  # [heads H, D]
        from_rows = lambda w, heads: w.reshape(heads, h, d).transpose(0, 2, 1)
        b, dq = {}, {}
        b["q"], dq["q"] = _quantized(to_rows(q_w, n), 32, False)
        b["k"], dq["k"] = _quantized(to_rows(kv_w[0], k), 32, False)
        b["v"], dq["v"] = _quantized(to_rows(kv_w[1], k), 32, False)
        out = attn["attn_vec_einsum"]["w"].reshape(n * h, d).T  # [D, N H]
        b["attn_out"], dq["attn_out"] = _quantized(out, 32, True)
        b["gating"], mlp["gating_einsum"] = _quantized(mlp["gating_einsum"], 16, False)
        b["linear"], dq["linear"] = _quantized(mlp["linear"].T, 16, False)  # [D, F]
        attn["q_einsum"]["w"] = from_rows(dq["q"], n)
        attn["kv_einsum"]["w"] = np.stack([from_rows(dq["k"], k), from_rows(dq["v"], k)])
        attn["attn_vec_einsum"]["w"] = dq["attn_out"].T.reshape(n, h, d)
        mlp["linear"] = dq["linear"].T
        blocks[f"layer_{i}"] = b
    bf16 = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), params)
    return blocks, bf16


@functools.cache
def models_and_params(tp: int):
    config = get_config("tiny")
    mesh = mesh_of(tp)
    blocks, bf16 = _blocks_and_params(config, init_params(config, jax.random.key(0)))
    plain = TensorParallelGemma3(config, mesh, "psum")
    quantized = TensorParallelGemma3(config, mesh, "psum", int8_blocks=True)
    params = plain.shard_params(bf16)
    placed = jax.tree.map(jax.device_put, blocks, quantized.block_shardings(blocks))
    return plain, params, quantized, {**params, BLOCKS: placed}


def _decode_steps(model, params, steps: int = 3) -> np.ndarray:
    """Greedy decode of ROWS prompts for `steps` tokens from a prefill: logits [steps, B, V]."""
    rng = np.random.default_rng(1)
    lengths = np.array([20, 9, 13], np.int32)
    tokens = rng.integers(1, model.config.vocab_size, (ROWS, CAPACITY)).astype(np.int32)
    mask = np.arange(CAPACITY)[None, :] < lengths[:, None]
    out = model(params, np.where(mask, tokens, 0), mask)
    cache = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(model.mesh, model.cache_spec)), out.cache
    )
    logits, step_tokens = [], tokens[np.arange(ROWS), lengths]
    for _ in range(steps):
        step = model.decode(params, cache, step_tokens, lengths)
        cache, lengths = step.cache, lengths + 1
        logits.append(np.asarray(step.logits, np.float32))
        step_tokens = logits[-1].argmax(-1).astype(np.int32)
    return np.stack(logits)


@pytest.mark.parametrize("tp", [1, 2])
def test_decode_on_int8_blocks_equals_decode_on_the_same_weights_in_bf16(tp):
    """The same weights, two programs: bf16 dots (f32 sums, bf16 outputs) or the int8-block
    kernel (f32 sums): logits within a few bf16 roundings, the same greedy tokens."""
    plain, params, quantized, with_blocks = models_and_params(tp)
    want = _decode_steps(plain, params)
    got = _decode_steps(quantized, with_blocks)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=0.03 * scale, rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_the_decode_program_calls_the_block_kernel_and_prefill_does_not():
    """Every decode matmul (6 a layer, the head) is a block_gemv call; the prefill programs
    take the blocks as arguments and ignore them."""
    _, _, quantized, with_blocks = models_and_params(2)
    if not block_gemv.native_available():
        pytest.skip("no C++ compiler: the kernel cannot be built")
    cache = {
        f"layer_{i}": {
            "k": jnp.zeros((ROWS, CAPACITY, 2, 16), jnp.bfloat16),
            "v": jnp.zeros((ROWS, CAPACITY, 2, 16), jnp.bfloat16),
        }
        for i in range(quantized.config.num_layers)
    }
    tokens = lengths = jnp.zeros((ROWS,), jnp.int32)
    decode = quantized._decode.lower(with_blocks, cache, tokens, lengths).as_text()
    assert decode.count(block_gemv.KERNEL.target) >= 6 * quantized.config.num_layers + 1
    ids = jnp.ones((1, 16), jnp.int32)
    prefill = jax.jit(quantized.__call__).lower(with_blocks, ids).as_text()
    assert block_gemv.KERNEL.target not in prefill


def test_block_specs_split_column_parallel_weights_on_outputs_and_row_parallel_on_inputs():
    specs = block_partition_specs(get_config("tiny"), 2)
    layer = specs["layer_0"]
    assert specs["head"] == layer["q"] == jax.sharding.PartitionSpec("tp", None)
    assert layer["attn_out"] == layer["linear"] == jax.sharding.PartitionSpec(None, "tp")
    assert layer["gating"] == jax.sharding.PartitionSpec(None, "tp", None)
    # tiny has 2 KV heads: split over 2 devices, replicated over 4 (as the bf16 kv_einsum)
    assert layer["k"] == jax.sharding.PartitionSpec("tp", None)
    assert block_partition_specs(get_config("tiny"), 4)["layer_0"]["v"] == (
        jax.sharding.PartitionSpec(None, None)
    )
