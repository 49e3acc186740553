"""The evaluation run: every method's forward pass against the BF16 `psum` reference, next to
the compute floor.

    config = EvalConfig(model="gemma3-270m", tp=2, methods=DEFAULT_METHODS)
    report = run_eval(config)  # {"reference": "psum", "compute_floor": {...}, "methods": {...},
                               #  "settings": {...}}

The model is loaded and sharded once in bfloat16; every method is an engine on the same
parameters (`PrefillEngine.with_all_reduce`). The compute floor is the same model loaded in
float32 and reduced with `psum`: scored against the reference like a method, it measures the
difference bf16 arithmetic alone makes, the noise a user of the bf16 model already accepts;
every method's KL and top-1 disagreement are also given as multiples of the floor's
(`eval.metrics.relative_to_floor`). The corpus is cut into windows once (`eval.corpus`), and
for each batch of windows the reference runs once, then the floor and every method; their
logits are scored against the reference's, their all-reduce outputs against the reference's
at the same site (`eval.metrics`), then dropped, so memory holds one batch's logits for two
runs, never a method's whole corpus. Greedy agreement decodes the same prompts (each from its
own place in the corpus) with every engine (`generation.generator.Generator`, KV cache, the
method on every all-reduce).

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
from equarx_serve.generation.model_args import DEFAULT_MODEL
from eval.corpus import DEFAULT_CORPUS

if TYPE_CHECKING:
    from equarx_serve.collectives import AllReduce

REFERENCE = "psum"
# The compute floor: the same model computed in float32 (float32 parameters, `psum`), scored
# against the BF16 reference like a method: the difference bf16 arithmetic alone makes.
FLOOR = "compute_floor"
FLOOR_DTYPE = "float32"
# psum-f32 and ring are left out: on XLA:CPU both give psum's bits at TP = 2 (XLA sums a bf16
# all-reduce in f32; ring sends bf16 words and sums in f32), a KL of 4e-6 at TP = 4 (README).
# naive-int8 too: each method is another forward pass over the corpus and greedy decode, and
# the strawman's numbers do not move (the quick gate CI runs still checks that it stays bad).
DEFAULT_METHODS = ("equarx-int8",)
DEFAULT_SEQ_LEN = 512
DEFAULT_DECODE_PROMPTS = 8  # --weights gguf: teacher-forced decode windows
DEFAULT_DECODE_PROMPT_LEN = 128
DEFAULT_DECODE_STEPS = 32
DEFAULT_NUM_SEQS = 16


# Windows per forward pass. The logits come back replicated on every device ([B, L, V], V =
# 262144 for Gemma 3: 256 MiB per 512-token window in bf16, on each device), so the default
# shrinks as TP grows: at TP = 4 a batch of 2 went past 21 GiB and was killed on a 24 GiB
# machine.
def default_batch_size(tp: int) -> int:
    return 2 if tp <= 2 else 1


# Greedy agreement: tokens matched before the first divergence is a noisy statistic per prompt
# (one near-tie ends it), so many prompts, each from its own place in the corpus.
DEFAULT_GREEDY_PROMPTS = 32
DEFAULT_GREEDY_PROMPT_LEN = 64
DEFAULT_GREEDY_TOKENS = 32
VERSIONED_PACKAGES = ("jax", "jaxlib", "flax", "numpy", "gemma", "equarx-serve")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """What `run_eval` measures. `methods` always gains the reference, first; the compute
    floor always runs."""

    model: str = DEFAULT_MODEL
    tp: int = 2
    methods: tuple[MethodSpec, ...] = tuple(parse_method(m) for m in DEFAULT_METHODS)
    corpus: str = DEFAULT_CORPUS  # a built-in corpus (eval.corpus.CORPORA), unless `text`
    text: Path | None = None
    seq_len: int = DEFAULT_SEQ_LEN
    num_seqs: int = DEFAULT_NUM_SEQS
    batch_size: int | None = None  # None: default_batch_size(tp)
    greedy_prompts: int = DEFAULT_GREEDY_PROMPTS
    greedy_prompt_len: int = DEFAULT_GREEDY_PROMPT_LEN
    greedy_tokens: int = DEFAULT_GREEDY_TOKENS
    checkpoint: Path | None = None
    tokenizer: Path | None = None
    # "gguf": also score the decode steps on the GGUF file's own quantized weights
    # (`eval.decode_weights`), teacher-forced over `decode_prompts` windows.
    weights: str = "bf16"
    decode_prompts: int = DEFAULT_DECODE_PROMPTS
    decode_prompt_len: int = DEFAULT_DECODE_PROMPT_LEN
    decode_steps: int = DEFAULT_DECODE_STEPS

    def all_methods(self) -> tuple[MethodSpec, ...]:
        """The reference, then the rest in the order given (each once)."""
        return (parse_method(REFERENCE), *(m for m in self.methods if m.label != REFERENCE))


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
        self.seconds = 0.0

    def add(self, token_metrics: dict[str, Any], num_scored: int, site_sums: Any) -> None:
        for key, value in token_metrics.items():
            scored = np.asarray(value)[:, :num_scored]
            self.tokens.setdefault(key, []).append(scored.reshape(-1))
        sums = np.asarray(site_sums, np.float64)
        self.site_sums = sums if self.site_sums is None else self.site_sums + sums

    def per_token(self) -> dict[str, np.ndarray]:
        return {key: np.concatenate(values) for key, values in self.tokens.items()}

    def summary(self, site_names: list[str], reference_ppl: float) -> dict[str, Any]:
        from eval import metrics

        per_site = metrics.summarize_sites(site_names, self.site_sums)
        summary = metrics.summarize(self.per_token(), reference_ppl)
        summary["nonfinite_all_reduce"] = sum(site["nonfinite"] for site in per_site)
        summary["nonfinite"] = summary["nonfinite_logits"] + summary["nonfinite_all_reduce"]
        summary["born_error_max"] = float(np.max([site["born_error"] for site in per_site]))
        summary["final_layer_error"] = per_site[-1]["error"]
        return {**summary, "per_layer": per_site}


@dataclasses.dataclass
class _Run:
    """The engines of one evaluation: the reference, the compute floor, every method."""

    engines: dict[str, Any]  # label -> PrefillEngine, the reference first, FLOOR second
    all_reduces: dict[str, AllReduce]  # method label -> the all-reduce it runs
    tokenizer: Any

    @property
    def reference(self) -> Any:
        return self.engines[REFERENCE]


def _build_engines(config: EvalConfig, log: Callable[[str], None]) -> _Run:
    import jax.numpy as jnp

    from equarx_serve.generation.generator import byte_tokenizer
    from equarx_serve.generation.prefill import PrefillEngine

    all_reduces = {spec.label: _with_gate_off(spec) for spec in config.all_methods()}
    max_length = max(config.seq_len, config.greedy_prompt_len + config.greedy_tokens)
    load = functools.partial(
        PrefillEngine.from_name,
        config.model,
        config.tp,
        REFERENCE,
        config.checkpoint,
        config.tokenizer,
        max_length=max_length,
    )
    log(f"loading {config.model} at TP={config.tp} (bfloat16, and float32 for the floor)")
    if config.tp == 1:
        log("warning: at TP=1 there is nothing to all-reduce; every method equals the reference")
    base = load(dtype=jnp.bfloat16)
    engines = {REFERENCE: base, FLOOR: load(dtype=jnp.dtype(FLOOR_DTYPE))}
    engines |= {label: base.with_all_reduce(ar) for label, ar in all_reduces.items()}
    engines[REFERENCE] = base
    return _Run(engines, all_reduces, base.tokenizer or byte_tokenizer(base.config.vocab_size))


def _score_windows(
    run: _Run,
    windows: np.ndarray,
    batch_size: int,
    progress: Callable[[int, int], None] | None,
) -> tuple[dict[str, _MethodScores], list[str]]:
    """Every engine's forward pass over the windows, scored against the reference's."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from eval import metrics
    from models.gemma3 import AXIS

    mesh = run.reference.mesh
    split = functools.partial(metrics.split_positions, mesh=mesh, axis_name=AXIS)
    seq_len = windows.shape[1]
    num_scored = seq_len - 1
    scores = {label: _MethodScores() for label in run.engines}
    site_names: list[str] = []
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        tokens = batch.tolist()

        def run_one(label: str, tokens=tokens) -> tuple[jax.Array, Any]:
            """label's logits laid out over the devices and its trace (one device's copy)."""
            started = time.perf_counter()
            result = run.engines[label].prefill(tokens, last_only=False, capture=True)
            outputs = split(result.logits), jax.tree.map(metrics.local_copy, result.trace)
            scores[label].seconds += time.perf_counter() - started
            return outputs

        # Peak memory: the batch's baseline (the reference's logits and log-probabilities, the
        # floor's log-probabilities, laid out over the devices), the reference's trace, and one
        # other method's logits (replicated, then laid out) and log-probabilities at a time.
        first = {label: run_one(label) for label in (REFERENCE, FLOOR)}
        reference_logits, reference_trace = first[REFERENCE]
        started = time.perf_counter()
        base = metrics.baseline(reference_logits, first[FLOOR][0])
        scores[REFERENCE].seconds += time.perf_counter() - started
        bucket = reference_logits.shape[1]  # the padded length
        targets = np.zeros((len(batch), bucket), np.int32)  # beyond num_scored: not scored
        targets[:, :num_scored] = batch[:, 1:]
        targets = split(jax.device_put(targets, NamedSharding(mesh, P())))
        site_names = [name for name, _ in metrics.sites(reference_trace)]
        for label in run.engines:
            logits, trace = first.pop(label, None) or run_one(label)
            started = time.perf_counter()
            scores[label].add(
                metrics.token_metrics(base, logits, targets),
                num_scored,
                metrics.site_errors(trace, reference_trace, num_tokens=seq_len),
            )
            scores[label].seconds += time.perf_counter() - started
            del logits, trace
        del base, reference_logits, reference_trace
        if progress:
            progress(len(batch), len(windows))
    return scores, site_names


def _greedy(run: _Run, prompts: list[list[int]], max_tokens: int) -> dict[str, dict[str, Any]]:
    """Every engine's greedy continuation of the prompts, against the reference's."""
    from equarx_serve.generation.generator import Generator, SamplingParams
    from eval import metrics

    sampling = SamplingParams(max_tokens=max_tokens)
    generated, seconds = {}, {}
    for label, engine in run.engines.items():
        started = time.perf_counter()
        completions = Generator(engine, max_batch=len(prompts)).generate(prompts, sampling)
        # Completion.tokens leaves the stop token out; put it back, so that stopping where
        # the reference went on (or the reverse) counts as a divergence.
        eos = [run.tokenizer.eos_id]
        generated[label] = [
            c.tokens + (eos if c.finish_reason == "stop" else []) for c in completions
        ]
        seconds[label] = time.perf_counter() - started
    return {
        label: {
            **metrics.greedy_agreement(generated[REFERENCE], tokens),
            "greedy_seconds": seconds[label],
        }
        for label, tokens in generated.items()
    }


def run_eval(
    config: EvalConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
    log: Callable[[str], None] = lambda message: None,
) -> dict[str, Any]:
    """Runs the evaluation (see module doc); `progress(n, total)` after every n of `total`
    windows scored.
    Returns the report: {"reference", "compute_floor": numbers, "methods": {label: numbers},
    "settings"}; every method's numbers include its KL and top-1 disagreement as multiples of
    the floor's. ValueError for bad settings (unknown method or corpus, a model that cannot
    split TP ways, text too short...)."""
    from eval import corpus as corpus_lib
    from eval import metrics

    started = time.perf_counter()
    run = _build_engines(config, log)
    base = run.reference
    corpus = (
        corpus_lib.load_corpus(config.text)
        if config.text
        else corpus_lib.named_corpus(config.corpus)
    )
    stream = corpus_lib.token_stream(corpus, run.tokenizer)
    windows = corpus_lib.make_windows(
        stream, run.tokenizer.bos_id, seq_len=config.seq_len, num_seqs=config.num_seqs
    )
    log(f"corpus: {corpus.name}, {len(stream)} tokens, {len(windows)} windows of {config.seq_len}")

    batch_size = config.batch_size or default_batch_size(config.tp)
    scores, site_names = _score_windows(run, windows, batch_size, progress)
    reference_tokens = scores[REFERENCE].per_token()
    reference_ppl = float(np.exp(np.mean(reference_tokens["nll"], dtype=np.float64)))
    reports = {label: score.summary(site_names, reference_ppl) for label, score in scores.items()}

    prompts: list[list[int]] = []
    if config.greedy_prompts > 0 and config.greedy_tokens > 0:
        prompts = corpus_lib.greedy_prompts(
            stream, run.tokenizer.bos_id, config.greedy_prompt_len, config.greedy_prompts
        )
        log(f"greedy: {len(prompts)} prompts x {config.greedy_tokens} tokens per method")
        for label, numbers in _greedy(run, prompts, config.greedy_tokens).items():
            reports[label].update(numbers)

    decode = _score_decode_weights(config, run, windows, log) if config.weights == "gguf" else None
    floor = reports.pop(FLOOR)
    for numbers in (*reports.values(), floor):  # the floor last: 1x itself
        numbers.update(metrics.relative_to_floor(numbers, floor))
    settings = {
        "model": config.model,
        "model_info": base.info,
        "dtype": str(base.dtype),
        "tp": config.tp,
        "devices": [str(d) for d in base.mesh.devices.flat],
        "methods": {
            label: {"name": ar.name, "options": ar.options()}
            for label, ar in run.all_reduces.items()
        },
        "compute_floor": {"dtype": FLOOR_DTYPE, "all_reduce": REFERENCE},
        "size_gate": "off: min_size_bytes=0 unless a method spec sets it",
        "corpus": {**corpus.describe(), "tokens": len(stream)},
        "seq_len": config.seq_len,
        "num_seqs": len(windows),
        "batch_size": batch_size,
        "scored_tokens": len(windows) * (config.seq_len - 1),
        "greedy": {
            "prompts": len(prompts),
            "prompt_len": config.greedy_prompt_len,
            "tokens": config.greedy_tokens,
        },
        "forward_seconds": {label: round(score.seconds, 1) for label, score in scores.items()},
        "versions": _versions(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    report = {
        "reference": REFERENCE,
        "compute_floor": floor,
        "methods": reports,
        "settings": settings,
    }
    if decode is not None:
        report["decode_weights"] = decode
    return report


def _score_decode_weights(
    config: EvalConfig, run: _Run, windows: np.ndarray, log: Callable[[str], None]
) -> dict[str, Any]:
    """The decode steps on the GGUF blocks against bf16 and the exact checkpoint
    (`eval.decode_weights`), on the first windows' prompts and their continuations."""
    from eval import decode_weights

    length, steps = config.decode_prompt_len, config.decode_steps
    if length + steps > windows.shape[1]:
        raise ValueError(
            f"decode prompts of {length} tokens and {steps} steps need windows of "
            f"{length + steps} tokens (--seq-len {windows.shape[1]})"
        )
    chosen = windows[: config.decode_prompts]
    log(f"decode weights: {len(chosen)} prompts of {length} tokens, {steps} teacher-forced steps")
    engines = {
        decode_weights.REFERENCE: run.reference,
        decode_weights.GGUF: run.reference.with_gguf_blocks(),
        decode_weights.EXACT: run.engines[FLOOR],
    }
    prompts = chosen[:, :length].tolist()
    return decode_weights.score_decode_weights(engines, prompts, chosen[:, length : length + steps])
