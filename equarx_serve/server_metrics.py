"""Prometheus metrics of `equarx-serve serve`, in a registry of their own per app.

Every name starts with `equarx_`. Request counts are by endpoint (the route's path, "other" for
unknown paths) and HTTP status; latencies are histograms in seconds; the all-reduce the model
runs on is an info metric and a gauge pair (TP degree, bytes each device puts on the wire per
prefill, from the all-reduce's own `wire_bytes`).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

# Latency buckets (seconds): CPU prefill of the 270M model runs from ~50 ms to tens of seconds.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKENS_PER_S_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


def prefill_all_reduce_bytes(engine: Any, batch: int, prompt_len: int) -> int:
    """Bytes each device sends in the all-reduces of one prefill of `batch` prompts padded to
    the bucket of `prompt_len`: 2 reductions per layer (attention output, MLP output) of
    [batch', bucket, embed_dim] partial sums, priced by the engine's all-reduce. batch' is
    `batch` rounded up to a power of two, as `decode.Generator` pads its prefill batches."""
    batch = 1 << (batch - 1).bit_length()
    bucket = engine.bucket_for(prompt_len)
    num_elements = batch * bucket * engine.config.embed_dim
    per_reduction = engine.all_reduce.wire_bytes(num_elements, engine.dtype, engine.tp)
    return 2 * engine.config.num_layers * per_reduction


class ServerMetrics:
    """The server's metrics; `render()` is the /metrics body."""

    def __init__(self, *, model_name: str, engine: Any, all_reduce_usage: dict[str, Any]):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "equarx_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.errors = Counter(
            "equarx_request_errors", "Error responses by endpoint and error type",
            ["endpoint", "type"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "equarx_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generated_tokens = Counter(
            "equarx_generation_tokens", "Tokens generated for finished requests (not counting "
            "those of cancelled ones)", registry=r,
        )  # fmt: skip
        self.finished = Counter(
            "equarx_requests_finished", "Generations by finish reason", ["finish_reason"],
            registry=r,
        )  # fmt: skip
        self.prefill_seconds = Histogram(
            "equarx_prefill_seconds", "Prefill latency of a request's batch (device time)",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft_seconds = Histogram(
            "equarx_time_to_first_token_seconds", "From the request's arrival to its first "
            "token (queueing included)", buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_seconds = Histogram(
            "equarx_queue_wait_seconds", "From the request's arrival to the start of its batch",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.request_seconds = Histogram(
            "equarx_request_seconds", "From the request's arrival to its last token",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.decode_tokens_per_s = Histogram(
            "equarx_decode_tokens_per_second", "Decode speed of each request (its own tokens)",
            buckets=TOKENS_PER_S_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "equarx_batch_size", "Requests admitted together (a call, or a group joining one)",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "equarx_queue_depth", "Requests waiting for the worker", registry=r
        )
        self.in_flight = Gauge(
            "equarx_requests_in_flight", "Generation requests being answered (queued or "
            "generating)", registry=r,
        )  # fmt: skip
        self.model_info = Info(
            "equarx_model", "The model and the all-reduce it runs on", registry=r
        )
        self.tp = Gauge("equarx_tensor_parallel_degree", "Devices on the TP mesh", registry=r)
        self.all_reduce_bytes_per_prefill = Gauge(
            "equarx_all_reduce_bytes_per_prefill", "Bytes each device sent in the all-reduces "
            "of the last prefill (2 per layer)", registry=r,
        )  # fmt: skip
        self.all_reduce_bytes = Counter(
            "equarx_all_reduce_prefill_bytes", "Bytes each device sent in prefill all-reduces",
            registry=r,
        )  # fmt: skip
        self.engine = engine
        self.tp.set(engine.tp)
        self.model_info.info(
            {
                "model": model_name,
                "all_reduce": engine.all_reduce.name,
                "all_reduce_options": _options_text(engine.all_reduce),
                "tp": str(engine.tp),
                "dtype": str(engine.dtype),
                **all_reduce_usage,
            }
        )

    def observe_batch(self, batch: int, prompt_len: int) -> None:
        self.batch_size.observe(batch)
        wire = prefill_all_reduce_bytes(self.engine, batch, prompt_len)
        self.all_reduce_bytes_per_prefill.set(wire)
        self.all_reduce_bytes.inc(wire)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def _options_text(all_reduce: Any) -> str:
    try:
        options = all_reduce.options()
    except Exception:  # a user's AllReduce that is not a plain dataclass
        return ""
    return ",".join(f"{k}={v}" for k, v in sorted(options.items()))
