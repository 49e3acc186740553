"""Decoding from the prefill KV cache: sampling, continuous batching, streaming, stop strings.

    engine = PrefillEngine.from_name("gemma3-270m", tp=2, all_reduce="equarx-int8")
    generator = Generator(engine, max_batch=8)
    prompt = generator.tokenizer.encode(chat_prompt([{"role": "user", "content": "Hi!"}]))
    [completion] = generator.generate([prompt], SamplingParams(max_tokens=32))
    completion.text, completion.finish_reason, completion.decode_tokens_per_s

How `Generator.generate` runs a list of requests on SLOTS = min(len(prompts), max_batch) rows:
  1. Every request is checked first (non-empty prompt, ids in the vocabulary, prompt +
     max_tokens <= engine.max_length). The KV cache CAPACITY is the engine's length bucket of
     the longest prompt + max_tokens, so the decode program is compiled once per
     (SLOTS, CAPACITY) and reused by every step.
  2. Waiting requests are admitted into free slots: their prompts are prefilled as one batch
     (padded with copies of the first prompt to a power of two, and short prompts to at least
     MIN_ROWS = 2 rows: few programs, and no slow 1-row matmuls on CPU), each prompt's
     KV cache [bucket] is copied into its slot of the [SLOTS, CAPACITY, K, H] cache, and its
     first token is sampled from the prefill's last-token logits.
  3. One decode step (`TensorParallelGemma3.decode`) runs every slot: each sequence's last
     token at position = its length; its k/v are written there and it attends over positions
     <= length (a sliding window on local layers). Idle slots run too (and one idle row when
     SLOTS = 1, see MIN_ROWS); their output is unused.
  4. Sampling runs on device, row by row: greedy (temperature 0), or temperature with optional
     top-k then top-p, from the key fold_in(PRNGKey(seed), step): a request's tokens depend on
     its seed and its own step, not on the batch around it.
  5. A request finishes on EOS or <end_of_turn> ("stop"), on a stop string ("stop": the text
     is cut before it, and it is never streamed: text that could still become a stop string
     is held back), at max_tokens ("length"), or when `on_token` returns False ("cancelled");
     its slot goes to the next waiting request.
  6. With `more`, requests can join a running call: whenever slots are free, `more(n)` is
     asked for up to n new requests, which wait and are admitted as in 2. SLOTS is then
     max_batch from the start, and the cache grows to a larger CAPACITY bucket (one more
     decode program) when a joining request needs it.

The all-reduce each phase uses: prefill reduces [B, bucket, D] messages, decode [B, 1, D]
ones; `equarx-int8` sends messages below its `min_size_bytes` to `psum`, which is where every
decode step's messages go (`Generator.all_reduce_usage`, logged once per engine and setting).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import string
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from equarx_serve.engine import PrefillEngine
from models.tokenizer import Tokenizer, set_bpe_specs

__all__ = [
    "Completion",
    "Generator",
    "SamplingParams",
    "byte_tokenizer",
    "chat_prompt",
    "sample_tokens",
]

logger = logging.getLogger("equarx_serve.decode")

FINISH_REASONS = ("stop", "length", "cancelled", "error")
# Temperatures below this are clamped (0 itself means greedy and never divides).
MIN_TEMPERATURE = 1e-5
_REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 byte sequence decodes to
# Decode batches have at least 2 rows (an idle one if need be), and so do prefill batches of
# short prompts: XLA:CPU runs a 1-row bf16 matmul (GEMV) ~7x slower than a 2-row one. Measured
# on this project's machine, [B, 640] x [262144, 640] bf16 (Gemma 3 270M's logits): B = 1
# 0.28 s, B = 2 0.040 s. Prefill of one 270M prompt, TP = 2, as 1 row vs 2 rows (a copy):
# bucket 128 0.79 vs 0.40 s, 512 1.16 vs 1.70 s, 1024 3.18 vs 3.51 s; so prompts in buckets
# above MIN_ROWS_MAX_BUCKET are prefilled as 1 row.
MIN_ROWS = 2
MIN_ROWS_MAX_BUCKET = 128

OnToken = Callable[[int, int, str], bool | None]
OnFinish = Callable[[int, "Completion"], None]
More = Callable[[int], Sequence[tuple[Sequence[int], "SamplingParams"]]]


# -- Requests and results -----------------------------------------------------------------------


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
        def is_int(value):
            return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

        def is_real(value):
            return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
                value, bool
            )

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not is_real(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {self.top_k!r}")
        if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a sequence of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass
class Completion:
    """One request's result.

    Attributes:
      prompt_tokens: The prompt's token ids.
      tokens: The generated ids, without EOS / <end_of_turn> and without the tokens of (or
        after the start of) a stop string.
      text: The generated text (cut before a stop string).
      finish_reason: "stop" (EOS, <end_of_turn> or a stop string), "length" (max_tokens),
        "cancelled" (on_token returned False) or "error" (a request from `more` that failed
        `Generator.check`; nothing ran).
      prefill_ms: The prefill of the batch this request was admitted with.
      time_to_first_token_ms: From the start of `generate` (for a request from `more`: from
        when it was handed in) to this request's first token (includes waiting for a slot).
      decode_ms: From the first token to the last.
      decode_tokens_per_s: Tokens after the first, per second of decode_ms (0 if none).
      error: Why the request was refused (finish_reason "error"), else None.
    """

    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    finish_reason: str
    prefill_ms: float
    time_to_first_token_ms: float
    decode_ms: float
    decode_tokens_per_s: float
    error: str | None = None


# -- Chat template and a tokenizer for random-init models ---------------------------------------

_CHAT_ROLES = {"user": "user", "assistant": "model", "model": "model"}


def _message_text(index: int, message: Any) -> tuple[str, str]:
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
        raise ValueError(f"message {index} must be a dict with 'role' and 'content'")
    role, content = message["role"], message["content"]
    if isinstance(content, list):  # OpenAI-style parts: only text is supported
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise ValueError(f"message {index}: only text content parts are supported")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    if not isinstance(content, str):
        raise ValueError(f"message {index}: content must be a string, got {type(content).__name__}")
    if role != "system" and role not in _CHAT_ROLES:
        raise ValueError(
            f"message {index}: unknown role {role!r}; valid: system, user, assistant (or model)"
        )
    return role, content


def chat_prompt(messages: Sequence[dict]) -> str:
    """The Gemma 3 chat template, ready for the model's turn:

        <start_of_turn>user\\n{system}\\n\\n{user}<end_of_turn>\\n
        <start_of_turn>model\\n{assistant}<end_of_turn>\\n ... <start_of_turn>model\\n

    A system message may come first only; as Gemma has no system role, its text is prepended
    to the first user turn. After it, turns alternate user / assistant ("model" also accepted),
    starting and ending with user. BOS is not included: `Tokenizer.encode` adds it.
    ValueError for anything else.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role', 'content'} dicts")
    parsed = [_message_text(i, m) for i, m in enumerate(messages)]
    system = None
    if parsed and parsed[0][0] == "system":
        system = parsed.pop(0)[1]
    if not parsed:
        raise ValueError("messages must contain at least one user message")
    turns = []
    for i, (role, content) in enumerate(parsed):
        expected = "user" if i % 2 == 0 else "model"
        if role == "system":
            raise ValueError("a system message may only come first")
        if _CHAT_ROLES[role] != expected:
            raise ValueError(
                "roles must alternate user/assistant, starting with user "
                f"(after an optional system message); turn {i} is {role!r}"
            )
        if i == 0 and system is not None:
            content = f"{system}\n\n{content}"
        turns.append(f"<start_of_turn>{expected}\n{content}<end_of_turn>\n")
    if parsed[-1][0] != "user":
        raise ValueError("the last message must be a user message (the model answers it)")
    return "".join(turns) + "<start_of_turn>model\n"


@functools.cache
def byte_tokenizer(vocab_size: int) -> Tokenizer:
    """A SentencePiece tokenizer of exactly `vocab_size` pieces for random-init test models
    (which ship none): Gemma's special ids (<pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4),
    <start_of_turn> and <end_of_turn>, 256 byte pieces (any text encodes), then printable ASCII
    characters and letter pairs. Needs vocab_size >= 263."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    piece = sp_pb2.ModelProto.SentencePiece
    special = [
        ("<pad>", piece.CONTROL),
        ("<eos>", piece.CONTROL),
        ("<bos>", piece.CONTROL),
        ("<unk>", piece.UNKNOWN),
        ("<mask>", piece.CONTROL),
        ("<start_of_turn>", piece.USER_DEFINED),
        ("<end_of_turn>", piece.USER_DEFINED),
    ]
    if vocab_size < len(special) + 256:
        raise ValueError(f"byte_tokenizer needs vocab_size >= {len(special) + 256}")
    chars = ["▁" if c == " " else c for c in string.printable[:95]]
    words = [*chars, *[f"▁{c}" for c in string.ascii_lowercase]]
    words += [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]
    words += [f"<unused{i}>" for i in range(vocab_size)]
    proto = sp_pb2.ModelProto()
    for text, kind in special:
        proto.pieces.add(piece=text, score=0.0, type=kind)
    for b in range(256):
        proto.pieces.add(piece=f"<0x{b:02X}>", score=0.0, type=piece.BYTE)
    for i, word in enumerate(words[: vocab_size - len(proto.pieces)]):
        kind = piece.CONTROL if word.startswith("<unused") else piece.NORMAL
        proto.pieces.add(piece=word, score=-float(i), type=kind)
    set_bpe_specs(proto, {"pad": 0, "eos": 1, "bos": 2, "unk": 3}, add_dummy_prefix=False)
    return Tokenizer(proto.SerializeToString(), source=f"byte_tokenizer({vocab_size})")


# -- Sampling (on device) -----------------------------------------------------------------------


def _sampling_mode(params: Sequence[SamplingParams]) -> tuple[str, int]:
    """The cheapest program that serves every row: (mode, max_k)."""
    sampled = [p for p in params if not p.greedy]
    if not sampled:
        return "greedy", 0
    if any(p.top_p < 1.0 for p in sampled):
        return "top_p", 0
    ks = [p.top_k for p in sampled if p.top_k is not None]
    return ("top_k", max(ks)) if ks else ("temperature", 0)


@functools.partial(jax.jit, static_argnames=("mode", "max_k"))
def sample_tokens(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    steps: jax.Array,
    *,
    mode: str,
    max_k: int = 0,
) -> jax.Array:
    """One token per row of logits [B, V].

    temperature [B] (0: greedy), top_k [B] int (0: off), top_p [B], seeds [B] uint32 and
    steps [B] int32 (row b draws with fold_in(PRNGKey(seeds[b]), steps[b])). `mode` (static)
    is the most any row needs: "greedy", "temperature", "top_k" (then max_k >= every row's
    top_k) or "top_p" (a full sort). Tokens within top-k / top-p are kept by a logit
    threshold, so ties at the threshold are kept too. Returns [B] int32.
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


# -- The generator ------------------------------------------------------------------------------


@dataclasses.dataclass
class _Request:
    """One request while it runs."""

    index: int
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = dataclasses.field(default_factory=list)
    produced: int = 0  # sampled tokens, EOS included
    text: str = ""
    sent: int = 0  # characters of `text` streamed
    prefill_ms: float = 0.0
    first_token_at: float | None = None
    arrived: float = 0.0  # the start of `generate`, or when `more` handed it in


def _stop_index(text: str, stops: Sequence[str], start: int) -> int | None:
    """Where the earliest stop string in text[start:] begins, or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters to hold back: an incomplete UTF-8 character, or the
    longest suffix of `text` that begins a stop string."""
    held = len(text) - len(text.rstrip(_REPLACEMENT))
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                held = max(held, n)
                break
    return held


def _prefill_rows(n: int, bucket: int) -> int:
    """The rows of a prefill batch of n prompts padded to `bucket`: a power of two (few
    programs), and >= MIN_ROWS for short buckets (see MIN_ROWS)."""
    rows = 1 << (n - 1).bit_length()
    return max(rows, MIN_ROWS) if bucket <= MIN_ROWS_MAX_BUCKET else rows


# The all-reduce usage already logged, per engine.
_LOGGED_USAGE: weakref.WeakKeyDictionary[PrefillEngine, set] = weakref.WeakKeyDictionary()


class Generator:
    """Batched, streaming text generation on a `PrefillEngine` (see the module doc).

    Args:
      engine: The model, mesh and all-reduce; its tokenizer (or, for random-init models
        without one, `byte_tokenizer(vocab_size)`) decodes text and gives the stop ids.
      max_batch: The most requests decoded together; further requests wait for a free slot.
    """

    def __init__(self, engine: PrefillEngine, *, max_batch: int = 8):
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        self.engine = engine
        self.max_batch = max_batch
        vocab = engine.config.vocab_size
        self.tokenizer = engine.tokenizer if engine.tokenizer is not None else byte_tokenizer(vocab)
        special = getattr(self.tokenizer, "special_tokens", {})
        ids = (self.tokenizer.eos_id, special.get("end_of_turn"))
        self.stop_token_ids = frozenset(i for i in ids if i is not None and i >= 0)
        self._replicated = NamedSharding(engine.mesh, P())
        cache_sharding = NamedSharding(engine.mesh, engine.model.cache_spec)
        self._cache_shardings = {
            f"layer_{i}": {"k": cache_sharding, "v": cache_sharding}
            for i in range(engine.config.num_layers)
        }
        self._insert = jax.jit(_insert_rows, donate_argnums=0, out_shardings=self._cache_shardings)
        layers, config, dtype = tuple(self._cache_shardings), engine.config, engine.dtype
        zeros = functools.partial(_zeros_cache, layers=layers, config=config, dtype=dtype)
        self._zeros = jax.jit(zeros, static_argnums=(0, 1), out_shardings=self._cache_shardings)
        self._grow = jax.jit(_grow_cache, static_argnums=1, out_shardings=self._cache_shardings)

    # -- checks and reports ------------------------------------------------------------------

    @property
    def max_context(self) -> int:
        """The longest prompt + max_tokens a request may have (the engine's max_length)."""
        return self.engine.max_length

    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """ValueError if this request cannot run: an empty prompt, ids outside the vocabulary
        or a prompt + max_tokens longer than `max_context`."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if len(prompt) == 0:
            raise ValueError("empty prompt: every prompt needs at least one token")
        vocab = self.engine.config.vocab_size
        bad = [t for t in prompt if not (isinstance(t, (int, np.integer)) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab}): got {bad[:5]}")
        total = len(prompt) + params.max_tokens
        if total > self.max_context:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} = {total} is "
                f"longer than the model's maximum context of {self.max_context} tokens"
            )

    def all_reduce_usage(self, batch: int, prompt_len: int) -> dict[str, Any]:
        """Which all-reduce prefill and decode messages actually take, for `batch` prompts of
        `prompt_len` tokens: {"all_reduce", "options", "min_size_bytes" (None: no gate),
        "prefill" / "decode": {"shape", "message_bytes", "uses"}}. A row-parallel message is
        [B, L, D] in the parameter dtype (L: the prompt's length bucket at prefill, 1 at
        decode); "uses" is the method's name, or "psum (size gate)" when it is below
        `min_size_bytes`. Batches are padded as `generate` pads them (a power of two at
        prefill; at least `MIN_ROWS`, see there), and the shapes say so."""
        ar, config = self.engine.all_reduce, self.engine.config
        itemsize = jnp.dtype(self.engine.dtype).itemsize
        phases = {}
        bucket = self.engine.bucket_for(prompt_len)
        shapes = (
            ("prefill", _prefill_rows(batch, bucket), bucket),
            ("decode", max(batch, MIN_ROWS), 1),
        )
        for phase, rows, length in shapes:
            elements = rows * length * config.embed_dim
            gated = ar.is_gated(elements, self.engine.dtype)
            phases[phase] = {
                "shape": [rows, length, config.embed_dim],
                "message_bytes": elements * itemsize,
                "uses": "psum (size gate)" if gated else ar.name,
            }
        return {
            "all_reduce": ar.name,
            "options": ar.options(),
            "min_size_bytes": ar.options().get("min_size_bytes"),
            **phases,
        }

    def _log_usage(self, batch: int, prompt_len: int) -> dict[str, Any]:
        usage = self.all_reduce_usage(batch, prompt_len)
        key = (usage["prefill"]["uses"], usage["decode"]["uses"])
        logged = _LOGGED_USAGE.setdefault(self.engine, set())
        if key not in logged:
            logged.add(key)
            pre, dec = usage["prefill"], usage["decode"]
            gate = usage["min_size_bytes"]
            logger.info(
                "all-reduce %s (size gate %s): prefill messages %s = %d bytes -> %s; decode "
                "messages %s = %d bytes -> %s",
                usage["all_reduce"],
                "none" if gate is None else f"{gate} bytes",
                pre["shape"], pre["message_bytes"], pre["uses"],
                dec["shape"], dec["message_bytes"], dec["uses"],
            )  # fmt: skip
        return usage

    # -- generation --------------------------------------------------------------------------

    def warm_up(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> float:
        """Compiles the programs a `generate` of these prompts uses, by running it with every
        request cancelled at its second token; returns the seconds it took."""
        seen: collections.Counter[int] = collections.Counter()

        def two_tokens(i: int, token: int, delta: str) -> bool:
            seen[i] += 1
            return seen[i] < 2

        started = time.perf_counter()
        self.generate(prompts, params, on_token=two_tokens)
        return time.perf_counter() - started

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        *,
        on_token: OnToken | None = None,
        on_finish: OnFinish | None = None,
        more: More | None = None,
    ) -> list[Completion]:
        """Generates a completion for every prompt (lists of token ids, BOS included), in
        batches of up to `max_batch` (see the module doc). `params`: one for all, or one per
        prompt. `on_token(request_index, token_id, text_delta)` is called for every generated
        token (not EOS / <end_of_turn>), with the newly streamable text (possibly "": text
        that may begin a stop string or an incomplete character is held back); returning
        False cancels that request. `on_finish(request_index, completion)` is called as each
        request finishes. `more(n)`, if given, is called whenever slots are free (n: how many)
        and returns up to n further (prompt, params) requests that join this call (module doc,
        6.); they get the next request indices, and one that fails `check` finishes at once
        with finish_reason "error" (the others run on). Returns the completions in prompt
        order, then those from `more` in the order they came. ValueError for bad input,
        before anything runs."""
        start = time.perf_counter()
        prompts = [list(p) for p in prompts]
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            try:
                self.check(prompt, p)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        if not prompts:
            return []

        # With `more`, every slot may be needed later: the decode program has them from the start.
        slots = self.max_batch if more is not None else min(len(prompts), self.max_batch)
        longest = max(len(q) + p.max_tokens for q, p in zip(prompts, params, strict=True))
        capacity = self.engine.bucket_for(longest)
        self._log_usage(slots, max(len(q) for q in prompts))
        mode, max_k = _sampling_mode(params)
        waiting = collections.deque(
            _Request(i, q, p, arrived=start)
            for i, (q, p) in enumerate(zip(prompts, params, strict=True))
        )
        rows = max(slots, MIN_ROWS)  # rows from `slots` on stay idle
        active: list[_Request | None] = [None] * rows
        results: dict[int, Completion] = {}
        count = len(prompts)  # request indices handed out
        cache = self._empty_cache(rows, capacity)
        last_tokens = np.zeros(rows, np.int32)
        lengths = np.zeros(rows, np.int32)

        def finish(slot: int, req: _Request, reason: str, text: str | None = None) -> None:
            now = time.perf_counter()
            if text is not None:  # cut before a stop string: keep the tokens inside the text
                keep = len(req.tokens)
                while keep and len(self.tokenizer.decode(req.tokens[:keep])) > len(text):
                    keep -= 1
                req.tokens, req.text = req.tokens[:keep], text
            decode_s = now - req.first_token_at
            completion = Completion(
                prompt_tokens=req.prompt,
                tokens=req.tokens,
                text=req.text,
                finish_reason=reason,
                prefill_ms=req.prefill_ms,
                time_to_first_token_ms=(req.first_token_at - req.arrived) * 1e3,
                decode_ms=decode_s * 1e3,
                decode_tokens_per_s=(req.produced - 1) / decode_s if req.produced > 1 else 0.0,
            )
            results[req.index] = completion
            active[slot] = None
            if on_finish is not None:
                on_finish(req.index, completion)

        def take_more(n: int) -> None:
            """Queues up to n requests from `more` (checked; a bad one finishes as "error")."""
            nonlocal count, capacity, cache, mode, max_k
            for prompt, p in more(n):
                index, prompt = count, list(prompt)
                count += 1
                try:
                    self.check(prompt, p)
                except ValueError as e:
                    completion = Completion(prompt, [], "", "error", 0.0, 0.0, 0.0, 0.0, str(e))
                    results[index] = completion
                    if on_finish is not None:
                        on_finish(index, completion)
                    continue
                if len(prompt) + p.max_tokens > capacity:  # positions beyond the cache's end
                    capacity = self.engine.bucket_for(len(prompt) + p.max_tokens)
                    cache = self._grow(cache, capacity)
                waiting.append(_Request(index, prompt, p, arrived=time.perf_counter()))
                # Serves every row that may be sampled from now on (a finished one's needs may go).
                live = [r.params for r in (*active, *waiting) if r is not None]
                mode, max_k = _sampling_mode(live)

        def accept(slot: int, req: _Request, token: int) -> None:
            """Handles one sampled token of the request in `slot`."""
            req.produced += 1
            if req.first_token_at is None:
                req.first_token_at = time.perf_counter()
            if token in self.stop_token_ids:
                return finish(slot, req, "stop")
            req.tokens.append(token)
            stops = req.params.stop
            req.text = self.tokenizer.decode(req.tokens)
            longest = max((len(s) for s in stops), default=0)
            at = _stop_index(req.text, stops, max(0, req.sent - longest))
            last = req.produced >= req.params.max_tokens
            if at is not None:
                cut = req.text[:at]
                delta = cut[req.sent :]
                if delta and on_token is not None:
                    on_token(req.index, token, delta)
                return finish(slot, req, "stop", cut)
            end = len(req.text) if last else len(req.text) - _held_back(req.text, stops)
            delta = req.text[req.sent : end] if end > req.sent else ""
            req.sent = max(req.sent, end)
            if on_token is not None and on_token(req.index, token, delta) is False:
                return finish(slot, req, "cancelled")
            if last:
                return finish(slot, req, "length")
            last_tokens[slot] = token

        while True:
            free = [s for s in range(slots) if active[s] is None]
            if more is not None and len(free) > len(waiting):
                take_more(len(free) - len(waiting))
            if not waiting and all(r is None for r in active):
                break
            if waiting and free:
                admitted = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
                cache, first = self._admit(cache, admitted, free, mode, max_k)
                for slot, req, token in zip(free, admitted, first, strict=False):
                    active[slot] = req
                    lengths[slot] = len(req.prompt)
                    accept(slot, req, int(token))
                continue  # admit more if some finished at once
            running = [(s, r) for s, r in enumerate(active) if r is not None]
            for s in range(rows):
                if active[s] is None:  # idle rows: position 0, output unused
                    last_tokens[s], lengths[s] = 0, 0
            out = self.engine.model.decode(
                self.engine.params,
                cache,
                self._put(last_tokens),
                self._put(lengths),
            )
            cache = out.cache
            tokens = self._sample(out.logits, active, mode, max_k)
            for slot, req in running:
                lengths[slot] += 1
                accept(slot, req, int(tokens[slot]))
        return [results[i] for i in range(count)]

    # -- steps ---------------------------------------------------------------------------------

    def _put(self, value: np.ndarray) -> jax.Array:
        return jax.device_put(value, self._replicated)

    def _empty_cache(self, slots: int, capacity: int) -> dict[str, dict[str, jax.Array]]:
        """Zeros [slots, capacity, K, H] for every layer's k and v, placed on the mesh."""
        return self._zeros(slots, capacity)

    def _admit(
        self,
        cache: dict[str, dict[str, jax.Array]],
        admitted: list[_Request],
        free_slots: list[int],
        mode: str,
        max_k: int,
    ) -> tuple[dict[str, dict[str, jax.Array]], np.ndarray]:
        """Prefills the admitted requests (one batch, padded by `_prefill_rows`), copies their
        KV caches into their slots and samples their first tokens."""
        started = time.perf_counter()
        bucket = self.engine.bucket_for(max(len(r.prompt) for r in admitted))
        batch = _prefill_rows(len(admitted), bucket)
        prompts = [r.prompt for r in admitted]
        prompts += [prompts[0]] * (batch - len(admitted))
        result = self.engine.prefill(prompts)
        jax.block_until_ready(result)
        prefill_ms = (time.perf_counter() - started) * 1e3
        slots = cache["layer_0"]["k"].shape[0]
        # Padding rows go to index `slots`: out of range, dropped.
        dst = np.full(batch, slots, np.int32)
        dst[: len(admitted)] = free_slots[: len(admitted)]
        cache = self._insert(cache, result.cache, self._put(dst))
        rows: list[_Request | None] = [*admitted, *[None] * (batch - len(admitted))]
        first = self._sample(result.logits, rows, mode, max_k)
        for req in admitted:
            req.prefill_ms = prefill_ms
        return cache, first[: len(admitted)]

    def _sample(
        self, logits: jax.Array, rows: Sequence[_Request | None], mode: str, max_k: int
    ) -> np.ndarray:
        """One token per row of logits [B, V] with each row's request's params (None: an
        unused row, greedy)."""
        default = SamplingParams()
        params = [default if r is None else r.params for r in rows]
        temperature = np.array([p.temperature for p in params], np.float32)
        top_k = np.array([p.top_k or 0 for p in params], np.int32)
        top_p = np.array([p.top_p for p in params], np.float32)
        seeds = np.array([p.seed & 0xFFFFFFFF for p in params], np.uint32)
        steps = np.array([0 if r is None else r.produced for r in rows], np.int32)
        tokens = sample_tokens(
            logits,
            *(self._put(a) for a in (temperature, top_k, top_p, seeds, steps)),
            mode=mode,
            max_k=max_k,
        )
        return np.asarray(tokens)


def _zeros_cache(slots, capacity, *, layers, config, dtype):
    shape = (slots, capacity, config.num_kv_heads, config.head_dim)  # [B, S, K, H]
    return {name: {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for name in layers}


def _grow_cache(cache, capacity):
    """Every layer's k and v [slots, S, K, H] padded with zeros to [slots, capacity, K, H]."""

    def grow(kv):
        return jnp.pad(kv, ((0, 0), (0, capacity - kv.shape[1]), (0, 0), (0, 0)))

    return jax.tree.map(grow, cache)


def _insert_rows(cache, prefill_cache, dst):
    """Copies every layer's prefill KV [b, bucket, K, H] into rows `dst` [b] of the slot cache
    [slots, capacity, K, H] (positions 0 to bucket - 1); out-of-range rows are dropped."""

    def insert(slot_kv, new_kv):
        bucket = new_kv.shape[1]
        return slot_kv.at[dst, :bucket].set(new_kv.astype(slot_kv.dtype), mode="drop")

    return jax.tree.map(insert, cache, prefill_cache)
