"""The decode steps on the GGUF file's own quantized weights (`--weights gguf`), scored.

    scores = score_decode_weights(engines, prompts, continuations)
    # engines: {"bf16": ..., "gguf": ..., "float32": ...}, the same checkpoint

Teacher-forced decode: every engine prefills the same prompts, then runs one decode step per
token of each prompt's continuation in the corpus (the true next token fed, whatever the
engine would have picked), so every engine's step k sees the same tokens and its logits can be
compared position by position. Three engines, one checkpoint: the bf16 reference (the
checkpoint widened to bf16, bf16 matmuls, `psum`), the GGUF blocks (every decode matmul and the
head on the file's exact quantized weights, `models.gguf_blocks`), and the exact checkpoint
(the dequantized weights in float32, float32 arithmetic: what both others approximate). Each
step's logits against the bf16 reference and against the exact checkpoint: KL, top-1
agreement, max |logit difference|; the bf16 reference against the exact checkpoint is the
floor, what bf16 decode already differs by.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

REFERENCE = "bf16"
EXACT = "float32"
GGUF = "gguf"


@dataclasses.dataclass(frozen=True)
class StepScores:
    """One engine's decode-step logits against another's, over every scored step."""

    kl: float  # mean KL(other || this), nats
    top1: float  # fraction of steps whose top-1 token agrees
    max_abs: float  # max |logit difference| over every step and token
    steps: int

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def teacher_forced_logits(
    engine: Any, prompts: Sequence[Sequence[int]], continuations: np.ndarray
) -> np.ndarray:
    """prompts (each of one length P) and their continuations [B, K] -> the decode steps'
    logits [B, K, V] float32: step k feeds continuation token k at position P + k, so its
    logits predict the token after it."""
    import jax
    import jax.numpy as jnp

    batch, steps = continuations.shape
    length = len(prompts[0])
    if any(len(p) != length for p in prompts) or len(prompts) != batch:
        raise ValueError("want B prompts of one length and continuations [B, K]")
    result = engine.prefill([list(p) for p in prompts])
    capacity = length + steps

    @jax.jit
    def grow(kv):  # [B, bucket, K, H] -> [B, capacity, K, H]
        return jnp.pad(kv, ((0, 0), (0, max(capacity - kv.shape[1], 0)), (0, 0), (0, 0)))

    cache = jax.tree.map(grow, result.cache)
    model, params = engine.model, engine.params
    logits = []
    for k in range(steps):
        lengths = np.full((batch,), length + k, np.int32)
        out = model.decode(params, cache, continuations[:, k].astype(np.int32), lengths)
        cache = out.cache
        logits.append(np.asarray(jax.device_get(model.gathered(out.logits)), np.float32))
    return np.stack(logits, axis=1)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def compare(this: np.ndarray, other: np.ndarray) -> StepScores:
    """Logits [..., V] of one engine against another's (the reference)."""
    log_p, log_q = _log_softmax(other), _log_softmax(this)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
    top1 = this.argmax(-1) == other.argmax(-1)
    diff = np.abs(this.astype(np.float64) - other.astype(np.float64))
    return StepScores(float(kl.mean()), float(top1.mean()), float(diff.max()), int(top1.size))


def score_decode_weights(
    engines: dict[str, Any], prompts: Sequence[Sequence[int]], continuations: np.ndarray
) -> dict[str, Any]:
    """engines {REFERENCE, GGUF, EXACT} on the same checkpoint -> {"vs_bf16": {gguf},
    "vs_float32": {bf16 (the floor), gguf}, "gguf_kl_over_floor"} (see module doc)."""
    logits = {
        label: teacher_forced_logits(engine, prompts, continuations)
        for label, engine in engines.items()
    }
    floor = compare(logits[REFERENCE], logits[EXACT])
    to_exact = compare(logits[GGUF], logits[EXACT])
    return {
        "vs_bf16": {GGUF: compare(logits[GGUF], logits[REFERENCE]).to_json()},
        "vs_float32": {REFERENCE: floor.to_json(), GGUF: to_exact.to_json()},
        "gguf_kl_to_float32_over_floor": to_exact.kl / floor.kl if floor.kl else float("inf"),
        "prompts": len(prompts),
        "prompt_len": len(prompts[0]),
        "steps": int(continuations.shape[1]),
    }
