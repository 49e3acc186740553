"""One request's sampling settings, and the sampler that draws one token per row on device.

    batch = SamplingBatch.for_rows([(params, step), None, ...], vocab_size)  # None: idle row
    tokens = sample(logits, batch, place)  # logits [B, V] -> [B] int32, on device

A row draws with the key fold_in(PRNGKey(seed), step): a request's tokens depend on its seed
and its own step, not on the batch around it. Greedy rows (temperature 0) take the argmax.

Every value is bounded before it reaches the device: `top_k` is at most the vocabulary (a
larger k keeps every token), a seed is its low 32 bits, and the program's static top-k width
is a power of two, so whatever requests ask, at most log2(V) + 4 sampling programs exist.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["MIN_TEMPERATURE", "SamplingBatch", "SamplingParams", "sample", "sample_tokens"]

# Temperatures below this are clamped (0 itself means greedy and never divides).
MIN_TEMPERATURE = 1e-5
SEED_MASK = 0xFFFFFFFF  # seeds are their low 32 bits (PRNGKey takes a uint32)

Mode = Literal["greedy", "temperature", "top_k", "top_p"]


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    Attributes:
      max_tokens: The most tokens to generate (>= 1).
      temperature: 0 is greedy (argmax); else logits are divided by it before sampling.
      top_k: Sample among the k most likely tokens only (None: all).
      top_p: Nucleus sampling: the smallest set of most likely tokens (after top_k) whose
        probability reaches top_p; 1.0 keeps all.
      seed: The request's random seed (its low 32 bits): the same seed, prompt and settings
        give the same tokens.
      stop: Strings that end the completion; the text stops before the first one.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a sequence of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """What one step samples with, one value per row (host values, bounded; see module doc).

    `mode` is the cheapest program that serves every row: "greedy", "temperature", "top_k"
    (then `max_k`, a power of two, is >= every row's top_k) or "top_p" (a full sort).
    """

    temperature: tuple[float, ...]
    top_k: tuple[int, ...]  # 0: off
    top_p: tuple[float, ...]
    seeds: tuple[int, ...]  # uint32
    steps: tuple[int, ...]  # the row's request's tokens sampled so far
    mode: Mode
    max_k: int = 0

    @classmethod
    def for_rows(
        cls, rows: Sequence[tuple[SamplingParams, int] | None], vocab_size: int
    ) -> SamplingBatch:
        """Rows of (params, step); None is an unused row (greedy, output ignored)."""
        default = SamplingParams()
        params = [default if row is None else row[0] for row in rows]
        top_k = tuple(min(p.top_k, vocab_size) if p.top_k else 0 for p in params)
        mode, max_k = _mode(params, top_k, vocab_size)
        return cls(
            temperature=tuple(float(p.temperature) for p in params),
            top_k=top_k,
            top_p=tuple(float(p.top_p) for p in params),
            seeds=tuple(int(p.seed) & SEED_MASK for p in params),
            steps=tuple(0 if row is None else int(row[1]) for row in rows),
            mode=mode,
            max_k=max_k,
        )

    @classmethod
    def from_dict(cls, values: dict) -> SamplingBatch:
        """The inverse of `dataclasses.asdict` (after a JSON round trip)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def _mode(
    params: Sequence[SamplingParams], top_k: Sequence[int], vocab_size: int
) -> tuple[Mode, int]:
    sampled = [(p, k) for p, k in zip(params, top_k, strict=True) if not p.greedy]
    if not sampled:
        return "greedy", 0
    if any(p.top_p < 1.0 for p, _ in sampled):
        return "top_p", 0
    ks = [k for _, k in sampled if k]
    if not ks:
        return "temperature", 0
    return "top_k", min(1 << (max(ks) - 1).bit_length(), vocab_size)


def sample(
    logits: jax.Array, batch: SamplingBatch, place: Callable[[np.ndarray], jax.Array]
) -> jax.Array:
    """One token per row of logits [B, V] (on device, [B] int32). `place` puts a host array
    on the logits' mesh (replicated)."""
    arrays = (
        np.asarray(batch.temperature, np.float32),
        np.asarray(batch.top_k, np.int32),
        np.asarray(batch.top_p, np.float32),
        np.asarray(batch.seeds, np.uint32),
        np.asarray(batch.steps, np.int32),
    )
    return sample_tokens(logits, *map(place, arrays), mode=batch.mode, max_k=batch.max_k)


@functools.partial(jax.jit, static_argnames=("mode", "max_k"))
def sample_tokens(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    steps: jax.Array,
    *,
    mode: Mode,
    max_k: int = 0,
) -> jax.Array:
    """One token per row of logits [B, V].

    temperature [B] (0: greedy), top_k [B] int (0: off), top_p [B], seeds [B] uint32 and
    steps [B] int32 (row b draws with fold_in(PRNGKey(seeds[b]), steps[b])). `mode` (static)
    is the most any row needs (see `SamplingBatch`). Tokens within top-k / top-p are kept by a
    logit threshold, so ties at the threshold are kept too. Returns [B] int32.
    """
    logits = logits.astype(jnp.float32)  # [B, V]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
    if mode == "greedy":
        return greedy
    batch, vocab = logits.shape
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seeds, steps)
    scaled = logits / jnp.maximum(temperature, MIN_TEMPERATURE)[:, None]  # [B, V]
    threshold = jnp.full((batch, 1), -jnp.inf)  # [B, 1]: keep logits >= threshold
    if mode == "top_k":
        max_k = min(max_k, vocab)
        top_values = lax.top_k(scaled, max_k)[0]  # [B, max_k], descending
        kth = jnp.take_along_axis(top_values, jnp.clip(top_k - 1, 0, max_k - 1)[:, None], axis=-1)
        threshold = jnp.where(top_k[:, None] > 0, kth, threshold)
    elif mode == "top_p":
        ordered = -jnp.sort(-scaled, axis=-1)  # [B, V], descending
        ranks = jnp.arange(vocab)[None, :]  # [1, V]
        in_top_k = (top_k[:, None] == 0) | (ranks < top_k[:, None])  # [B, V]
        ordered = jnp.where(in_top_k, ordered, -jnp.inf)
        probs = jax.nn.softmax(ordered, axis=-1)  # [B, V], top-k renormalized
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
        keep = in_top_k & (before < top_p[:, None])  # [B, V]
        count = jnp.maximum(jnp.sum(keep, axis=-1), 1)  # [B]
        threshold = jnp.take_along_axis(ordered, (count - 1)[:, None], axis=-1)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)  # [B, V]
    sampled = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)  # [B]
    return jnp.where(temperature > 0, sampled, greedy)
