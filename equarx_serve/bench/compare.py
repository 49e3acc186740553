"""`equarx-serve bench compare`: this project beside llama.cpp on the same Gemma 3 270M GGUF,
measured side by side in one run, with this machine's limits.

    equarx-serve bench compare [--seq-lens 128 512 2048] [--batches 1 8] [--max-tokens 32]
                               [--repeats 3] [--threads N] [--tp 2] [--all-reduce METHOD]
                               [--dtype bfloat16] [--serve-clients 1 4 16] [--json PATH]

One process holds both sides:
  - this project: `PrefillEngine.from_name` (the GGUF's weights in --dtype, TP = --tp host CPU
    devices, --all-reduce) and one `decode.Generator` per decode batch size;
  - llama.cpp: `llama-cpp-python` (the optional dependency group `compare`:
    `pip install -e '.[compare]'`) on the very GGUF file the project's weights come from,
    --threads threads (default: every core), its default batch sizes (n_batch 2048 tokens a
    call, n_ubatch 512 a compute step) and a KV cache of its own for each decode row.
    Without llama-cpp-python, or for another model, its columns say "skipped" and why.

What is timed, per workload, after one untimed run of every workload on every side (it
compiles the project's programs):
  prefill L  one prompt of L random token ids (fixed seed, special ids never drawn), logits at
             its last token. Project: `engine.prefill([prompt])` to `block_until_ready`.
             llama.cpp: a cleared KV cache, then `llama_decode` of the prompt (in n_batch
             chunks), logits of the last token only.
  decode B   B copies of one English prompt, greedy, --max-tokens tokens each; tokens/s from
             the first generated token to the last (the prefill excluded), in total and per
             sequence. Project: `Generator(engine, max_batch=B).generate` (its Completions'
             timings; a sequence that emits EOS stops early and counts what it produced).
             llama.cpp: the B sequences in one `llama_decode` per step (B = 1: one token),
             argmax of each row's logits in numpy, never stopping early.
Every round runs each workload on both sides, the order of the sides alternating round by
round; the tables give the median of --repeats rounds.

With --serve-clients C...: then both as servers (`bench/served.py`): `equarx-serve serve`
and llama-cpp-python's OpenAI server on the same GGUF, C concurrent clients of the official
OpenAI client at each level; output tokens/s from `usage`, latency and time to first token,
and this project's served single-stream decode rate beside its `Generator`'s.

The machine's limits, measured in the same run: GFLOP/s of a 2048^3 matmul (`jnp.dot`, one
device, f32 and bf16) and the read rate (bytes per second of a jitted sum over 256 MiB of
f32 split over every local device, all summing at once; a read-only pass: a written output
would time the page faults of a fresh buffer, ~10x slower here). From them: the prefill's
FLOP-bound floor (the model's FLOPs, `prefill_flops`, at the faster matmul rate) and
decode's ceiling (a step reads every weight once: weight bytes at the read rate, or the
batch's FLOPs at the matmul rate, whichever takes longer), for the project's weights in
--dtype and for the GGUF file's bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from equarx_serve.arguments import UsageError, argument_type, int_at_least
from equarx_serve.bench import provenance
from equarx_serve.bench.prefill import _seq_len
from equarx_serve.bench.served import ServedComparison, compare_servers, format_served
from equarx_serve.bench.text import right_aligned
from equarx_serve.collectives.registry import MethodSpec, parse_method
from equarx_serve.distributed.devices import set_host_device_count
from equarx_serve.generation.model_args import (
    add_model_arguments,
    check_model_arguments,
)
from models.config import GGUF_MODEL

DEFAULT_SEQ_LENS = (128, 512, 2048)
DEFAULT_BATCHES = (1, 8)
DEFAULT_MAX_TOKENS = 32
DEFAULT_REPEATS = 3
LLAMA_MODEL = GGUF_MODEL  # the model whose GGUF file llama.cpp can run beside ours
INSTALL_HINT = "pip install -e '.[compare]' (builds llama.cpp: ~8 min on 2 cores)"
# The decode prompt: plain English, so that greedy continuations run on without an EOS.
DECODE_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press into a "
    "system that could produce books far faster than scribes. Within fifty years"
)
MATMUL_SIZE = 2048
READ_MIB = 256


# -- Workloads and what each side reports --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """kind "prefill" (size: prompt tokens) or "decode" (size: sequences in the batch)."""

    kind: str
    size: int

    @property
    def label(self) -> str:
        return f"prefill {self.size}" if self.kind == "prefill" else f"decode batch {self.size}"


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    """One batch's decode: `tokens` generated after each sequence's first (summed over the
    batch) in `seconds`, from the first token to the last; `first_sequence`: the tokens the
    batch's first sequence generated (its first included)."""

    batch: int
    tokens: int
    seconds: float
    first_sequence: tuple[int, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Side(Protocol):
    """One implementation under test."""

    name: str

    def prefill(self, tokens: list[int]) -> float:
        """Seconds for the prefill of one prompt (last-token logits)."""
        ...

    def decode(self, prompt: list[int], batch: int, max_tokens: int) -> DecodeRun:
        """Greedy decode of `batch` copies of `prompt`, `max_tokens` tokens each."""
        ...


@dataclasses.dataclass(frozen=True)
class CompareConfig:
    """What `run` measures (see the module doc)."""

    model: str = LLAMA_MODEL
    tp: int = 2
    all_reduce: MethodSpec = dataclasses.field(default_factory=lambda: parse_method("psum"))
    dtype: str = "bfloat16"
    weights: str = "bf16"  # the decode weights (`PrefillEngine.from_name`)
    checkpoint: Path | None = None  # an orbax checkpoint and its tokenizer (llama.cpp skipped)
    tokenizer: Path | None = None
    seq_lens: tuple[int, ...] = DEFAULT_SEQ_LENS
    batches: tuple[int, ...] = DEFAULT_BATCHES
    max_tokens: int = DEFAULT_MAX_TOKENS
    repeats: int = DEFAULT_REPEATS
    threads: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    serve_clients: tuple[int, ...] = ()  # concurrency levels of the serving comparison
    json_path: Path | None = None
    seed: int = 0
    matmul_size: int = MATMUL_SIZE
    read_mib: int = READ_MIB

    @property
    def workloads(self) -> list[Workload]:
        return [Workload("prefill", n) for n in self.seq_lens] + [
            Workload("decode", b) for b in self.batches
        ]


# -- The model's cost and the machine's limits ---------------------------------------------------


def _num_params(config: Any) -> tuple[int, int, int]:
    """(matrix parameters outside the embedding table, the table's, every parameter) of a
    Gemma 3 config; the rest are norm scales (no matmul)."""
    import jax

    from models.gemma3 import param_shapes

    shapes = param_shapes(config)
    embedding = math.prod(shapes["embedder"]["input_embedding"])
    leaves = jax.tree.leaves(shapes, is_leaf=lambda s: isinstance(s, tuple))
    matrices = sum(math.prod(s) for s in leaves if len(s) >= 2) - embedding
    return matrices, embedding, sum(math.prod(s) for s in leaves)


def prefill_flops(config: Any, length: int) -> float:
    """Multiply-adds x 2 of one prompt's prefill with last-token logits: every layer's
    projections at every position, causal attention (local layers: the window only), the
    head at the last position."""
    from models.config import AttentionType

    matrices, embedding, _ = _num_params(config)
    attention = 0
    width = config.num_heads * config.head_dim
    for kind in config.attention_types:
        reach = config.sliding_window_size if kind == AttentionType.LOCAL_SLIDING else length
        keys = sum(min(t + 1, reach) for t in range(length))  # keys each query attends to
        attention += 2 * 2 * width * keys  # q.k and p.v
    return 2.0 * matrices * length + attention + 2.0 * embedding


def decode_flops_per_token(config: Any) -> float:
    """Multiply-adds x 2 of one decode token (projections and head; attention over a short
    context is negligible beside them)."""
    matrices, embedding, _ = _num_params(config)
    return 2.0 * (matrices + embedding)


def weight_bytes(config: Any, itemsize: int) -> int:
    """Bytes of every weight (the tied table once) at `itemsize` bytes a parameter."""
    return _num_params(config)[2] * itemsize


@dataclasses.dataclass(frozen=True)
class MachineLimits:
    """matmul_gflops: {dtype: GFLOP/s of an n^3 `jnp.dot` on one device}; read_gb_s: GB/s
    read by a sum over every local device (see the module doc)."""

    matmul_gflops: dict[str, float]
    read_gb_s: float
    matmul_size: int
    read_mib: int

    @property
    def best_gflops(self) -> float:
        return max(self.matmul_gflops.values())

    def prefill_floor_ms(self, flops: float) -> float:
        """The FLOP-bound floor: every FLOP at the faster matmul rate."""
        return flops / (self.best_gflops * 1e9) * 1e3

    def decode_ceiling(self, bytes_per_step: float, flops_per_token: float, batch: int) -> float:
        """Total tokens/s when a step reads every weight once (at the read rate) or computes
        its batch's FLOPs (at the matmul rate), whichever takes longer."""
        step_s = max(
            bytes_per_step / (self.read_gb_s * 1e9),
            batch * flops_per_token / (self.best_gflops * 1e9),
        )
        return batch / step_s


def _median_seconds(fn: Callable[..., Any], *args: Any, repeats: int = 5) -> float:
    """The median seconds of `fn(*args)` (jitted) over `repeats` calls after a first one."""
    import jax

    jax.block_until_ready(fn(*args))  # compile, warm caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_machine(matmul_size: int = MATMUL_SIZE, read_mib: int = READ_MIB) -> MachineLimits:
    """The matmul and read rates (module doc), each the median of 5 runs."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    device = jax.devices()[0]
    n = matmul_size
    rates = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        a = jax.device_put(jnp.ones((n, n), dtype), device)
        b = jax.device_put(jnp.ones((n, n), dtype), device)
        rates[jnp.dtype(dtype).name] = 2 * n**3 / _median_seconds(jax.jit(jnp.dot), a, b) / 1e9
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("d",))
    elements = read_mib * 2**20 // 4 // len(devices) * len(devices)
    x = jax.device_put(jnp.ones((elements,), jnp.float32), NamedSharding(mesh, P("d")))
    total = jax.jit(jax.shard_map(lambda v: jnp.sum(v, keepdims=True), mesh=mesh,
                                  in_specs=P("d"), out_specs=P("d")))  # fmt: skip
    read = elements * 4 / _median_seconds(total, x) / 1e9
    return MachineLimits(rates, read, matmul_size, read_mib)


# -- The two sides -------------------------------------------------------------------------------


def decode_run_from_completions(completions: Sequence[Any]) -> DecodeRun:
    """A `DecodeRun` from one `Generator.generate` call's Completions: the tokens after each
    one's first (decode_tokens_per_s x decode time) over the span from the earliest first token
    to the latest last one."""
    tokens = sum(round(c.decode_tokens_per_s * c.decode_ms / 1e3) for c in completions)
    start = min(c.time_to_first_token_ms for c in completions)
    end = max(c.time_to_first_token_ms + c.decode_ms for c in completions)
    first = tuple(completions[0].tokens)
    return DecodeRun(len(completions), tokens, (end - start) / 1e3, first)


class ProjectSide:
    """This project: the engine's prefill and a `Generator` per batch size."""

    def __init__(self, engine: Any, batches: Sequence[int]):
        from equarx_serve.generation.generator import Generator

        self.engine = engine
        self.generators = {b: Generator(engine, max_batch=b) for b in batches}
        self.tokenizer = self.generators[batches[0]].tokenizer
        dtype = engine.dtype.name if hasattr(engine.dtype, "name") else str(engine.dtype)
        weights = {
            "bf16": "",
            "gguf": ", decode on the GGUF's blocks",
            "auto": ", decode on the GGUF's blocks at 1 row",
        }[engine.weights]
        self.name = f"this project (TP={engine.tp}, {dtype}, {engine.all_reduce.name}{weights})"

    def generator(self, batch: int) -> Any:
        """The `Generator` of `batch` rows (made on first use outside --batches)."""
        from equarx_serve.generation.generator import Generator

        if batch not in self.generators:
            self.generators[batch] = Generator(self.engine, max_batch=batch)
        return self.generators[batch]

    def prefill(self, tokens: list[int]) -> float:
        import jax

        start = time.perf_counter()
        jax.block_until_ready(self.engine.prefill([tokens]))
        return time.perf_counter() - start

    def decode(self, prompt: list[int], batch: int, max_tokens: int) -> DecodeRun:
        from equarx_serve.generation.generator import SamplingParams

        params = SamplingParams(max_tokens=max_tokens)
        completions = self.generators[batch].generate([prompt] * batch, params)
        return decode_run_from_completions(completions)


class LlamaCppSide:
    """llama.cpp through `llama-cpp-python`'s C API: one context with `n_seq_max` sequences of
    up to `context` tokens each (see the module doc)."""

    def __init__(self, gguf_path: Path, *, threads: int, context: int, n_seq_max: int):
        import llama_cpp

        self._llama = llama_cpp
        # llama-cpp-python prints llama.cpp's log through this logger: errors only.
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        self._model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), model_params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = context * n_seq_max  # split evenly: each sequence its own cache
        ctx_params.n_seq_max = n_seq_max
        self.n_batch = ctx_params.n_batch
        ctx_params.n_threads = ctx_params.n_threads_batch = threads
        self._ctx = llama_cpp.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create a context")
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(vocab)
        self._batch = llama_cpp.llama_batch_init(max(self.n_batch, n_seq_max), 0, n_seq_max)
        version = getattr(llama_cpp, "__version__", "?")
        self.name = f"llama.cpp ({threads} threads, llama-cpp-python {version})"

    def close(self) -> None:
        self._llama.llama_batch_free(self._batch)
        self._llama.llama_free(self._ctx)
        self._llama.llama_model_free(self._model)

    def _clear(self) -> None:
        self._llama.llama_memory_clear(self._llama.llama_get_memory(self._ctx), True)

    def _decode(self, entries: Sequence[tuple[int, int, int, bool]]) -> None:
        """One `llama_decode` of (token, position, sequence, wants logits) entries."""
        batch = self._batch
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        if status := self._llama.llama_decode(self._ctx, batch):
            raise RuntimeError(f"llama_decode returned {status}")

    def _prompt(self, tokens: Sequence[int], seq: int) -> None:
        """The prompt of sequence `seq` in n_batch chunks, logits at its last token."""
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            last = start + len(chunk) == len(tokens)
            self._decode([
                (t, start + i, seq, last and i == len(chunk) - 1) for i, t in enumerate(chunk)
            ])  # fmt: skip

    def _argmax(self, row: int) -> int:
        import numpy as np

        logits = self._llama.llama_get_logits_ith(self._ctx, row)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.vocab_size,))))

    def prefill(self, tokens: list[int]) -> float:
        self._clear()
        start = time.perf_counter()
        self._prompt(tokens, 0)
        self._llama.llama_synchronize(self._ctx)
        return time.perf_counter() - start

    def decode(self, prompt: list[int], batch: int, max_tokens: int) -> DecodeRun:
        self._clear()
        for seq in range(batch):
            self._prompt(prompt, seq)
            # The sequences share the prompt: their first tokens are the same.
        next_tokens = [self._argmax(-1)] * batch
        first_sequence = [next_tokens[0]]
        start = time.perf_counter()
        for step in range(max_tokens - 1):
            position = len(prompt) + step
            self._decode([(next_tokens[s], position, s, True) for s in range(batch)])
            next_tokens = [self._argmax(s) for s in range(batch)]
            first_sequence.append(next_tokens[0])
        seconds = time.perf_counter() - start
        return DecodeRun(batch, batch * (max_tokens - 1), seconds, tuple(first_sequence))


LlamaFactory = Callable[[CompareConfig, Any, int], "Side | str"]


def open_llama_cpp(config: CompareConfig, engine: Any, context: int) -> Side | str:
    """llama.cpp on the GGUF file the engine's weights came from, or why it cannot run."""
    gguf = engine.info.get("gguf_path")
    if config.model != LLAMA_MODEL or gguf is None:
        return (
            f"llama.cpp runs beside the packaged {LLAMA_MODEL} GGUF only (here: {config.model}"
            + (f", {config.checkpoint})" if config.checkpoint else ")")
        )
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama-cpp-python is not installed: {INSTALL_HINT}"
    return LlamaCppSide(
        Path(gguf), threads=config.threads, context=context, n_seq_max=max(config.batches)
    )


# -- The run -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One workload on one side: prefill milliseconds, or decode runs, one per round."""

    workload: Workload
    side: str
    prefill_ms: list[float] = dataclasses.field(default_factory=list)
    decode: list[DecodeRun] = dataclasses.field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.prefill_ms)

    @property
    def tokens_per_s(self) -> float:
        """Total tokens/s (all sequences), the median over rounds."""
        return statistics.median(run.tokens_per_s for run in self.decode)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"workload": self.workload.label, "side": self.side}
        if self.workload.kind == "prefill":
            out.update(median_ms=self.median_ms, times_ms=self.prefill_ms)
        else:
            out.update(
                tokens_per_s=self.tokens_per_s,
                tokens_per_s_per_sequence=self.tokens_per_s / self.workload.size,
                runs=[dataclasses.asdict(r) for r in self.decode],
            )
        return out


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Everything one run measured."""

    rows: dict[tuple[Workload, str], Row]
    sides: list[str]  # names, the project first
    skipped: str | None  # why llama.cpp did not run
    machine: MachineLimits
    limits: dict[str, dict[str, float]]  # per workload label: floor / ceilings
    decode_prompt_tokens: int
    served: ServedComparison | None = None  # with --serve-clients


def _one(side: Side, workload: Workload, prompts: dict[int, list[int]], config: CompareConfig):
    if workload.kind == "prefill":
        return side.prefill(prompts[workload.size]) * 1e3
    return side.decode(prompts[0], workload.size, config.max_tokens)


def measure(
    sides: Sequence[Side], prompts: dict[int, list[int]], config: CompareConfig
) -> dict[tuple[Workload, str], Row]:
    """One untimed run of every workload on every side, then `repeats` rounds, each running
    every workload on every side, the sides' order alternating round by round."""
    from tqdm import tqdm

    rows = {(w, s.name): Row(w, s.name) for w in config.workloads for s in sides}
    total = (config.repeats + 1) * len(rows)
    with tqdm(total=total, desc="bench compare", unit="run") as bar:
        for r in range(-1, config.repeats):  # round -1: warm-up
            for workload in config.workloads:
                shift = max(r, 0) % len(sides)
                for side in [*sides[shift:], *sides[:shift]]:
                    bar.set_postfix_str(f"{workload.label}: {side.name}")
                    value = _one(side, workload, prompts, config)
                    bar.update(1)
                    if r < 0:
                        continue
                    row = rows[workload, side.name]
                    if workload.kind == "prefill":
                        row.prefill_ms.append(value)
                    else:
                        row.decode.append(value)
    return rows


def _limits(config: CompareConfig, engine: Any, machine: MachineLimits, gguf_bytes: int | None):
    import jax.numpy as jnp

    model = engine.config
    limits: dict[str, dict[str, float]] = {}
    for w in config.workloads:
        if w.kind == "prefill":
            flops = prefill_flops(model, w.size)
            limits[w.label] = {"flops": flops, "floor_ms": machine.prefill_floor_ms(flops)}
            continue
        per_token = decode_flops_per_token(model)
        ours = weight_bytes(model, jnp.dtype(config.dtype).itemsize)
        limits[w.label] = {"ceiling_tokens_per_s": machine.decode_ceiling(ours, per_token, w.size)}
        if gguf_bytes is not None:
            limits[w.label]["ceiling_gguf_tokens_per_s"] = machine.decode_ceiling(
                gguf_bytes, per_token, w.size
            )
    return limits


def _load_engine(config: CompareConfig) -> Any:
    import jax.numpy as jnp

    from equarx_serve.collectives import get_all_reduce
    from equarx_serve.generation.prefill import PrefillEngine

    all_reduce = get_all_reduce(config.all_reduce.name, **config.all_reduce.options)
    try:
        return PrefillEngine.from_name(
            config.model, config.tp, all_reduce, config.checkpoint, config.tokenizer,
            dtype=jnp.dtype(config.dtype), max_length=max(*config.seq_lens, 1024),
            weights=config.weights,
        )  # fmt: skip
    except ValueError as e:
        raise UsageError(str(e)) from None


def compare(config: CompareConfig, llama: LlamaFactory = open_llama_cpp) -> Comparison:
    """Loads both sides, measures the machine and every workload (module doc)."""
    from equarx_serve.bench.prefill_worker import random_prompts

    engine = _load_engine(config)
    project = ProjectSide(engine, config.batches)
    decode_prompt = project.tokenizer.encode(DECODE_PROMPT)
    if len(decode_prompt) + config.max_tokens > engine.max_length:
        raise UsageError(f"--max-tokens {config.max_tokens} is too long for this model")
    special = [] if engine.tokenizer is None else list(engine.tokenizer.special_tokens.values())
    prompts = {0: decode_prompt}
    for n in config.seq_lens:
        [prompts[n]] = random_prompts(1, n, engine.config.vocab_size, special, config.seed + n)
    context = max(*config.seq_lens, len(decode_prompt) + config.max_tokens)  # tokens a sequence
    other = llama(config, engine, context)
    sides: list[Side] = [project] if isinstance(other, str) else [project, other]
    machine = measure_machine(config.matmul_size, config.read_mib)
    try:
        rows = measure(sides, prompts, config)
    finally:
        if hasattr(other, "close"):
            other.close()
    gguf = engine.info.get("gguf_path")
    gguf_bytes = os.path.getsize(gguf) if gguf else None
    served = None
    if config.serve_clients:
        served = compare_servers(
            config, project.generator(1), project.tokenizer, Path(gguf) if gguf else None,
            other if isinstance(other, str) else None,
        )  # fmt: skip
    return Comparison(
        rows=rows,
        sides=[s.name for s in sides],
        skipped=other if isinstance(other, str) else None,
        machine=machine,
        limits=_limits(config, engine, machine, gguf_bytes),
        decode_prompt_tokens=len(decode_prompt),
        served=served,
    )


# -- Reports -------------------------------------------------------------------------------------


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def format_report(result: Comparison, config: CompareConfig) -> str:
    project, llama = result.sides[0], result.sides[1] if len(result.sides) > 1 else None
    m = result.machine
    text = [
        f"\n== {config.model} on this machine ({os.cpu_count()} cores), measured side by side, "
        f"median of {config.repeats} interleaved rounds ==",
        f"A: {project}",
        f"B: {llama if llama else 'llama.cpp: skipped: ' + str(result.skipped)}",
        f"machine: matmul {m.matmul_size}^3 "
        + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in m.matmul_gflops.items())
        + f" (one device); read {m.read_gb_s:.1f} GB/s ({m.read_mib} MiB, every device)",
        "\nprefill, one prompt, last-token logits (ms)",
    ]
    lines = [["tokens", "A ms", "B ms", "A speed / B", "FLOP-bound floor ms", "A / floor"]]
    for w in config.workloads:
        if w.kind != "prefill":
            continue
        a = result.rows[w, project].median_ms
        b = result.rows[w, llama].median_ms if llama else None
        floor = result.limits[w.label]["floor_ms"]
        lines.append([
            str(w.size), f"{a:.0f}", "-" if b is None else f"{b:.0f}",
            "-" if b is None else f"{b / a:.2f}x", f"{floor:.0f}", f"{a / floor:.1f}x",
        ])  # fmt: skip
    text += right_aligned(lines)
    text.append(
        f"\ndecode, greedy, {config.max_tokens} tokens a sequence after a "
        f"{result.decode_prompt_tokens}-token prompt (tokens/s: total, per sequence)"
    )
    lines = [["batch", "A total", "A /seq", "B total", "B /seq", "A speed / B",
              f"ceiling {config.dtype}", "ceiling GGUF"]]  # fmt: skip
    for w in config.workloads:
        if w.kind != "decode":
            continue
        a = result.rows[w, project].tokens_per_s
        b = result.rows[w, llama].tokens_per_s if llama else None
        lim = result.limits[w.label]
        gguf = lim.get("ceiling_gguf_tokens_per_s")
        lines.append([
            str(w.size), f"{a:.1f}", f"{a / w.size:.1f}",
            "-" if b is None else f"{b:.1f}", "-" if b is None else f"{b / w.size:.1f}",
            "-" if b is None else f"{a / b:.2f}x", f"{lim['ceiling_tokens_per_s']:.0f}",
            "-" if gguf is None else f"{gguf:.0f}",
        ])  # fmt: skip
    text += right_aligned(lines)
    if llama:
        text.append("greedy continuations (the batch's first sequence), tokens in common:")
        for w in config.workloads:
            if w.kind == "decode":
                a = result.rows[w, project].decode[0].first_sequence
                b = result.rows[w, llama].decode[0].first_sequence
                text.append(
                    f"  batch {w.size}: {common_prefix(a, b)} of {len(b)} before they differ"
                )
    if result.served:
        text += format_served(result.served)
    text.append(
        "A speed / B > 1: this project is faster. Floor / ceilings: this machine's limits for "
        "this model (FLOPs at the measured matmul rate; weights read once a step at the "
        "measured read rate), not measurements of either side."
    )
    return "\n".join(text)


def write_json(result: Comparison, config: CompareConfig, path: Path) -> None:
    import jax

    settings = {
        "model": config.model,
        "tp": config.tp,
        "all_reduce": dataclasses.asdict(config.all_reduce),
        "dtype": config.dtype,
        "weights": config.weights,
        "seq_lens": list(config.seq_lens),
        "batches": list(config.batches),
        "max_tokens": config.max_tokens,
        "serve_clients": list(config.serve_clients),
        "repeats": config.repeats,
        "threads": config.threads,
        "seed": config.seed,
        "sides": result.sides,
        "llama_cpp_skipped": result.skipped,
        "decode_prompt_tokens": result.decode_prompt_tokens,
        "jax_version": jax.__version__,
        "python_version": platform.python_version(),
        "host_cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    report = {
        "provenance": provenance.collect(),
        "settings": settings,
        "machine": dataclasses.asdict(result.machine),
        "limits": result.limits,
        "rows": [row.to_json() for row in result.rows.values()],
        "served": result.served.to_json() if result.served else None,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def run(config: CompareConfig, llama: LlamaFactory = open_llama_cpp) -> int:
    """Measures, prints the report, writes the JSON if asked; 0 on success."""
    set_host_device_count(config.tp)  # before JAX starts (later calls change nothing)
    result = compare(config, llama)
    print(format_report(result, config))
    if result.skipped:
        print(f"llama.cpp skipped: {result.skipped}", file=sys.stderr)
    if config.json_path:
        write_json(result, config, config.json_path)
        print(f"wrote {config.json_path}")
    return 0


# -- Command line --------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `bench compare`."""
    model = parser.add_argument_group("this project")
    add_model_arguments(model)
    work = parser.add_argument_group("workloads")
    work.add_argument("--seq-lens", nargs="+", type=argument_type(_seq_len),
                      default=list(DEFAULT_SEQ_LENS), metavar="L",
                      help="prefill prompt lengths (default: %(default)s)")  # fmt: skip
    work.add_argument("--batches", nargs="+", type=argument_type(int_at_least(1)),
                      default=list(DEFAULT_BATCHES), metavar="B",
                      help="decode batch sizes (default: %(default)s)")  # fmt: skip
    work.add_argument("--max-tokens", type=argument_type(int_at_least(2)),
                      default=DEFAULT_MAX_TOKENS, metavar="N",
                      help="tokens generated a sequence (default: %(default)s)")  # fmt: skip
    work.add_argument("--repeats", type=argument_type(int_at_least(1)), default=DEFAULT_REPEATS,
                      metavar="R", help="timed rounds (default: %(default)s)")  # fmt: skip
    work.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    work.add_argument("--serve-clients", nargs="+", type=argument_type(int_at_least(1)),
                      default=[], metavar="C",
                      help="then both as servers at C concurrent clients each (e.g. 1 4 16; "
                      "default: not run)")  # fmt: skip
    parser.add_argument("--threads", type=argument_type(int_at_least(1)), default=os.cpu_count(),
                        metavar="N", help="llama.cpp's threads (default: %(default)s, the "
                        "cores)")  # fmt: skip
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every number here")


def config_from_args(args: argparse.Namespace) -> CompareConfig:
    from equarx_serve.bench.allreduce import resolve_methods

    check_model_arguments(args)
    resolve_methods([args.all_reduce])  # UsageError for an unknown name or option
    return CompareConfig(
        model=args.model,
        tp=args.tp,
        all_reduce=args.all_reduce,
        dtype=args.dtype,
        weights=args.weights,
        checkpoint=args.checkpoint,
        tokenizer=args.tokenizer,
        seq_lens=tuple(sorted(set(args.seq_lens))),
        batches=tuple(sorted(set(args.batches))),
        max_tokens=args.max_tokens,
        serve_clients=tuple(sorted(set(args.serve_clients))),
        repeats=args.repeats,
        threads=args.threads,
        json_path=args.json,
        seed=args.seed,
    )
