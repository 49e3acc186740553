"""The evaluation run: every method's forward pass against the BF16 `psum` reference.

    config = EvalConfig(model="gemma3-270m", tp=2, methods=DEFAULT_METHODS)
    report = run_eval(config)  # {"reference": "psum", "methods": {...}, "settings": {...}}

The model is loaded and sharded once; every method is an engine on the same parameters
(`PrefillEngine.with_all_reduce`). The corpus is cut into windows once (`eval.corpus`), and
for each batch of windows the reference and the `psum-f32` floor run once, then every other
method; each method's logits are scored against the reference's and its all-reduce outputs
against the floor's (`eval.metrics`), then dropped, so memory holds one batch's logits for
three runs, never a method's whole corpus. Greedy agreement decodes the same prompts with
every method (`equarx_serve.decode.Generator`, KV cache, the method on every all-reduce).

Quantized methods run with their size gate off (`min_size_bytes=0`) unless the method spec
sets it: the harness measures what the quantized collective does to every reduction, the
worst case a deployment can meet, not what a threshold happens to let through at this size.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.metadata
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from equarx_serve.collectives.registry import MethodSpec, get_all_reduce, parse_method
from equarx_serve.model_args import DEFAULT_MODEL

if TYPE_CHECKING:
    from equarx_serve.collectives import AllReduce

REFERENCE = "psum"
FLOOR = "psum-f32"
DEFAULT_METHODS = ("psum", "psum-f32", "ring", "naive-int8", "equarx-int8")
DEFAULT_SEQ_LEN = 512
DEFAULT_NUM_SEQS = 16


# Windows per forward pass. The logits come back replicated on every device ([B, L, V], V =
# 262144 for Gemma 3: 256 MiB per 512-token window in bf16, on each device), so the default
# shrinks as TP grows: at TP = 4 a batch of 2 went past 21 GiB and was killed on a 24 GiB
# machine.
def default_batch_size(tp: int) -> int:
    return 2 if tp <= 2 else 1


DEFAULT_GREEDY_PROMPTS = 8
DEFAULT_GREEDY_PROMPT_LEN = 64
DEFAULT_GREEDY_TOKENS = 32
VERSIONED_PACKAGES = ("jax", "jaxlib", "flax", "numpy", "gemma", "equarx-serve")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """What `run_eval` measures. `methods` always gains the reference and the floor."""

    model: str = DEFAULT_MODEL
    tp: int = 2
    methods: tuple[MethodSpec, ...] = tuple(parse_method(m) for m in DEFAULT_METHODS)
    text: Path | None = None  # None: the default corpus
    seq_len: int = DEFAULT_SEQ_LEN
    num_seqs: int = DEFAULT_NUM_SEQS
    batch_size: int | None = None  # None: default_batch_size(tp)
    greedy_prompts: int = DEFAULT_GREEDY_PROMPTS
    greedy_prompt_len: int = DEFAULT_GREEDY_PROMPT_LEN
    greedy_tokens: int = DEFAULT_GREEDY_TOKENS
    checkpoint: Path | None = None
    tokenizer: Path | None = None

    def all_methods(self) -> tuple[MethodSpec, ...]:
        """The reference, the floor, then the rest in the order given (each once)."""
        specs = [parse_method(REFERENCE), parse_method(FLOOR)]
        specs += [m for m in self.methods if m.label not in (REFERENCE, FLOOR)]
        return tuple(specs)


def _with_gate_off(spec: MethodSpec) -> AllReduce:
    """The all-reduce the harness runs `spec` with: its gate off unless the spec sets one
    (any option of the method that `ungated()` changes)."""
    ar = get_all_reduce(spec)
    ungated = ar.ungated()
    gate_options = {k for k, v in ungated.options().items() if ar.options()[k] != v}
    return ar if gate_options & set(spec.options) else ungated


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "platform": platform.platform()}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


class _MethodScores:
    """Per-token arrays and per-site sums of one method, accumulated over batches."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[np.ndarray]] = {}
        self.site_sums: np.ndarray | None = None

    def add(self, token_metrics: dict[str, Any], num_scored: int, site_sums: Any) -> None:
        for key, value in token_metrics.items():
            scored = np.asarray(value)[:, :num_scored]
            self.tokens.setdefault(key, []).append(scored.reshape(-1))
        sums = np.asarray(site_sums, np.float64)
        self.site_sums = sums if self.site_sums is None else self.site_sums + sums

    def per_token(self) -> dict[str, np.ndarray]:
        return {key: np.concatenate(values) for key, values in self.tokens.items()}


def run_eval(
    config: EvalConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
    log: Callable[[str], None] = lambda message: None,
) -> dict[str, Any]:
    """Runs the evaluation (see module doc); `progress(n, total)` after every n of `total`
    windows scored.
    Returns the report: {"reference", "floor", "methods": {label: numbers}, "settings"}.
    ValueError for bad settings (unknown method, model that cannot split TP ways, text too
    short...)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from equarx_serve.decode import Generator, SamplingParams, byte_tokenizer
    from equarx_serve.engine import PrefillEngine
    from eval import corpus as corpus_lib
    from eval import metrics
    from models.gemma3 import AXIS

    started = time.perf_counter()
    specs = config.all_methods()
    all_reduces = {spec.label: _with_gate_off(spec) for spec in specs}

    max_length = max(config.seq_len, config.greedy_prompt_len + config.greedy_tokens)
    log(f"loading {config.model} at TP={config.tp}")
    if config.tp == 1:
        log("warning: at TP=1 there is nothing to all-reduce; every method equals the reference")
    base = PrefillEngine.from_name(
        config.model,
        config.tp,
        all_reduces[REFERENCE],
        config.checkpoint,
        config.tokenizer,
        max_length=max_length,
    )
    engines = {label: base.with_all_reduce(ar) for label, ar in all_reduces.items()}
    engines[REFERENCE] = base
    tokenizer = base.tokenizer or byte_tokenizer(base.config.vocab_size)

    corpus = corpus_lib.load_corpus(config.text) if config.text else corpus_lib.default_corpus()
    stream = corpus_lib.token_stream(corpus, tokenizer)
    windows = corpus_lib.make_windows(
        stream, tokenizer.bos_id, seq_len=config.seq_len, num_seqs=config.num_seqs
    )
    log(f"corpus: {corpus.name}, {len(stream)} tokens, {len(windows)} windows of {config.seq_len}")

    num_scored = config.seq_len - 1
    scores = {label: _MethodScores() for label in engines}
    site_names: list[str] = []
    batch_size = config.batch_size or default_batch_size(config.tp)
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        # Peak memory: the reference's logits, laid out over the devices (once), the floor's
        # trace, and one method's replicated logits at a time.
        tokens = batch.tolist()
        first = {label: engines[label].prefill(tokens, last_only=False, capture=True)
                 for label in (REFERENCE, FLOOR)}  # fmt: skip
        bucket = first[REFERENCE].bucket
        targets = np.zeros((len(batch), bucket), np.int32)  # beyond num_scored: not scored
        targets[:, :num_scored] = batch[:, 1:]
        split = functools.partial(metrics.split_positions, mesh=base.mesh, axis_name=AXIS)
        targets = split(jax.device_put(targets, NamedSharding(base.mesh, P())))
        reference_logits = split(first[REFERENCE].logits)
        f32_trace = jax.tree.map(metrics.local_copy, first[FLOOR].trace)
        site_names = [name for name, _ in metrics.sites(f32_trace)]
        for label, engine in engines.items():
            result = first.pop(label, None) or engine.prefill(tokens, last_only=False, capture=True)
            trace = jax.tree.map(metrics.local_copy, result.trace)
            scores[label].add(
                metrics.token_metrics(reference_logits, split(result.logits), targets),
                num_scored,
                metrics.site_errors(trace, f32_trace, num_tokens=config.seq_len),
            )
            del result, trace
        del reference_logits, f32_trace
        if progress:
            progress(len(batch), len(windows))

    reports = {}
    reference_tokens = scores[REFERENCE].per_token()
    reference_ppl = float(np.exp(np.mean(reference_tokens["nll"], dtype=np.float64)))
    for label, score in scores.items():
        per_site = metrics.summarize_sites(site_names, score.site_sums)
        summary = metrics.summarize(score.per_token(), reference_ppl)
        summary["nonfinite_all_reduce"] = sum(site["nonfinite"] for site in per_site)
        summary["nonfinite"] = summary["nonfinite_logits"] + summary["nonfinite_all_reduce"]
        summary["born_error_max"] = float(np.max([site["born_error"] for site in per_site]))
        summary["final_layer_error"] = per_site[-1]["error"]
        reports[label] = {**summary, "per_layer": per_site}

    prompts: list[list[int]] = []
    if config.greedy_prompts > 0 and config.greedy_tokens > 0:
        prompts = corpus_lib.prompts_from_windows(
            windows, config.greedy_prompt_len, config.greedy_prompts
        )
        log(f"greedy: {len(prompts)} prompts x {config.greedy_tokens} tokens per method")
        sampling = SamplingParams(max_tokens=config.greedy_tokens)
        # Completion.tokens leaves the stop token out; put it back, so that stopping where
        # the reference went on (or the reverse) counts as a divergence.
        generated = {
            label: [
                c.tokens + ([tokenizer.eos_id] if c.finish_reason == "stop" else [])
                for c in Generator(engine, max_batch=len(prompts)).generate(prompts, sampling)
            ]
            for label, engine in engines.items()
        }
        for label in engines:
            reports[label].update(metrics.greedy_agreement(generated[REFERENCE], generated[label]))

    settings = {
        "model": config.model,
        "model_info": base.info,
        "dtype": str(base.dtype),
        "tp": config.tp,
        "devices": [str(d) for d in base.mesh.devices.flat],
        "methods": {
            label: {"name": ar.name, "options": ar.options()} for label, ar in all_reduces.items()
        },
        "size_gate": "off: min_size_bytes=0 unless a method spec sets it",
        "corpus": {**corpus.describe(), "tokens": len(stream)},
        "seq_len": config.seq_len,
        "num_seqs": len(windows),
        "batch_size": batch_size,
        "scored_tokens": len(windows) * num_scored,
        "greedy": {
            "prompts": len(prompts),
            "prompt_len": config.greedy_prompt_len,
            "tokens": config.greedy_tokens,
        },
        "versions": _versions(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    return {"reference": REFERENCE, "floor": FLOOR, "methods": reports, "settings": settings}
