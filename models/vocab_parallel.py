"""A vocab-parallel output head: logits, sampling and quality metrics on logits sharded over the
vocabulary, for use inside `jax.shard_map` over a mesh axis ("tp").

Gemma's output head is its tied embedding table [V, D] (V = 262144 for Gemma 3). Replicated,
every device computes and holds all V logits of every row; here device d holds rows
[d V/T, (d + 1) V/T) of the table (`P("tp", None)`) and computes only those logits (a
"block", [..., V/T]). What crosses devices:

  - `argmax`, `top_k`: each device's maxima / top-k candidates with their global indices
    (`top_k`: k a row per device, all-gathered; the global top-k is taken from them);
  - `sample`: the same, plus sums for top-p's softmax normalizer; `sampling.sample_tokens`'s
    semantics exactly (temperature, top-k, top-p, per-row seeds), see there;
  - `token_metrics`: maxima and sums ([B, L] per statistic) and 5 candidates a row;
  - `embed`: the token lookup, one psum of [B, L, D] (each token's row lives on one device);
  - `gather`: the whole [..., V], only when a caller asks for it.

Exactness. Greedy and top-k sampling equal `sampling.sample_tokens` on the gathered logits bit
for bit: the same threshold value, and each device adds the same Gumbel noise
(`jax.random.categorical` is argmax(logits + gumbel(key, [V]))) to its slice. Top-p equals
it except where the nucleus boundary's cumulative probability is within float rounding of
top_p (the normalizer's sum runs in another order); a row whose nucleus is wider than
`candidates` tokens (a flat distribution, or top_k > candidates) falls back to gathering the
logits and the reference's full sort. `top_p == 1.0` keeps every token, as `SamplingParams`
documents (the reference's float cumsum can reach 1.0 before the last ~1e-7 of probability
and drop that tail).

Ties: `argmax` and `top_k` prefer the lower vocabulary index, as `jnp.argmax` and
`lax.top_k` on the whole vector do. Blocks are [..., V/T] with T dividing V. Results are
replicated, but JAX cannot prove it for some (all-gathered candidates): a `shard_map` with
`out_specs=P()` around them needs `check_vma=False`, as the model's own.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from equarx_serve.kernels import head_gemv

AXIS = "tp"
# sampling.sample_tokens's clamp: temperatures below it are raised to it (0: greedy).
MIN_TEMPERATURE = 1e-5
# Top-p candidates gathered per device and row: nuclei up to this many tokens are resolved
# from them; a wider one falls back to the gathered logits.
TOP_P_CANDIDATES = 64
METRICS_TOP_K = 5  # eval/metrics.py's TOP_K
SAMPLING_MODES = ("greedy", "temperature", "top_k", "top_p")


def _block_offset(block_size: int, axis_name: str) -> jax.Array:
    """The global vocabulary index of this device's first logit."""
    return lax.axis_index(axis_name) * block_size


# -- The head -----------------------------------------------------------------------------------


def logits_block(
    x: jax.Array, table_block: jax.Array, *, softcap: float | None = None
) -> jax.Array:
    """x [..., D] (replicated) and this device's table rows [V/T, D] -> its logits [..., V/T],
    computed as gemma computes the whole (in the operands' dtype, then soft-capped), by
    `head_gemv.rows_times_table`: up to `head_gemv.MAX_ROWS` rows of a bfloat16 table
    (decode, a prefill's last tokens) through the native kernel on CPU, which reads the table
    once at memory speed (XLA:CPU's dot runs at half of it), else XLA's dot."""
    rows = math.prod(x.shape[:-1])
    flat = head_gemv.rows_times_table(x.reshape(rows, x.shape[-1]), table_block)  # [rows, V/T]
    return soft_capped(flat.reshape(*x.shape[:-1], -1), softcap)


def soft_capped(logits: jax.Array, softcap: float | None) -> jax.Array:
    """gemma's final soft cap, softcap * tanh(logits / softcap); None: the logits as they are."""
    if softcap is None:
        return logits
    return jnp.tanh(logits / softcap) * softcap


def embed(tokens: jax.Array, table_block: jax.Array, axis_name: str = AXIS) -> jax.Array:
    """tokens [B, L] -> the embeddings [B, L, D] scaled by sqrt(D) (gemma's `encode`), from
    the sharded table: each device looks up the tokens it holds, zeros for the others, and a
    psum completes them (exact: one non-zero term per element)."""
    rows, dim = table_block.shape
    local = tokens - _block_offset(rows, axis_name)  # [B, L]
    mine = (local >= 0) & (local < rows)
    x = jnp.where(mine[..., None], table_block[jnp.clip(local, 0, rows - 1)], 0)  # [B, L, D]
    x = lax.psum(x, axis_name)
    return x * jnp.sqrt(dim).astype(x.dtype)


def gather(block: jax.Array, axis_name: str = AXIS) -> jax.Array:
    """[..., V/T] -> the whole [..., V] on every device (what a replicated head returns)."""
    return lax.all_gather(block, axis_name, axis=block.ndim - 1, tiled=True)


# -- Selection ------------------------------------------------------------------------------------


def _first_max(block: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., n] -> (jnp.max, jnp.argmax) over the last axis: the maximum and the int32 index
    of its first occurrence; a NaN is the maximum (the first NaN). Plain reductions, where
    XLA:CPU runs jnp.argmax's (value, index) reduction ~4x slower (measured on [8, 131072]
    bf16 per device, 2 host devices: 1.3 vs 5.6 ms; [2, 131072]: 0.35 vs 2.1 ms). NaN is
    looked for explicitly: XLA:CPU's vectorized max need not propagate it."""
    nan = jnp.isnan(block)
    has_nan = jnp.any(nan, axis=-1)  # [...]
    best = jnp.where(has_nan, jnp.nan, jnp.max(block, axis=-1)).astype(block.dtype)
    at_best = jnp.where(has_nan[..., None], nan, block == best[..., None])
    index = lax.broadcasted_iota(jnp.int32, block.shape, block.ndim - 1)
    return best, jnp.min(jnp.where(at_best, index, jnp.iinfo(jnp.int32).max), axis=-1)


def argmax(block: jax.Array, axis_name: str = AXIS) -> jax.Array:
    """[..., V/T] -> [...] int32: the global `jnp.argmax` (the first maximum; the first NaN if
    any, as jnp.argmax)."""
    local_max, local_arg = _first_max(block)  # [...], [...]
    local_arg += _block_offset(block.shape[-1], axis_name)
    global_max = lax.pmax(local_max, axis_name)
    # A NaN anywhere wins (collectives' max need not propagate it): blocks holding one compete
    # with their first NaN.
    local_nan = jnp.isnan(local_max)
    any_nan = lax.pmax(local_nan.astype(jnp.int32), axis_name) > 0
    holds_best = jnp.where(any_nan, local_nan, local_max == global_max)
    candidate = jnp.where(holds_best, local_arg, jnp.iinfo(jnp.int32).max)
    return lax.pmin(candidate, axis_name)


def top_k(block: jax.Array, k: int, axis_name: str = AXIS) -> tuple[jax.Array, jax.Array]:
    """[..., V/T] -> the global `lax.top_k`: values [..., k] (descending) and int32 indices
    [..., k]. Each device's k best (with global indices) are all-gathered, the best k of
    those kept."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    block_size = block.shape[-1]
    local_k = min(k, block_size)
    values, indices = lax.top_k(block, local_k)  # [..., k']
    indices = indices.astype(jnp.int32) + _block_offset(block_size, axis_name)
    # [T, ..., k'] -> [..., T k'] in device order: among equal values the lower index first.
    all_values = jnp.moveaxis(lax.all_gather(values, axis_name), 0, -2)
    all_indices = jnp.moveaxis(lax.all_gather(indices, axis_name), 0, -2)
    all_values = all_values.reshape(*values.shape[:-1], -1)  # [..., T k']
    all_indices = all_indices.reshape(*values.shape[:-1], -1)
    if k > all_values.shape[-1]:
        raise ValueError(f"k = {k} is more than the {all_values.shape[-1]} logits of a row")
    best_values, best = lax.top_k(all_values, k)  # [..., k]
    return best_values, jnp.take_along_axis(all_indices, best, axis=-1)


def _logsumexp(block: jax.Array, axis_name: str) -> jax.Array:
    """[..., V/T] -> [...]: log sum exp over the whole vocabulary (finite inputs)."""
    global_max = lax.pmax(jnp.max(block, axis=-1), axis_name)  # [...]
    total = lax.psum(jnp.sum(jnp.exp(block - global_max[..., None]), axis=-1), axis_name)
    return global_max + jnp.log(total)


# -- Sampling -------------------------------------------------------------------------------------


def _gumbel_block(keys: jax.Array, vocab_size: int, block_size: int, axis_name: str) -> jax.Array:
    """[B] keys -> [B, V/T]: this device's slice of the Gumbel noise `jax.random.categorical`
    draws for a [V] row with each key."""
    noise = jax.vmap(lambda key: jax.random.gumbel(key, (vocab_size,), jnp.float32))(keys)
    return lax.dynamic_slice_in_dim(noise, _block_offset(block_size, axis_name), block_size, 1)


def _top_p_threshold_gathered(
    scaled_block: jax.Array, top_k_: jax.Array, top_p: jax.Array, axis_name: str
) -> jax.Array:
    """`sampling.sample_tokens`'s top-p threshold [B, 1], computed as it does on the gathered
    logits (the fallback for nuclei wider than the candidates)."""
    scaled = gather(scaled_block, axis_name)  # [B, V]
    vocab = scaled.shape[-1]
    ordered = -jnp.sort(-scaled, axis=-1)  # [B, V], descending
    ranks = jnp.arange(vocab)[None, :]
    in_top_k = (top_k_[:, None] == 0) | (ranks < top_k_[:, None])
    ordered = jnp.where(in_top_k, ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & (before < top_p[:, None])
    count = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    return jnp.take_along_axis(ordered, (count - 1)[:, None], axis=-1)


def top_p_threshold_from_candidates(
    scaled_block: jax.Array,
    top_k_: jax.Array,
    top_p: jax.Array,
    *,
    candidates: int = TOP_P_CANDIDATES,
    axis_name: str = AXIS,
) -> tuple[jax.Array, jax.Array]:
    """The top-k (top_k_ > 0) then top-p threshold of `sampling.sample_tokens` (keep logits >=
    it) from the global `candidates` best logits and the softmax normalizer: (threshold
    [B, 1], settled [B] bool). A row is settled when the candidates decide it: its top-k lies
    within them, or without top-k every token is kept (top_p == 1) or the nucleus ends before
    the last candidate; an unsettled row's threshold is meaningless."""
    vocab = scaled_block.shape[-1] * lax.axis_size(axis_name)
    c = min(candidates, vocab)
    ordered, _ = top_k(scaled_block, c, axis_name)  # [B, C], descending, global
    ranks = jnp.arange(c)[None, :]
    in_top_k = (top_k_[:, None] == 0) | (ranks < top_k_[:, None])  # [B, C]
    top = ordered[:, :1]  # [B, 1], the row's maximum
    # The softmax normalizer over the top-k tokens (all tokens without top-k).
    from_candidates = jnp.sum(jnp.where(in_top_k, jnp.exp(ordered - top), 0.0), axis=-1)
    everywhere = lax.psum(jnp.sum(jnp.exp(scaled_block - top), axis=-1), axis_name)
    normalizer = jnp.where(top_k_ > 0, from_candidates, everywhere)  # [B]
    probs = jnp.where(in_top_k, jnp.exp(ordered - top), 0.0) / normalizer[:, None]
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & (before < top_p[:, None])  # [B, C]
    keep_all = top_p >= 1.0  # [B]: top-k alone (or nothing)
    count = jnp.where(keep_all, jnp.clip(top_k_, 1, c), jnp.maximum(jnp.sum(keep, axis=-1), 1))
    threshold = jnp.take_along_axis(ordered, (count - 1)[:, None], axis=-1)  # [B, 1]
    threshold = jnp.where((keep_all & (top_k_ == 0))[:, None], -jnp.inf, threshold)
    without_top_k = keep_all | ~keep[:, -1] | (c == vocab)
    settled = jnp.where(top_k_ > 0, (top_k_ <= c) | (c == vocab), without_top_k)
    return threshold, settled


def _top_p_threshold(
    scaled_block: jax.Array,
    top_k_: jax.Array,
    top_p: jax.Array,
    sampled_rows: jax.Array,
    candidates: int,
    axis_name: str,
) -> jax.Array:
    """[B, 1]: `top_p_threshold_from_candidates`, or, when a row of `sampled_rows` is not
    settled by them, `_top_p_threshold_gathered` for all rows (on every device: the predicate
    is max-reduced over devices, so they take the same branch)."""
    threshold, settled = top_p_threshold_from_candidates(
        scaled_block, top_k_, top_p, candidates=candidates, axis_name=axis_name
    )
    unsettled = jnp.any(sampled_rows & ~settled).astype(jnp.int32)
    return lax.cond(
        lax.pmax(unsettled, axis_name) > 0,
        lambda: _top_p_threshold_gathered(scaled_block, top_k_, top_p, axis_name),
        lambda: threshold,
    )


def sample(
    block: jax.Array,
    temperature: jax.Array,
    top_k_: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    steps: jax.Array,
    *,
    mode: str,
    max_k: int = 0,
    candidates: int = TOP_P_CANDIDATES,
    axis_name: str = AXIS,
) -> jax.Array:
    """One token per row of the sharded logits [B, V/T]; the arguments and the result as
    `equarx_serve.generation.sampling.sample_tokens` (on the gathered logits) takes and gives them:
    temperature [B] (0: greedy), top_k_ [B] int (0: off), top_p [B], seeds [B] uint32, steps
    [B] int32 (row b draws with fold_in(PRNGKey(seeds[b]), steps[b])), `mode` (static) the
    most any row needs, `max_k` >= every row's top-k in "top_k" mode. Returns [B] int32,
    replicated. See the module doc for what crosses devices and for exactness."""
    if mode not in SAMPLING_MODES:
        raise ValueError(f"unknown sampling mode {mode!r}; valid: {', '.join(SAMPLING_MODES)}")
    block = block.astype(jnp.float32)  # [B, V/T]
    greedy = argmax(block, axis_name)  # [B]
    if mode == "greedy":
        return greedy
    batch, block_size = block.shape
    vocab = block_size * lax.axis_size(axis_name)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seeds, steps)
    scaled = block / jnp.maximum(temperature, MIN_TEMPERATURE)[:, None]  # [B, V/T]
    threshold = jnp.full((batch, 1), -jnp.inf)  # [B, 1]: keep logits >= threshold
    if mode == "top_k":
        max_k = min(max_k, vocab)
        top_values, _ = top_k(scaled, max_k, axis_name)  # [B, max_k]
        kth = jnp.take_along_axis(top_values, jnp.clip(top_k_ - 1, 0, max_k - 1)[:, None], -1)
        threshold = jnp.where(top_k_[:, None] > 0, kth, threshold)
    elif mode == "top_p":
        threshold = _top_p_threshold(scaled, top_k_, top_p, temperature > 0, candidates, axis_name)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)  # [B, V/T]
    noisy = masked + _gumbel_block(keys, vocab, block_size, axis_name)
    sampled = argmax(noisy, axis_name)
    return jnp.where(temperature > 0, sampled, greedy)


# -- Quality metrics ------------------------------------------------------------------------------


def _log_softmax(block: jax.Array, axis_name: str) -> jax.Array:
    """[..., V/T] -> its log-probabilities (f32) under the whole vocabulary's softmax."""
    block = block.astype(jnp.float32)
    return block - _logsumexp(block, axis_name)[..., None]


def _kl(log_p: jax.Array, log_q: jax.Array, axis_name: str) -> jax.Array:
    return lax.psum(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1), axis_name)


def token_metrics(
    reference_block: jax.Array,
    float32_block: jax.Array,
    block: jax.Array,
    targets: jax.Array,
    axis_name: str = AXIS,
) -> dict[str, jax.Array]:
    """`eval.metrics.token_metrics` on sharded logits: the reference's, the float32 model's
    and the method's logits [B, L, V/T], targets [B, L] -> per position [B, L] (replicated):
    nll, kl, kl_to_float32, top1, top5, max_abs, mean_abs, cosine, nonfinite (see there).
    Only [B, L] maxima and sums and 5 candidates a row cross devices."""
    p = reference_block.astype(jnp.float32)  # [B, L, V/T]
    q = block.astype(jnp.float32)
    block_size = q.shape[-1]
    vocab = block_size * lax.axis_size(axis_name)
    log_p, log_q = _log_softmax(p, axis_name), _log_softmax(q, axis_name)  # [B, L, V/T]

    local_target = targets - _block_offset(block_size, axis_name)  # [B, L]
    mine = (local_target >= 0) & (local_target < block_size)
    target_log_q = jnp.take_along_axis(
        log_q, jnp.clip(local_target, 0, block_size - 1)[..., None], axis=-1
    )[..., 0]
    nll = -lax.psum(jnp.where(mine, target_log_q, 0.0), axis_name)

    _, top_p_ids = top_k(p, METRICS_TOP_K, axis_name)  # [B, L, 5]
    _, top_q_ids = top_k(q, METRICS_TOP_K, axis_name)
    shared = jnp.any(top_p_ids[..., :, None] == top_q_ids[..., None, :], axis=-1)

    diff = jnp.abs(q - p)
    dot, p_sq, q_sq = (
        lax.psum(jnp.sum(a * b, axis=-1), axis_name) for a, b in ((p, q), (p, p), (q, q))
    )
    return {
        "nll": nll,
        "kl": _kl(log_p, log_q, axis_name),
        "kl_to_float32": _kl(_log_softmax(float32_block, axis_name), log_q, axis_name),
        "top1": (top_p_ids[..., 0] == top_q_ids[..., 0]).astype(jnp.float32),
        "top5": jnp.mean(shared, axis=-1, dtype=jnp.float32),
        "max_abs": lax.pmax(jnp.max(diff, axis=-1), axis_name),
        "mean_abs": lax.psum(jnp.sum(diff, axis=-1), axis_name) / vocab,
        "cosine": dot / (jnp.sqrt(p_sq) * jnp.sqrt(q_sq)),
        "nonfinite": lax.psum(jnp.sum(~jnp.isfinite(q), axis=-1, dtype=jnp.int32), axis_name),
    }
