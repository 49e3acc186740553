"""`equarx-serve serve`: the OpenAI-compatible HTTP server (`equarx_serve/server/`) under uvicorn.

    equarx-serve serve [--host 127.0.0.1] [--port 8000] [--model gemma3-270m] [--tp 2]
                       [--all-reduce equarx-int8] [--max-batch 8] [--max-queue 64]
                       [--max-prompt-tokens N] [--dtype bfloat16|float32]
                       [--checkpoint PATH --tokenizer PATH]
                       [--api-key KEY] [--allowed-hosts H,...] [--no-docs]
                       [--max-body-bytes N] [--header-timeout S] [--body-timeout S]
                       [--keep-alive-timeout S] [--max-connections N]
                       [--drain-seconds S] [--graceful-timeout S]
                       [--processes N | --coordinator HOST:PORT --num-processes N
                        --process-id I [--control-port PORT]]

It loads the model, shards it over TP host devices (XLA_FLAGS
--xla_force_host_platform_device_count, set before JAX is imported), compiles the first
programs with a short warm-up generation, then listens. SIGTERM or Ctrl-C: for
--drain-seconds /health and new requests get 503 while the listener stays open, then it
closes; queued and running requests finish, those still running --graceful-timeout seconds
after the signal end with a 503 (an error event in a stream); the process exits 0. A second
signal closes the listener at once (the drain goes on); a third exits at once.

Operator settings (`equarx_serve/server/http.py`), with safe defaults: a request body limit,
deadlines for a request's head and body, idle keep-alive timeout, a connection limit, an
optional API key (--api-key or the EQUARX_API_KEY environment variable), --no-docs, and a
Host allow-list (on a loopback --host: loopback names only, against DNS rebinding).

Across processes (`equarx_serve/cli/processes.py`): `--processes N` runs N local processes joined
by gloo, TP / N devices each; on several hosts, the same command on each with its own
`--process-id`. Process 0 serves HTTP and decides each step, the others run the same steps
(the mesh spans them). If another process exits or hangs, process 0 answers every request
with 503 and exits with code 3 within seconds (`generation/replicated.py`).

This module imports neither JAX nor FastAPI until the command runs, so `--help` is fast.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import threading
from typing import Any

from equarx_serve.arguments import UsageError, argument_type, int_at_least
from equarx_serve.cli import processes
from equarx_serve.generation.model_args import (
    add_model_arguments,
    add_overlap_argument,
    check_model_arguments,
    engine_from_args,
)

DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_QUEUE = 64
# Prompt + completion tokens per request. Gemma 3 270M has a 32K context; on CPU long buckets
# compile and run slowly, so the server's default is shorter (raise it with --max-length).
DEFAULT_MAX_LENGTH = 2048
DEFAULT_GRACEFUL_TIMEOUT_S = 120.0
DEFAULT_DRAIN_S = 5.0
API_KEY_ENV = "EQUARX_API_KEY"
# After the engine failed (a lost process): time for the 503s to reach their clients.
FAILURE_EXIT_GRACE_S = 1.0

logger = logging.getLogger("equarx_serve.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `serve`."""
    parser.add_argument("--host", default="127.0.0.1", help="default: %(default)s")
    parser.add_argument(
        "--port",
        type=argument_type(int_at_least(0)),
        default=8000,
        help="default: %(default)s (0: any free port)",
    )
    add_model_arguments(parser)
    add_overlap_argument(parser)
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the id in /v1/models and requests (default: --model)",
    )
    parser.add_argument(
        "--max-batch",
        type=argument_type(int_at_least(1)),
        default=DEFAULT_MAX_BATCH,
        metavar="B",
        help="requests per device step (default: %(default)s)",
    )
    parser.add_argument(
        "--max-queue",
        type=argument_type(int_at_least(1)),
        default=DEFAULT_MAX_QUEUE,
        metavar="Q",
        help="waiting requests before 503 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=argument_type(int_at_least(1)),
        metavar="N",
        help="longest prompt accepted (default: the context length)",
    )
    parser.add_argument(
        "--max-length",
        type=argument_type(int_at_least(16)),
        default=DEFAULT_MAX_LENGTH,
        metavar="N",
        help="prompt + completion tokens of a request (default: 2048)",
    )
    parser.add_argument(
        "--batch-window-ms",
        type=float,
        default=5.0,
        metavar="MS",
        help="how long an idle worker waits to batch more requests (default: %(default)s)",
    )
    parser.add_argument(
        "--graceful-timeout",
        type=float,
        default=DEFAULT_GRACEFUL_TIMEOUT_S,
        metavar="S",
        help="on SIGTERM, how long running requests may take to "
        "finish before they are cancelled (default: %(default)s)",
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=DEFAULT_DRAIN_S,
        metavar="S",
        help="on SIGTERM, how long /health and new requests get 503 before the listener "
        "closes (default: %(default)s)",
    )
    _add_http_arguments(parser)
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    processes.add_process_arguments(parser)


def _add_http_arguments(parser: argparse.ArgumentParser) -> None:
    """The operator's limits and access settings (see the module doc)."""
    from equarx_serve.server.settings import HTTPSettings

    defaults = HTTPSettings()
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}; none)",
    )
    parser.add_argument(
        "--allowed-hosts",
        metavar="H,...",
        help="host names the Host header may name, or '*' (default: loopback names on a "
        "loopback --host, else any)",
    )
    parser.add_argument(
        "--no-docs", action="store_true", help="turn off the /docs and /redoc pages"
    )
    parser.add_argument(
        "--max-body-bytes",
        type=argument_type(int_at_least(1)),
        default=defaults.max_body_bytes,
        metavar="N",
        help="largest request body, else 413 (default: %(default)s)",
    )
    for flag, default, text in (
        ("--header-timeout", defaults.header_timeout_s, "seconds to send a request's head"),
        ("--body-timeout", defaults.body_timeout_s, "seconds to send a request's body (408)"),
        ("--keep-alive-timeout", defaults.keep_alive_s, "seconds an idle connection stays"),
        (
            "--write-timeout",
            defaults.write_timeout_s,
            "seconds a client may take none of a response's bytes before it is disconnected",
        ),
    ):
        parser.add_argument(
            flag, type=float, default=default, metavar="S", help=f"{text} (default: %(default)s)"
        )
    for flag, default, text in (
        ("--max-head-bytes", defaults.max_head_bytes, "largest request head, else 431"),
        ("--max-headers", defaults.max_headers, "most header lines in a request head (431)"),
        ("--send-buffer-bytes", defaults.send_buffer_bytes, "each connection's SO_SNDBUF"),
    ):
        parser.add_argument(
            flag,
            type=argument_type(int_at_least(1)),
            default=default,
            metavar="N",
            help=f"{text} (default: %(default)s)",
        )
    parser.add_argument(
        "--max-connections",
        type=argument_type(int_at_least(1)),
        default=defaults.max_connections,
        metavar="N",
        help="open connections (and requests) before new requests get 503; /health and "
        "/metrics still answer (default: %(default)s)",
    )


def _allowed_hosts(args: argparse.Namespace) -> tuple[str, ...]:
    """--allowed-hosts, or by default loopback names on a loopback --host ("*": any)."""
    from equarx_serve.server.settings import LOOPBACK_HOSTS

    if args.allowed_hosts is not None:
        hosts = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
        return () if "*" in hosts else hosts
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    return LOOPBACK_HOSTS if loopback else ()


def http_settings(args: argparse.Namespace) -> Any:
    """The `HTTPSettings` of the command line (UsageError for bad values)."""
    from equarx_serve.server.settings import HTTPSettings

    try:
        return HTTPSettings(
            max_body_bytes=args.max_body_bytes,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            keep_alive_s=args.keep_alive_timeout,
            max_head_bytes=args.max_head_bytes,
            max_headers=args.max_headers,
            write_timeout_s=args.write_timeout,
            send_buffer_bytes=args.send_buffer_bytes,
            max_connections=args.max_connections,
            api_key=args.api_key,
            docs=not args.no_docs,
            allowed_hosts=_allowed_hosts(args),
            drain_s=args.drain_seconds,
            graceful_timeout_s=args.graceful_timeout,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    """Load, compile, serve until SIGTERM/SIGINT; 0 after a clean shutdown."""
    check_model_arguments(args)
    if args.batch_window_ms < 0 or args.graceful_timeout < 0:
        raise UsageError("--batch-window-ms and --graceful-timeout must be >= 0")
    settings = http_settings(args)
    cluster = processes.cluster_from_args(args)
    if cluster.launch:
        return processes.launch_local("serve", cluster.launch, args)
    where = f"p{cluster.process_id} " if cluster.member else ""
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {where}%(levelname)s %(name)s: %(message)s",
    )
    if args.log_level != "debug":
        logging.getLogger("jax").setLevel(logging.WARNING)  # backend probing at import
    processes.set_up_devices(cluster, args.tp)  # XLA_FLAGS first, then JAX
    engine = engine_from_args(args, max_length=args.max_length)
    if not cluster.leader:
        return processes.run_follower(cluster, engine)
    return _serve(args, settings, engine, processes.start_leader(cluster))


def _serve(args: argparse.Namespace, settings: Any, engine: Any, leader: Any) -> int:
    """Process 0: the HTTP server; with a leader, over the processes it drives."""
    import uvicorn

    from equarx_serve.generation.generator import Generator
    from equarx_serve.generation.replicated import EXIT_CLUSTER_FAILED, ReplicatedRunner
    from equarx_serve.generation.runner import DeviceRunner
    from equarx_serve.server import create_app, drain_on_exit
    from equarx_serve.server.http import uvicorn_config

    runner = DeviceRunner(engine)
    generator = Generator(
        engine,
        max_batch=args.max_batch,
        runner=runner if leader is None else ReplicatedRunner(runner, leader),
    )

    def exit_after_failure(reason: str) -> None:
        """Every request was answered 503; leave before anything waits on the lost process."""
        timer = threading.Timer(
            FAILURE_EXIT_GRACE_S, _exit_failed, args=(reason, EXIT_CLUSTER_FAILED)
        )
        timer.daemon = True
        timer.start()

    app = create_app(
        generator,
        model_name=args.served_model_name or args.model,
        max_queue=args.max_queue,
        max_prompt_tokens=args.max_prompt_tokens,
        max_batch=args.max_batch,
        batch_window_s=args.batch_window_ms / 1e3,
        warmup=True,
        on_failure=exit_after_failure,
        http=settings,
    )
    if leader is not None:
        leader.on_failure = app.state.worker.fail  # a lost follower fails every request
    config = uvicorn_config(
        app, settings, host=args.host, port=args.port, log_level=args.log_level, lifespan="on"
    )
    server = uvicorn.Server(config)
    drain_on_exit(server, app)
    # uvicorn re-raises the signal it shut down on once it has finished, under the handlers
    # that were installed before it ran: make those no-ops so a drained shutdown exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        if leader is not None:
            leader.stop()
    return 0 if server.started else 1


def _exit_failed(reason: str, code: int) -> None:
    from equarx_serve.generation.replicated import exit_now

    logger.error("exiting with code %d: %s", code, reason)
    exit_now(code)
