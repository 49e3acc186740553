"""Prometheus metrics of `equarx-serve serve`, in a registry of their own per app.

Every name starts with `equarx_`. Request counts are by endpoint (the route's path, "other" for
unknown paths) and HTTP status; latencies are histograms in seconds. The all-reduce the model
runs on is an info metric (with what prefill and decode messages of a full batch use), and
every device step is counted with the bytes each device sent in its all-reduces, read from the
step's record (`generation.batching.BatchPolicy`, the owner of batch padding).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from equarx_serve.generation.batching import AllReduceUsage, Phase
from equarx_serve.generation.engine import StepRecord

__all__ = ["ServerMetrics"]

# Latency buckets (seconds): CPU prefill of the 270M model runs from ~50 ms to tens of seconds.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKENS_PER_S_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


class ServerMetrics:
    """The server's metrics; `render()` is the /metrics body."""

    def __init__(self, *, model_name: str, engine: Any, usage: AllReduceUsage, processes: int = 1):
        self.registry = CollectorRegistry()
        self._declare_request_counters(self.registry)
        self._declare_latencies(self.registry)
        self._declare_engine_metrics(self.registry)
        self._describe_model(self.registry, model_name, engine, usage, processes)

    def _declare_request_counters(self, r: CollectorRegistry) -> None:
        """What happened to requests: by endpoint and status, errors by type, tokens, and how
        generations finished."""
        self.requests = Counter(
            "equarx_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.errors = Counter(
            "equarx_request_errors",
            "Error responses by endpoint and error type",
            ["endpoint", "type"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "equarx_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generated_tokens = Counter(
            "equarx_generation_tokens",
            "Tokens generated for finished requests (not counting those of cancelled ones)",
            registry=r,
        )
        self.finished = Counter(
            "equarx_requests_finished",
            "Generations by finish reason",
            ["finish_reason"],
            registry=r,
        )

    def _declare_latencies(self, r: CollectorRegistry) -> None:
        """The histograms of a request's life (seconds), its decode speed and batch sizes."""

        def histogram(name: str, help: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, help, buckets=buckets, registry=r)

        self.prefill_seconds = histogram(
            "equarx_prefill_seconds", "Prefill latency of a request's batch (device time)"
        )
        self.ttft_seconds = histogram(
            "equarx_time_to_first_token_seconds",
            "From the request's arrival to its first token (queueing included)",
        )
        self.queue_seconds = histogram(
            "equarx_queue_wait_seconds", "From the request's arrival to its entry into the engine"
        )
        self.request_seconds = histogram(
            "equarx_request_seconds", "From the request's arrival to its last token"
        )
        self.decode_tokens_per_s = histogram(
            "equarx_decode_tokens_per_second",
            "Decode speed of each request (its own tokens)",
            TOKENS_PER_S_BUCKETS,
        )
        self.batch_size = histogram(
            "equarx_batch_size", "Requests prefilled together in one step", BATCH_BUCKETS
        )

    def _declare_engine_metrics(self, r: CollectorRegistry) -> None:
        """The queue, the requests in flight, the device steps and their all-reduce bytes."""
        self.queue_depth = Gauge(
            "equarx_queue_depth", "Requests waiting for the engine", registry=r
        )
        self.in_flight = Gauge(
            "equarx_requests_in_flight",
            "Generation requests being answered (queued or generating)",
            registry=r,
        )
        self.steps = Counter(
            "equarx_engine_steps", "Device steps run, by phase", ["phase"], registry=r
        )
        self.all_reduce_bytes_per_prefill = Gauge(
            "equarx_all_reduce_bytes_per_prefill",
            "Bytes each device sent in the all-reduces of the last prefill step (2 per layer)",
            registry=r,
        )
        self.all_reduce_bytes = Counter(
            "equarx_all_reduce_bytes",
            "Bytes each device sent in all-reduces, by phase",
            ["phase"],
            registry=r,
        )

    def _describe_model(
        self,
        r: CollectorRegistry,
        model_name: str,
        engine: Any,
        usage: AllReduceUsage,
        processes: int,
    ) -> None:
        """The model, the all-reduce it runs on (and what its messages use), TP and processes."""
        self.model_info = Info(
            "equarx_model", "The model and the all-reduce it runs on", registry=r
        )
        self.tp = Gauge("equarx_tensor_parallel_degree", "Devices on the TP mesh", registry=r)
        self.processes = Gauge("equarx_processes", "Processes the TP mesh spans", registry=r)
        self.tp.set(engine.tp)
        self.processes.set(processes)
        self.model_info.info(
            {
                "model": model_name,
                "all_reduce": engine.all_reduce.name,
                "all_reduce_options": ",".join(
                    f"{k}={v}" for k, v in sorted(usage.options.items())
                ),
                "tp": str(engine.tp),
                "dtype": str(engine.dtype),
                **_phase_uses(usage),
            }
        )

    def observe_step(self, record: StepRecord) -> None:
        """One device step of the engine (`StepEngine(on_step=...)`)."""
        phase = record.shape.phase
        self.steps.labels(phase).inc()
        self.all_reduce_bytes.labels(phase).inc(record.traffic.wire_bytes)
        if phase == Phase.PREFILL:
            self.batch_size.observe(record.requests)
            self.all_reduce_bytes_per_prefill.set(record.traffic.wire_bytes)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def _phase_uses(usage: AllReduceUsage) -> dict[str, str]:
    """What prefill and decode messages of the batch `usage` was made for use."""
    return {
        f"{phase}_uses": f"{traffic.uses} ({traffic.message_bytes} B messages of shape "
        f"{list(traffic.shape)})"
        for phase, traffic in ((Phase.PREFILL, usage.prefill), (Phase.DECODE, usage.decode))
    }
