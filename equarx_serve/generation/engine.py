"""The step-wise engine: continuous batching one device step at a time.

    engine = StepEngine(DeviceRunner(prefill_engine), tokenizer=tok, slots=8)
    engine.add_request("a", prompt_ids, SamplingParams(max_tokens=32))  # ValueError if bad
    while engine.has_unfinished:
        for event in engine.step():  # TokenEvent, FinishedEvent, ErrorEvent
            ...
    engine.abort("a")  # FinishedEvent (cancelled), or None if it is not here

What `step()` does (the structure of vLLM's engine):
  1. If requests wait and slots are free, a PREFILL step: as many waiting requests as there
     are free slots (first come, first served) are prefilled as one batch (padded by
     `BatchPolicy`), their KV caches copied into their slots and their first tokens sampled.
     The cache first grows to the length bucket of the longest prompt + max_tokens among the
     requests it holds and those waiting (one decode program per capacity).
  2. Else, if requests run, a DECODE step: one token for each of the cache's first rows up to
     the highest running slot (`BatchPolicy.running_decode_shape`: a power of two of them, at
     least 2; idle rows among them too, their output unused), sampled per request (see
     `sampling.py`). Slots are taken lowest first, so a lone request decodes 2 rows.
  3. Each sampled token goes through the request's detokenizer: a request finishes on EOS or
     <end_of_turn> ("stop"), on a stop string ("stop": the text is cut before it, and it is
     never streamed), or at max_tokens ("length"); its slot goes to the next request.
  4. When nothing runs or waits, the KV cache is released.

Requests are checked when they are added (empty prompt, ids outside the vocabulary, prompt +
max_tokens beyond the context), so a bad one never reaches a batch. A step that fails fails the
requests in it (ErrorEvent), and the others run on; `FatalRunnerError` (the runner can run no
more steps, e.g. a lost process) propagates. Every step is reported to `on_step` with its
shape and all-reduce traffic (`StepRecord`), which the server's metrics read.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from equarx_serve.generation.batching import AllReduceTraffic, BatchPolicy, StepShape
from equarx_serve.generation.detokenizer import Detokenizer
from equarx_serve.generation.events import (
    ErrorEvent,
    Event,
    FinishedEvent,
    FinishReason,
    TokenEvent,
)
from equarx_serve.generation.kv_cache import SlotTable
from equarx_serve.generation.prefill import CompiledPrefill, PrefillEngine
from equarx_serve.generation.requests import Request
from equarx_serve.generation.runner import (
    CacheLost,
    CompiledDecode,
    FatalRunnerError,
    StepOutput,
)
from equarx_serve.generation.sampling import SamplingBatch, SamplingParams
from equarx_serve.generation.steps import DecodeStep, PrefillStep, ReleaseStep, Step

__all__ = ["RequestError", "Runner", "StepEngine", "StepRecord", "check_request"]

logger = logging.getLogger("equarx_serve.generation")


class Runner(Protocol):
    """What runs the steps: `runner.DeviceRunner`, or `replicated.ReplicatedRunner`."""

    engine: PrefillEngine

    def run(self, step: Step) -> StepOutput: ...


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One device step: its padded shape, its all-reduces, its device time, how many
    requests it served and the compiled program it ran."""

    shape: StepShape
    traffic: AllReduceTraffic
    device_ms: float
    requests: int
    program: CompiledPrefill | CompiledDecode | None


class RequestError(ValueError):
    """Why a request cannot run; `field` names the part of the request at fault ("prompt",
    "max_tokens", "params") and `code` the kind, where it has one (the server answers both)."""

    def __init__(self, message: str, field: str, code: str | None = None):
        super().__init__(message)
        self.field = field
        self.code = code


def check_request(
    prompt: Sequence[int], params: SamplingParams, *, vocab_size: int, max_context: int
) -> None:
    """RequestError (a ValueError) if a request cannot run: params that are not
    SamplingParams, an empty prompt, ids outside the vocabulary, or a prompt + max_tokens
    longer than max_context."""
    if not isinstance(params, SamplingParams):
        raise RequestError(f"params must be SamplingParams, got {type(params).__name__}", "params")
    if len(prompt) == 0:
        raise RequestError("empty prompt: every prompt needs at least one token", "prompt")
    bad = [t for t in prompt if not (isinstance(t, (int, np.integer)) and 0 <= t < vocab_size)]
    if bad:
        message = f"prompt token ids must be ints in [0, {vocab_size}): got {bad[:5]}"
        raise RequestError(message, "prompt", "invalid_token_id")
    total = len(prompt) + params.max_tokens
    if total > max_context:
        raise RequestError(
            f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} = {total} is "
            f"longer than the model's maximum context of {max_context} tokens",
            "max_tokens",
            "context_length_exceeded",
        )


class StepEngine:
    """Continuous batching on `slots` rows of a KV cache (see module doc).

    Args:
      runner: Runs the device steps.
      tokenizer: Decodes generated tokens.
      slots: The most requests decoded together.
      stop_token_ids: Tokens that end a request (EOS, <end_of_turn>).
      on_step: Called with every step's `StepRecord`.
      clock: Seconds (time.perf_counter); request timings use it.
    """

    def __init__(
        self,
        runner: Runner,
        *,
        tokenizer: Any,
        slots: int,
        stop_token_ids: Iterable[int] = (),
        on_step: Callable[[StepRecord], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.runner = runner
        self.prefill_engine = runner.engine
        self.policy = BatchPolicy(runner.engine)
        self.tokenizer = tokenizer
        self.stop_token_ids = frozenset(stop_token_ids)
        self.vocab_size = runner.engine.config.vocab_size
        self.max_context = runner.engine.max_length
        self.slots: SlotTable[Request] = SlotTable(slots, self.policy.decode_shape(slots).rows)
        self.on_step = on_step
        self.clock = clock
        self._waiting: collections.deque[Request] = collections.deque()
        self._requests: dict[Hashable, Request] = {}

    # -- requests ----------------------------------------------------------------------------

    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """ValueError if this request cannot run (see `check_request`)."""
        check_request(prompt, params, vocab_size=self.vocab_size, max_context=self.max_context)

    def add_request(
        self,
        request_id: Hashable,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        arrived: float | None = None,
    ) -> None:
        """Queues a request (after `check`; ValueError if it cannot run or the id is taken).
        `arrived`: when it arrived (`clock` seconds; default now), for its timings."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already here")
        self.check(prompt, params)
        request = Request(
            request_id,
            [int(t) for t in prompt],
            params,
            Detokenizer(self.tokenizer, params.stop),
            arrived=self.clock() if arrived is None else arrived,
        )
        self._requests[request_id] = request
        self._waiting.append(request)

    def abort(self, request_id: Hashable) -> FinishedEvent | None:
        """Ends a waiting or running request as cancelled (None if it is not here)."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.slot is None:
            self._waiting.remove(request)
        event = self._finish(request, FinishReason.CANCELLED)
        self._release_if_idle()
        return event

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._requests) - len(self._waiting)

    @property
    def room(self) -> int:
        """Requests that could be admitted at the next step beyond those waiting."""
        return len(self.slots.free()) - len(self._waiting)

    # -- steps -------------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """Runs one prefill or decode step (see module doc) and returns its events."""
        if self._waiting and self.slots.free():
            events = self._prefill_step()
        elif self.num_running:
            events = self._decode_step()
        else:
            events = []
        self._release_if_idle()
        return events

    def _prefill_step(self) -> list[Event]:
        free = self.slots.free()
        admitted = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
        live = [*admitted, *self._waiting, *(r for _, r in self.slots.running())]
        capacity = self.prefill_engine.bucket_for(max(r.context for r in live))
        self.slots.capacity = max(self.slots.capacity, capacity)
        shape = self.policy.prefill_shape([len(r.prompt) for r in admitted])
        padding = shape.rows - len(admitted)
        rows: list[tuple[SamplingParams, int] | None] = [(r.params, r.produced) for r in admitted]
        prompts = [tuple(r.prompt) for r in admitted]
        step = PrefillStep(
            prompts=(*prompts, *[prompts[0]] * padding),
            slots=(*free[: len(admitted)], *[self.slots.rows] * padding),
            cache_rows=self.slots.rows,
            capacity=self.slots.capacity,
            sampling=SamplingBatch.for_rows([*rows, *[None] * padding], self.vocab_size),
        )
        try:
            output = self._run(step, shape, len(admitted))
        except FatalRunnerError:
            raise
        except Exception as e:
            return self._fail(admitted, e, cache_lost=isinstance(e, CacheLost))
        events: list[Event] = []
        for slot, request, token in zip(free, admitted, output.tokens.tolist(), strict=False):
            request.slot, request.prefill_ms = slot, output.device_ms
            self.slots.assign(slot, request, len(request.prompt))
            self.slots.set_next_token(slot, token)
            events += self._accept(request, token)
        return events

    def _decode_step(self) -> list[Event]:
        running = self.slots.running()
        shape = self.policy.running_decode_shape(running[-1][0], self.slots.rows)
        rows: list[tuple[SamplingParams, int] | None] = [None] * shape.rows
        for slot, request in running:
            rows[slot] = (request.params, request.produced)
        tokens, lengths = self.slots.decode_inputs()
        step = DecodeStep(
            tuple(tokens[: shape.rows]),
            tuple(lengths[: shape.rows]),
            SamplingBatch.for_rows(rows, self.vocab_size),
        )
        try:
            output = self._run(step, shape, len(running))
        except FatalRunnerError:
            raise
        except Exception as e:  # the step was given the cache: it is gone
            return self._fail([], e, cache_lost=True)
        events: list[Event] = []
        for slot, request in running:
            token = int(output.tokens[slot])
            self.slots.advance(slot, token)
            events += self._accept(request, token)
        return events

    def _run(self, step: Step, shape: StepShape, requests: int) -> StepOutput:
        """Runs a step and reports its `StepRecord`."""
        output = self.runner.run(step)
        if self.on_step is not None:
            self.on_step(
                StepRecord(
                    shape=shape,
                    traffic=self.policy.traffic(shape),
                    device_ms=output.device_ms,
                    requests=requests,
                    program=output.program,
                )
            )
        return output

    def _fail(self, requests: list[Request], error: Exception, *, cache_lost: bool) -> list[Event]:
        """ErrorEvents for the requests of a failed step, and for every running one when the
        KV cache is lost."""
        logger.error("a step failed (%s); failing its requests", error, exc_info=error)
        failed = list(requests)
        if cache_lost:
            failed += [r for _, r in self.slots.running()]
            self.slots.capacity = 0
        message = f"{type(error).__name__}: {error}"
        events: list[Event] = []
        for request in failed:
            if request.slot is not None:
                self.slots.release(request.slot)
            del self._requests[request.request_id]
            events.append(ErrorEvent(request.request_id, message))
        return events

    def _accept(self, request: Request, token: int) -> list[Event]:
        """One sampled token of a running request: its events."""
        request.produced += 1
        if request.first_token_at is None:
            request.first_token_at = self.clock()
        if token in self.stop_token_ids:
            return [self._finish(request, FinishReason.STOP)]
        last = request.produced >= request.params.max_tokens
        delta = request.detokenizer.add(token, last=last)
        events: list[Event] = []
        if delta.text or not delta.stopped:
            events.append(TokenEvent(request.request_id, token, delta.text))
        if delta.stopped:
            events.append(self._finish(request, FinishReason.STOP))
        elif last:
            events.append(self._finish(request, FinishReason.LENGTH))
        return events

    def _finish(self, request: Request, reason: FinishReason) -> FinishedEvent:
        if request.slot is not None:
            self.slots.release(request.slot)
        del self._requests[request.request_id]
        completion = request.completion(reason, self.clock())
        return FinishedEvent(request.request_id, completion, request.detokenizer.unsent())

    def _release_if_idle(self) -> None:
        if not self._requests and self.slots.capacity:
            self.runner.run(ReleaseStep())
            self.slots.capacity = 0
