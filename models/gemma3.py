"""Tensor-parallel (Megatron) Gemma 3 text model in Flax linen, on a pluggable all-reduce.

The parameter tree is exactly `gemma.gm.nn.Transformer`'s (names, shapes, layouts), so gemma
checkpoints load as they are, and the forward pass mirrors gemma's op by op (same dtypes:
everything is computed in the parameter dtype, as gemma does).

Tensor parallelism over a mesh axis "tp" of size T (`param_partition_specs`):
  - embedding (the tied input/output table [V, D]): split on V, vocab-parallel
    (`models.vocab_parallel`): each device computes the logits of its V / T rows, which leave
    the model as one array sharded over "tp" on V (reading it gathers them; the step engine
    samples on the shards); a token's lookup is one psum of [B, L, D] (its row lives on one
    device). No device holds or copies the whole table;
  - every norm scale: replicated;
  - `q_einsum` / `qkv_einsum` [.., N, D, H] and `mlp/gating_einsum`: column-parallel, split on
    the query-head and hidden axes (N / T heads, F / T hidden units per device);
  - `kv_einsum` [2, K, D, H]: split on K when T divides K, replicated otherwise (then every
    device computes all K key/value heads and attends with the one its query heads use);
  - `attn_vec_einsum` [N, H, D] and `mlp/linear` [F, D]: row-parallel, each device computes a
    partial [B, L, D] sum that the pluggable all-reduce completes: the only two collectives of
    a layer (the only others: the embedding's lookup psum).

Local (sliding-window) layers attend with work proportional to the window
(`models.attention`): a prefill of T >= 2 W tokens runs blocked (bands of key blocks), a decode
step reads only the W cache entries ending at its position. Shorter prompts use the masked
full attention (no less work at T < 2 W).

Folded rotation: when the all-reduce rotates its input before quantizing (`equarx-int8`'s
block Hadamard, `AllReduce.foldable_rotation`) and the rotation block divides D, the model
keeps a rotated copy of both row-parallel weights beside the originals, `w_rotated` and
`linear_rotated`: their output columns (the D axis) multiplied by the rotation once, when the
parameters are placed (`shard_params`, `fold_params`), stored in the parameter dtype. A message
the all-reduce will quantize is computed with the rotated copy, so its partial sums come out
already rotated and the all-reduce (`with_rotated_input()`) applies only the inverse; a message
below the size gate (decode steps, short prompts) is computed with the original weights and
goes to `psum` exactly as without folding (rounding the rotated weights to bf16 alone moves
the model about as far as bf16 arithmetic does, so the gated path keeps the originals). The
choice is made per call site from the message's static shape. The cost is memory: the two
row-parallel weights twice (+71 MB for 270M in bf16; a quarter to a third more for the
larger sizes); `fold_rotation=False` on the all-reduce keeps one copy and rotates inside it.

Overlap (`overlap_chunks` K > 1; "auto", the default, chooses K > 1 only where it pays:
2 CPU processes on a slow measured link, a long prompt: `collectives.overlap.auto_chunks`): a
prefill's layers run on K chunks of the tokens, chunk k of a layer needing only chunk k of
the layer before it (its queries see the keys of chunks <= k), so one chunk's all-reduce can
be on the wire while the next chunk's matmuls run, into the next layer. Each all-reduce is
started as soon as its partial sums exist and waited for where its result is needed
(`collectives.overlap`): on CPU across processes its bytes move beside XLA on threads of their
own (`collectives.exchange`), on TPU and GPU XLA's asynchronous collectives overlap it from the
same structure. Every operation is per token or (the attention) over the same keys, so the
values at real tokens are those of the unchunked model up to rounding (per-chunk matmuls,
softmax sums over a chunk's keys); the whole message, not a chunk, decides the size gate and
the folded rotation, so a chunked prefill quantizes exactly the messages the unchunked one
does. Decode steps (one token) and traced programs (`capture`: one record per all-reduce) are
never chunked, nor a prompt of fewer than 2 `MIN_CHUNK_TOKENS` (fewer chunks when the chunks
would be shorter).

The Flax modules below are written for one device's shard (their sizes are the local ones) and
run inside `jax.shard_map`; `TensorParallelGemma3` wraps them in `jit(shard_map(...))`:

    model = TensorParallelGemma3(get_config("tiny"), mesh, all_reduce="equarx-int8")
    params = model.shard_params(params)  # the gemma tree, placed by param_partition_specs
    out = model(params, tokens, input_mask)  # out.logits [B, L, V]; out.cache["layer_0"]["k"]

Always run a model on parameters from its own `shard_params` or `fold_params`: with a folded
rotation they hold the rotated copies besides the checkpoint's.

Padding follows gemma: `input_mask` (default `tokens != 0`) marks real tokens; positions count
real tokens only, and attention is causal over real tokens (prompts may be padded on either
side; each prompt's real tokens must be contiguous, which the blocked local attention relies
on for prompts of 2 W tokens or more). Logits and cache entries at padded positions are
unspecified (gemma's are meaningless too, and the blocked local attention computes others).
One deliberate difference: `last_only` picks each prompt's last real token, where gemma picks
index sum(input_mask) - 1 (the same for right-padded prompts, wrong for left-padded ones).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from typing import Any, Literal

import flax
import jax
import jax.numpy as jnp
from flax import linen as nn
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from equarx_serve.collectives import AllReduce, get_all_reduce, overlap
from equarx_serve.collectives.hadamard import HadamardRotation
from equarx_serve.collectives.overlap import Started
from equarx_serve.kernels import block_gemv, decode_attention, head_gemv
from models import vocab_parallel
from models.attention import local_attention, local_decode_attention, masked_attention
from models.config import AttentionType, Gemma3Config

K_MASK = -2.3819763e38  # gemma's masked-logit value
AXIS = "tp"
# The row-parallel weights (paths in a layer's parameter tree), [..., D] each, and the suffix of
# their rotated copies' names (`fold_rotation`).
ROW_PARALLEL_WEIGHTS = (("attn", "attn_vec_einsum", "w"), ("mlp", "linear"))
ROTATED = "_rotated"
TRACE = "all_reduce_trace"  # Flax collection of the all-reduce records (`reduce_and_trace`)
# A token chunk's input to a block in an overlapped prefill: given the newest all-reduce
# started, the chunk's values (`Block.chunked`).
ChunkSource = Callable[[Started | None], jax.Array]
MIN_CHUNK_TOKENS = 16  # the shortest token chunk of an overlapped prefill (`overlap_chunks`)

LayerCache = dict[str, jax.Array]  # {"k", "v"}: [B, L, K_local, H], after QK-norm and RoPE
Params = dict[str, Any]
# The decode step's weights in int8 blocks, a subtree of the parameters beside the checkpoint's
# (`block_partition_specs`); each weight {"values": int8 [..., O, I], "scales": f32
# [..., O, I / G], and "offsets" like the scales where its type has minima}.
BLOCKS = "int8_blocks"
Blocks = dict[str, jax.Array]


# -- Tensor-parallel layout ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Sizes on one device for tensor-parallel degree `tp`.

    Attributes:
      tp: Devices on the tensor-parallel axis.
      num_heads: Query heads per device, N / tp.
      num_kv_heads: Key/value heads each device computes: K / tp when sharded, else K.
      kv_sharded: Whether the key/value heads are split over devices (tp divides K).
      hidden_dim: MLP hidden units per device, F / tp.
      vocab_size: Embedding rows (and logits) per device, V / tp.
    """

    tp: int
    num_heads: int
    num_kv_heads: int
    kv_sharded: bool
    hidden_dim: int
    vocab_size: int

    @classmethod
    def create(cls, config: Gemma3Config, tp: int) -> ShardLayout:
        """The layout, or a ValueError when `config` cannot be split `tp` ways."""
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"the tensor-parallel degree must be an int >= 1, got {tp!r}")
        if config.num_heads % tp:
            raise ValueError(
                f"the tensor-parallel degree {tp} must divide num_heads ({config.num_heads})"
            )
        if config.hidden_dim % tp:
            raise ValueError(
                f"the tensor-parallel degree {tp} must divide hidden_dim ({config.hidden_dim})"
            )
        if config.vocab_size % tp:
            raise ValueError(
                f"the tensor-parallel degree {tp} must divide vocab_size ({config.vocab_size})"
            )
        kv_sharded = config.num_kv_heads % tp == 0
        if not kv_sharded and tp % config.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({config.num_kv_heads}) and the tensor-parallel degree {tp} must "
                "divide one another (KV heads are sharded, or replicated with each device's "
                "query heads sharing one of them)"
            )
        return cls(
            tp=tp,
            num_heads=config.num_heads // tp,
            num_kv_heads=config.num_kv_heads // tp if kv_sharded else config.num_kv_heads,
            kv_sharded=kv_sharded,
            hidden_dim=config.hidden_dim // tp,
            vocab_size=config.vocab_size // tp,
        )


@dataclasses.dataclass(frozen=True)
class _Param:
    """A leaf of the parameter layout: global shape, partition spec, init fan-in (None: a norm
    scale)."""

    shape: tuple[int, ...]
    spec: P
    fan_in: int | None


def _param_layout(
    config: Gemma3Config, tp: int, axis_name: str, *, rotated_copies: bool = False
) -> Params:
    """The gemma parameter tree with a `_Param` at every leaf (and, with `rotated_copies`, the
    row-parallel weights' rotated copies beside them)."""
    layout = ShardLayout.create(config, tp)
    n, k, d, h, f = (
        config.num_heads,
        config.num_kv_heads,
        config.embed_dim,
        config.head_dim,
        config.hidden_dim,
    )
    kv_axis = axis_name if layout.kv_sharded else None
    norm = lambda dim: {"scale": _Param((dim,), P(), None)}

    attn: Params = {}
    if n == k:  # gemma fuses q, k and v into one einsum when there are as many KV heads as heads
        attn["qkv_einsum"] = {"w": _Param((3, n, d, h), P(None, axis_name, None, None), d)}
    else:
        attn["q_einsum"] = {"w": _Param((n, d, h), P(axis_name, None, None), d)}
        attn["kv_einsum"] = {"w": _Param((2, k, d, h), P(None, kv_axis, None, None), d)}
    attn["attn_vec_einsum"] = {"w": _Param((n, h, d), P(axis_name, None, None), n * h)}
    if config.use_qk_norm:
        attn["_query_norm"] = norm(h)
        attn["_key_norm"] = norm(h)

    if config.transpose_gating_einsum:
        gating = _Param((2, f, d), P(None, axis_name, None), d)
    else:
        gating = _Param((2, d, f), P(None, None, axis_name), d)
    layer: Params = {
        "pre_attention_norm": norm(d),
        "attn": attn,
        "pre_ffw_norm": norm(d),
        "mlp": {"gating_einsum": gating, "linear": _Param((f, d), P(axis_name, None), f)},
    }
    if config.use_post_attn_norm:
        layer["post_attention_norm"] = norm(d)
    if config.use_post_ffw_norm:
        layer["post_ffw_norm"] = norm(d)

    if rotated_copies:
        for *parents, name in ROW_PARALLEL_WEIGHTS:
            node = functools.reduce(lambda tree, key: tree[key], parents, layer)
            node[name + ROTATED] = node[name]
    return {
        "embedder": {"input_embedding": _Param((config.vocab_size, d), P(axis_name, None), d)},
        **{f"layer_{i}": layer for i in range(config.num_layers)},
        "final_norm": norm(d),
    }


def param_shapes(config: Gemma3Config) -> Params:
    """The global shape of every parameter, in gemma's tree."""
    return jax.tree.map(lambda p: p.shape, _param_layout(config, 1, AXIS))


def param_partition_specs(
    config: Gemma3Config, tp: int, *, axis_name: str = AXIS, rotated_copies: bool = False
) -> Params:
    """A `PartitionSpec` for every parameter (the tree of `param_shapes`, and with
    `rotated_copies` the folded rotation's copies), for degree `tp`.

    Raises ValueError when the model cannot be split `tp` ways (see `ShardLayout.create`).
    """
    layout = _param_layout(config, tp, axis_name, rotated_copies=rotated_copies)
    return jax.tree.map(lambda p: p.spec, layout)


def cache_partition_spec(config: Gemma3Config, tp: int, *, axis_name: str = AXIS) -> P:
    """The spec of every cache array [B, L, K, H]: split on K when the KV heads are sharded."""
    kv_sharded = ShardLayout.create(config, tp).kv_sharded
    return P(None, None, axis_name if kv_sharded else None, None)


def block_partition_specs(config: Gemma3Config, tp: int, *, axis_name: str = AXIS) -> Params:
    """The `PartitionSpec` of every decode weight in int8 blocks (`BLOCKS`), one per weight for
    its values, scales and offsets alike (a pytree prefix): {"head": [V, D], "layer_i": {"q"
    [N H, D], "k", "v" [K H, D], "attn_out" [D, N H], "gating" [2, F, D], "linear" [D, F]}},
    each [..., O, I] (output-major, the groups along the reduced axis I, as GGUF stores them),
    split as the bf16 weight it stands for: column-parallel ones on O, row-parallel ones on I.
    """
    kv_axis = axis_name if ShardLayout.create(config, tp).kv_sharded else None
    layer = {
        "q": P(axis_name, None),
        "k": P(kv_axis, None),
        "v": P(kv_axis, None),
        "attn_out": P(None, axis_name),
        "gating": P(None, axis_name, None),
        "linear": P(None, axis_name),
    }
    return {"head": P(axis_name, None), **{f"layer_{i}": layer for i in range(config.num_layers)}}


def init_params(
    config: Gemma3Config,
    key: jax.Array,
    dtype: jnp.dtype = jnp.float32,
    *,
    norm_scale_std: float = 0.1,
) -> Params:
    """Random parameters for random-init test models: weights N(0, 1 / fan_in) (so activations
    and logits are O(1)), norm scales N(0, norm_scale_std^2) (so that tests exercise the
    `1 + scale` of RMSNorm; a freshly trained model would start from zeros)."""
    layout = _param_layout(config, 1, AXIS)
    leaves, treedef = jax.tree.flatten(layout)
    keys = jax.random.split(key, len(leaves))
    values = [
        jax.random.normal(k, p.shape, jnp.float32)
        * (norm_scale_std if p.fan_in is None else p.fan_in**-0.5)
        for k, p in zip(keys, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, [v.astype(dtype) for v in values])


def fold_rotation(params: Params, rotation: HadamardRotation) -> Params:
    """`params` (the checkpoint's tree) plus, beside every row-parallel weight W, its rotated
    copy (`<name>_rotated`): the output columns (last axis, D) multiplied by `rotation`,
    computed in f32, stored in W's dtype and placement. Every other leaf is the same array.
    A partial sum x @ W_rotated is (x @ W) R."""
    rotate = jax.jit(rotation.apply)
    folded = {key: value for key, value in params.items()}
    for key in params:
        if not key.startswith("layer_"):
            continue
        folded[key] = layer = jax.tree.map(lambda x: x, params[key])  # a copy of the dicts
        for *parents, name in ROW_PARALLEL_WEIGHTS:
            node = functools.reduce(lambda tree, k: tree[k], parents, layer)
            node[name + ROTATED] = rotate(node[name])
    return folded


def layers_hlo(hlo_text: str) -> str:
    """The lines of a compiled model program's HLO text that its layers made (op_name
    `.../layer_i/...`): their collectives are the row-parallel all-reduces, without the
    vocab-parallel head's own (the embedding lookup's psum, sampling's maxima and candidates)."""
    return "\n".join(line for line in hlo_text.splitlines() if "/layer_" in line)


# -- Masks and positions (as gemma builds them) -------------------------------------------------


def positions_from_mask(input_mask: jax.Array) -> jax.Array:
    """[B, L] bool -> [B, L] int: the index of each real token among its sequence's real
    tokens (padding gets its neighbour's; it does not matter)."""
    positions = jnp.cumsum(input_mask, axis=-1)
    return positions - (positions >= 1)


def causal_attention_mask(input_mask: jax.Array) -> jax.Array:
    """[B, L] bool -> [B, L, L] bool: query t sees real tokens s <= t."""
    seq_len = input_mask.shape[-1]
    causal = jnp.tril(jnp.ones((seq_len, seq_len), dtype=jnp.bool_))
    return input_mask[:, None, :] * causal[None, :, :]


def sliding_window_mask(
    positions: jax.Array, window: int, key_positions: jax.Array | None = None
) -> jax.Array:
    """[B, T] query positions (and [B, S] key positions, default the same) -> [B, T, S] bool:
    key positions within (q - window, q + window)."""
    if key_positions is None:
        key_positions = positions
    key_positions = key_positions[:, None, :]  # B 1 S
    query_positions = positions[:, :, None]  # B T 1
    mask = key_positions > query_positions - window
    return mask * (key_positions < query_positions + window)


def mask_from_lengths(lengths: jax.Array, seq_len: int) -> jax.Array:
    """[B] prompt lengths -> [B, seq_len] bool input mask of right-padded prompts."""
    return jnp.arange(seq_len)[None, :] < jnp.asarray(lengths)[:, None]


def last_token_index(input_mask: jax.Array) -> jax.Array:
    """[B, L] bool -> [B]: the index of each sequence's last real token (0 if none). gemma
    takes sum(input_mask) - 1, which is the same for right-padded prompts only."""
    seq_len = input_mask.shape[-1]
    return jnp.max(jnp.where(input_mask, jnp.arange(seq_len), 0), axis=-1)


def rope_settings(config: Gemma3Config, local: bool) -> dict[str, float]:
    """`apply_rope`'s base frequency and scale factor for a local (sliding) or global layer."""
    return dict(
        base_frequency=config.local_base_frequency if local else config.global_base_frequency,
        scale_factor=config.local_scale_factor if local else config.global_scale_factor,
    )


def apply_rope(
    x: jax.Array, positions: jax.Array, *, base_frequency: int, scale_factor: float
) -> jax.Array:
    """Rotary embedding of x [B, L, N, H] at positions [B, L] (gemma's half-split layout)."""
    head_dim = x.shape[-1]
    freq_exponents = (2.0 / head_dim) * jnp.arange(0, head_dim // 2, dtype=jnp.float32)
    timescale = base_frequency**freq_exponents  # [H/2]
    sinusoid = positions[..., None] / timescale[None, None, :]  # [B, L, H/2]
    sinusoid = sinusoid[..., None, :] / scale_factor  # [B, L, 1, H/2]
    sin, cos = jnp.sin(sinusoid), jnp.cos(sinusoid)
    first_half, second_half = jnp.split(x, 2, axis=-1)
    first = first_half * cos - second_half * sin
    second = second_half * cos + first_half * sin
    return jnp.concatenate([first, second], axis=-1).astype(x.dtype)


# -- Layers (local shard shapes) ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RowParallelReduction:
    """How the layers reduce their row-parallel partial sums: `all_reduce`, whether the
    rotated weight copies exist (`folded`, see the module doc), and into how many token chunks
    a prefill's messages are split (`overlap_chunks`, see "Overlap" in the module doc)."""

    all_reduce: AllReduce
    folded: bool = False
    overlap_chunks: int | Literal["auto"] = 1

    def rotated(self, message_shape: tuple[int, ...], dtype: jnp.dtype) -> bool:
        """Whether a message of this shape is computed with the rotated weights (and reduced
        with `with_rotated_input()`): only when folded and the all-reduce quantizes it."""
        return self.folded and self.all_reduce.quantizes(math.prod(message_shape), dtype)

    def all_reduce_for(self, rotated: bool) -> AllReduce:
        return self.all_reduce.with_rotated_input() if rotated else self.all_reduce

    def chunk_bounds(self, num_tokens: int) -> list[tuple[int, int]]:
        """[start, stop) of each token chunk of a prefill of `num_tokens`: `overlap_chunks`
        near-equal ones of at least `MIN_CHUNK_TOKENS`, fewer for short prompts (one: whole)."""
        chunks = self.overlap_chunks
        if chunks == "auto":
            chunks = overlap.auto_chunks(num_tokens)
        count = max(1, min(chunks, num_tokens // MIN_CHUNK_TOKENS))
        edges = [num_tokens * i // count for i in range(count + 1)]
        return list(itertools.pairwise(edges))

    def for_chunks(self, message_shape: tuple[int, ...], dtype: jnp.dtype) -> ChunkReduction:
        """How each chunk of a message of `message_shape` is reduced: the whole message, not
        the chunk, decides the size gate and the rotation, so chunking changes neither which
        messages are quantized nor the weights that compute them."""
        rotated = self.rotated(message_shape, dtype)
        all_reduce = self.all_reduce
        if not all_reduce.is_gated(math.prod(message_shape), dtype):
            all_reduce = all_reduce.ungated()  # a chunk may be under the gate; its message is not
        return ChunkReduction(all_reduce.with_rotated_input() if rotated else all_reduce, rotated)


@dataclasses.dataclass(frozen=True)
class ChunkReduction:
    """The all-reduce of one token chunk of a row-parallel message, and whether its partial
    sums are computed with the rotated weights."""

    all_reduce: AllReduce
    rotated: bool

    def start(self, partial: jax.Array, axis_name: str, previous: Started | None) -> Started:
        """The all-reduce of `partial`, started behind `previous` (the layer's all-reduce
        started before it, if any): the chain fixes the order of a layer's chunk all-reduces,
        the same on every device, and keeps XLA from combining independent ones into one (which
        would wait for all their inputs and leave nothing to overlap). See
        `collectives.overlap`."""
        return overlap.start_all_reduce(self.all_reduce, partial, axis_name, previous)


def reduce_and_trace(module: nn.Module, partial: jax.Array, rotated: bool) -> jax.Array:
    """The all-reduce (`module.reduction`) of this device's partial sums [B, T, D] over
    `module.axis_name`; `rotated`: they were computed with the rotated weights.

    When the `TRACE` collection is mutable (`capture=True`), also records, under the module's
    path: "output" [B, T, D], the reduced value; "error_sq" [B, T], the squared L2 error of
    that value against an f32 `psum` of the same partial sums (the error this all-reduce adds
    here, before it propagates); "exact_sq" [B, T], the squared norm of that f32 sum; and
    "nonfinite" [B, T], how many output elements are NaN or Inf. The extra f32 psum runs only
    when tracing (`AllReduce.exact_sum`: with a folded rotation, rotated back).
    """
    all_reduce = module.reduction.all_reduce_for(rotated)
    output = all_reduce(partial, module.axis_name)
    if module.is_mutable_collection(TRACE):
        exact = all_reduce.exact_sum(partial, module.axis_name)  # [B, T, D]
        error = output.astype(jnp.float32) - exact
        module.sow(TRACE, "output", output)
        module.sow(TRACE, "error_sq", jnp.sum(error * error, axis=-1))
        module.sow(TRACE, "exact_sq", jnp.sum(exact * exact, axis=-1))
        module.sow(TRACE, "nonfinite", jnp.sum(~jnp.isfinite(output), axis=-1, dtype=jnp.int32))
    return output


class Einsum(nn.Module):
    """A weight of `shape` applied with an einsum equation given at call time (`rotated`: its
    rotated copy, see the module doc)."""

    shape: tuple[int, ...]
    weight_name: str = "w"

    @nn.compact
    def __call__(self, eqn: str, x: jax.Array, *, rotated: bool = False) -> jax.Array:
        name = self.weight_name + ROTATED if rotated else self.weight_name
        w = self.param(name, nn.initializers.normal(), self.shape)
        return jnp.einsum(eqn, x, w)


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMSNorm of x over its last axis, scaled by (1 + scale) (`RMSNorm`'s computation)."""
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    normed = x * lax.rsqrt(var + 1e-06)
    scale = jnp.expand_dims(scale, axis=range(x.ndim - 1))
    return normed * (1 + scale)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis, scaled by (1 + scale)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
        return rms_norm(x, scale)


class Embedder(nn.Module):
    """This device's rows of the tied embedding table, [V / T, D] (vocab-parallel)."""

    vocab_size: int  # rows on this device
    embed_dim: int
    axis_name: str
    softcap: float | None

    def setup(self):
        self.input_embedding_table = self.param(
            "input_embedding", nn.initializers.normal(), (self.vocab_size, self.embed_dim)
        )

    def encode(self, tokens: jax.Array) -> jax.Array:
        """[B, L] tokens -> [B, L, D] (replicated), scaled by sqrt(D)."""
        return vocab_parallel.embed(tokens, self.input_embedding_table, self.axis_name)

    def decode(self, x: jax.Array) -> jax.Array:
        """[..., D] -> this device's logits [..., V / T], soft-capped when configured."""
        return vocab_parallel.logits_block(x, self.input_embedding_table, softcap=self.softcap)


class Attention(nn.Module):
    """This device's query heads (and KV heads, when sharded); the output projection is
    row-parallel and all-reduced."""

    config: Gemma3Config
    layout: ShardLayout
    attn_type: AttentionType
    reduction: RowParallelReduction
    axis_name: str

    def setup(self):
        c, lay = self.config, self.layout
        self.use_qkv_einsum = c.num_heads == c.num_kv_heads
        if self.use_qkv_einsum:
            self.qkv_einsum = Einsum((3, lay.num_heads, c.embed_dim, c.head_dim))
        else:
            self.q_einsum = Einsum((lay.num_heads, c.embed_dim, c.head_dim))
            self.kv_einsum = Einsum((2, lay.num_kv_heads, c.embed_dim, c.head_dim))
        self.attn_vec_einsum = Einsum((lay.num_heads, c.head_dim, c.embed_dim))
        if c.use_qk_norm:
            self._query_norm = RMSNorm()
            self._key_norm = RMSNorm()

    def _kv_for_local_heads(self, kv: jax.Array) -> jax.Array:
        """[B, S, K_local, H] -> the KV heads this device's query heads use. Replicated KV
        heads: every device holds them all; its N / T query heads share the one at index
        (device * N / T) // (N / K) = device // (T / K)."""
        if self.layout.kv_sharded:
            return kv
        index = lax.axis_index(self.axis_name) // (self.layout.tp // self.config.num_kv_heads)
        return lax.dynamic_slice_in_dim(kv, index, 1, axis=2)

    def _attend(
        self,
        query: jax.Array,
        cache: LayerCache,
        positions: jax.Array,
        attn_mask: jax.Array,
        input_mask: jax.Array | None,
        *,
        local: bool,
        decoding: bool,
    ) -> jax.Array:
        """query [B, T, N, H] over this device's keys/values (`cache`, [B, S, K, H]: the
        prompt's own in a prefill, T == S; in a decode step, B' >= B rows, the first B the
        queries') -> [B, T, N, H]. Local layers: blocked over the window when the prompt is
        at least two windows long, over the window's cache entries in a decode step;
        otherwise the masked full attention (gemma's)."""
        c = self.config
        window, softcap = c.sliding_window_size, c.attn_logits_softcap
        key = self._kv_for_local_heads(cache["k"])  # [B, S, K, H]
        value = self._kv_for_local_heads(cache["v"])
        if decoding and decode_attention.pays(query, key):  # the visible entries read once
            last = positions[:, 0]  # [B]: keys at cache index <= the token's position
            first = jnp.maximum(last - (window - 1), 0) if local else jnp.zeros_like(last)
            return decode_attention.attend(query, key, value, first, last, softcap=softcap)
        key, value = key[: query.shape[0]], value[: query.shape[0]]  # a decode's rows
        if local and decoding:
            return local_decode_attention(
                query, key, value, positions[:, 0], window=window, softcap=softcap
            )
        if local and query.shape[1] >= 2 * window:
            return local_attention(
                query, key, value, positions, input_mask, window=window, softcap=softcap
            )
        if local:
            attn_mask = attn_mask * sliding_window_mask(positions, window)  # [B, T, T]
        return masked_attention(query, key, value, attn_mask, softcap=softcap)

    def attend(
        self,
        x: jax.Array,
        positions: jax.Array,
        attn_mask: jax.Array,
        input_mask: jax.Array | None = None,
    ) -> tuple[LayerCache, jax.Array]:
        """As `__call__`, up to the row-parallel projection: (cache, this device's heads'
        attention output [B, T, N, H])."""
        query, cache = self._project(x, positions)
        encoded = self._attend(
            query, cache, positions, attn_mask, input_mask, local=self._local, decoding=False
        )
        return cache, encoded

    @property
    def _local(self) -> bool:
        return self.attn_type == AttentionType.LOCAL_SLIDING

    def _project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, LayerCache]:
        """x [B, T, D], positions [B, T] -> (query [B, T, N, H], {"k", "v"} [B, T, K, H]),
        normed and rotary-embedded."""
        c = self.config
        rope = rope_settings(c, self._local)
        if self.use_qkv_einsum:
            # [B, T, N, H] each
            query, key, value = self.qkv_einsum("BTD,CNDH->CBTNH", x)
        else:
            query = self.q_einsum("BTD,NDH->BTNH", x)  # [B, T, N, H]
            key, value = self.kv_einsum("BSD,CKDH->CBSKH", x)  # [B, T, K, H] each
        if c.use_qk_norm:
            query = self._query_norm(query)
            key = self._key_norm(key)
        query = apply_rope(query, positions, **rope) * c.query_scale
        key = apply_rope(key, positions, **rope)
        return query, {"k": key, "v": value}

    def attend_chunk(
        self,
        x: jax.Array,
        earlier: LayerCache | None,
        positions: jax.Array,
        attn_mask: jax.Array,
        bounds: tuple[int, int],
    ) -> tuple[LayerCache, jax.Array]:
        """`attend` for the tokens [a, b) = `bounds` of a prefill (x [B, b - a, D]) given the
        keys and values of the tokens before them (`earlier`, [B, a, K, H]; None for a = 0):
        (the keys and values of tokens [0, b), this device's heads' attention output
        [B, b - a, N, H]). Its queries see keys [0, b) under `attn_mask` [B, L, L] (a local
        layer only the last `sliding_window_size` positions of them: rows are contiguous), so
        a chunk needs nothing of the later tokens."""
        a, b = bounds
        query, own = self._project(x, positions[:, a:b])
        cache = (
            own
            if earlier is None
            else jax.tree.map(lambda old, new: jnp.concatenate([old, new], axis=1), earlier, own)
        )
        first = 0
        mask = attn_mask[:, a:b, :b]  # [B, T, b]
        if self._local:
            window = self.config.sliding_window_size
            first = max(0, a - window + 1)
            mask = mask * sliding_window_mask(positions[:, a:b], window, positions[:, :b])
        key = self._kv_for_local_heads(cache["k"][:, first:])
        value = self._kv_for_local_heads(cache["v"][:, first:])
        softcap = self.config.attn_logits_softcap
        return cache, masked_attention(query, key, value, mask[..., first:], softcap=softcap)

    def project(
        self,
        encoded: jax.Array,
        chunk: ChunkReduction | None = None,
        previous: Started | None = None,
    ) -> jax.Array | Started:
        """Row-parallel: this device's heads' share of the output [B, T, N, H] -> [B, T, D],
        summed over devices (one chunk of the tokens, untraced: started with `chunk.start`
        behind `previous`)."""
        if chunk is not None:
            partial = self.attn_vec_einsum("BTNH,NHD->BTD", encoded, rotated=chunk.rotated)
            return chunk.start(partial, self.axis_name, previous)
        b, t = encoded.shape[:2]
        rotated = self.reduction.rotated((b, t, self.config.embed_dim), encoded.dtype)
        partial = self.attn_vec_einsum("BTNH,NHD->BTD", encoded, rotated=rotated)  # [B, T, D]
        return reduce_and_trace(self, partial, rotated)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        attn_mask: jax.Array,
        input_mask: jax.Array | None = None,
    ) -> tuple[LayerCache, jax.Array]:
        """Prefill: x [B, L, D], positions [B, L], attn_mask [B, L, L] (causal over real
        tokens), input_mask [B, L] -> (cache [B, L, K, H], [B, L, D]). Decode steps do not
        run through here: `Gemma3Shard._decode_attention` computes the same attention for one
        new token a row, reading the weights as stored."""
        cache, encoded = self.attend(x, positions, attn_mask, input_mask)
        return cache, self.project(encoded)


class FeedForward(nn.Module):
    """Gated GELU MLP on this device's hidden units; the down projection is row-parallel and
    all-reduced."""

    config: Gemma3Config
    layout: ShardLayout
    reduction: RowParallelReduction
    axis_name: str

    @nn.compact
    def __call__(
        self, x: jax.Array, chunk: ChunkReduction | None = None, previous: Started | None = None
    ) -> jax.Array | Started:
        """x [B, L, D] -> [B, L, D] (one chunk of the tokens, untraced: started with
        `chunk.start` behind `previous`)."""
        d, f = self.config.embed_dim, self.layout.hidden_dim
        init = nn.initializers.normal()
        if self.config.transpose_gating_einsum:
            w_gating = self.param("gating_einsum", init, (2, f, d))
            gate = jnp.einsum("BTD,CFD->BTCF", x, w_gating)  # [B, T, 2, F]
        else:
            w_gating = self.param("gating_einsum", init, (2, d, f))
            gate = jnp.einsum("BTD,CDF->BTCF", x, w_gating)  # [B, T, 2, F]
        activations = nn.gelu(gate[..., 0, :]) * gate[..., 1, :]  # [B, T, F]

        if chunk is None:
            rotated = self.reduction.rotated((*x.shape[:-1], d), x.dtype)
        else:
            rotated = chunk.rotated
        w_linear = self.param("linear" + ROTATED if rotated else "linear", init, (f, d))
        partial = jnp.einsum("BTF,FD->BTD", activations, w_linear)  # [B, T, D]
        if chunk is not None:
            return chunk.start(partial, self.axis_name, previous)
        return reduce_and_trace(self, partial, rotated)


class Block(nn.Module):
    """Pre-norm attention and MLP, each with a post-norm before its residual add."""

    config: Gemma3Config
    layout: ShardLayout
    attn_type: AttentionType
    reduction: RowParallelReduction
    axis_name: str

    def setup(self):
        c = self.config
        self.pre_attention_norm = RMSNorm()
        self.attn = Attention(c, self.layout, self.attn_type, self.reduction, self.axis_name)
        self.post_attention_norm = RMSNorm() if c.use_post_attn_norm else None
        self.pre_ffw_norm = RMSNorm()
        self.mlp = FeedForward(c, self.layout, self.reduction, self.axis_name)
        self.post_ffw_norm = RMSNorm() if c.use_post_ffw_norm else None

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        attn_mask: jax.Array,
        input_mask: jax.Array | None = None,
    ) -> tuple[LayerCache, jax.Array]:
        """A prefill: x [B, L, D] (replicated) -> (cache, [B, L, D] replicated); decode steps
        run `Gemma3Shard._decode_block` instead, and a prefill in token chunks `chunked`."""
        normed = self.pre_attention_norm(x)
        cache, attn_output = self.attn(normed, positions, attn_mask, input_mask)
        attn_output = self._attention_residual(x, attn_output)
        return cache, self._mlp_residual(attn_output, self.mlp(self.pre_ffw_norm(attn_output)))

    def chunked(
        self,
        inputs: list[ChunkSource],
        positions: jax.Array,
        attn_mask: jax.Array,
        bounds: list[tuple[int, int]],
        message: jax.ShapeDtypeStruct,
        last: Started | None,
    ) -> tuple[LayerCache, list[ChunkSource], Started | None]:
        """The block on the token chunks `bounds` of a prefill (see "Overlap" in the module
        doc): `inputs[k](last)` is chunk k's input [B, T_k, D] (the previous block's output,
        waited for only once `last`, the newest all-reduce started, has started);
        `message` is one whole all-reduce message [B, L, D]. Returns (the cache, as `__call__`
        gives it; each chunk's output as a source for the next block; the newest all-reduce
        started). Per chunk k: its input, attention (keys and values of chunks <= k) and
        output projection, then the MLP of chunk k - 1 (once its attention output is
        reduced): all-reduces start in the order attn 0, attn 1, mlp 0, attn 2, mlp 1, ...,
        mlp K-1, each behind the one before, so while one is on the wire the next chunk's
        compute runs, into the next block's first chunks (`collectives.overlap`)."""
        chunk = self.reduction.for_chunks(message.shape, message.dtype)
        count = len(bounds)
        cache: LayerCache | None = None
        xs: list[jax.Array] = []
        attn_started: list[Started] = []
        outputs: list[ChunkSource] = []
        for step in range(count + 1):
            if step < count:
                xs.append(inputs[step](last))
                normed = overlap.behind(self.pre_attention_norm(xs[-1]), last)
                cache, encoded = self.attn.attend_chunk(
                    normed, cache, positions, attn_mask, bounds[step]
                )
                last = self.attn.project(encoded, chunk, last)
                attn_started.append(last)
            if step > 0:
                attn_output = attn_started[step - 1].result(after=last.token)
                residual = self._attention_residual(xs[step - 1], attn_output)
                normed = overlap.behind(self.pre_ffw_norm(residual), last)
                last = self.mlp(normed, chunk, last)
                outputs.append(functools.partial(self._chunk_output, residual, last))
        return cache, outputs, last

    def _chunk_output(
        self, residual: jax.Array, started: Started, last: Started | None
    ) -> jax.Array:
        """A chunk's output: its MLP residual, the MLP's all-reduce waited for once `last`
        has started."""
        return self._mlp_residual(residual, started.result(None if last is None else last.token))

    def _attention_residual(self, x: jax.Array, attn_output: jax.Array) -> jax.Array:
        if self.post_attention_norm is not None:
            attn_output = self.post_attention_norm(attn_output)
        return attn_output + x

    def _mlp_residual(self, residual: jax.Array, mlp_output: jax.Array) -> jax.Array:
        if self.post_ffw_norm is not None:
            mlp_output = self.post_ffw_norm(mlp_output)
        return mlp_output + residual


class Gemma3Shard(nn.Module):
    """One device's part of the tensor-parallel model; call inside `jax.shard_map` with the
    local shards of the gemma parameter tree."""

    config: Gemma3Config
    layout: ShardLayout
    reduction: RowParallelReduction
    axis_name: str = AXIS

    def setup(self):
        c = self.config
        self.embedder = Embedder(
            self.layout.vocab_size, c.embed_dim, self.axis_name, c.final_logit_softcap
        )
        self.blocks = [
            Block(c, self.layout, attn_type, self.reduction, self.axis_name, name=f"layer_{i}")
            for i, attn_type in enumerate(c.attention_types)
        ]
        self.final_norm = RMSNorm()

    def __call__(
        self, tokens: jax.Array, input_mask: jax.Array, *, last_only: bool = False
    ) -> tuple[jax.Array, dict[str, LayerCache]]:
        """tokens, input_mask [B, L] -> (this device's logits [B, L, V / T], or [B, V / T] at
        each sequence's last real token when last_only; {"layer_i": {"k", "v"}}, local
        [B, L, K_local, H])."""
        x = self.embedder.encode(tokens)  # [B, L, D]
        positions = positions_from_mask(input_mask)  # [B, L]
        attn_mask = causal_attention_mask(input_mask)  # [B, L, L]
        bounds = self.reduction.chunk_bounds(x.shape[1])
        if len(bounds) > 1 and not self.is_mutable_collection(TRACE):
            cache, x = self._chunked(x, positions, attn_mask, bounds)
        else:
            cache = {}
            for i, block in enumerate(self.blocks):
                cache[f"layer_{i}"], x = block(x, positions, attn_mask, input_mask)
        x = self.final_norm(x)

        if last_only:
            x = x[jnp.arange(x.shape[0]), last_token_index(input_mask)]  # [B, D]
        return self.embedder.decode(x), cache

    def _chunked(
        self,
        x: jax.Array,
        positions: jax.Array,
        attn_mask: jax.Array,
        bounds: list[tuple[int, int]],
    ) -> tuple[dict[str, LayerCache], jax.Array]:
        """The blocks on the token chunks `bounds` (`Block.chunked`), each block's chunk k
        taking the previous block's chunk k as soon as it is reduced: (cache, [B, L, D])."""
        message = jax.ShapeDtypeStruct(x.shape, x.dtype)
        sources: list[ChunkSource] = [lambda last, a=a, b=b: x[:, a:b] for a, b in bounds]
        cache, last = {}, None
        for i, block in enumerate(self.blocks):
            cache[f"layer_{i}"], sources, last = block.chunked(
                sources, positions, attn_mask, bounds, message, last
            )
        return cache, jnp.concatenate([source(last) for source in sources], axis=1)

    def decode(
        self, tokens: jax.Array, lengths: jax.Array, cache: dict[str, LayerCache]
    ) -> tuple[jax.Array, dict[str, LayerCache]]:
        """One decode step: tokens [B] (each sequence's newest token), lengths [B] (tokens
        already in its cache: the new token's position and cache index), cache
        {"layer_i": {"k", "v"}} local [B' >= B, S, K_local, H] (the first B rows are the
        tokens'; the others stay as they are) -> (this device's logits [B, V / T],
        the cache with the new k/v at index lengths). The token attends over cache positions
        <= its own. The layers' computation is `Block`'s, written on the weights as stored
        (see `_decode_block`)."""
        params = self.variables["params"]
        blocks = params.get(BLOCKS)
        x = self.embedder.encode(tokens[:, None])[:, 0]  # [B, D]
        new_cache = {}
        for i, block in enumerate(self.blocks):
            name = f"layer_{i}"
            with jax.named_scope(name):  # op names as `Block`'s: `layers_hlo` finds the layers
                new_cache[name], x = self._decode_block(
                    block, params[name], x, lengths, cache[name], blocks and blocks[name]
                )
        x = rms_norm(x, params["final_norm"]["scale"])  # [B, D]
        if blocks is None:
            return self.embedder.decode(x), new_cache
        logits = _block_matmul(x, blocks["head"])  # [B, V / T]
        return vocab_parallel.soft_capped(logits, self.config.final_logit_softcap), new_cache

    def _decode_block(
        self,
        block: Block,
        p: Params,
        x: jax.Array,
        positions: jax.Array,
        cache: LayerCache,
        blocks: Params | None = None,
    ) -> tuple[LayerCache, jax.Array]:
        """`Block` for one new token per row, x [B, D] at positions [B] -> (the cache with its
        k/v written at index positions, [B, D]); the matmuls on the layer's int8 `blocks`
        (`block_partition_specs`) where given, else on its bf16 weights.

        Every matmul reads its weight in the layout it is stored in: a 2-D dot, or a dot
        batched over the weight's leading (head) axis. Written as `Block`'s einsums, XLA:CPU
        copies (transposes) the q, k/v, output and gating weights into other layouts on every
        step (270M, TP = 2: 324 copy thunks a step, the largest item of a profile taken on a
        loaded CPU; on a quiet one the step measured the same within noise, and the logits
        are bit-identical)."""
        c = self.config
        b, d = x.shape
        # The all-reduce messages are [B, 1, D], as `Block`'s.
        rotated = self.reduction.rotated((b, 1, d), x.dtype)
        all_reduce = self.reduction.all_reduce_for(rotated)
        reduce = lambda partial: all_reduce(partial[:, None], self.axis_name)[:, 0]
        suffix = ROTATED if rotated else ""
        if blocks is not None and rotated:  # the blocks are not rotated: rotate the sums
            rotation = self.reduction.all_reduce.foldable_rotation
            reduce_rotated = reduce
            reduce = lambda partial: reduce_rotated(rotation.apply(partial))

        normed = rms_norm(x, p["pre_attention_norm"]["scale"])
        cache, encoded = self._decode_attention(block, p["attn"], normed, positions, cache, blocks)
        encoded = encoded.reshape(b, -1)  # [B, N H]
        if blocks is None:
            w_out = p["attn"]["attn_vec_einsum"]["w" + suffix]  # [N, H, D]
            attn_output = reduce(jnp.dot(encoded, w_out.reshape(-1, d)))
        else:
            attn_output = reduce(_block_matmul(encoded, blocks["attn_out"]))
        if c.use_post_attn_norm:
            attn_output = rms_norm(attn_output, p["post_attention_norm"]["scale"])
        attn_output = attn_output + x

        normed = rms_norm(attn_output, p["pre_ffw_norm"]["scale"])
        w_gating = p["mlp"]["gating_einsum"]
        if blocks is not None:  # [2, F, D]
            gate = _block_matmul(normed, blocks["gating"]).reshape(b, 2, -1)
        elif c.transpose_gating_einsum:  # [2, F, D]: one product with its [2 F, D] view
            gate = head_gemv.rows_times_table(normed, w_gating.reshape(-1, d)).reshape(b, 2, -1)
        else:  # [2, D, F]
            gate = jnp.swapaxes(_per_head(normed, w_gating), 0, 1)  # [B, 2, F]
        activations = nn.gelu(gate[:, 0]) * gate[:, 1]  # [B, F]
        if blocks is None:
            outputs = reduce(jnp.dot(activations, p["mlp"]["linear" + suffix]))
        else:
            outputs = reduce(_block_matmul(activations, blocks["linear"]))
        if c.use_post_ffw_norm:
            outputs = rms_norm(outputs, p["post_ffw_norm"]["scale"])
        return cache, outputs + attn_output

    def _decode_attention(
        self,
        block: Block,
        attn: Params,
        x: jax.Array,
        positions: jax.Array,
        cache: LayerCache,
        blocks: Params | None = None,
    ) -> tuple[LayerCache, jax.Array]:
        """`Attention` before its output projection, for x [B, D] (normed) at positions [B]
        (on the layer's int8 `blocks` where given): -> (the cache with the new k/v at index
        positions, this device's heads [B, 1, N, H])."""
        c = self.config
        if blocks is not None:  # [B, heads H] each -> [B, 1, heads, H]
            b, h = x.shape[0], c.head_dim
            q, k, v = (_block_matmul(x, blocks[n]).reshape(b, 1, -1, h) for n in "qkv")
        else:
            if "qkv_einsum" in attn:
                q, k, v = jnp.split(_per_head(x, attn["qkv_einsum"]["w"]), 3)  # [N, B, H]
            else:
                q = _per_head(x, attn["q_einsum"]["w"])  # [N, B, H]
                k, v = jnp.split(_per_head(x, attn["kv_einsum"]["w"]), 2)  # [K, B, H]
            q, k, v = (jnp.swapaxes(t, 0, 1)[:, None] for t in (q, k, v))  # [B, 1, heads, H]
        local = block.attn_type == AttentionType.LOCAL_SLIDING
        rope = rope_settings(c, local)
        if c.use_qk_norm:
            q = rms_norm(q, attn["_query_norm"]["scale"])
            k = rms_norm(k, attn["_key_norm"]["scale"])
        q = apply_rope(q, positions[:, None], **rope) * c.query_scale
        k = apply_rope(k, positions[:, None], **rope)
        rows = jnp.arange(x.shape[0])
        cache = {
            "k": cache["k"].at[rows, positions].set(k[:, 0]),  # [B, S, K, H]
            "v": cache["v"].at[rows, positions].set(v[:, 0]),
        }
        key_positions = jnp.arange(cache["k"].shape[1])  # [S]
        attn_mask = key_positions[None, None, :] <= positions[:, None, None]  # [B, 1, S]
        encoded = block.attn._attend(
            q, cache, positions[:, None], attn_mask, None, local=local, decoding=True
        )
        return cache, encoded


def _block_matmul(x: jax.Array, weight: Blocks) -> jax.Array:
    """x [B, I] times a weight in int8 blocks [..., O, I] (its leading axes flattened into O)
    -> [B, prod(...) O] in x's dtype (`block_gemv`: the native kernel on CPU)."""
    values = weight["values"]
    flat = lambda a: a.reshape(-1, a.shape[-1])
    offsets = weight.get("offsets")
    out = block_gemv.matmul(
        x, flat(values), flat(weight["scales"]), None if offsets is None else flat(offsets)
    )
    return out.astype(x.dtype)


def _per_head(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [B, D] and a weight [..., D, H] whose leading axes (heads, and q/k/v or gate/up) are
    G in all -> [G, B, H]: a matmul batched over the G heads, reading w as stored."""
    w = w.reshape(-1, *w.shape[-2:])  # [G, D, H]
    xs = jnp.broadcast_to(x, (w.shape[0], *x.shape))  # [G, B, D]
    return lax.dot_general(xs, w, (((2,), (1,)), ((0,), (0,))))


# -- The tensor-parallel forward pass -----------------------------------------------------------


@flax.struct.dataclass
class Gemma3Output:
    """logits: [B, L, V], or [B, V] with last_only: one array split over "tp" on V (each
    device computed its V / T; reading the array, or using it outside the mesh's programs,
    gathers them).
    cache: {"layer_i": {"k", "v"}}, each [B, L, K, H] after QK-norm/RoPE (k) in the parameter
    dtype, split over "tp" on K when the KV heads are sharded, else replicated.
    trace: with capture=True, every row-parallel all-reduce's record (`reduce_and_trace`),
    {"layer_i": {"attn" | "mlp": {"output", "error_sq", "exact_sq", "nonfinite"}}}, each
    value a 1-tuple (Flax `sow`), replicated; else None."""

    logits: jax.Array
    cache: dict[str, LayerCache]
    trace: dict[str, Any] | None = None


@flax.struct.dataclass
class SamplingInputs:
    """How each row draws its token, [B] arrays (replicated), as `vocab_parallel.sample`
    takes them: temperature (0: greedy), top_k (0: off), top_p, seeds (uint32), steps (row b
    draws with fold_in(PRNGKey(seeds[b]), steps[b]))."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seeds: jax.Array
    steps: jax.Array

    def arrays(self) -> tuple[jax.Array, ...]:
        """(temperature, top_k, top_p, seeds, steps), in `sample_tokens`'s argument order."""
        return self.temperature, self.top_k, self.top_p, self.seeds, self.steps


@flax.struct.dataclass
class SampledStep:
    """tokens: [B] int32, each row's sampled next token (replicated). cache: as in
    `Gemma3Output`, with the step's k/v written."""

    tokens: jax.Array
    cache: dict[str, LayerCache]


class TensorParallelGemma3:
    """Gemma 3 prefill, tensor-parallel over `mesh` axis `axis_name`, reducing row-parallel
    outputs with `all_reduce` (a registered name, e.g. "psum", "equarx-int8", or an instance).

    `rotation` is the all-reduce's input rotation folded into the row-parallel weights (see
    the module doc), or None: then parameters run as they are. `overlap_chunks` > 1 runs a
    prefill's layers on that many token chunks (see "Overlap" in the module doc); 1: whole
    messages; "auto" (the default): chunks where they pay (`collectives.overlap.auto_chunks`).

    `int8_blocks`: the decode steps' matmuls and head run on the decode weights in int8 blocks
    (`BLOCKS`, split as `block_partition_specs` says; a GGUF checkpoint's own quantized
    weights, `models.gguf_blocks`), which the parameters then hold beside the checkpoint's;
    prefill runs on the checkpoint's weights either way.

    Compiled functions are cached per instance (one per `last_only`, retraced per input
    shape/dtype), so reuse an instance.
    """

    def __init__(
        self,
        config: Gemma3Config,
        mesh: Mesh,
        all_reduce: str | AllReduce = "psum",
        *,
        axis_name: str = AXIS,
        overlap_chunks: int | Literal["auto"] = "auto",
        int8_blocks: bool = False,
    ):
        if overlap_chunks != "auto" and (
            not isinstance(overlap_chunks, int)
            or isinstance(overlap_chunks, bool)
            or (overlap_chunks < 1)
        ):
            raise ValueError(
                f"overlap_chunks must be an int >= 1 or 'auto', got {overlap_chunks!r}"
            )
        if axis_name not in mesh.axis_names:
            raise ValueError(f"mesh has no axis {axis_name!r}; its axes: {mesh.axis_names}")
        self.config = config
        self.mesh = mesh
        self.axis_name = axis_name
        self.tp = mesh.shape[axis_name]
        self.layout = ShardLayout.create(config, self.tp)
        self.all_reduce = get_all_reduce(all_reduce)
        rotation = self.all_reduce.foldable_rotation
        self.rotation = rotation if rotation and rotation.divides(config.embed_dim) else None
        folded = self.rotation is not None
        self.checkpoint_specs = param_partition_specs(config, self.tp, axis_name=axis_name)
        self.param_specs = param_partition_specs(
            config, self.tp, axis_name=axis_name, rotated_copies=folded
        )
        self.int8_blocks = int8_blocks
        self.block_specs = block_partition_specs(config, self.tp, axis_name=axis_name)
        if int8_blocks:  # a prefix: one spec for a weight's values, scales and offsets
            self.param_specs = {**self.param_specs, BLOCKS: self.block_specs}
        self.cache_spec = cache_partition_spec(config, self.tp, axis_name=axis_name)
        self._cache_specs = {
            f"layer_{i}": {"k": self.cache_spec, "v": self.cache_spec}
            for i in range(config.num_layers)
        }
        self.overlap_chunks = overlap_chunks
        reduction = RowParallelReduction(self.all_reduce, folded, overlap_chunks)
        self._module = Gemma3Shard(config, self.layout, reduction, axis_name)
        self._forward = {
            (last_only, capture): self._build(last_only, capture)
            for last_only in (False, True)
            for capture in (False, True)
        }
        self._decode = self._build_decode()
        self._samplers: dict[tuple[str, int], Any] = {}  # (mode, max_k) -> program
        self._gather = jax.jit(lambda logits: logits, out_shardings=NamedSharding(mesh, P()))
        self._decoders: dict[tuple[str, int], Any] = {}

    def param_shardings(self) -> Params:
        """A NamedSharding for every parameter the model runs on (`param_specs`)."""
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), self.param_specs)

    def block_shardings(self, blocks: Params) -> Params:
        """A NamedSharding for every array of `blocks` (the `BLOCKS` tree), by its weight's
        spec (`block_partition_specs`)."""
        return jax.tree.map(
            lambda spec, weight: jax.tree.map(lambda _: NamedSharding(self.mesh, spec), weight),
            self.block_specs,
            blocks,
            is_leaf=lambda x: isinstance(x, P),
        )

    def checkpoint_shardings(self) -> Params:
        """A NamedSharding for every checkpoint parameter (the tree of `param_shapes`)."""
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), self.checkpoint_specs)

    def shard_params(self, params: Params) -> Params:
        """Places (global) checkpoint parameters on the mesh as `param_partition_specs` says,
        and adds the rotated copies when the rotation is folded (`fold_params`)."""
        return self.fold_params(jax.device_put(params, self.checkpoint_shardings()))

    def fold_params(self, params: Params) -> Params:
        """Checkpoint parameters (already placed) -> the ones this model runs on: with a folded
        rotation, the same arrays plus the rotated copies (`fold_rotation`); else params."""
        if self.rotation is None:
            return params
        return fold_rotation(params, self.rotation)

    def _logits_spec(self, ndim: int) -> P:
        """Logits [..., V] of `ndim` axes leave the programs split over "tp" on V."""
        return P(*([None] * (ndim - 1)), self.axis_name)

    def _build(self, last_only: bool, capture: bool):

        def shard_forward(params, tokens, input_mask):
            variables = {"params": params}
            if not capture:
                logits, cache = self._module.apply(
                    variables, tokens, input_mask, last_only=last_only
                )
                return logits, cache, None
            (logits, cache), traced = self._module.apply(
                variables, tokens, input_mask, last_only=last_only, mutable=[TRACE]
            )
            return logits, cache, traced[TRACE]

        # check_vma=False: ring all-reduces built from ppermute return replicated values that
        # the varying-manual-axes check cannot prove replicated (out_specs P()).
        sharded = jax.shard_map(
            shard_forward,
            mesh=self.mesh,
            in_specs=(self.param_specs, P(), P()),
            out_specs=(self._logits_spec(2 if last_only else 3), self._cache_specs, P()),
            check_vma=False,
        )

        def forward(params, tokens, input_mask):
            logits, cache, trace = sharded(params, tokens, input_mask)
            return Gemma3Output(logits=logits, cache=cache, trace=trace)

        return jax.jit(forward)

    def _build_decode(self):

        def shard_decode(params, cache, tokens, lengths):
            return self._module.apply(
                {"params": params}, tokens, lengths, cache, method=Gemma3Shard.decode
            )

        sharded = jax.shard_map(
            shard_decode,
            mesh=self.mesh,
            in_specs=(self.param_specs, self._cache_specs, P(), P()),
            out_specs=(self._logits_spec(2), self._cache_specs),
            check_vma=False,  # as in `_build`
        )

        def decode(params, cache, tokens, lengths):
            logits, cache = sharded(params, cache, tokens, lengths)
            return Gemma3Output(logits=logits, cache=cache)

        # The cache is updated in place (donated): programs are reused for a fixed capacity.
        return jax.jit(decode, donate_argnums=1)

    def gathered(self, logits: jax.Array) -> jax.Array:
        """Logits split on V (as the programs give them) -> the same values replicated on every
        device (one all-gather): for callers that read whole logits when the mesh spans
        processes (a process reads its own devices' copy)."""
        return self._gather(logits)

    def _sample_shard(self, mode: str, max_k: int):
        """This device's part of sampling: (logits [B, V / T], SamplingInputs) -> [B]."""

        def sample(logits, sampling):
            return vocab_parallel.sample(
                logits, *sampling.arrays(), mode=mode, max_k=max_k, axis_name=self.axis_name
            )

        return sample

    def sampler(self, mode: str, max_k: int = 0):
        """The compiled (logits [B, V] split on V, SamplingInputs) -> tokens [B] int32
        (replicated) for static `mode` and `max_k` (see `vocab_parallel.sample`): only maxima,
        sums and candidates cross devices, never the logits."""
        key = (mode, max_k)
        if key not in self._samplers:
            sharded = jax.shard_map(
                self._sample_shard(mode, max_k),
                mesh=self.mesh,
                in_specs=(self._logits_spec(2), P()),
                out_specs=P(),
                check_vma=False,  # all-gathered candidates (see `vocab_parallel`)
            )
            self._samplers[key] = jax.jit(sharded)
        return self._samplers[key]

    def sampling_decoder(self, mode: str, max_k: int = 0):
        """The compiled decode step that samples too (one program, the logits never leave
        it): (params, cache, tokens, lengths, SamplingInputs) -> `SampledStep`; the cache is
        DONATED (see `decode`). With fewer tokens [R] than cache rows [B, ...], the step
        decodes the cache's first R rows only (their KV entries updated in place; the other
        rows untouched), so that a step costs what the running sequences need, not the
        whole cache's rows."""
        key = (mode, max_k)
        if key not in self._decoders:
            sample = self._sample_shard(mode, max_k)

            def shard_step(params, cache, tokens, lengths, sampling):
                # The whole cache goes in: the step writes and reads its first R rows in place
                # (a slice of them, updated and written back, cost three copies a layer).
                logits, cache = self._module.apply(
                    {"params": params}, tokens, lengths, cache, method=Gemma3Shard.decode
                )
                return sample(logits, sampling), cache

            sharded = jax.shard_map(
                shard_step,
                mesh=self.mesh,
                in_specs=(self.param_specs, self._cache_specs, P(), P(), P()),
                out_specs=(P(), self._cache_specs),
                check_vma=False,  # as in `_build`
            )

            def step(params, cache, tokens, lengths, sampling):
                return SampledStep(*sharded(params, cache, tokens, lengths, sampling))

            self._decoders[key] = jax.jit(step, donate_argnums=1)
        return self._decoders[key]

    def decode(
        self, params: Params, cache: dict[str, LayerCache], tokens: jax.Array, lengths: jax.Array
    ) -> Gemma3Output:
        """One decode step for a batch of sequences (right-padded: cache index == position).

        cache: {"layer_i": {"k", "v"}}, each [B, S, K, H] sharded like `Gemma3Output.cache`
        (S: a fixed capacity; it is DONATED: use the returned one). tokens [B] int: each
        sequence's newest token; lengths [B] int: the tokens already in its cache, which is
        where the new token's k/v go (lengths < S). Returns logits [B, V] for the next token
        and the updated cache. Its two all-reduces per layer reduce [B, 1, D] messages.
        """
        tokens = jnp.asarray(tokens, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        if tokens.ndim != 1 or lengths.shape != tokens.shape:
            raise ValueError(
                f"tokens and lengths must both be [B], got {tokens.shape} and {lengths.shape}"
            )
        return self._decode(params, cache, tokens, lengths)

    def __call__(
        self,
        params: Params,
        tokens: jax.Array,
        input_mask: jax.Array | None = None,
        *,
        last_only: bool = False,
        capture: bool = False,
    ) -> Gemma3Output:
        """tokens [B, L] int, input_mask [B, L] bool (default: tokens != 0, gemma's padding
        id) -> logits and KV cache, and with `capture` the all-reduce trace (see
        `Gemma3Output`)."""
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be [B, L] integers, got {tokens.dtype}{tokens.shape}")
        if input_mask is None:
            input_mask = tokens != 0
        input_mask = jnp.asarray(input_mask, dtype=jnp.bool_)
        if input_mask.shape != tokens.shape:
            raise ValueError(
                f"input_mask {input_mask.shape} must have the shape of tokens {tokens.shape}"
            )
        return self._forward[bool(last_only), bool(capture)](params, tokens, input_mask)
