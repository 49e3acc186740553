"""The OpenAI serving logic: a validated body in, a completion (or its event stream) out.

For `POST /v1/completions` and `/v1/chat/completions`: the body's options are checked and
turned into `SamplingParams` (OpenAI's defaults and limits), the prompt is tokenized (the chat
template for chat) and checked against the context, the request goes to the worker's queue,
and its events (`generation.events`) become one JSON response or server-sent events in
OpenAI's chunk format ending with `data: [DONE]`. A client that goes away (a closed stream, or
a disconnect while a non-streamed request waits) cancels its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from equarx_serve.generation.events import (
    Completion,
    ErrorEvent,
    ErrorKind,
    FinishedEvent,
    TokenEvent,
)
from equarx_serve.generation.sampling import SamplingParams
from equarx_serve.generation.text import chat_prompt
from equarx_serve.server.metrics import ServerMetrics
from equarx_serve.server.protocol import (
    UNSUPPORTED,
    APIError,
    ChatBody,
    CompletionBody,
    SamplingBody,
    bad_request,
    unavailable,
)
from equarx_serve.server.worker import Draining, EngineWorker, Job, QueueFull, Unavailable

__all__ = ["CHAT", "COMPLETIONS", "Endpoint", "OpenAIServing", "ServingLimits"]

logger = logging.getLogger("equarx_serve.server")

MAX_STOP_SEQUENCES = 4  # as OpenAI
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DISCONNECT_POLL_S = 0.5  # a waiting non-streamed request checks its client this often


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """What differs between the two generation endpoints."""

    path: str
    id_prefix: str
    object: str
    chunk_object: str
    chat: bool


COMPLETIONS = Endpoint("/v1/completions", "cmpl-", "text_completion", "text_completion", False)
CHAT = Endpoint(
    "/v1/chat/completions", "chatcmpl-", "chat.completion", "chat.completion.chunk", True
)


@dataclasses.dataclass(frozen=True)
class ServingLimits:
    """context: prompt + completion tokens; max_prompt: the longest prompt; default_max_tokens:
    max_tokens of chat requests that give none (capped by the context); max_queue: requests
    that may wait."""

    context: int
    max_prompt: int
    default_max_tokens: int
    max_queue: int


def event_error(event: ErrorEvent) -> APIError:
    """The HTTP error for a request's ErrorEvent."""
    if event.kind == ErrorKind.INVALID_REQUEST:
        return bad_request(event.message)
    if event.kind == ErrorKind.UNAVAILABLE:
        return unavailable(f"the engine is unavailable: {event.message}", "engine_unavailable")
    return APIError(500, f"generation failed: {event.message}", type="server_error")


def _usage(completion: Completion) -> dict[str, int]:
    prompt, generated = len(completion.prompt_tokens), len(completion.tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }


def _timings(completion: Completion, job: Job, done_at: float) -> dict[str, float]:
    """Extension field "timings" (llama.cpp's server has one too): milliseconds."""
    ttft = (job.first_token_at or done_at) - job.arrived
    timings = {
        "queue_ms": 1e3 * max(0.0, ttft) - completion.time_to_first_token_ms,
        "prefill_ms": completion.prefill_ms,
        "time_to_first_token_ms": 1e3 * ttft,
        "decode_ms": completion.decode_ms,
        "decode_tokens_per_s": completion.decode_tokens_per_s,
        "total_ms": 1e3 * (done_at - job.arrived),
    }
    return {name: round(value, 3) for name, value in timings.items()}


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class OpenAIServing:
    """Completions and chat completions on an `EngineWorker` (see module doc)."""

    def __init__(
        self,
        worker: EngineWorker,
        metrics: ServerMetrics,
        tokenizer: Any,
        *,
        model_name: str,
        limits: ServingLimits,
    ):
        self.worker = worker
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits

    # -- the two endpoints -------------------------------------------------------------------

    async def completions(self, body: CompletionBody, request: Request) -> Response:
        self._check_model(body)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise bad_request(
                    f"prompt must be a string or a list of one string, got a list of "
                    f"{len(prompt)}; send one request per prompt (the server batches concurrent "
                    "requests)",
                    "prompt",
                )
            prompt = prompt[0]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        tokens = self.tokenizer.encode(prompt)
        self._check_prompt(tokens, "prompt")
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = self._sampling_params(body, len(tokens), max_tokens)
        return await self._answer(COMPLETIONS, request, body, tokens, params)

    async def chat_completions(self, body: ChatBody, request: Request) -> Response:
        self._check_model(body)
        if not body.messages:
            raise bad_request("messages must not be empty", "messages")
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        if not any(m["content"] for m in messages):
            raise bad_request("every message is empty", "messages")
        try:
            tokens = self.tokenizer.encode(chat_prompt(messages))  # BOS added here
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        self._check_prompt(tokens, "messages")
        max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        params = self._sampling_params(body, len(tokens), max_tokens)
        return await self._answer(CHAT, request, body, tokens, params)

    # -- validation --------------------------------------------------------------------------

    def _check_model(self, body: SamplingBody) -> None:
        for name, value in (body.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise bad_request(
                    f"{name}={json.dumps(value)[:60]} is not supported by this server",
                    name,
                    "unsupported_parameter",
                )
        if body.model is not None and body.model != self.model_name:
            raise APIError(
                404,
                f"The model {body.model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _check_prompt(self, tokens: list[int], param: str) -> None:
        limits = self.limits
        if len(tokens) > limits.max_prompt:
            limit = "the context length" if limits.max_prompt == limits.context - 1 else None
            raise bad_request(
                f"the prompt is {len(tokens)} tokens, longer than this server's limit of "
                f"{limits.max_prompt} ({limit or 'max_prompt_tokens'})",
                param,
                "context_length_exceeded",
            )

    def _sampling_params(
        self, body: SamplingBody, prompt_len: int, max_tokens: int | None
    ) -> SamplingParams:
        context = self.limits.context
        if body.n not in (None, 1):
            raise bad_request(f"n={body.n} is not supported: only n=1", "n", "unsupported_value")
        if max_tokens is None:
            max_tokens = min(self.limits.default_max_tokens, context - prompt_len)
        if max_tokens < 1:
            raise bad_request(
                f"max_tokens must be at least 1, got {max_tokens}",
                "max_tokens",
                "integer_below_min_value",
            )
        if prompt_len + max_tokens > context:
            raise bad_request(
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} in the completion). Please reduce the prompt or max_tokens.",
                "max_tokens",
                "context_length_exceeded",
            )
        temperature = 1.0 if body.temperature is None else body.temperature
        if not 0.0 <= temperature <= 2.0:
            raise bad_request(f"temperature must be in [0, 2], got {temperature}", "temperature")
        top_p = 1.0 if body.top_p is None else body.top_p
        if not 0.0 < top_p <= 1.0:
            raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
        if body.top_k is not None and body.top_k < 1:
            raise bad_request(f"top_k must be at least 1 (or absent), got {body.top_k}", "top_k")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOP_SEQUENCES:
            raise bad_request(
                f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stop)}", "stop"
            )
        if any(not s for s in stop):
            raise bad_request("stop sequences must not be empty strings", "stop")
        seed = secrets.randbits(31) if body.seed is None else body.seed
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_k=body.top_k,
                top_p=top_p,
                seed=seed,
                stop=tuple(stop),
            )
        except ValueError as e:
            raise bad_request(str(e)) from None

    # -- answering ---------------------------------------------------------------------------

    def _submit(self, endpoint: Endpoint, prompt: list[int], params: SamplingParams) -> Job:
        try:
            self.worker.engine.check(prompt, params)
        except ValueError as e:
            raise bad_request(str(e)) from None
        job = Job(
            request_id=endpoint.id_prefix + uuid.uuid4().hex[:24],
            prompt=prompt,
            params=params,
            loop=asyncio.get_running_loop(),
            events=asyncio.Queue(),
            arrived=time.perf_counter(),
        )
        try:
            self.worker.submit(job)
        except Unavailable as e:
            raise unavailable(f"the engine is unavailable: {e}", "engine_unavailable") from None
        except Draining:
            message = "the server is shutting down; retry on another replica"
            raise unavailable(message, "shutting_down") from None
        except QueueFull:
            message = (
                f"the server is busy: {self.limits.max_queue} requests are already queued; "
                "retry later"
            )
            raise unavailable(message, "queue_full") from None
        self.metrics.in_flight.inc()
        return job

    def _finished(self, job: Job, completion: Completion) -> float:
        """Accounts for a finished request; returns when."""
        done_at = time.perf_counter()
        m = self.metrics
        m.in_flight.dec()
        m.prompt_tokens.inc(len(completion.prompt_tokens))
        m.generated_tokens.inc(len(completion.tokens))
        m.finished.labels(completion.finish_reason).inc()
        m.prefill_seconds.observe(completion.prefill_ms / 1e3)
        if job.first_token_at is not None:
            m.ttft_seconds.observe(job.first_token_at - job.arrived)
        m.request_seconds.observe(done_at - job.arrived)
        if completion.tokens:
            m.decode_tokens_per_s.observe(completion.decode_tokens_per_s)
        logger.info(
            "%s: %d prompt + %d generated tokens, %s; to first token %.1f ms (prefill %.1f ms), "
            "decode %.1f ms (%.1f tok/s), total %.1f ms",
            job.request_id,
            len(completion.prompt_tokens),
            len(completion.tokens),
            completion.finish_reason,
            1e3 * ((job.first_token_at or done_at) - job.arrived),
            completion.prefill_ms,
            completion.decode_ms,
            completion.decode_tokens_per_s,
            1e3 * (done_at - job.arrived),
        )
        return done_at

    def _failed(self, event: ErrorEvent) -> APIError:
        self.metrics.in_flight.dec()
        return event_error(event)

    def _abandon(self, job: Job) -> None:
        """The client went away before the end: free its slot."""
        self.metrics.in_flight.dec()
        self.metrics.finished.labels("cancelled").inc()
        self.worker.cancel(job)
        logger.info("%s: client disconnected; cancelled", job.request_id)

    async def _answer(
        self,
        endpoint: Endpoint,
        request: Request,
        body: SamplingBody,
        prompt: list[int],
        params: SamplingParams,
    ) -> Response:
        job = self._submit(endpoint, prompt, params)
        if body.stream:
            return StreamingResponse(
                self._stream(endpoint, job, body.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        settled = False
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                if isinstance(event, ErrorEvent):
                    settled = True
                    raise self._failed(event)
                if isinstance(event, FinishedEvent):
                    settled = True
                    break
        finally:
            if not settled:
                self._abandon(job)
        completion = event.completion
        done_at = self._finished(job, completion)
        choice: dict[str, Any] = {"index": 0, "finish_reason": completion.finish_reason}
        if endpoint.chat:
            choice["message"] = {"role": "assistant", "content": completion.text}
        else:
            choice |= {"text": completion.text, "logprobs": None}
        return JSONResponse(
            {
                "id": job.request_id,
                "object": endpoint.object,
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [choice],
                "usage": _usage(completion),
                "timings": _timings(completion, job, done_at),
            }
        )

    async def _stream(
        self, endpoint: Endpoint, job: Job, include_usage: bool
    ) -> AsyncIterator[bytes]:
        head = {
            "id": job.request_id,
            "object": endpoint.chunk_object,
            "created": int(time.time()),
            "model": self.model_name,
        }

        def chunk(text: str | None, finish_reason: str | None = None, first: bool = False) -> bytes:
            if endpoint.chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
                if text:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            else:
                choice = {
                    "index": 0,
                    "text": text or "",
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            return _sse(head | {"choices": [choice]})

        settled = False
        try:
            if endpoint.chat:
                yield chunk(None, first=True)
            while True:
                event = await job.events.get()
                if isinstance(event, TokenEvent):
                    if event.text:
                        yield chunk(event.text)
                    continue
                settled = True
                if isinstance(event, ErrorEvent):
                    error = self._failed(event)
                    self.metrics.errors.labels(endpoint.path, error.type).inc()
                    yield _sse(error.body())
                    break
                completion = event.completion
                done_at = self._finished(job, completion)
                if event.unsent:
                    yield chunk(event.unsent)
                yield chunk(None, completion.finish_reason)
                if include_usage:
                    timings = _timings(completion, job, done_at)
                    yield _sse(
                        head | {"choices": [], "usage": _usage(completion), "timings": timings}
                    )
                break
            yield _sse("[DONE]")
        finally:
            if not settled:
                self._abandon(job)
