"""The OpenAI serving logic: a validated body in, a completion (or its event stream) out.

For `POST /v1/completions` and `/v1/chat/completions`: the body's options are checked and
turned into `SamplingParams` (OpenAI's defaults and limits), the prompt is tokenized off the
event loop (the chat template for chat, where message text never becomes a control token) and
checked against the context, the request goes to the worker's queue, and its events
(`generation.events`) become one JSON response or server-sent events in OpenAI's chunk format
ending with `data: [DONE]`. A completion may have several prompts (a list of strings or of
token-id lists): one job each, answered as the choices of one response. A client that goes
away (a closed stream, or a disconnect at any time while a non-streamed request waits)
cancels its jobs, queued or running. Errors never carry exception text: an internal failure
is logged with the request id, and the client gets the id.
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

from equarx_serve.generation.engine import RequestError
from equarx_serve.generation.events import (
    Completion,
    ErrorEvent,
    ErrorKind,
    Event,
    TokenEvent,
)
from equarx_serve.generation.sampling import SamplingParams
from equarx_serve.generation.text import encode_chat
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

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


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


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
SHUTTING_DOWN = "the server is shutting down; retry on another replica"


def event_error(event: ErrorEvent, *, draining: bool) -> APIError:
    """The HTTP error for a request's ErrorEvent (`draining`: the server is shutting down)."""
    if event.kind == ErrorKind.INVALID_REQUEST:
        return bad_request(event.message)
    if event.kind == ErrorKind.UNAVAILABLE and draining:
        return unavailable(SHUTTING_DOWN, "shutting_down")
    if event.kind == ErrorKind.UNAVAILABLE:
        return unavailable(f"the engine is unavailable: {event.message}", "engine_unavailable")
    logger.error("%s: generation failed: %s", event.request_id, event.message)
    message = f"generation failed (request {event.request_id}; the server log has the cause)"
    return APIError(500, message, type="server_error")


def check_text(text: str, param: str) -> str:
    """400 unless `text` is valid Unicode (a lone UTF-16 surrogate from a JSON \\ud83d escape
    is not): the tokenizer and the JSON answer need UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(
            f"{param} is not valid Unicode: {e.reason} at character {e.start}",
            param,
            "invalid_unicode",
        ) from None
    return text


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(completions: list[Completion]) -> dict[str, int]:
    prompt = sum(len(c.prompt_tokens) for c in completions)
    generated = sum(len(c.tokens) for c in completions)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }


def _timings(job: Job, completion: Completion, done_at: float) -> dict[str, float]:
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
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise bad_request("prompt must not be empty", "prompt")
        if len(prompts) > self.limits.max_queue:
            raise bad_request(
                f"at most {self.limits.max_queue} prompts per request, got {len(prompts)}",
                "prompt",
            )
        token_lists = []
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            if not prompt:
                raise bad_request(f"{param} must not be empty", param)
            if isinstance(prompt, str):
                text = check_text(prompt, param)
                prompt = await asyncio.to_thread(self.tokenizer.encode, text)
            self._check_prompt(prompt, param)
            token_lists.append(prompt)
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        longest = max(len(tokens) for tokens in token_lists)
        params = self._sampling_params(body, longest, max_tokens)
        return await self._answer(COMPLETIONS, request, body, token_lists, params)

    async def chat_completions(self, body: ChatBody, request: Request) -> Response:
        self._check_model(body)
        messages = [
            {"role": m.role, "content": check_text(m.text, f"messages.{i}.content")}
            for i, m in enumerate(body.messages)
        ]
        if not any(m["content"] for m in messages):
            raise bad_request("every message is empty", "messages")
        try:
            tokens = await asyncio.to_thread(encode_chat, self.tokenizer, messages)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        self._check_prompt(tokens, "messages")
        max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        params = self._sampling_params(body, len(tokens), max_tokens)
        return await self._answer(CHAT, request, body, [tokens], params)

    # -- validation --------------------------------------------------------------------------

    def _check_model(self, body: SamplingBody) -> None:
        for name, value in (body.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise bad_request(
                    f"{name}={json.dumps(value)[:60]} is not supported by this server",
                    name,
                    "unsupported_parameter",
                )
        if body.model is not None:
            check_text(body.model, "model")
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
        # The body's ranges (max_tokens >= 1, temperature, top_p, top_k, n = 1, at most
        # MAX_STOP_SEQUENCES stop strings) were checked by the protocol models.
        context = self.limits.context
        if max_tokens is None:
            max_tokens = min(self.limits.default_max_tokens, context - prompt_len)
        if prompt_len + max_tokens > context:
            raise bad_request(
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} in the completion). Please reduce the prompt or max_tokens.",
                "max_tokens",
                "context_length_exceeded",
            )
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stop):
            raise bad_request("stop sequences must not be empty strings", "stop")
        for text in stop:
            check_text(text, "stop")
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

    def _submit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        events: asyncio.Queue,
        group: str = "",
    ) -> Job:
        try:
            self.worker.engine.check(prompt, params)
        except RequestError as e:
            raise bad_request(str(e), e.field, e.code) from None
        job = Job(
            request_id=request_id,
            prompt=prompt,
            params=params,
            loop=asyncio.get_running_loop(),
            events=events,
            arrived=time.perf_counter(),
            group=group,
        )
        try:
            self.worker.submit(job)
        except Unavailable as e:
            raise unavailable(f"the engine is unavailable: {e}", "engine_unavailable") from None
        except Draining:
            raise unavailable(SHUTTING_DOWN, "shutting_down") from None
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
        return event_error(event, draining=self.worker.draining and self.worker.failure is None)

    def _abandon(self, job: Job) -> None:
        """The client went away before the end: free its slot."""
        self.metrics.in_flight.dec()
        self.metrics.finished.labels("cancelled").inc()
        self.worker.cancel(job)
        logger.info("%s: client disconnected; cancelled", job.request_id)

    def _submit_all(
        self, endpoint: Endpoint, prompts: list[list[int]], params: SamplingParams
    ) -> tuple[str, list[Job], asyncio.Queue]:
        """One job per prompt, all posting to one event queue: (the response id, the jobs,
        the queue). If one cannot be queued, the others are cancelled and its error raised."""
        request_id = endpoint.id_prefix + uuid.uuid4().hex[:24]
        events: asyncio.Queue[Event] = asyncio.Queue()
        jobs: list[Job] = []
        try:
            for i, prompt in enumerate(prompts):
                job_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                jobs.append(self._submit(job_id, prompt, params, events, group=request_id))
        except APIError:
            for job in jobs:
                self._abandon(job)
            raise
        return request_id, jobs, events

    async def _answer(
        self,
        endpoint: Endpoint,
        request: Request,
        body: SamplingBody,
        prompts: list[list[int]],
        params: SamplingParams,
    ) -> Response:
        request_id, jobs, events = self._submit_all(endpoint, prompts, params)
        pending = {job.request_id: job for job in jobs}  # those without their last event
        if body.stream:
            return StreamingResponse(
                self._stream(endpoint, request_id, jobs, pending, events, body.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        collect = asyncio.ensure_future(self._collect(jobs, pending, events))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            collect.cancel()  # no-op once done
            for job in pending.values():  # the client went away, or one job failed
                self._abandon(job)
        if not collect.done():  # the client went away: `cancel` only asked it to stop
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finished = collect.result()  # raises a failed job's APIError
        choices = []
        for index, (_, completion, _) in enumerate(finished):
            choice: dict[str, Any] = {"index": index, "finish_reason": completion.finish_reason}
            if endpoint.chat:
                choice["message"] = {"role": "assistant", "content": completion.text}
            else:
                choice |= {"text": completion.text, "logprobs": None}
            choices.append(choice)
        return JSONResponse(
            {
                "id": request_id,
                "object": endpoint.object,
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": _usage([completion for _, completion, _ in finished]),
                "timings": _timings(*finished[0]),
            }
        )

    async def _collect(
        self, jobs: list[Job], pending: dict[str, Job], events: asyncio.Queue
    ) -> list[tuple[Job, Completion, float]]:
        """Every job's (job, completion, finished at), in prompt order, once all finished;
        the first error is raised (the jobs still in `pending` are left to the caller)."""
        finished: dict[str, tuple[Job, Completion, float]] = {}
        while pending:
            event = await events.get()
            job = pending.get(event.request_id)
            if job is None or isinstance(event, TokenEvent):
                continue
            del pending[event.request_id]
            if isinstance(event, ErrorEvent):
                raise self._failed(event)
            finished[job.request_id] = (
                job,
                event.completion,
                self._finished(job, event.completion),
            )
        return [finished[job.request_id] for job in jobs]

    async def _stream(
        self,
        endpoint: Endpoint,
        request_id: str,
        jobs: list[Job],
        pending: dict[str, Job],
        events: asyncio.Queue,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        head = {
            "id": request_id,
            "object": endpoint.chunk_object,
            "created": int(time.time()),
            "model": self.model_name,
        }
        index = {job.request_id: i for i, job in enumerate(jobs)}

        def chunk(i: int, text: str | None, finish_reason: str | None = None) -> bytes:
            if endpoint.chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if i < 0 else {}
                if text:
                    delta["content"] = text
                choice = {"index": max(i, 0), "delta": delta, "finish_reason": finish_reason}
            else:
                choice = {
                    "index": i,
                    "text": text or "",
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            return _sse(head | {"choices": [choice]})

        finished: list[tuple[Job, Completion, float]] = []
        try:
            if endpoint.chat:
                yield chunk(-1, None)  # the role, first
            while pending:
                event = await events.get()
                job = pending.get(event.request_id)
                if job is None:
                    continue
                if isinstance(event, TokenEvent):
                    if event.text:
                        yield chunk(index[job.request_id], event.text)
                    continue
                del pending[event.request_id]
                if isinstance(event, ErrorEvent):
                    error = self._failed(event)
                    self.metrics.errors.labels(endpoint.path, error.type).inc()
                    yield _sse(error.body())
                    break
                completion = event.completion
                finished.append((job, completion, self._finished(job, completion)))
                if event.unsent:
                    yield chunk(index[job.request_id], event.unsent)
                yield chunk(index[job.request_id], None, completion.finish_reason)
            else:
                if include_usage:
                    usage = _usage([completion for _, completion, _ in finished])
                    timings = _timings(*min(finished, key=lambda f: index[f[0].request_id]))
                    yield _sse(head | {"choices": [], "usage": usage, "timings": timings})
            yield _sse("[DONE]")
        finally:
            for job in pending.values():  # the client went away, or another job failed
                self._abandon(job)
            pending.clear()
