"""The tensor-parallel Gemma 3 model against the `gemma` library's `gm.nn.Transformer`.

Both run on the same parameter tree (ours from `init_params`, checked to have exactly gemma's
structure and shapes) and the same padded batch. Compiled models and gemma's reference outputs
are cached across parametrizations to keep the file fast on 2 cores.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import AXIS, mesh_of
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from equarx_serve.collectives import AllReduce, get_all_reduce
from equarx_serve.collectives.hadamard import HadamardRotation, hadamard_matrix
from models.config import AttentionType, Gemma3Config, get_config
from models.gemma3 import (
    TensorParallelGemma3,
    cache_partition_spec,
    fold_rotation,
    init_params,
    last_token_index,
    mask_from_lengths,
    param_partition_specs,
    param_shapes,
)

TINY = ("tiny", "tiny-mqa")
RELEASED = ("gemma3-270m", "gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b")
SEQ_LEN = 16
LENGTHS = (16, 11, 6)  # real tokens per prompt: full, right-padded, left-padded (see _batch)


def gemma_nn():
    """`gemma.gm.nn`, imported on first use (it pulls in TensorFlow: seconds)."""
    from gemma import gm

    return gm.nn


def to_gemma_config(config: Gemma3Config):
    """The gemma `TransformerConfig` of our config (text only)."""
    gm_nn = gemma_nn()
    from gemma.gm.nn import _config

    norm = _config.QueryPreAttentionNormalisation
    if config.query_pre_attn_scalar == config.head_dim:
        query_pre_attn_norm = norm.BY_ONE_OVER_SQRT_HEAD_DIM
    elif config.query_pre_attn_scalar == config.embed_dim // config.num_heads:
        query_pre_attn_norm = norm.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS
    else:
        raise ValueError(f"gemma has no query_pre_attn_scalar={config.query_pre_attn_scalar}")
    return _config.TransformerConfig(
        num_embed=config.vocab_size,
        embed_dim=config.embed_dim,
        hidden_dim=config.hidden_dim,
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        num_kv_heads=config.num_kv_heads,
        final_logit_softcap=config.final_logit_softcap,
        use_post_attn_norm=config.use_post_attn_norm,
        use_post_ffw_norm=config.use_post_ffw_norm,
        attention_types=tuple(gm_nn.AttentionType[t.name] for t in config.attention_types),
        query_pre_attn_norm=query_pre_attn_norm,
        attn_logits_soft_cap=config.attn_logits_softcap,
        sliding_window_size=config.sliding_window_size,
        transpose_gating_einsum=config.transpose_gating_einsum,
        use_qk_norm=config.use_qk_norm,
        local_base_frequency=config.local_base_frequency,
        global_base_frequency=config.global_base_frequency,
        local_scale_factor=config.local_scale_factor,
        global_scale_factor=config.global_scale_factor,
    )


def config_of(name: str) -> Gemma3Config:
    """A registered config, or "tiny-mha": tiny with as many KV heads as heads (gemma then
    fuses the q, k, v projections into `qkv_einsum`)."""
    if name == "tiny-mha":
        return dataclasses.replace(get_config("tiny"), num_kv_heads=4)
    return get_config(name)


@functools.cache
def gemma_model(name: str):
    return gemma_nn().Transformer(config=to_gemma_config(config_of(name)), dtype=jnp.float32)


@functools.cache
def params_of(name: str, dtype: str = "float32"):
    params = init_params(config_of(name), jax.random.key(0))
    return jax.tree.map(lambda x: x.astype(dtype), params)


@functools.cache
def _batch(vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """tokens [3, SEQ_LEN] of real (nonzero) ids padded with gemma's padding id 0: prompt 0
    fills the row, prompt 1 is right-padded, prompt 2 left-padded; and the input mask."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab_size, (len(LENGTHS), SEQ_LEN)).astype(np.int32)
    mask = np.zeros(tokens.shape, bool)
    mask[0, : LENGTHS[0]] = True
    mask[1, : LENGTHS[1]] = True
    mask[2, SEQ_LEN - LENGTHS[2] :] = True
    return np.where(mask, tokens, 0), mask


def batch_of(name: str) -> tuple[np.ndarray, np.ndarray]:
    return _batch(config_of(name).vocab_size)


@functools.cache
def gemma_reference(name: str, dtype: str = "float32"):
    """gemma's logits [B, L, V] and KV cache {"layer_i": {"k", "v"}} (float64 numpy)."""
    tokens, _ = batch_of(name)
    model = gemma_model(name)
    cache = model.init_cache(batch_size=len(tokens), dtype=jnp.dtype(dtype), cache_length=SEQ_LEN)
    out = model.apply({"params": params_of(name, dtype)}, jnp.asarray(tokens), cache=cache)
    as_np = lambda x: np.asarray(x, np.float64)
    kv = {layer: {"k": as_np(c["k"]), "v": as_np(c["v"])} for layer, c in out.cache.items()}
    return as_np(out.logits), kv


@functools.cache
def tp_model(name: str, tp: int, all_reduce: str) -> TensorParallelGemma3:
    ar = get_all_reduce(all_reduce, **({"min_size_bytes": 0} if "int8" in all_reduce else {}))
    return TensorParallelGemma3(config_of(name), mesh_of(tp), ar)


@functools.cache
def tp_forward(name: str, tp: int, all_reduce: str, dtype: str = "float32", last_only=False):
    model = tp_model(name, tp, all_reduce)
    tokens, mask = batch_of(name)
    return model(model.shard_params(params_of(name, dtype)), tokens, mask, last_only=last_only)


def real(name: str, x) -> np.ndarray:
    """[B, L, ...] -> [real positions, ...] (float64): the model's outputs at padding are
    unspecified, as gemma's are meaningless (the blocked local attention gives others)."""
    _, mask = batch_of(name)
    return np.asarray(x, np.float64)[mask]


def rel_rms(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def report(label: str, x, ref) -> tuple[float, float]:
    """Prints and returns (max abs difference, relative RMS difference)."""
    x = np.asarray(x, np.float64)
    max_abs, rms = float(np.max(np.abs(x - ref))), rel_rms(x, ref)
    scale = np.max(np.abs(ref))
    print(f"{label}: max |diff| {max_abs:.3g} (max |ref| {scale:.3g}), rel RMS {rms:.3g}")
    return max_abs, rms


# -- Configs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RELEASED)
def test_config_literals_equal_gemma(name):
    cls = {
        "gemma3-270m": "Gemma3_270M",
        "gemma3-1b": "Gemma3_1B",
        "gemma3-4b": "Gemma3_4B",
        "gemma3-12b": "Gemma3_12B",
        "gemma3-27b": "Gemma3_27B",
    }[name]
    theirs = getattr(gemma_nn(), cls).config
    ours = get_config(name)
    same_name = [
        "embed_dim",
        "hidden_dim",
        "num_heads",
        "head_dim",
        "num_kv_heads",
        "num_layers",
        "sliding_window_size",
        "final_logit_softcap",
        "use_post_attn_norm",
        "use_post_ffw_norm",
        "use_qk_norm",
        "transpose_gating_einsum",
        "local_base_frequency",
        "global_base_frequency",
        "local_scale_factor",
        "global_scale_factor",
    ]
    for field in same_name:
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.vocab_size == theirs.num_embed
    assert ours.attn_logits_softcap == theirs.attn_logits_soft_cap
    assert ours.query_scale == theirs.query_pre_attn_scalar()
    assert [t.name for t in ours.attention_types] == [t.name for t in theirs.attention_types]
    # Every field on both sides is accounted for (a new one fails here until it is compared).
    ours_checked = {*same_name, "vocab_size", "attn_logits_softcap", "query_pre_attn_scalar"}
    ours_checked.add("attention_pattern")  # compared through attention_types
    assert {f.name for f in dataclasses.fields(ours)} == ours_checked
    theirs_checked = {*same_name} - {"num_layers"}  # theirs is a property of attention_types
    theirs_checked |= {"num_embed", "attn_logits_soft_cap", "query_pre_attn_norm"}
    theirs_checked |= {"attention_types", "vision_encoder"}  # vision: not the text model
    assert {f.name for f in dataclasses.fields(theirs)} == theirs_checked


def test_get_config_unknown_name():
    with pytest.raises(ValueError, match=r"unknown Gemma 3 config 'gemma3-2b'.*gemma3-270m"):
        get_config("gemma3-2b")


def test_config_validation():
    with pytest.raises(ValueError, match="must divide num_heads"):
        dataclasses.replace(get_config("tiny"), num_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim must be even"):
        dataclasses.replace(get_config("tiny"), head_dim=15)
    assert [t == AttentionType.GLOBAL for t in get_config("gemma3-1b").attention_types] == (
        [False] * 5 + [True]
    ) * 4 + [False] * 2


# -- Parameter tree and its partitioning ---------------------------------------------------------


@pytest.mark.parametrize("name", [*TINY, "tiny-mha", *RELEASED])
def test_param_tree_equals_gemma(name):
    tokens = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    theirs = jax.eval_shape(gemma_model(name).init, jax.random.key(0), tokens)["params"]
    theirs = jax.tree.map(lambda x: x.shape, theirs)
    assert param_shapes(config_of(name)) == theirs


@pytest.mark.parametrize(
    ("name", "tp"),
    [(name, tp) for name in (*TINY, "tiny-mha") for tp in (1, 2, 4)]
    + [(name, tp) for name in ("gemma3-4b", "gemma3-27b") for tp in (2, 4, 8)],
)
def test_partition_specs_split_evenly(name, tp):
    config = config_of(name)
    specs, shapes = param_partition_specs(config, tp), param_shapes(config)
    shape_leaves, shape_tree = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    spec_leaves, spec_tree = jax.tree.flatten(specs)
    assert spec_tree == shape_tree
    for spec, shape in zip(spec_leaves, shape_leaves, strict=True):
        assert len(spec) <= len(shape)
        for axis, dim in zip(spec, shape, strict=False):
            assert axis is None or (axis == AXIS and dim % tp == 0), (spec, shape)


def test_partition_specs_tiny():
    """Column-parallel q / gating, row-parallel attn_vec / linear, KV split only when tp | K."""
    for tp, kv in ((2, AXIS), (4, None)):
        layer = param_partition_specs(get_config("tiny"), tp)["layer_3"]
        assert layer["attn"]["q_einsum"]["w"] == P(AXIS, None, None)
        assert layer["attn"]["kv_einsum"]["w"] == P(None, kv, None, None)
        assert layer["attn"]["attn_vec_einsum"]["w"] == P(AXIS, None, None)
        assert layer["attn"]["_key_norm"]["scale"] == P()
        assert layer["mlp"]["gating_einsum"] == P(None, AXIS, None)
        assert layer["mlp"]["linear"] == P(AXIS, None)
    # The tied embedding is vocab-parallel: split on V.
    embedding = param_partition_specs(get_config("tiny"), 4)["embedder"]["input_embedding"]
    assert embedding == P(AXIS, None)


def test_bad_tensor_parallel_degree():
    with pytest.raises(ValueError, match=r"degree 3 must divide num_heads \(4\)"):
        TensorParallelGemma3(get_config("tiny"), mesh_of(3))
    with pytest.raises(ValueError, match=r"degree 8 must divide num_heads \(4\)"):
        param_partition_specs(get_config("gemma3-1b"), 8)
    odd_kv = dataclasses.replace(get_config("tiny"), num_heads=6, num_kv_heads=3)
    with pytest.raises(ValueError, match="must divide one another"):
        param_partition_specs(odd_kv, 2)
    with pytest.raises(ValueError, match="must divide hidden_dim"):
        param_partition_specs(dataclasses.replace(get_config("tiny"), hidden_dim=130), 4)
    with pytest.raises(ValueError, match="mesh has no axis 'tp'"):
        TensorParallelGemma3(get_config("tiny"), Mesh(np.array(jax.devices()[:2]), ("dp",)))


# -- Forward pass vs gemma ----------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", TINY)
def test_logits_equal_gemma_f32(name, tp):
    ref, _ = gemma_reference(name)
    out = tp_forward(name, tp, "psum-f32")
    assert out.logits.shape == ref.shape and out.logits.dtype == jnp.float32
    report(f"{name} TP={tp} f32 psum-f32 vs gemma f32", real(name, out.logits), real(name, ref))
    np.testing.assert_allclose(real(name, out.logits), real(name, ref), atol=1e-4, rtol=1e-4)


def test_logits_equal_gemma_f32_fused_qkv():
    """num_kv_heads == num_heads: gemma's `qkv_einsum`, split on heads."""
    ref, _ = gemma_reference("tiny-mha")
    out = tp_forward("tiny-mha", 2, "psum-f32")
    ours, ref = real("tiny-mha", out.logits), real("tiny-mha", ref)
    report("tiny-mha TP=2 f32 vs gemma f32", ours, ref)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", TINY)
def test_logits_close_to_gemma_bf16(name, tp):
    """bf16 params, computed in bf16 as gemma does, reduced with bf16 psum. Sharding changes
    the rounding (partial sums are rounded to bf16 before the all-reduce), so we ask for what
    bf16 itself gives: within 2x gemma's own bf16 error against the f32 model, and a few %
    of gemma bf16."""
    ref_bf16 = real(name, gemma_reference(name, "bfloat16")[0])
    ref_f32 = real(name, gemma_reference(name)[0])
    out = tp_forward(name, tp, "psum", "bfloat16")
    assert out.logits.dtype == jnp.bfloat16
    ours = real(name, out.logits)
    max_abs, rms = report(f"{name} TP={tp} bf16 psum vs gemma bf16", ours, ref_bf16)
    _, ours_vs_f32 = report(f"{name} TP={tp} bf16 psum vs gemma f32", ours, ref_f32)
    gemma_vs_f32 = rel_rms(ref_bf16, ref_f32)
    print(f"  gemma bf16 vs gemma f32: rel RMS {gemma_vs_f32:.3g}")
    assert rms < 0.04 and max_abs < 0.1 * np.max(np.abs(ref_f32))
    assert ours_vs_f32 < 2 * gemma_vs_f32


@pytest.mark.parametrize(("tp", "dtype"), [(4, "float32"), (2, "bfloat16")])
def test_logits_close_to_gemma_equarx_int8(tp, dtype):
    """int8 all-reduces (12 of them, each ~1% relative error) stay within a few % of f32."""
    ref, _ = gemma_reference("tiny")
    out = tp_forward("tiny", tp, "equarx-int8", dtype)
    label = f"tiny TP={tp} {dtype} equarx-int8 vs gemma f32"
    _, rms = report(label, real("tiny", out.logits), real("tiny", ref))
    assert 1e-4 < rms < 0.06  # quantized (not gated to psum), and close


# -- KV cache, last-token logits, collectives ----------------------------------------------------


@pytest.mark.parametrize(("name", "tp"), [("tiny", 2), ("tiny", 4), ("tiny-mqa", 2)])
def test_kv_cache_shapes_sharding_and_values(name, tp):
    config = config_of(name)
    _, ref_cache = gemma_reference(name)
    out = tp_forward(name, tp, "psum-f32")
    sharded = config.num_kv_heads % tp == 0
    local_heads = config.num_kv_heads // tp if sharded else config.num_kv_heads
    assert cache_partition_spec(config, tp) == P(None, None, AXIS if sharded else None, None)
    assert set(out.cache) == {f"layer_{i}" for i in range(config.num_layers)}
    for layer, kv in out.cache.items():
        for which in ("k", "v"):
            x = kv[which]
            assert x.shape == (len(LENGTHS), SEQ_LEN, config.num_kv_heads, config.head_dim)
            assert x.dtype == jnp.float32
            assert x.sharding.is_equivalent_to(
                jax.sharding.NamedSharding(mesh_of(tp), cache_partition_spec(config, tp)), 4
            )
            assert {s.data.shape[2] for s in x.addressable_shards} == {local_heads}
            np.testing.assert_allclose(
                real(name, x), real(name, ref_cache[layer][which]), atol=1e-5
            )


def test_last_only_logits():
    full = np.asarray(tp_forward("tiny", 2, "psum-f32").logits)
    last = tp_forward("tiny", 2, "psum-f32", last_only=True)
    _, mask = batch_of("tiny")
    index = np.asarray(last_token_index(jnp.asarray(mask)))
    np.testing.assert_array_equal(index, [15, 10, 15])  # the left-padded prompt ends at 15
    np.testing.assert_array_equal(mask_from_lengths(np.array(LENGTHS[:2]), SEQ_LEN), mask[:2])
    assert last.logits.shape == (len(LENGTHS), config_of("tiny").vocab_size)
    np.testing.assert_allclose(
        np.asarray(last.logits), full[np.arange(len(LENGTHS)), index], atol=1e-5, rtol=1e-5
    )


def test_only_collectives_are_two_all_reduces_per_layer():
    """And one for the vocab-parallel embedding lookup; the logits leave split on V."""
    model = tp_model("tiny", 2, "psum-f32")
    tokens, mask = batch_of("tiny")
    params = model.shard_params(params_of("tiny"))
    text = model._forward[False, False].lower(params, tokens, mask).as_text()
    assert text.count("all_reduce") == 2 * config_of("tiny").num_layers + 1
    for op in ("collective_permute", "all_gather", "all_to_all", "reduce_scatter"):
        assert op not in text


@pytest.mark.parametrize(("name", "tp"), [("gemma3-270m", 2), ("gemma3-4b", 8)])
def test_released_configs_trace(name, tp):
    """Real sizes (abstractly): MQA replicated over 2 devices; 4 KV heads over 8 devices."""
    config = get_config(name)
    model = TensorParallelGemma3(config, mesh_of(tp), "psum")
    params = jax.tree.map(
        lambda shape, sharding: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding),
        param_shapes(config),
        model.param_shardings(),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    mask = tokens.update(dtype=jnp.bool_)
    out = jax.eval_shape(model._forward[True, False], params, tokens, mask)
    assert out.logits.shape == (2, config.vocab_size) and out.logits.dtype == jnp.bfloat16
    k = out.cache[f"layer_{config.num_layers - 1}"]["k"]
    assert k.shape == (2, 32, config.num_kv_heads, config.head_dim)


# -- the all-reduce's rotation folded into the row-parallel weights -------------------------------


@dataclasses.dataclass(frozen=True)
class RotatingPsum(AllReduce):
    """A test double for a quantized all-reduce with a foldable rotation that sums exactly (f32
    psum of the rotated input, rotated back): with it, folding may only change float rounding.
    (equarx-int8's own rotated-input path gives the bits of its in-collective rotation on the
    same rotated values: collectives_test.)"""

    name: ClassVar[str] = "test-rotating-psum"
    quantized: ClassVar[bool] = True  # so that the model folds, and picks the rotated weights
    rotation: ClassVar[HadamardRotation] = HadamardRotation(32)

    foldable: bool = True
    rotated_input: bool = False

    @property
    def foldable_rotation(self) -> HadamardRotation | None:
        return self.rotation if self.foldable else None

    def with_rotated_input(self) -> AllReduce:
        return dataclasses.replace(self, rotated_input=True)

    def reduce(self, x, axis_name, axis_size):
        x32 = x.astype(jnp.float32)
        rotated = x32 if self.rotated_input else self.rotation.apply(x32)
        return self.rotation.apply(jax.lax.psum(rotated, axis_name)).astype(x.dtype)

    def exact_sum(self, x, axis_name):
        exact = super().exact_sum(x, axis_name)
        return self.rotation.apply(exact) if self.rotated_input else exact


@pytest.mark.parametrize("tp", [2, 4])
def test_folded_rotation_gives_the_logits_of_rotating_inside_the_all_reduce(tp):
    config, tokens_mask = config_of("tiny"), batch_of("tiny")
    models = {
        label: TensorParallelGemma3(config, mesh_of(tp), ar)
        for label, ar in (
            ("folded", RotatingPsum()),
            ("inside", RotatingPsum(foldable=False)),
            ("plain", get_all_reduce("psum-f32")),
        )
    }
    assert models["folded"].rotation == RotatingPsum.rotation
    assert models["inside"].rotation is None and models["plain"].rotation is None
    out = {}
    for label, model in models.items():
        params = model.shard_params(params_of("tiny"))
        out[label] = model(params, *tokens_mask, capture=True)
    report(f"tiny TP={tp} folded vs in-collective rotation", out["folded"].logits,
           out["inside"].logits)  # fmt: skip
    for other in ("inside", "plain"):
        np.testing.assert_allclose(
            np.asarray(out["folded"].logits), np.asarray(out[other].logits), atol=2e-5, rtol=2e-5
        )
    # The folded model really runs on the rotated copies: zero them and its logits change.
    folded = models["folded"]
    params = folded.shard_params(params_of("tiny"))
    zeroed = jax.tree_util.tree_map_with_path(
        lambda path, w: jnp.zeros_like(w) if path[-1].key.endswith("_rotated") else w, params
    )
    broken = folded(zeroed, *tokens_mask).logits
    assert not np.allclose(np.asarray(broken), np.asarray(out["folded"].logits), atol=1e-2)
    # The trace's exact sum is rotated back too: the born error is float rounding only.
    for layer in out["folded"].trace.values():
        for site in layer.values():
            error = np.sum(site["error_sq"][0]) / np.sum(site["exact_sq"][0])
            assert error < 1e-10


def test_folding_adds_rotated_copies_of_the_row_parallel_weights_only():
    config = config_of("tiny")
    params = params_of("tiny")
    folded = fold_rotation(params, HadamardRotation(32))
    h = np.kron(np.eye(config.embed_dim // 32), hadamard_matrix(32) / np.sqrt(32))  # [D, D]
    for i in range(config.num_layers):
        layer, folded_layer = params[f"layer_{i}"], folded[f"layer_{i}"]
        linear = layer["mlp"]["linear"]
        assert folded_layer["mlp"]["linear"] is linear
        np.testing.assert_allclose(
            np.asarray(folded_layer["mlp"]["linear_rotated"]), linear @ h, atol=1e-6
        )
        attn = folded_layer["attn"]["attn_vec_einsum"]
        assert attn["w"] is layer["attn"]["attn_vec_einsum"]["w"]  # [N, H, D]
        np.testing.assert_allclose(np.asarray(attn["w_rotated"]), attn["w"] @ h, atol=1e-6)
        assert folded_layer["mlp"]["gating_einsum"] is layer["mlp"]["gating_einsum"]
        assert "linear_rotated" not in layer["mlp"]  # the input tree is left as it was
    assert folded["embedder"]["input_embedding"] is params["embedder"]["input_embedding"]
    specs = param_partition_specs(config, 2, rotated_copies=True)["layer_0"]
    assert specs["mlp"]["linear_rotated"] == specs["mlp"]["linear"] == P(AXIS, None)
