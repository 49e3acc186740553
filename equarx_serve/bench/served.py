"""Serving side by side (`bench compare --serve-clients 1 4 16`): this project's
`equarx-serve serve` and llama-cpp-python's OpenAI server on the same GGUF, loaded by the
official OpenAI client, one server at a time.

Each server runs in a process of its own, started, waited for and stopped with SIGTERM
(`bench.serve.running_server`):
  - this project: `equarx-serve serve` with bench compare's model flags (--tp, --all-reduce,
    --weights, --dtype) and the server's defaults otherwise (one process, --max-batch 8);
  - llama-cpp-python: `python -m llama_cpp.server` (its `server` extra) on the GGUF file,
    --threads threads; it runs one request at a time.

Every request is a completion (`/v1/completions`, greedy, `SERVED_MAX_TOKENS` tokens at most)
of its own ~`PROMPT_TOKENS`-token window of CPython's reference text, so that no two requests
share a prefix past the BOS (llama.cpp reuses a cached prefix). At C concurrent clients each
client sends its requests back to back (`requests_per_client`), twice:
  1. non-streamed: output tokens from each answer's `usage`, over the wall time of the level
     (output tokens/s), and each request's latency (send to full answer);
  2. streamed: time to first token (send to the first text) and, where the stream carries
     `usage` (`stream_options.include_usage`; llama-cpp-python's does not), the stream's
     decode rate: its tokens after the first over the time from the first text to the end.
One untimed round at every level first (it compiles this project's batch shapes). Errors are
counted, never retried.

Beside the served rate at one client: this project's `Generator` (batch 1, in the bench
process, before any server starts) on the same prompts, its decode tokens/s (first token to
last), so that the server's loss against the engine is measured in the same run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from equarx_serve.bench.serve import ClientsPass, percentile, run_clients, running_server
from equarx_serve.bench.text import right_aligned
from equarx_serve.distributed.multiprocess import free_port

SERVED_MAX_TOKENS = 64
PROMPT_TOKENS = 200
PROMPT_STRIDE = 37  # tokens between the starts of two requests' windows
MIN_REQUESTS = 8  # a level sends at least this many (p99 of fewer is their maximum)
PROJECT = "equarx-serve"
LLAMA_SERVER = "llama-cpp-python server"
SERVER_HINT = "pip install 'llama-cpp-python[server]' (the `compare` extra carries it)"


@dataclasses.dataclass(frozen=True)
class ServedLevel:
    """One server at `clients` concurrent clients (see the module doc)."""

    server: str
    clients: int
    requests: int  # sent in each of the two passes
    errors: int  # both passes
    output_tokens: int  # non-streamed pass, from `usage`
    wall_s: float  # non-streamed pass
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    stream_decode_tokens_per_s: float | None  # median over streams; None without usage

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"output_tokens_per_s": self.output_tokens_per_s}


@dataclasses.dataclass(frozen=True)
class ServedComparison:
    levels: list[ServedLevel]
    generate_decode_tokens_per_s: float  # this project's Generator, batch 1, same prompts
    llama_skipped: str | None  # why llama-cpp-python's server did not run
    prompt_tokens: int  # of the first prompt, as the project's tokenizer counts them

    def level(self, server: str, clients: int) -> ServedLevel | None:
        return next((x for x in self.levels if (x.server, x.clients) == (server, clients)), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "max_tokens": SERVED_MAX_TOKENS,
            "prompt_tokens": self.prompt_tokens,
            "generate_decode_tokens_per_s": self.generate_decode_tokens_per_s,
            "llama_server_skipped": self.llama_skipped,
            "levels": [x.to_json() for x in self.levels],
        }


def prompts(tokenizer: Any, count: int) -> list[str]:
    """`count` texts of ~PROMPT_TOKENS tokens, each starting at its own place in CPython's
    reference text (`pydoc_data`)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[t] for t in ("class", "function", "if", "while", "try", "with"))
    ids = tokenizer.encode(text)[1:]  # no BOS: the server adds its own
    needed = (count - 1) * PROMPT_STRIDE + PROMPT_TOKENS
    if len(ids) < needed:
        raise ValueError(f"the reference text has {len(ids)} tokens, {needed} are needed")
    return [
        tokenizer.decode(ids[i * PROMPT_STRIDE : i * PROMPT_STRIDE + PROMPT_TOKENS - 1])
        for i in range(count)
    ]


def requests_per_client(clients: int) -> int:
    return max(2, -(-MIN_REQUESTS // clients))


@dataclasses.dataclass(frozen=True)
class _Answer:
    latency_s: float
    tokens: int | None  # from usage
    first_s: float | None = None  # streamed: time to the first text


async def _complete(client: Any, model: str, prompt: str, stream: bool) -> _Answer:
    started = time.perf_counter()
    common = dict(model=model, prompt=prompt, max_tokens=SERVED_MAX_TOKENS, temperature=0)
    if not stream:
        answer = await client.completions.create(**common)
        return _Answer(time.perf_counter() - started, answer.usage.completion_tokens)
    first, tokens = None, None
    chunks = await client.completions.create(
        **common, stream=True, stream_options={"include_usage": True}
    )
    async for chunk in chunks:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - started
        if getattr(chunk, "usage", None) is not None:
            tokens = chunk.usage.completion_tokens
    return _Answer(time.perf_counter() - started, tokens, first)


async def _pass(
    url: str, model: str, texts: Sequence[str], clients: int, per_client: int, stream: bool
) -> ClientsPass[_Answer]:
    """`clients` clients, `per_client` completions each, back to back (`run_clients`)."""

    async def complete(client: Any, i: int) -> _Answer:
        return await _complete(client, model, texts[i % len(texts)], stream)

    return await run_clients(url, clients, per_client, complete)


def stream_decode_rate(answer: _Answer) -> float | None:
    """Tokens after the first over the time from the first text to the end of the stream."""
    if answer.tokens is None or answer.first_s is None or answer.tokens < 2:
        return None
    span = answer.latency_s - answer.first_s
    return (answer.tokens - 1) / span if span > 0 else None


def measure_level(url: str, server: str, model: str, texts: Sequence[str], clients: int):
    per_client = requests_per_client(clients)
    plain_pass = asyncio.run(_pass(url, model, texts, clients, per_client, False))
    streamed_pass = asyncio.run(_pass(url, model, texts, clients, per_client, True))
    plain, streamed = plain_pass.results, streamed_pass.results
    rates = [r for a in streamed if (r := stream_decode_rate(a)) is not None]
    firsts = [a.first_s for a in streamed if a.first_s is not None]
    latencies = [a.latency_s for a in plain]
    return ServedLevel(
        server=server,
        clients=clients,
        requests=clients * per_client,
        errors=plain_pass.errors + streamed_pass.errors + (len(streamed) - len(firsts)),
        output_tokens=sum(a.tokens or 0 for a in plain),
        wall_s=plain_pass.wall_s,
        latency_p50_s=percentile(latencies, 0.5),
        latency_p99_s=percentile(latencies, 0.99),
        ttft_p50_s=percentile(firsts, 0.5),
        ttft_p99_s=percentile(firsts, 0.99),
        stream_decode_tokens_per_s=statistics.median(rates) if rates else None,
    )


def measure_server(
    url: str, server: str, model: str, texts: Sequence[str], levels: Sequence[int]
) -> list[ServedLevel]:
    for clients in levels:  # untimed: compiles the batch shapes of every level
        asyncio.run(_pass(url, model, texts, clients, 1, False))
    measured = []
    for clients in levels:
        level = measure_level(url, server, model, texts, clients)
        print(
            f"  {server}, {clients} clients: {level.output_tokens_per_s:.1f} output tokens/s, "
            f"latency p50 {level.latency_p50_s:.2f} s, TTFT p50 {level.ttft_p50_s:.2f} s, "
            f"{level.errors} errors",
            flush=True,
        )
        measured.append(level)
    return measured


def generate_decode_rate(generator: Any, tokenizer: Any, texts: Sequence[str]) -> float:
    """Median decode tokens/s of `generator` (batch 1) on each text, after one untimed run."""
    from equarx_serve.generation.generator import SamplingParams

    params = SamplingParams(max_tokens=SERVED_MAX_TOKENS)
    encoded = [tokenizer.encode(t) for t in texts]
    generator.generate([encoded[0]], params)  # compiles the prompt's bucket
    rates = [generator.generate([ids], params)[0].decode_tokens_per_s for ids in encoded]
    return statistics.median(rates)


def project_command(config: Any, port: int) -> list[str]:
    """`equarx-serve serve` with bench compare's model flags."""
    command = [sys.executable, "-m", "equarx_serve", "serve", "--model", config.model]
    command += ["--tp", str(config.tp), "--all-reduce", config.all_reduce.label]
    command += ["--weights", config.weights, "--dtype", config.dtype, "--port", str(port)]
    command += ["--served-model-name", config.model, "--log-level", "warning"]
    if config.checkpoint:
        command += ["--checkpoint", str(config.checkpoint), "--tokenizer", str(config.tokenizer)]
    return command


def llama_server_command(gguf: Path, model: str, threads: int, port: int) -> list[str]:
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf)]
    command += ["--model_alias", model, "--n_threads", str(threads)]
    command += ["--n_threads_batch", str(threads), "--n_ctx", "2048", "--verbose", "False"]
    return [*command, "--host", "127.0.0.1", "--port", str(port)]


def llama_server_missing() -> str | None:
    """Why llama-cpp-python's OpenAI server cannot start here, or None."""
    try:
        import llama_cpp.server.app  # noqa: F401
    except ImportError as e:
        return f"llama-cpp-python's server cannot be imported ({e}): {SERVER_HINT}"
    return None


def compare_servers(
    config: Any, generator: Any, tokenizer: Any, gguf: Path | None, llama_skipped: str | None
) -> ServedComparison:
    """Both servers at every level of `config.serve_clients` (module doc). `llama_skipped`:
    why llama.cpp cannot run beside this model at all (bench compare's reason), or None."""
    texts = prompts(tokenizer, max(requests_per_client(c) * c for c in config.serve_clients))
    generate_rate = generate_decode_rate(generator, tokenizer, texts[:MIN_REQUESTS])
    port = free_port()
    print(f"== serving: {PROJECT}", flush=True)
    with running_server(project_command(config, port), port) as url:
        levels = measure_server(url, PROJECT, config.model, texts, config.serve_clients)
    skipped = llama_skipped or (None if gguf else "no GGUF file") or llama_server_missing()
    if skipped is None:
        port = free_port()
        print(f"== serving: {LLAMA_SERVER}", flush=True)
        command = llama_server_command(gguf, config.model, config.threads, port)
        with running_server(command, port, ready_path="/v1/models") as url:
            levels += measure_server(url, LLAMA_SERVER, config.model, texts, config.serve_clients)
    return ServedComparison(levels, generate_rate, skipped, len(tokenizer.encode(texts[0])))


def format_served(result: ServedComparison, max_tokens: int = SERVED_MAX_TOKENS) -> list[str]:
    """The serving table of `bench compare`'s report."""
    text = [
        f"\nserving, /v1/completions of ~{result.prompt_tokens}-token prompts, greedy, up to "
        f"{max_tokens} tokens, official OpenAI client; A: {PROJECT}, B: "
        + (LLAMA_SERVER if result.llama_skipped is None else f"skipped: {result.llama_skipped}")
    ]
    clients = sorted({x.clients for x in result.levels})
    lines = [["clients", "A tok/s", "B tok/s", "A / B", "A p50/p99 s", "B p50/p99 s",
              "A TTFT p50/p99 s", "B TTFT p50/p99 s", "errors A/B"]]  # fmt: skip
    for c in clients:
        a, b = result.level(PROJECT, c), result.level(LLAMA_SERVER, c)
        assert a is not None
        lines.append([
            str(c), f"{a.output_tokens_per_s:.1f}", f"{b.output_tokens_per_s:.1f}" if b else "-",
            f"{a.output_tokens_per_s / b.output_tokens_per_s:.2f}x" if b else "-",
            f"{a.latency_p50_s:.2f}/{a.latency_p99_s:.2f}",
            f"{b.latency_p50_s:.2f}/{b.latency_p99_s:.2f}" if b else "-",
            f"{a.ttft_p50_s:.2f}/{a.ttft_p99_s:.2f}",
            f"{b.ttft_p50_s:.2f}/{b.ttft_p99_s:.2f}" if b else "-",
            f"{a.errors}/{b.errors if b else '-'}",
        ])  # fmt: skip
    text += right_aligned(lines)
    one = result.level(PROJECT, 1)
    if one is not None and one.stream_decode_tokens_per_s is not None:
        generate = result.generate_decode_tokens_per_s
        text.append(
            f"one client, A's streamed decode {one.stream_decode_tokens_per_s:.1f} tokens/s vs "
            f"the Generator's {generate:.1f} on the same prompts in this process: "
            f"{one.stream_decode_tokens_per_s / generate:.2f}x"
        )
    return text
