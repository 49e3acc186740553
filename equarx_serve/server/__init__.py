"""`equarx-serve serve`: an OpenAI-compatible HTTP server over the step-wise engine.

    app = create_app(Generator(engine, max_batch=8), model_name="gemma3-270m", max_queue=64)
    uvicorn.run(app)  # or: equarx-serve serve --model gemma3-270m --tp 2

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `"stream": true` as
server-sent events in OpenAI's chunk format, ending with `data: [DONE]`), `GET /v1/models`,
`GET /health`, `GET /metrics` (Prometheus text, see `metrics.py`).

By concern:
    protocol.py        request bodies, the error type and its JSON shape
    openai_serving.py  bodies to sampling settings and prompts, events to responses / streams
    worker.py          the thread that owns the step engine: queue, steps, events, drain, fail
    app.py             the FastAPI app: routes, error handlers, request counting, lifespan
    metrics.py         Prometheus metrics (requests, latencies, steps and all-reduce bytes)

Scheduling: one worker thread owns the devices through a `StepEngine`
(`equarx_serve/generation/engine.py`): requests wait in a bounded queue (`max_queue`; a full
queue answers 503 at once) and join the running batch as soon as a slot is free, so concurrent
users share every device step; a client that disconnects frees its slot. SIGTERM (through
`serve`) drains: new requests get 503, queued and running ones finish.

Errors follow OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for bad
input (malformed JSON, missing or mistyped fields, empty or too long prompts, bad sampling
values, n != 1), 404 for an unknown model or path, 503 when busy, draining, or when the engine
failed for good (a lost process of a multi-process mesh), 500 when a step fails (for the
requests in it; the server keeps serving).
"""

from equarx_serve.server.app import create_app, drain_on_exit
from equarx_serve.server.protocol import APIError

__all__ = ["APIError", "create_app", "drain_on_exit"]
