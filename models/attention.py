"""Gemma 3 attention as pure functions: the masked full attention, and the local (sliding-window)
layers' attention with work proportional to the window.

A local layer lets the query at position p see keys at positions in (p - W, p + W) and,
causally, at indices <= its own (gemma's `sliding_window_mask` times its causal mask), so at
most W keys per query. `masked_attention` is the model's computation: the whole [T, S] logits,
masked; at T = 2048 and W = 512 (Gemma 3 270M) ~4x the work the window needs.

`local_attention` (prefill) cuts the queries into blocks of C positions. Block i sees keys at
indices [(i - R) C, (i + 1) C), R = ceil((W - 1) / C) (the blocks a window reaches back):

    keys      |  ...  | i-R | ... | i-1 |  i  |
    queries                             |  i  |   logits [C, (R + 1) C] per block

so the logits are [T, (R + 1) C] instead of [T, T], and the mask inside a band is exactly
gemma's. Requirement: each row's real tokens are contiguous (right- or left-padded prompts,
what the engine builds). Positions then advance with indices over real tokens, so every key a
real query sees lies in its band, and its output equals `masked_attention`'s up to the order
of floating-point sums. Outputs at padding queries are unspecified (gemma's are meaningless
as well: nothing real attends to them).

`local_decode_attention` (decode, one new token per row at position p, cache index ==
position) reads only the W cache entries ending at p.

Shapes: B batch, T queries, S keys, N query heads, K key/value heads (the N heads are K groups
of G = N / K, gemma's grouped attention), H head width, I query blocks, C block length, W the
window. Queries arrive scaled and rotated (RoPE), keys rotated, as gemma computes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

K_MASK = -2.3819763e38  # gemma's masked-logit value


def _check_window(window: int) -> None:
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"the sliding window must be an int >= 1, got {window!r}")


def masked_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array,
    *,
    softcap: float | None = None,
) -> jax.Array:
    """query [B, T, N, H], key and value [B, S, K, H], mask [B, T, S] bool (True: query t
    sees key s) -> [B, T, N, H]: softmax over the unmasked keys, in gemma's dtypes (logits and
    softmax in the inputs' dtype, as `models.gemma3.Attention` computes them)."""
    b, t, n, h = query.shape
    k = key.shape[2]
    if n % k:
        raise ValueError(f"{k} key/value heads must divide {n} query heads")
    grouped_query = query.reshape(b, t, k, n // k, h)  # [B, T, K, G, H]
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", grouped_query, key)
    logits = logits.reshape(b, t, n, -1)  # [B, T, N, S]
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    logits = jnp.where(mask[:, :, None, :], logits, K_MASK)  # [B, T, N, S]
    probs = jax.nn.softmax(logits, axis=-1).astype(key.dtype)
    probs = probs.reshape(b, t, k, n // k, -1)  # [B, T, K, G, S]
    encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value)
    return encoded.reshape(b, t, n, h)  # [B, T, N, H]


def default_block_size(window: int, length: int) -> int:
    """Half the window (at most `length`). Measured (2 cores, 2 fake devices in parallel), one
    local layer of Gemma 3 270M at TP = 2 (2 query heads, 1 KV head, H 256), T 2048, W 512:
    bf16 masked full 177 ms, C = 512 58 ms, C = 256 36 ms, C = 128 35 ms; f32 274, 130, 117,
    151 ms."""
    return min(-(-window // 2), length)


def window_reach(window: int, block_size: int) -> int:
    """R: how many key blocks before its own a query block's window reaches."""
    return -(-(window - 1) // block_size)


def _bands(x: jax.Array, num_blocks: int, block_size: int, reach: int) -> jax.Array:
    """x [B, (R + I) C, ...] (R blocks of front padding, then I blocks) -> [B, I, (R + 1) C,
    ...]: band i holds blocks i .. i + R of x, the keys query block i sees."""
    blocks = x.reshape(x.shape[0], reach + num_blocks, block_size, *x.shape[2:])  # [B, R+I, C, .]
    shifted = [blocks[:, j : j + num_blocks] for j in range(reach + 1)]  # R+1 x [B, I, C, ...]
    band = jnp.concatenate(shifted, axis=2)  # [B, I, (R + 1) C, ...]
    return band


def _pad_positions(x: jax.Array, front: int, back: int) -> jax.Array:
    """Pads axis 1 of x [B, T, ...] with `front` and `back` zeros (False for masks)."""
    widths = [(0, 0), (front, back)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, widths)


def local_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    positions: jax.Array,
    input_mask: jax.Array,
    *,
    window: int,
    softcap: float | None = None,
    block_size: int | None = None,
) -> jax.Array:
    """Sliding-window self-attention of a prefill, blocked (see the module doc).

    query [B, T, N, H], key and value [B, T, K, H] (the same T positions), positions [B, T]
    (gemma's: each token's index among its row's real tokens), input_mask [B, T] bool (real
    tokens; each row's contiguous) -> [B, T, N, H], equal to `masked_attention` with gemma's
    causal and sliding-window masks at every real query. `block_size` C trades the band's
    width (R + 1) C against the number of blocks; the default, `default_block_size`, was the
    fastest measured at 270M's shapes.
    """
    _check_window(window)
    b, t, n, h = query.shape
    if key.shape[:2] != (b, t) or value.shape != key.shape:
        raise ValueError(
            f"key and value must be [B, T, K, H] with B, T = {b, t}: got {key.shape}, {value.shape}"
        )
    if positions.shape != (b, t) or input_mask.shape != (b, t):
        raise ValueError(
            f"positions and input_mask must be [B, T] = {(b, t)}: got {positions.shape}, "
            f"{input_mask.shape}"
        )
    c = default_block_size(window, t) if block_size is None else block_size
    if not isinstance(c, int) or isinstance(c, bool) or c < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    k = key.shape[2]
    if n % k:
        raise ValueError(f"{k} key/value heads must divide {n} query heads")
    num_blocks = -(-t // c)
    reach = window_reach(window, c)
    tail = num_blocks * c - t  # padding that makes T a whole number of blocks

    # Queries [B, I, C, K, G, H]; keys, values, key indices and masks as bands [B, I, S, ...],
    # S = (R + 1) C, whose first R blocks are padding (masked) for block 0.
    grouped_query = _pad_positions(query, 0, tail).reshape(b, num_blocks, c, k, n // k, h)
    front = reach * c
    key_band = _bands(_pad_positions(key, front, tail), num_blocks, c, reach)  # [B, I, S, K, H]
    value_band = _bands(_pad_positions(value, front, tail), num_blocks, c, reach)
    key_real = _bands(_pad_positions(input_mask, front, tail), num_blocks, c, reach)  # [B, I, S]
    key_pos = _bands(_pad_positions(positions, front, tail), num_blocks, c, reach)  # [B, I, S]
    query_pos = _pad_positions(positions, 0, tail).reshape(b, num_blocks, c)  # [B, I, C]

    block_start = jnp.arange(num_blocks)[:, None] * c  # [I, 1]
    query_index = block_start + jnp.arange(c)[None, :]  # [I, C]
    key_index = block_start - front + jnp.arange((reach + 1) * c)[None, :]  # [I, S]
    causal = key_index[:, None, :] <= query_index[:, :, None]  # [I, C, S]
    q_pos, k_pos = query_pos[..., :, None], key_pos[..., None, :]  # [B, I, C, 1], [B, I, 1, S]
    # gemma's window is (p - W, p + W); its upper side follows from causality here.
    in_window = k_pos > q_pos - window  # [B, I, C, S]
    mask = key_real[:, :, None, :] & causal[None] & in_window  # [B, I, C, S]

    logits = jnp.einsum("BICKGH,BISKH->BICKGS", grouped_query, key_band)
    logits = logits.reshape(b, num_blocks, c, n, -1)  # [B, I, C, N, S]
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    logits = jnp.where(mask[:, :, :, None, :], logits, K_MASK)
    probs = jax.nn.softmax(logits, axis=-1).astype(key.dtype)
    probs = probs.reshape(b, num_blocks, c, k, n // k, -1)  # [B, I, C, K, G, S]
    encoded = jnp.einsum("BICKGS,BISKH->BICKGH", probs, value_band)
    return encoded.reshape(b, num_blocks * c, n, h)[:, :t]  # [B, T, N, H]


def local_decode_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    positions: jax.Array,
    *,
    window: int,
    softcap: float | None = None,
) -> jax.Array:
    """One decode step of a local layer: query [B, 1, N, H] at positions [B] int over caches
    [B, S, K, H] whose index is the position (right-padded prompts; the new token's k/v
    already written at its position) -> [B, 1, N, H]. Reads the min(W, S) cache entries
    ending at each row's position; equal to `masked_attention` over the whole cache with
    gemma's decode mask (key index <= position) times its sliding window."""
    _check_window(window)
    b, _, _, _ = query.shape
    capacity = key_cache.shape[1]
    if positions.shape != (b,):
        raise ValueError(f"positions must be [B] = ({b},), got {positions.shape}")
    span = min(window, capacity)
    start = jnp.clip(positions - (span - 1), 0, capacity - span)  # [B]
    if span == capacity:  # the whole cache: no gather (XLA:CPU copies the cache before one)
        key_span, value_span = key_cache, value_cache
    else:
        take = jax.vmap(lambda kv, s: lax.dynamic_slice_in_dim(kv, s, span, axis=0))
        key_span, value_span = take(key_cache, start), take(value_cache, start)  # [B, W, K, H]
    key_index = start[:, None] + jnp.arange(span)[None, :]  # [B, W]
    query_pos = positions[:, None]  # [B, 1]
    # gemma's window is (p - W, p + W); its upper side follows from causality.
    visible = (key_index <= query_pos) & (key_index > query_pos - window)  # [B, W]
    return masked_attention(query, key_span, value_span, visible[:, None, :], softcap=softcap)
