"""Batch text generation: `Generator`, a loop over the step-wise engine.

    engine = PrefillEngine.from_name("gemma3-270m", tp=2, all_reduce="equarx-int8")
    generator = Generator(engine, max_batch=8)
    prompt = generator.tokenizer.encode(chat_prompt([{"role": "user", "content": "Hi!"}]))
    [completion] = generator.generate([prompt], SamplingParams(max_tokens=32))
    completion.text, completion.finish_reason, completion.decode_tokens_per_s

`generate` checks every request first (non-empty prompt, ids in the vocabulary, prompt +
max_tokens <= engine.max_length), then runs a `StepEngine` (`equarx_serve/generation/engine.py`:
continuous batching, one prefill or decode step at a time) on min(len(prompts), max_batch)
slots until every request is done, calling `on_token` and `on_finish` as the events come. The
parts (sampler, detokenizer with stop strings, KV-cache slots, batch padding, the device
runner) are in `equarx_serve/generation/`.

The all-reduce each phase uses: prefill reduces [B, bucket, D] messages, decode [B, 1, D]
ones; `equarx-int8` sends messages below its `min_size_bytes` to `psum`, which is where every
decode step's messages go (`Generator.all_reduce_usage`, logged once per engine and setting).

With a `ReplicatedRunner` (`equarx_serve/generation/replicated.py`) the same loop drives a mesh
that spans processes: this process decides every step, the others run it too.
"""

from __future__ import annotations

import collections
import logging
import time
import weakref
from collections.abc import Callable, Sequence

from equarx_serve.generation.batching import AllReduceUsage, BatchPolicy
from equarx_serve.generation.engine import Runner, StepEngine, StepRecord, check_request
from equarx_serve.generation.events import (
    Completion,
    ErrorEvent,
    FinishedEvent,
    FinishReason,
)
from equarx_serve.generation.prefill import PrefillEngine
from equarx_serve.generation.runner import DeviceRunner
from equarx_serve.generation.sampling import SamplingParams
from equarx_serve.generation.text import byte_tokenizer, chat_prompt

__all__ = [
    "Completion",
    "FinishReason",
    "GenerationError",
    "Generator",
    "SamplingParams",
    "byte_tokenizer",
    "chat_prompt",
]

logger = logging.getLogger("equarx_serve.generation.generator")

DEFAULT_PARAMS = SamplingParams()
OnToken = Callable[[int, int, str], bool | None]
OnFinish = Callable[[int, Completion], None]

# The all-reduce usage already logged, per engine.
_LOGGED_USAGE: weakref.WeakKeyDictionary[PrefillEngine, set] = weakref.WeakKeyDictionary()


class GenerationError(RuntimeError):
    """A step of `generate` failed (the device raised); the other requests were cancelled."""


class Generator:
    """Batched, streaming text generation on a `PrefillEngine` (see the module doc).

    Args:
      engine: The model, mesh and all-reduce; its tokenizer (or, for random-init models
        without one, `byte_tokenizer(vocab_size)`) decodes text and gives the stop ids.
      max_batch: The most requests decoded together; further requests wait for a free slot.
      runner: Runs the device steps (default: a `DeviceRunner` on `engine`).
    """

    def __init__(self, engine: PrefillEngine, *, max_batch: int = 8, runner: Runner | None = None):
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        self.engine = engine
        self.max_batch = max_batch
        self.runner = runner if runner is not None else DeviceRunner(engine)
        self.policy = BatchPolicy(engine)
        vocab = engine.config.vocab_size
        self.tokenizer = engine.tokenizer if engine.tokenizer is not None else byte_tokenizer(vocab)
        special = getattr(self.tokenizer, "special_tokens", {})
        ids = (self.tokenizer.eos_id, special.get("end_of_turn"))
        self.stop_token_ids = frozenset(i for i in ids if i is not None and i >= 0)

    @property
    def max_context(self) -> int:
        """The longest prompt + max_tokens a request may have (the engine's max_length)."""
        return self.engine.max_length

    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """ValueError if this request cannot run: an empty prompt, ids outside the vocabulary
        or a prompt + max_tokens longer than `max_context`."""
        check_request(
            prompt,
            params,
            vocab_size=self.engine.config.vocab_size,
            max_context=self.max_context,
        )

    def all_reduce_usage(self, batch: int, prompt_len: int) -> AllReduceUsage:
        """Which all-reduce prefill and decode messages actually take, for `batch` prompts of
        `prompt_len` tokens, padded as every step pads them (`BatchPolicy`)."""
        return self.policy.usage(batch, prompt_len)

    def new_engine(
        self, slots: int, *, on_step: Callable[[StepRecord], None] | None = None
    ) -> StepEngine:
        """A step engine on this generator's runner, tokenizer and stop ids."""
        return StepEngine(
            self.runner,
            tokenizer=self.tokenizer,
            slots=slots,
            stop_token_ids=self.stop_token_ids,
            on_step=on_step,
        )

    def log_usage(self, batch: int, prompt_len: int) -> AllReduceUsage:
        """`all_reduce_usage`, logged once per engine and collective choice."""
        usage = self.all_reduce_usage(batch, prompt_len)
        pre, dec = usage.prefill, usage.decode
        logged = _LOGGED_USAGE.setdefault(self.engine, set())
        if (pre.uses, dec.uses) not in logged:
            logged.add((pre.uses, dec.uses))
            gate = "none" if usage.min_size_bytes is None else f"{usage.min_size_bytes} bytes"
            logger.info(
                "all-reduce %s (size gate %s): prefill messages %s = %d bytes -> %s; decode "
                "messages %s = %d bytes -> %s",
                *(usage.all_reduce, gate, list(pre.shape), pre.message_bytes, pre.uses),
                *(list(dec.shape), dec.message_bytes, dec.uses),
            )
        return usage

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
        params: SamplingParams | Sequence[SamplingParams] = DEFAULT_PARAMS,
        *,
        on_token: OnToken | None = None,
        on_finish: OnFinish | None = None,
    ) -> list[Completion]:
        """Generates a completion for every prompt (lists of token ids, BOS included), in
        batches of up to `max_batch` (see the module doc). `params`: one for all, or one per
        prompt. `on_token(request_index, token_id, text_delta)` is called for every generated
        token (not EOS / <end_of_turn>), with the newly streamable text (possibly "": text
        that may begin a stop string or an incomplete character is held back); returning
        False cancels that request. `on_finish(request_index, completion)` is called as each
        request finishes. Returns the completions in prompt order. ValueError for bad input,
        before anything runs; GenerationError if a device step fails."""
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

        slots = min(len(prompts), self.max_batch)
        self.log_usage(slots, max(len(q) for q in prompts))
        engine = self.new_engine(slots)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(i, prompt, p, arrived=start)
        results: dict[int, Completion] = {}

        def finished(event: FinishedEvent) -> None:
            results[event.request_id] = event.completion
            if on_finish is not None:
                on_finish(event.request_id, event.completion)

        while engine.has_unfinished:
            for event in engine.step():
                if isinstance(event, FinishedEvent):
                    finished(event)
                elif isinstance(event, ErrorEvent):
                    for i in range(len(prompts)):
                        engine.abort(i)
                    raise GenerationError(f"request {event.request_id}: {event.message}")
                elif on_token is not None:
                    wanted = on_token(event.request_id, event.token, event.text)
                    cancelled = engine.abort(event.request_id) if wanted is False else None
                    if cancelled is not None:
                        finished(cancelled)
        return [results[i] for i in range(len(prompts))]
