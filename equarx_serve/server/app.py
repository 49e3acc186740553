"""The FastAPI app: routes, error handlers, request counting, the operator's guards
(`http.py`), an OpenAPI schema that describes what the routes really answer, the worker's
lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from equarx_serve.generation.generator import Generator
from equarx_serve.generation.sampling import SamplingParams
from equarx_serve.server.http import HTTPSettings, add_http_guards, drain_on_signal
from equarx_serve.server.metrics import ServerMetrics
from equarx_serve.server.openai_serving import (
    CHAT,
    COMPLETIONS,
    SHUTTING_DOWN,
    OpenAIServing,
    ServingLimits,
)
from equarx_serve.server.protocol import (
    APIError,
    ChatBody,
    CompletionBody,
    ErrorBody,
    validation_api_error,
)
from equarx_serve.server.worker import DEFAULT_BATCH_WINDOW_S, EngineWorker

__all__ = ["create_app", "drain_on_exit"]

logger = logging.getLogger("equarx_serve.server")

DEFAULT_MAX_QUEUE = 64
USAGE_PROMPT_TOKENS = 128  # the prompt length the info metric's all-reduce usage is shown for
WARMUP_PROMPT = "Hello"
ENDPOINTS = (COMPLETIONS.path, CHAT.path, "/v1/models", "/health", "/metrics")
DEFAULT_HTTP = HTTPSettings()
PROMETHEUS_TEXT = CONTENT_TYPE_LATEST

_ERROR_MEANINGS = {
    400: "Bad input: malformed JSON, a missing, mistyped or out-of-range field, a prompt "
    "too long for the context, invalid Unicode, a disallowed Host header",
    401: "A valid API key is required (when the server has one)",
    404: "Unknown model",
    408: "The request body did not arrive in time",
    413: "The request body is over the server's limit",
    500: "A device step failed (the cause is in the server log)",
    503: "Busy (queue full: retry later), draining (shutting down), or the engine failed",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {
        status: {"model": ErrorBody, "description": _ERROR_MEANINGS[status]} for status in statuses
    }


GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion (JSON), or with `stream: true` server-sent events: one "
        "`data: {chunk}` per piece of text, the last chunk with finish_reason, an optional "
        "usage chunk, an error object if the request fails mid-stream, then `data: [DONE]`",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    },
    **_errors(400, 401, 404, 408, 413, 500, 503),
}
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": '{"status": "ok"}'},
    503: {"description": '{"status": "draining" | "failed" | "worker not running", ...}'},
}
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition format",
        "content": {PROMETHEUS_TEXT: {"schema": {"type": "string"}}},
    }
}


class _CountRequests:
    """ASGI middleware: equarx_requests{endpoint, status} for every HTTP response (streamed
    ones included, counted when their headers go out)."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

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


def _warm_up(worker: EngineWorker, tokenizer: Any) -> None:
    """One short request through the worker's own engine (before its thread starts): compiles
    the first prefill program and the decode program of a full batch."""
    engine = worker.engine
    engine.add_request("warm-up", tokenizer.encode(WARMUP_PROMPT), SamplingParams(max_tokens=2))
    while engine.has_unfinished:
        engine.step()


@dataclasses.dataclass(frozen=True)
class _Parts:
    """What the lifespan, the error handlers and the routes of one app share: built once, by
    `_build_parts`, so that each of them reads as its own step of `create_app`."""

    generator: Generator
    model_name: str
    worker: EngineWorker
    metrics: ServerMetrics
    serving: OpenAIServing
    limits: ServingLimits
    max_batch: int
    max_queue: int
    processes: int


def create_app(
    generator: Generator,
    *,
    model_name: str,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_prompt_tokens: int | None = None,
    max_batch: int | None = None,
    batch_window_s: float = DEFAULT_BATCH_WINDOW_S,
    default_max_tokens: int = 256,
    warmup: bool = False,
    on_failure: Callable[[str], None] = lambda reason: None,
    http: HTTPSettings = DEFAULT_HTTP,
) -> FastAPI:
    """The server for `generator` (its runner, tokenizer and limits).

    Args:
      model_name: The id in /v1/models; requests naming another model get 404.
      max_queue: Requests that may wait for the worker; one more gets 503.
      max_prompt_tokens: Longest prompt accepted, in tokens (default: the context length).
      max_batch: Requests decoded together (default: `generator.max_batch`).
      batch_window_s: How long the idle worker waits for more requests to batch.
      default_max_tokens: max_tokens of chat requests that give none (capped by the context).
      warmup: Run a short generation at start-up (compiles the first programs).
      on_failure: Called once if the engine fails for good (a lost process of the mesh),
        after every request was answered 503.
      http: The body limit and deadline, API key, /docs switch, Host allow-list, drain
        window (connection limits and timeouts: `http.uvicorn_config`).
    """
    parts = _build_parts(
        generator,
        model_name=model_name,
        max_queue=max_queue,
        max_prompt_tokens=max_prompt_tokens,
        max_batch=max_batch or generator.max_batch,
        batch_window_s=batch_window_s,
        default_max_tokens=default_max_tokens,
        on_failure=on_failure,
    )
    docs = {} if http.docs else {"docs_url": None, "redoc_url": None}
    app = FastAPI(title="equarx-serve", lifespan=_lifespan(parts, warmup=warmup), **docs)
    app.state.worker, app.state.metrics, app.state.generator = (
        parts.worker,
        parts.metrics,
        generator,
    )
    app.state.http = http
    count_error = _error_counter(parts.metrics)
    app.state.count_error = count_error  # also for the refusals of `http.py`'s protocol
    add_http_guards(app, http)
    app.add_middleware(_CountRequests, metrics=parts.metrics)  # outermost: counts refusals too
    _add_error_handlers(app, count_error)
    _add_generation_routes(app, parts.serving)
    _add_info_routes(app, parts)
    app.openapi = lambda: _openapi(app)
    return app


def _build_parts(
    generator: Generator,
    *,
    model_name: str,
    max_queue: int,
    max_prompt_tokens: int | None,
    max_batch: int,
    batch_window_s: float,
    default_max_tokens: int,
    on_failure: Callable[[str], None],
) -> _Parts:
    """The metrics, the worker (on an engine of its own, reporting to the metrics), the
    limits a request is checked against and the OpenAI serving layer over them."""
    engine = generator.engine
    context = generator.max_context
    usage = generator.all_reduce_usage(max_batch, min(USAGE_PROMPT_TOKENS, context))
    processes = len({device.process_index for device in engine.mesh.devices.flat})
    metrics = ServerMetrics(model_name=model_name, engine=engine, usage=usage, processes=processes)
    worker = EngineWorker(
        generator.new_engine(max_batch, on_step=metrics.observe_step),
        max_queue=max_queue,
        batch_window_s=batch_window_s,
        on_queue_depth=metrics.queue_depth.set,
        on_dequeue=lambda job: metrics.queue_seconds.observe(time.perf_counter() - job.arrived),
        on_failure=on_failure,
    )
    limits = ServingLimits(
        context=context,
        max_prompt=min(max_prompt_tokens or context - 1, context - 1),  # room for one token
        default_max_tokens=default_max_tokens,
        max_queue=max_queue,
    )
    serving = OpenAIServing(
        worker, metrics, generator.tokenizer, model_name=model_name, limits=limits
    )
    return _Parts(
        generator, model_name, worker, metrics, serving, limits, max_batch, max_queue, processes
    )


def _lifespan(
    parts: _Parts, *, warmup: bool
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """Start-up and shutdown: the optional warm-up, the worker's thread started and its
    settings logged once; on shutdown the worker stopped (off the event loop: it joins)."""
    worker, engine, limits = parts.worker, parts.generator.engine, parts.limits

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if warmup:
            started = time.perf_counter()
            await asyncio.to_thread(_warm_up, worker, parts.generator.tokenizer)
            logger.info("warm-up generation: %.0f ms", 1e3 * (time.perf_counter() - started))
        worker.start()
        logger.info(
            "serving %s: TP=%d over %d process(es), all-reduce %s, max_batch %d, max_queue %d, "
            "max prompt %d tokens, context %d",
            parts.model_name,
            engine.tp,
            parts.processes,
            engine.all_reduce.name,
            parts.max_batch,
            parts.max_queue,
            limits.max_prompt,
            limits.context,
        )
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)
            logger.info("worker stopped after %d steps", worker.steps)

    return lifespan


def _error_counter(metrics: ServerMetrics) -> Callable[[str, str], None]:
    """count_error(path, kind): equarx_request_errors by endpoint ("other" for unknown
    paths, so that a client cannot grow the label set) and error type."""

    def count_error(path: str, kind: str) -> None:
        metrics.errors.labels(path if path in ENDPOINTS else "other", kind).inc()

    return count_error


def _add_error_handlers(app: FastAPI, count_error: Callable[[str, str], None]) -> None:
    """Every error as OpenAI's error JSON, counted and logged in one place
    (`error_response`): our APIError, FastAPI's validation errors (400, not its 422),
    Starlette's 404 / 405, and anything unexpected (500 with a reference into the log,
    never the cause)."""

    def error_response(request: Request, error: APIError) -> JSONResponse:
        path = request.url.path
        count_error(path, error.type)
        level = logging.ERROR if error.status >= 500 else logging.INFO
        logger.log(level, "%s %s: %d %s", request.method, path, error.status, error.message)
        headers = {"Retry-After": "1"} if error.status == 503 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(request, error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(request, validation_api_error(error))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {error.detail}"
        response = error_response(request, APIError(error.status_code, message, type=kind))
        response.headers.update(error.headers or {})  # e.g. 405's Allow
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        reference = uuid.uuid4().hex[:12]
        logger.exception(
            "unexpected error %s in %s %s", reference, request.method, request.url.path
        )
        message = f"internal error (reference {reference}; the server log has the cause)"
        internal = APIError(500, message, type="server_error")
        return error_response(request, internal)


def _add_generation_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """The OpenAI endpoints; `openai_serving.py` holds their logic, these only route."""

    @app.post(COMPLETIONS.path, responses=GENERATION_RESPONSES)
    async def completions(body: CompletionBody, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post(CHAT.path, responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatBody, request: Request) -> Response:
        return await serving.chat_completions(body, request)


def _add_info_routes(app: FastAPI, parts: _Parts) -> None:
    """What an operator or a client asks about the server: /v1/models (the model, its
    context, TP and all-reduce), /health (503 while failed, draining or not yet running) and
    /metrics (Prometheus text)."""
    worker, metrics, engine = parts.worker, parts.metrics, parts.generator.engine
    created = int(time.time())

    @app.get("/v1/models", responses=_errors(401, 500))
    async def models() -> dict[str, Any]:
        model = {
            "id": parts.model_name,
            "object": "model",
            "created": created,
            "owned_by": "equarx-serve",
            "max_model_len": parts.limits.context,
            "tp": engine.tp,
            "all_reduce": engine.all_reduce.name,
        }
        return {"object": "list", "data": [model]}

    @app.api_route("/health", methods=["GET", "HEAD"], responses=HEALTH_RESPONSES)
    async def health() -> JSONResponse:
        if worker.failure is not None:
            return JSONResponse({"status": "failed", "reason": worker.failure}, status_code=503)
        if worker.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not worker.alive:
            return JSONResponse({"status": "worker not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=PROMETHEUS_TEXT)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without the 422 it documents for every body (this server answers
    400 instead, documented per route)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation["responses"].pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def drain_on_exit(server: Any, app: FastAPI) -> None:
    """Make a `uvicorn.Server`'s SIGTERM/SIGINT drain first, as `app`'s settings say (see
    `http.py`): /health and new requests 503 during the drain window, then the listener
    closes; requests still running at the end of the grace period end with a 503."""
    drain_on_signal(server, app.state.worker, app.state.http, SHUTTING_DOWN)
