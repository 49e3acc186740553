"""Quality metrics of one method's forward pass against the reference's, on the same tokens.

Everything heavy runs jitted on one device, one batch at a time, and returns small per-token
or per-site arrays; `summarize` turns the concatenated per-token arrays into the report's
numbers. Cost per batch: two log-softmaxes and a top-5 over [B, T, V] logits (V = 262144 for
Gemma 3: ~10 FLOPs an element), so a method's scoring costs about what its vocab projection
does.

Per token t (scoring position t predicts token t + 1), with p the reference's next-token
distribution and q the method's:
  nll         -log q(token t + 1)            -> perplexity = exp(mean nll)
  kl          KL(p || q) = sum p (log p - log q), nats
  top1        argmax q == argmax p
  top5        |top5(p) & top5(q)| / 5
  max_abs / mean_abs / cosine of the logit vectors
Per all-reduce site (layer_i/attn, layer_i/mlp), summed over tokens:
  born        ||y - y_exact||^2 and ||y_exact||^2, where y_exact is the f32 psum of the same
              partial sums this run reduced: the error the all-reduce adds at this site
  propagated  ||y - y_ref||^2 and ||y_ref||^2, against the reference run's output at the
              same site: the error accumulated through all the layers below
Against the float32 model itself (the compute floor's logits, not the reference's):
  kl_to_float32                KL(float32 model || method): how far from the higher-precision
                               model a method is, next to the reference's own distance
Against the compute floor (the float32 model's numbers, `relative_to_floor`):
  kl_mean_vs_floor             kl_mean / the floor's kl_mean
  top1_disagreement_vs_floor   (1 - top1) / (1 - the floor's top1)
  top1_agreement_below_floor   the floor's top1 - top1 (points, as a fraction)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

TOP_K = 5
KL_PERCENTILE = 99.0

Trace = dict[str, Any]  # models.gemma3 all-reduce trace: {"layer_i": {"attn"|"mlp": {...}}}


def local_copy(x: jax.Array) -> jax.Array:
    """One device's copy of a replicated array, so work on it runs once, not once per replica."""
    if not x.sharding.is_fully_replicated:
        raise ValueError(f"local_copy needs a replicated array, got {x.sharding}")
    return x.addressable_shards[0].data


def split_positions(x: jax.Array, mesh: Mesh, axis_name: str) -> jax.Array:
    """A [B, L, ...] array, laid out any way (the engine's logits are vocab-sharded), re-laid
    out as ceil(L / N) positions per device of the mesh axis, so scoring runs once, in
    parallel. When N does not divide L the positions are padded with zeros up to a multiple
    of N; callers score only their first positions (the window's), never the padding.
    Measured on XLA:CPU with 2 host devices: 28 s to score [2, 511, 262144] logits on one
    device, 5.7 s split over both."""
    num_devices = mesh.shape[axis_name]
    padded = -(-x.shape[1] // num_devices) * num_devices
    return _relayout(NamedSharding(mesh, P(None, axis_name)), padded - x.shape[1])(x)


@functools.cache
def _relayout(sharding: NamedSharding, pad: int) -> Callable[[jax.Array], jax.Array]:
    """A compiled copy into `sharding`, `pad` zero positions appended to axis 1.
    (`jax.device_put` takes a slow path for this, through one host copy of the whole array:
    ~1 GiB of f32 logits a batch.)"""

    def pad_positions(x: jax.Array) -> jax.Array:
        widths = [(0, 0)] * x.ndim
        widths[1] = (0, pad)
        return jnp.pad(x, widths)

    return jax.jit(pad_positions, out_shardings=sharding)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["logits", "log_probs", "top_k", "float32_log_probs"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Baseline:
    """What every method of one batch is scored against, computed once per batch (`baseline`):
    the reference's logits [B, L, V], log-probabilities [B, L, V] f32 and top-K tokens
    [B, L, K], and the float32 model's log-probabilities [B, L, V] f32."""

    logits: jax.Array
    log_probs: jax.Array
    top_k: jax.Array
    float32_log_probs: jax.Array


def baseline(reference_logits: jax.Array, float32_logits: jax.Array) -> Baseline:
    """The reference's and the float32 model's logits [B, L, V] -> the batch's `Baseline`."""
    return Baseline(
        logits=reference_logits,
        log_probs=log_probs(reference_logits),
        top_k=_top_k(reference_logits),
        float32_log_probs=log_probs(float32_logits),
    )


def token_metrics(base: Baseline, logits: jax.Array, targets: jax.Array) -> dict[str, jax.Array]:
    """A method's logits [B, L, V] against the batch's `Baseline`, targets [B, L] (the token
    after each position) -> per position [B, L]: nll, kl, kl_to_float32, top1, top5, max_abs,
    mean_abs, cosine and nonfinite (the count of non-finite logits). The caller drops the
    positions it does not score.

    Separate programs, each log-softmax and top-k materialized once: fused into one, XLA:CPU
    recomputes the [B, L, V] log-softmaxes inside every consumer (measured: 50 s instead of 7 s
    for [2, 511, 262144]); the baseline's are shared by every method of the batch."""
    log_q = log_probs(logits)
    return {
        **_distribution_metrics(base.log_probs, base.float32_log_probs, log_q, targets),
        **_top_k_metrics(base.top_k, _top_k(logits)),
        **_logit_errors(base.logits, logits),
    }


def _kl(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


@jax.jit
def log_probs(logits: jax.Array) -> jax.Array:
    """[B, L, V] logits -> f32 log-probabilities."""
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


@jax.jit
def _top_k(logits: jax.Array) -> jax.Array:
    return jax.lax.top_k(logits.astype(jnp.float32), TOP_K)[1]  # [B, T, K]


@jax.jit
def _distribution_metrics(
    log_p: jax.Array, log_f: jax.Array, log_q: jax.Array, targets: jax.Array
) -> dict[str, jax.Array]:
    return {
        "nll": -jnp.take_along_axis(log_q, targets[..., None], axis=-1)[..., 0],  # [B, T]
        "kl": _kl(log_p, log_q),  # [B, T]
        "kl_to_float32": _kl(log_f, log_q),  # [B, T]
    }


@jax.jit
def _top_k_metrics(top_p: jax.Array, top_q: jax.Array) -> dict[str, jax.Array]:
    shared = jnp.any(top_p[..., :, None] == top_q[..., None, :], axis=-1)  # [B, T, K]
    return {
        "top1": (top_p[..., 0] == top_q[..., 0]).astype(jnp.float32),
        "top5": jnp.mean(shared, axis=-1, dtype=jnp.float32),
    }


@jax.jit
def _logit_errors(p_logits: jax.Array, q_logits: jax.Array) -> dict[str, jax.Array]:
    p, q = p_logits.astype(jnp.float32), q_logits.astype(jnp.float32)  # [B, T, V]
    diff = jnp.abs(q - p)
    norms = jnp.linalg.norm(p, axis=-1) * jnp.linalg.norm(q, axis=-1)  # [B, T]
    return {
        "max_abs": jnp.max(diff, axis=-1),
        "mean_abs": jnp.mean(diff, axis=-1),
        "cosine": jnp.sum(p * q, axis=-1) / norms,
        "nonfinite": jnp.sum(~jnp.isfinite(q), axis=-1, dtype=jnp.int32),
    }


def sites(trace: Trace) -> Iterator[tuple[str, dict[str, Any]]]:
    """("layer_i/attn" | "layer_i/mlp", record) in depth order."""
    for i in range(len(trace)):
        for kind in ("attn", "mlp"):
            yield f"layer_{i}/{kind}", trace[f"layer_{i}"][kind]


@functools.partial(jax.jit, static_argnames="num_tokens")
def site_errors(trace: Trace, reference_trace: Trace, *, num_tokens: int) -> jax.Array:
    """[num_sites, 5] sums over the first `num_tokens` positions of every sequence, per site in
    depth order: born error^2, exact^2, propagated error^2 (against the reference run's
    output), the reference run's output^2, non-finite output elements."""
    rows = []
    for (_, record), (_, ref_record) in zip(sites(trace), sites(reference_trace), strict=True):
        (output,) = record["output"]  # [B, L, D]
        (ref_output,) = ref_record["output"]
        output = output[:, :num_tokens].astype(jnp.float32)
        ref_output = ref_output[:, :num_tokens].astype(jnp.float32)
        rows.append(
            jnp.stack([
                jnp.sum(record["error_sq"][0][:, :num_tokens]),
                jnp.sum(record["exact_sq"][0][:, :num_tokens]),
                jnp.sum(jnp.square(output - ref_output)),
                jnp.sum(jnp.square(ref_output)),
                jnp.sum(record["nonfinite"][0][:, :num_tokens]).astype(jnp.float32),
            ])
        )  # fmt: skip
    return jnp.stack(rows)


def summarize(tokens: dict[str, np.ndarray], reference_perplexity: float) -> dict[str, float]:
    """The report's numbers from per-token arrays (every scored token, concatenated)."""
    perplexity = float(np.exp(np.mean(tokens["nll"], dtype=np.float64)))
    return {
        "perplexity": perplexity,
        "ppl_abs_change": perplexity - reference_perplexity,
        "ppl_rel_change": perplexity / reference_perplexity - 1.0,
        "kl_mean": float(np.mean(tokens["kl"], dtype=np.float64)),
        "kl_p99": float(np.percentile(tokens["kl"], KL_PERCENTILE)),
        "kl_max": float(np.max(tokens["kl"])),
        "top1_agreement": float(np.mean(tokens["top1"], dtype=np.float64)),
        "top5_overlap": float(np.mean(tokens["top5"], dtype=np.float64)),
        "logit_max_abs_error": float(np.max(tokens["max_abs"])),
        "logit_mean_abs_error": float(np.mean(tokens["mean_abs"], dtype=np.float64)),
        "logit_cosine_mean": float(np.mean(tokens["cosine"], dtype=np.float64)),
        "logit_cosine_min": float(np.min(tokens["cosine"])),
        "nonfinite_logits": int(np.sum(tokens["nonfinite"])),
        "kl_to_float32": float(np.mean(tokens["kl_to_float32"], dtype=np.float64)),
    }


def summarize_sites(names: list[str], sums: np.ndarray) -> list[dict[str, object]]:
    """Per site: relative born and propagated errors (sqrt of the summed squares' ratio) and
    the non-finite count, from `site_errors` summed over batches."""
    rows = []
    for name, (born_sq, exact_sq, error_sq, base_sq, nonfinite) in zip(names, sums, strict=True):
        layer, kind = name.split("/")
        rows.append({
            "site": name,
            "layer": int(layer.removeprefix("layer_")),
            "kind": kind,
            "born_error": _relative(born_sq, exact_sq),
            "error": _relative(error_sq, base_sq),
            "nonfinite": int(nonfinite),
        })  # fmt: skip
    return rows


def _relative(error_sq: float, norm_sq: float) -> float:
    """sqrt(error_sq / norm_sq); 0 for an exact zero, and NaN or Inf kept (never hidden)."""
    if error_sq == 0 and norm_sq == 0:
        return 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.sqrt(np.float64(error_sq) / np.float64(norm_sq)))


def greedy_agreement(reference: list[list[int]], generated: list[list[int]]) -> dict[str, object]:
    """Per prompt, how many generated tokens match the reference's before the first
    divergence (a method that reproduces the reference exactly, stop token included, scores
    all; the caller appends the stop token to completions that stopped)."""
    matched = [_common_prefix(ref, gen) for ref, gen in zip(reference, generated, strict=True)]
    lengths = [len(ref) for ref in reference]
    stderr = float(np.std(matched, ddof=1) / np.sqrt(len(matched))) if len(matched) > 1 else 0.0
    return {
        "greedy_matched_mean": float(np.mean(matched)),
        "greedy_matched_stderr": stderr,
        "greedy_matched_fraction": float(sum(matched) / max(sum(lengths), 1)),
        "greedy_identical": float(np.mean([m == n for m, n in zip(matched, lengths, strict=True)])),
        "greedy_matched": matched,
    }


def relative_to_floor(numbers: dict[str, Any], floor: dict[str, Any]) -> dict[str, float]:
    """A method's KL and top-1 disagreement as multiples of the compute floor's, and its top-1
    agreement's shortfall from the floor's (see the module doc)."""
    return {
        "kl_mean_vs_floor": _ratio(numbers["kl_mean"], floor["kl_mean"]),
        "top1_disagreement_vs_floor": _ratio(
            1.0 - numbers["top1_agreement"], 1.0 - floor["top1_agreement"]
        ),
        "top1_agreement_below_floor": floor["top1_agreement"] - numbers["top1_agreement"],
    }


def _ratio(value: float, floor: float) -> float:
    """value / floor; 0 when both are 0, Inf when only the floor is (a zero floor)."""
    if floor == 0:
        return 0.0 if value == 0 else math.inf
    return value / floor


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
