"""Serving measured with the official OpenAI Python client (`openai`), against real servers.

    python -m equarx_serve.bench.serve [--model gemma3-270m] [--tp 2] [--processes 2]
        [--methods psum equarx-int8] [--ttft-tokens 2000] [--ttft-repeats 5]
        [--weights auto] [--overlap-chunks auto] [--clients 1 4 16] [--load-method M]
        [--requests-per-client 4] [--max-tokens 16]
        [--link RATE [--link-delay D]] [--json PATH]

For each all-reduce in --methods (and each --overlap-chunks K, labelled METHOD/overlap=K where
there are several), one `equarx-serve serve` is started (its own process group; with
--processes N, N local processes joined by gloo over loopback, or with --link RATE on emulated
hosts joined by links of that rate, root only, see `distributed/cluster.py`), waited for
(/health), then measured, then stopped with SIGTERM:

1. Time to first token of a long prompt: a streamed completion (`max_tokens` 2, greedy) of
   --ttft-tokens tokens of text (CPython's reference, cut with the model's tokenizer): one
   untimed run (it compiles the prompt's length bucket), then --ttft-repeats timed ones, each
   from sending the request to receiving the first streamed text, on the client.
2. Load (on --load-method, default the last, with the first --overlap-chunks): C clients at
   a time (--clients), each sending --requests-per-client chat completions back to back
   (non-streamed, --max-tokens, greedy, a different short question each), after one untimed
   round at every level (it compiles the batch shapes). Per level: requests/s (answered
   requests / wall time), latency p50 and p99 (send to full answer), errors (exceptions, no
   retries) and lost requests (sent but neither answered nor failed), checked against the
   server's own counters.

Methods run one after the other on the same machine: the TTFT ratio is of medians measured in
one run of this command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from equarx_serve.arguments import argument_type, chunks_or_auto
from equarx_serve.bench import links, provenance
from equarx_serve.distributed.cluster import Link
from equarx_serve.distributed.multiprocess import free_port
from equarx_serve.generation.model_args import AUTO, DEFAULT_WEIGHTS, WEIGHTS

START_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 900.0
QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Give a synonym for happy.",
    "What do bees make?",
    "Why is the sky blue?",
    "Name a planet in the solar system.",
)


@dataclasses.dataclass(frozen=True)
class LoadLevel:
    clients: int
    requests: int
    answered: int
    errors: int
    lost: int
    wall_s: float
    requests_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    completion_tokens: int


def server_command(
    args: argparse.Namespace, method: str, port: int, overlap_chunks: str = "auto"
) -> list[str]:
    """The `equarx-serve serve` command line for `method` (its prefills in `overlap_chunks`)
    on `port`."""
    command = [sys.executable, "-m", "equarx_serve", "serve", "--model", args.model]
    command += ["--tp", str(args.tp), "--all-reduce", method, "--port", str(port)]
    command += ["--overlap-chunks", overlap_chunks, "--weights", args.weights]
    command += ["--max-length", str(args.max_length), "--log-level", "warning"]
    if args.processes:
        command += ["--processes", str(args.processes)]
    if args.link:
        command += ["--link", args.link]
    if args.link_delay:
        command += ["--link-delay", args.link_delay]
    return command


@contextlib.contextmanager
def running_server(command: list[str], port: int, ready_path: str = "/health") -> Iterator[str]:
    """The server `command` starts (its own process group, listening on `port`), once
    `ready_path` answers 200; yields its base URL, then stops it with SIGTERM."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    server = subprocess.Popen(command, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ready(url + ready_path):
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode} while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start in {START_TIMEOUT_S:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def long_prompt(model: str, tokens: int) -> str:
    """About `tokens` tokens of English prose and code (BOS included), cut with the model's
    tokenizer."""
    from pydoc_data.topics import topics

    from equarx_serve.generation.text import byte_tokenizer
    from models.cache import packaged_gguf_path
    from models.config import get_config
    from models.tokenizer import Tokenizer

    if model == "gemma3-270m":
        tokenizer = Tokenizer.from_gguf(packaged_gguf_path()[0])
    else:  # random-init models are served with a byte tokenizer
        tokenizer = byte_tokenizer(get_config(model).vocab_size)
    ids = tokenizer.encode("\n\n".join(topics[t] for t in ("class", "function", "if", "while")))
    if len(ids) < tokens:
        raise ValueError(f"the reference text has only {len(ids)} tokens")
    return tokenizer.decode(ids[1:tokens])


def time_to_first_token(url: str, model: str, prompt: str) -> tuple[float, int]:
    """Seconds from sending a streamed completion to its first text; and its prompt tokens."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    started = time.perf_counter()
    first = None
    prompt_tokens = 0
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - started
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    if first is None:
        raise RuntimeError("the stream had no text")
    return first, prompt_tokens


@dataclasses.dataclass(frozen=True)
class ClientsPass[T]:
    """What `run_clients` got back: each answered request's result, the requests that raised
    (counted, never retried) and the wall time of the whole pass."""

    results: list[T]
    errors: int
    wall_s: float


async def run_clients[T](
    url: str,
    clients: int,
    per_client: int,
    request: Callable[[Any, int], Awaitable[T]],
) -> ClientsPass[T]:
    """`clients` concurrent clients of the server at `url` (one official `AsyncOpenAI` client,
    no retries), each sending `per_client` requests back to back: `request(client, i)` with i
    = c * per_client + r the request's index."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )
    results: list[T] = []
    errors = 0

    async def one_client(c: int) -> None:
        nonlocal errors
        for r in range(per_client):
            try:
                results.append(await request(client, c * per_client + r))
            except Exception as e:
                errors += 1
                print(f"  error: {type(e).__name__}: {e}", file=sys.stderr)

    started = time.perf_counter()
    await asyncio.gather(*(one_client(c) for c in range(clients)))
    wall = time.perf_counter() - started
    await client.close()
    return ClientsPass(results, errors, wall)


async def load_level(
    url: str, model: str, clients: int, per_client: int, max_tokens: int
) -> LoadLevel:
    async def chat(client: Any, i: int) -> tuple[float, int]:  # (latency s, completion tokens)
        started = time.perf_counter()
        answer = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            max_tokens=max_tokens,
            temperature=0,
        )
        return time.perf_counter() - started, answer.usage.completion_tokens

    done = await run_clients(url, clients, per_client, chat)
    latencies = [latency for latency, _ in done.results]
    sent = clients * per_client
    ordered = sorted(latencies) or [float("nan")]
    return LoadLevel(
        clients=clients,
        requests=sent,
        answered=len(latencies),
        errors=done.errors,
        lost=sent - len(latencies) - done.errors,
        wall_s=done.wall_s,
        requests_per_s=len(latencies) / done.wall_s,
        latency_p50_s=statistics.median(ordered),
        latency_p99_s=percentile(ordered, 0.99),
        completion_tokens=sum(tokens for _, tokens in done.results),
    )


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile of `values` (NaN for none)."""
    ordered = sorted(values) or [float("nan")]
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def finished_on_server(url: str) -> int:
    """Requests the server says it finished (any reason)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("equarx_requests_finished_total{"):
            total += float(line.rpartition(" ")[2])
    return int(total)


def run(args: argparse.Namespace) -> dict:
    prompt = long_prompt(args.model, args.ttft_tokens) if args.ttft_repeats else ""
    result: dict = {"settings": vars(args) | {"json": str(args.json)}, "ttft": {}, "load": []}
    result["link"] = measure_link(args)
    load_method = args.load_method or args.methods[-1]
    for method in args.methods:
        for chunks in args.overlap_chunks:
            label = server_label(method, chunks, args.overlap_chunks)
            print(f"== {label}", flush=True)
            port = free_port()
            with running_server(server_command(args, method, port, chunks), port) as url:
                if args.ttft_repeats:
                    result["ttft"][label] = _measure_ttft(url, args, prompt)
                if method == load_method and chunks == args.overlap_chunks[0] and args.clients:
                    result["load_method"] = label
                    result["load"] = _measure_load(url, args)
    return result


def measure_link(args: argparse.Namespace) -> dict | None:
    """With --link: the link measured once, on emulated hosts set up as each server's are (each
    server measures its own at start and prints it), for the result's provenance."""
    if not args.link:
        return None
    with links.hosts_for(args.processes, Link.parse(args.link, args.link_delay)) as (_, measured):
        return measured


def server_label(method: str, chunks: str, all_chunks: Sequence[str]) -> str:
    """`method`, with "/overlap=K" where more than one --overlap-chunks is measured."""
    return method if len(all_chunks) == 1 else f"{method}/overlap={chunks}"


def _measure_ttft(url: str, args: argparse.Namespace, prompt: str) -> dict:
    time_to_first_token(url, args.model, prompt)  # compiles the bucket
    timed = [time_to_first_token(url, args.model, prompt) for _ in range(args.ttft_repeats)]
    seconds = [t for t, _ in timed]
    print(
        f"TTFT of {timed[0][1]} prompt tokens: median {statistics.median(seconds):.2f} s of "
        f"{[round(s, 2) for s in seconds]}"
    )
    return {
        "prompt_tokens": timed[0][1],
        "seconds": seconds,
        "median_s": statistics.median(seconds),
    }


def _measure_load(url: str, args: argparse.Namespace) -> list[dict]:
    for clients in args.clients:  # untimed: compiles the shapes each level's batches take
        per_client = max(1, len(QUESTIONS) // clients)  # every question (length) at every level
        asyncio.run(load_level(url, args.model, clients, per_client, args.max_tokens))
    levels = []
    for clients in args.clients:
        before = finished_on_server(url)
        level = asyncio.run(
            load_level(url, args.model, clients, args.requests_per_client, args.max_tokens)
        )
        finished = finished_on_server(url) - before
        if finished != level.answered + level.errors:
            raise RuntimeError(f"the server finished {finished} requests, the clients saw {level}")
        levels.append(dataclasses.asdict(level))
        print(
            f"  {clients:>3} clients: {level.requests_per_s:.2f} req/s, latency p50 "
            f"{level.latency_p50_s:.2f} s p99 {level.latency_p99_s:.2f} s, "
            f"{level.answered}/{level.requests} answered, {level.errors} errors, {level.lost} lost"
        )
    return levels


def format_summary(result: dict) -> str:
    ttft = result["ttft"]
    lines = ["| all-reduce | prompt tokens | TTFT median (s) | runs (s) |", "|---|---|---|---|"]
    for method, t in ttft.items():
        runs = ", ".join(f"{s:.2f}" for s in t["seconds"])
        lines.append(f"| `{method}` | {t['prompt_tokens']} | {t['median_s']:.2f} | {runs} |")
    if len(ttft) >= 2:
        (a, ta), (b, tb) = list(ttft.items())[:2]
        lines.append(f"\n`{b}` / `{a}` TTFT: {tb['median_s'] / ta['median_s']:.3f}x")
    if result["load"]:
        lines += [
            f"\nload on `{result['load_method']}`:",
            "| clients | requests | req/s | p50 (s) | p99 (s) | errors | lost |",
            "|---|---|---|---|---|---|---|",
        ]
        for level in result["load"]:
            lines.append(
                f"| {level['clients']} | {level['requests']} | {level['requests_per_s']:.2f} | "
                f"{level['latency_p50_s']:.2f} | {level['latency_p99_s']:.2f} | "
                f"{level['errors']} | {level['lost']} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--processes", type=int, default=2, help="0: one process")
    parser.add_argument("--methods", nargs="+", default=["psum", "equarx-int8"])
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument(
        "--weights",
        choices=(AUTO, *WEIGHTS),
        default=DEFAULT_WEIGHTS,
        help="every server's `serve --weights` (default: %(default)s, serve's own default)",
    )
    parser.add_argument(
        "--overlap-chunks",
        nargs="+",
        default=["auto"],
        type=argument_type(lambda text: str(chunks_or_auto(text))),
        metavar="K",
        help="each method's servers with `serve --overlap-chunks K` (default: auto)",
    )
    parser.add_argument("--ttft-tokens", type=int, default=2000)
    parser.add_argument("--ttft-repeats", type=int, default=5)
    parser.add_argument("--clients", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--load-method", help="the method measured under load (default: last)")
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--link", metavar="RATE", help="emulated hosts on links of RATE (root)")
    parser.add_argument("--link-delay", metavar="D", help="one-way delay of every link")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if (args.link or args.link_delay) and args.processes < 2:
        parser.error("--link and --link-delay need --processes 2 or more")
    if args.link_delay and not args.link:
        parser.error("--link-delay needs --link")
    result = run(args)
    print(format_summary(result))
    if args.json:
        document = {"provenance": provenance.collect(result.get("link"))} | result
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
