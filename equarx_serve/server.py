"""`equarx-serve serve`: an OpenAI-compatible HTTP server over the tensor-parallel generator.

    app = create_app(Generator(engine, max_batch=8), model_name="gemma3-270m", max_queue=64)
    uvicorn.run(app)  # or: equarx-serve serve --model gemma3-270m --tp 2

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `"stream": true` as
server-sent events in OpenAI's chunk format, ending with `data: [DONE]`), `GET /v1/models`,
`GET /health`, `GET /metrics` (Prometheus text, see `server_metrics.py`).

Scheduling: one worker thread owns the devices. Requests wait in a bounded queue (`max_queue`;
a full queue answers 503 at once); the worker takes up to `max_batch` waiting requests (after
waiting `batch_window_s` for more to arrive) and runs them in ONE `Generator.generate` call, so
concurrent users share every device step. Requests that arrive while it runs join it (its
`more`): each is prefilled as soon as a slot is free, not when the whole batch ends (at most
`max_batch` run at once). Tokens go back to each request's asyncio queue through
`loop.call_soon_threadsafe`; a client that disconnects makes `on_token` return False for its
request, which frees its slot. `Scheduler.drain` (SIGTERM/SIGINT through
`serve`) refuses new requests with 503 and lets queued and running ones finish.

Errors follow OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for bad
input (malformed JSON, missing or mistyped fields, empty or too long prompts, bad sampling
values, n != 1), 404 for an unknown model or path, 503 when busy or draining, 500 when
generation fails (the server keeps serving).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import queue
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from equarx_serve.server_metrics import ServerMetrics

logger = logging.getLogger("equarx_serve.server")

DEFAULT_MAX_QUEUE = 64
DEFAULT_BATCH_WINDOW_S = 0.005  # a burst of requests sent together lands in one batch
MAX_STOP_SEQUENCES = 4  # as OpenAI
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
USAGE_PROMPT_TOKENS = 128  # the prompt length the info metric's all-reduce usage is shown for
DISCONNECT_POLL_S = 0.5  # a waiting non-streamed request checks its client this often
# Requests that may join one generate call; then it ends as its last ones finish and the next
# starts afresh (under steady load one call would otherwise run, and its lists grow, forever).
MAX_JOBS_PER_CALL = 4096
ENDPOINTS = (
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
)  # fmt: skip


# -- errors --------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered as OpenAI does: `status` and `{"error": {...}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code,
        )  # fmt: skip

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message, "type": self.type, "param": self.param,
                "code": self.code,
            }
        }  # fmt: skip


def _bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# -- request bodies ----------------------------------------------------------------------------
class _Strict(BaseModel):
    # Strict: "5" is not an int, true is not a number; unknown fields are ignored (clients send
    # e.g. "user" or "logprobs": null), except the features below when they ask for something.
    model_config = ConfigDict(strict=True, extra="ignore")


# OpenAI parameters this server does not implement: 400 unless set to their no-op value.
UNSUPPORTED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []), "functions": (None, []), "response_format": (None, {"type": "text"}),
}  # fmt: skip


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingBody(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # extras: checked by UNSUPPORTED
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None


class CompletionBody(_SamplingBody):
    prompt: str | list[str]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]


class ChatBody(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens


# -- the worker ------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class Job:
    """One request on its way through the worker. `events` receives ("token", id, text),
    then ("done", Completion) or ("error", exception)."""

    request_id: str
    prompt: list[int]
    params: Any  # decode.SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float  # time.perf_counter()
    cancelled: bool = False
    finished: bool = False  # its completion or error has been posted
    first_token_at: float | None = None

    def post(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled = True


class QueueFull(Exception):
    pass


class Draining(Exception):
    pass


_STOP = object()


class Scheduler:
    """The worker thread and its bounded queue (see the module doc)."""

    def __init__(
        self,
        generator: Any,
        metrics: ServerMetrics,
        *,
        max_batch: int,
        max_queue: int,
        batch_window_s: float = DEFAULT_BATCH_WINDOW_S,
    ):
        if max_batch < 1 or max_queue < 1 or batch_window_s < 0:
            raise ValueError(
                f"need max_batch >= 1, max_queue >= 1, batch_window_s >= 0; got {max_batch}, "
                f"{max_queue}, {batch_window_s}"
            )
        self.generator, self.metrics = generator, metrics
        self.max_batch, self.batch_window_s = max_batch, batch_window_s
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        self.draining = False
        self._stopping = False  # `_more` took the stop mark: exit after the running call
        self.generate_calls = 0

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="equarx-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`; Draining or QueueFull at once when it cannot be taken."""
        if self.draining or not self.alive:
            raise Draining
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull from None
        self.metrics.queue_depth.set(self._queue.qsize())

    def drain(self) -> None:
        """Refuse new requests from now on; queued and running ones still finish."""
        if not self.draining:
            logger.info("draining: new requests get 503, %d queued", self._queue.qsize())
        self.draining = True

    def stop(self, timeout_s: float | None = None) -> None:
        """Drain, let the worker finish everything queued, join it."""
        self.drain()
        if not self.alive:
            return
        self._queue.put(_STOP)  # after every queued job (FIFO)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the worker did not finish within %s s", timeout_s)

    def _take_batch(self) -> tuple[list[Job], bool]:
        """Blocks for one job, then takes more for up to `batch_window_s`, at most
        `max_batch`. Returns (jobs, stop)."""
        first = self._queue.get()
        if first is _STOP:
            return [], True
        jobs, stop = [first], False
        deadline = time.perf_counter() + self.batch_window_s
        while len(jobs) < self.max_batch:
            try:
                job = self._queue.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                break
            if job is _STOP:
                stop = True
                break
            jobs.append(job)
        self.metrics.queue_depth.set(self._queue.qsize())
        return [j for j in jobs if not j.cancelled], stop

    def _run(self) -> None:
        while True:
            jobs, stop = self._take_batch()
            try:
                if jobs:
                    self._generate(jobs)
            except Exception as e:  # the worker must outlive any failure
                logger.exception("worker error")
                for job in jobs:
                    if not job.finished:
                        job.finished = True
                        job.post(("error", e))
            if stop or self._stopping:
                return

    def _more(self, jobs: list[Job], n: int) -> list[tuple[list[int], Any]]:
        """Up to n queued jobs (fewer when `max_batch` of `jobs` still run) to join the running
        generate call: appended to `jobs`, so their request indices follow."""
        running = sum(not j.finished for j in jobs)
        n = min(n, self.max_batch - running, MAX_JOBS_PER_CALL - len(jobs))
        taken: list[Job] = []
        while len(taken) < n and not self._stopping:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is _STOP:  # nothing is queued after it (draining refuses new jobs)
                self._stopping = True
            elif not job.cancelled:
                taken.append(job)
        if not taken:
            return []
        now = time.perf_counter()
        for job in taken:
            self.metrics.queue_seconds.observe(now - job.arrived)
        self.metrics.queue_depth.set(self._queue.qsize())
        # Prefilled together, like a new call's batch: counted as one.
        self.metrics.observe_batch(len(taken), max(len(j.prompt) for j in taken))
        logger.info(
            "%d joined the running batch: %s", len(taken),
            ", ".join(f"{j.request_id} ({len(j.prompt)} tok)" for j in taken),
        )  # fmt: skip
        jobs += taken
        return [(j.prompt, j.params) for j in taken]

    def _generate(self, jobs: list[Job]) -> None:
        start = time.perf_counter()
        for job in jobs:
            self.metrics.queue_seconds.observe(start - job.arrived)

        def on_token(i: int, token: int, text: str) -> bool:
            job = jobs[i]
            if job.cancelled:
                return False
            if job.first_token_at is None:
                job.first_token_at = time.perf_counter()
            job.post(("token", token, text))
            return True

        def on_finish(i: int, completion: Any) -> None:
            jobs[i].finished = True
            if completion.finish_reason == "error":  # a joining request the generator refused
                jobs[i].post(("error", ValueError(completion.error)))
            else:
                jobs[i].post(("done", completion))  # at once, not when the whole batch is done

        self.generate_calls += 1
        self.metrics.observe_batch(len(jobs), max(len(j.prompt) for j in jobs))
        logger.info(
            "batch of %d: %s", len(jobs), ", ".join(f"{j.request_id} ({len(j.prompt)} tok)"
                                                   for j in jobs),
        )  # fmt: skip
        try:
            completions = self.generator.generate(
                [j.prompt for j in jobs], [j.params for j in jobs], on_token=on_token,
                on_finish=on_finish, more=functools.partial(self._more, jobs),
            )  # fmt: skip
        except Exception as e:
            untouched = [j for j in jobs if j.first_token_at is None and not j.finished]
            if len(jobs) > 1 and len(untouched) == len(jobs):
                # One bad request must not fail the others: run each alone.
                logger.warning("batch of %d failed (%s); running each request alone", len(jobs), e)
                for job in jobs:
                    self._generate([job])
                return
            logger.exception("generation failed for %s", [j.request_id for j in jobs])
            for job in jobs:
                if not job.finished:
                    job.finished = True
                    job.post(("error", e))
            return
        for job, completion in zip(jobs, completions, strict=True):
            if not job.finished:
                job.finished = True
                job.post(("done", completion))


# -- responses --------------------------------------------------------------------------------
def _usage(completion: Any) -> dict[str, int]:
    prompt, generated = len(completion.prompt_tokens), len(completion.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": generated,
            "total_tokens": prompt + generated}  # fmt: skip


def _timings(completion: Any, job: Job, done_at: float) -> dict[str, float]:
    """Extension field "timings" (llama.cpp's server has one too): milliseconds."""
    ttft = (job.first_token_at or done_at) - job.arrived
    return {
        "queue_ms": round(1e3 * max(0.0, ttft) - completion.time_to_first_token_ms, 3),
        "prefill_ms": round(completion.prefill_ms, 3),
        "time_to_first_token_ms": round(1e3 * ttft, 3),
        "decode_ms": round(completion.decode_ms, 3),
        "decode_tokens_per_s": round(completion.decode_tokens_per_s, 3),
        "total_ms": round(1e3 * (done_at - job.arrived), 3),
    }


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


@dataclasses.dataclass(frozen=True)
class _Kind:
    """What differs between the two generation endpoints."""

    endpoint: str
    id_prefix: str
    object: str
    chunk_object: str
    chat: bool


_COMPLETION = _Kind("/v1/completions", "cmpl-", "text_completion", "text_completion", False)
_CHAT = _Kind("/v1/chat/completions", "chatcmpl-", "chat.completion", "chat.completion.chunk",
              True)  # fmt: skip


# -- the app ------------------------------------------------------------------------------------
class _CountRequests:
    """ASGI middleware: equarx_requests{endpoint, status} for every HTTP response (streamed
    ones included, counted when their headers go out)."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(
    generator: Any,
    *,
    model_name: str,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_prompt_tokens: int | None = None,
    max_batch: int | None = None,
    batch_window_s: float = DEFAULT_BATCH_WINDOW_S,
    default_max_tokens: int = 256,
    tokenizer: Any = None,
    warmup: bool = False,
) -> FastAPI:
    """The server for `generator` (a `decode.Generator`, or anything with its `generate`,
    `engine`, `tokenizer`, `max_batch`, `max_context` and `all_reduce_usage`).

    Args:
      model_name: The id in /v1/models; requests naming another model get 404.
      max_queue: Requests that may wait for the worker; one more gets 503.
      max_prompt_tokens: Longest prompt accepted, in tokens (default: the context length).
      max_batch: Requests per generate call (default: `generator.max_batch`).
      batch_window_s: How long the idle worker waits for more requests to batch.
      default_max_tokens: max_tokens of chat requests that give none (capped by the context).
      tokenizer: Default: `generator.tokenizer`.
      warmup: Run a short generation at start-up (compiles the first programs).
    """
    from equarx_serve.decode import SamplingParams, chat_prompt

    engine = generator.engine
    tokenizer = tokenizer if tokenizer is not None else generator.tokenizer
    context = generator.max_context
    max_prompt = min(max_prompt_tokens or context - 1, context - 1)  # room for one token
    max_batch = max_batch or getattr(generator, "max_batch", 1)
    usage = _all_reduce_usage(generator, max_batch, min(USAGE_PROMPT_TOKENS, context))
    metrics = ServerMetrics(model_name=model_name, engine=engine, all_reduce_usage=usage)
    scheduler = Scheduler(
        generator, metrics, max_batch=max_batch, max_queue=max_queue,
        batch_window_s=batch_window_s,
    )  # fmt: skip
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if warmup:
            t0 = time.perf_counter()
            await asyncio.to_thread(
                generator.generate, [tokenizer.encode("Hello")], SamplingParams(max_tokens=2)
            )
            logger.info("warm-up generation: %.0f ms", 1e3 * (time.perf_counter() - t0))
        scheduler.start()
        logger.info(
            "serving %s: TP=%d, all-reduce %s, max_batch %d, max_queue %d, max prompt %d "
            "tokens, context %d", model_name, engine.tp, engine.all_reduce.name, max_batch,
            max_queue, max_prompt, context,
        )  # fmt: skip
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop)
            logger.info("worker stopped after %d generate calls", scheduler.generate_calls)

    app = FastAPI(title="equarx-serve", lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.generator = scheduler, metrics, generator
    app.add_middleware(_CountRequests, metrics=metrics)

    def error_response(request: Request, error: APIError) -> JSONResponse:
        path = request.url.path
        metrics.errors.labels(path if path in ENDPOINTS else "other", error.type).inc()
        if error.status >= 500:
            logger.error("%s %s: %d %s", request.method, path, error.status, error.message)
        else:
            logger.info("%s %s: %d %s", request.method, path, error.status, error.message)
        headers = {"Retry-After": "1"} if error.status == 503 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(request, error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(request, _validation_api_error(error))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {error.detail}"
        return error_response(request, APIError(error.status_code, message, type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(request, APIError(500, f"internal error: {error}",
                                                type="server_error"))  # fmt: skip

    # -- validation ------------------------------------------------------------------------
    def check_model(body: _SamplingBody) -> None:
        for name, value in (body.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise _bad_request(f"{name}={json.dumps(value)[:60]} is not supported by this "
                                   "server", name, "unsupported_parameter")  # fmt: skip
        if body.model is not None and body.model != model_name:
            raise APIError(
                404, f"The model {body.model!r} does not exist; this server serves "
                f"{model_name!r}", type="invalid_request_error", param="model",
                code="model_not_found",
            )  # fmt: skip

    def sampling_params(body: _SamplingBody, prompt_len: int, max_tokens: int | None) -> Any:
        if body.n not in (None, 1):
            raise _bad_request(f"n={body.n} is not supported: only n=1", "n", "unsupported_value")
        room = context - prompt_len
        if max_tokens is None:
            max_tokens = min(default_max_tokens, room)
        if max_tokens < 1:
            raise _bad_request(
                f"max_tokens must be at least 1, got {max_tokens}", "max_tokens",
                "integer_below_min_value",
            )  # fmt: skip
        if prompt_len + max_tokens > context:
            raise _bad_request(
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} in the completion). Please reduce the prompt or max_tokens.",
                "max_tokens", "context_length_exceeded",
            )  # fmt: skip
        temperature = 1.0 if body.temperature is None else body.temperature
        if not 0.0 <= temperature <= 2.0:
            raise _bad_request(f"temperature must be in [0, 2], got {temperature}", "temperature")
        top_p = 1.0 if body.top_p is None else body.top_p
        if not 0.0 < top_p <= 1.0:
            raise _bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
        if body.top_k is not None and body.top_k < 1:
            raise _bad_request(f"top_k must be at least 1 (or absent), got {body.top_k}", "top_k")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOP_SEQUENCES:
            raise _bad_request(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stop)}",
                               "stop")  # fmt: skip
        if any(not s for s in stop):
            raise _bad_request("stop sequences must not be empty strings", "stop")
        seed = secrets.randbits(31) if body.seed is None else body.seed
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=temperature, top_k=body.top_k, top_p=top_p,
                seed=seed, stop=tuple(stop),
            )  # fmt: skip
        except ValueError as e:
            raise _bad_request(str(e)) from None

    def check_prompt(tokens: list[int], param: str) -> None:
        if len(tokens) > max_prompt:
            limit = "the context length" if max_prompt == context - 1 else "max_prompt_tokens"
            raise _bad_request(
                f"the prompt is {len(tokens)} tokens, longer than this server's limit of "
                f"{max_prompt} ({limit})", param, "context_length_exceeded",
            )  # fmt: skip

    # -- generation --------------------------------------------------------------------------
    async def submit(kind: _Kind, prompt: list[int], params: Any) -> Job:
        job = Job(
            request_id=kind.id_prefix + uuid.uuid4().hex[:24], prompt=prompt, params=params,
            loop=asyncio.get_running_loop(), events=asyncio.Queue(), arrived=time.perf_counter(),
        )  # fmt: skip
        try:
            scheduler.submit(job)
        except Draining:
            raise APIError(503, "the server is shutting down; retry on another replica",
                           type="server_error", code="shutting_down") from None  # fmt: skip
        except QueueFull:
            raise APIError(
                503, f"the server is busy: {max_queue} requests are already queued; retry "
                "later", type="server_error", code="queue_full",
            ) from None  # fmt: skip
        metrics.in_flight.inc()
        return job

    def finish(job: Job, completion: Any) -> float:
        done_at = time.perf_counter()
        metrics.in_flight.dec()
        metrics.prompt_tokens.inc(len(completion.prompt_tokens))
        metrics.generated_tokens.inc(len(completion.tokens))
        metrics.finished.labels(completion.finish_reason).inc()
        metrics.prefill_seconds.observe(completion.prefill_ms / 1e3)
        if job.first_token_at is not None:
            metrics.ttft_seconds.observe(job.first_token_at - job.arrived)
        metrics.request_seconds.observe(done_at - job.arrived)
        if completion.tokens:
            metrics.decode_tokens_per_s.observe(completion.decode_tokens_per_s)
        logger.info(
            "%s: %d prompt + %d generated tokens, %s; queue+prefill to first token %.1f ms "
            "(prefill %.1f ms), decode %.1f ms (%.1f tok/s), total %.1f ms", job.request_id,
            len(completion.prompt_tokens), len(completion.tokens), completion.finish_reason,
            1e3 * ((job.first_token_at or done_at) - job.arrived), completion.prefill_ms,
            completion.decode_ms, completion.decode_tokens_per_s, 1e3 * (done_at - job.arrived),
        )  # fmt: skip
        return done_at

    def abandon(job: Job) -> None:
        """The client went away before the end: free its slot."""
        if not job.cancelled:
            job.cancelled = True
            metrics.in_flight.dec()
            metrics.finished.labels("cancelled").inc()
            logger.info("%s: client disconnected; cancelled", job.request_id)

    def generation_error(error: Exception) -> APIError:
        if isinstance(error, ValueError):  # the generator's own input checks
            return _bad_request(str(error))
        return APIError(500, f"generation failed: {type(error).__name__}: {error}",
                        type="server_error")  # fmt: skip

    async def answer(kind: _Kind, request: Request, body: _SamplingBody, prompt: list[int],
                     params: Any) -> Response:  # fmt: skip
        job = await submit(kind, prompt, params)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                stream(kind, job, include_usage), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )  # fmt: skip
        event: tuple = ("waiting",)
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        abandon(job)
                        return Response(status_code=499)
                    continue
                if event[0] == "done":
                    break
                if event[0] == "error":
                    metrics.in_flight.dec()
                    job.cancelled = True
                    raise generation_error(event[1])
        finally:
            if not job.cancelled and event[0] != "done":
                abandon(job)
        completion = event[1]
        done_at = finish(job, completion)
        text = completion.text
        choice: dict[str, Any] = {"index": 0, "finish_reason": completion.finish_reason}
        if kind.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice |= {"text": text, "logprobs": None}
        return JSONResponse({
            "id": job.request_id, "object": kind.object, "created": int(time.time()),
            "model": model_name, "choices": [choice], "usage": _usage(completion),
            "timings": _timings(completion, job, done_at),
        })  # fmt: skip

    async def stream(kind: _Kind, job: Job, include_usage: bool) -> AsyncIterator[bytes]:
        head = {"id": job.request_id, "object": kind.chunk_object, "created": int(time.time()),
                "model": model_name}  # fmt: skip

        def chunk(text: str | None, finish_reason: str | None, first: bool = False) -> bytes:
            if kind.chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
                if text:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None,
                          "finish_reason": finish_reason}  # fmt: skip
            return _sse(head | {"choices": [choice]})

        finished = False
        try:
            if kind.chat:
                yield chunk(None, None, first=True)
            while True:
                event = await job.events.get()
                if event[0] == "token":
                    if event[2]:
                        yield chunk(event[2], None)
                    continue
                if event[0] == "error":
                    finished = True
                    metrics.in_flight.dec()
                    error = generation_error(event[1])
                    metrics.errors.labels(kind.endpoint, error.type).inc()
                    yield _sse(error.body())
                    break
                completion, finished = event[1], True
                done_at = finish(job, completion)
                yield chunk(None, completion.finish_reason)
                if include_usage:
                    yield _sse(head | {"choices": [], "usage": _usage(completion),
                                       "timings": _timings(completion, job, done_at)})  # fmt: skip
                break
            yield _sse("[DONE]")
        finally:
            if not finished:
                abandon(job)

    # -- routes ------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        check_model(body)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise _bad_request(
                    f"prompt must be a string or a list of one string, got a list of "
                    f"{len(prompt)}; send one request per prompt (the server batches "
                    "concurrent requests)", "prompt",
                )  # fmt: skip
            prompt = prompt[0]
        if not prompt:
            raise _bad_request("prompt must not be empty", "prompt")
        tokens = tokenizer.encode(prompt)
        check_prompt(tokens, "prompt")
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = sampling_params(body, len(tokens), max_tokens)
        return await answer(_COMPLETION, request, body, tokens, params)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Response:
        check_model(body)
        if not body.messages:
            raise _bad_request("messages must not be empty", "messages")
        messages = [
            {"role": m.role, "content": m.content if isinstance(m.content, str)
             else "".join(part.text for part in m.content)}
            for m in body.messages
        ]  # fmt: skip
        if not any(m["content"] for m in messages):
            raise _bad_request("every message is empty", "messages")
        try:
            tokens = tokenizer.encode(chat_prompt(messages))  # BOS added here
        except ValueError as e:
            raise _bad_request(str(e), "messages") from None
        check_prompt(tokens, "messages")
        max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        params = sampling_params(body, len(tokens), max_tokens)
        return await answer(_CHAT, request, body, tokens, params)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "equarx-serve",
             "max_model_len": context, "tp": engine.tp, "all_reduce": engine.all_reduce.name},
        ]}  # fmt: skip

    @app.get("/health")
    async def health() -> JSONResponse:
        if scheduler.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not scheduler.alive:
            return JSONResponse({"status": "worker not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _validation_api_error(error: RequestValidationError) -> APIError:
    """FastAPI's 422 turned into OpenAI's 400: the first problem, with its field as param."""
    errors = error.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg"))
        return _bad_request(f"the body is not valid JSON: {detail}", None, "invalid_json")
    if first.get("type") == "missing" and not loc:
        return _bad_request("the body must be a JSON object", None, "invalid_json")
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if "input" in first and first.get("type") != "missing":
        message += f" (got {json.dumps(first['input'], default=str)[:100]})"
    more = len(errors) - 1
    if more:
        message += f"; and {more} more problem{'s' * (more > 1)}"
    return _bad_request(message, param, first.get("type"))


def _all_reduce_usage(generator: Any, max_batch: int, prompt_len: int) -> dict[str, str]:
    """What prefill and decode messages of a full batch of `prompt_len`-token prompts use
    (equarx-int8 sends small messages to psum), flattened for the info metric."""
    usage = generator.all_reduce_usage(max_batch, prompt_len)
    return {
        f"{phase}_uses": f"{usage[phase]['uses']} ({usage[phase]['message_bytes']} B message "
        f"at batch {max_batch}, {prompt_len} tokens)"
        for phase in ("prefill", "decode")
    }


def drain_on_exit(server: Any, app: FastAPI) -> None:
    """Make a `uvicorn.Server`'s SIGTERM/SIGINT drain the scheduler first (new requests 503)."""
    handle_exit = server.handle_exit

    def drain_then_exit(sig: int, frame: Any) -> None:
        app.state.scheduler.drain()
        handle_exit(sig, frame)

    server.handle_exit = drain_then_exit


__all__: Sequence[str] = ("APIError", "Scheduler", "create_app", "drain_on_exit")
