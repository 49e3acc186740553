"""The decode step's own layer code (`Gemma3Shard._decode_block`: matmuls on the weights as
stored): equal to the prefill's `Block` at every config branch (fused qkv, separate q and kv,
sharded and replicated KV heads, both gating layouts, a folded rotation), and its compiled
program copies no weight."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest
from conftest import mesh_of

from equarx_serve.collectives import get_all_reduce
from equarx_serve.generation.prefill import PrefillEngine
from equarx_serve.generation.runner import DeviceRunner
from equarx_serve.generation.sampling import SamplingBatch, sampling_inputs
from models.config import get_config
from models.gemma3 import init_params

TINY = get_config("tiny")  # 4 heads, 2 KV heads, gating [2, F, D]
CONFIGS = {
    "tiny": TINY,
    "tiny-mqa": get_config("tiny-mqa"),  # 1 KV head: replicated at TP = 2
    "fused-qkv": dataclasses.replace(TINY, num_kv_heads=TINY.num_heads),  # qkv_einsum
    "gating-dff": dataclasses.replace(TINY, transpose_gating_einsum=False),  # [2, D, F]
}
MAX_LENGTH = 64
PROMPT = 21  # longer than the local layers' window (8)


@functools.cache
def _engine(name: str, tp: int, quantize_all: bool = False) -> PrefillEngine:
    """psum-f32, or with `quantize_all` equarx-int8 without its size gate."""
    mesh_of(tp)
    config = CONFIGS[name]
    params = init_params(config, jax.random.PRNGKey(1))
    all_reduce = get_all_reduce("equarx-int8", min_size_bytes=0) if quantize_all else "psum-f32"
    return PrefillEngine(config, params, tp=tp, all_reduce=all_reduce, max_length=MAX_LENGTH)


def _decode_vs_prefill(engine: PrefillEngine, steps: int = 3) -> float:
    """Max |logit difference| between decode steps from the prefill's cache and the full
    prefill of the same tokens (2 rows of different prompts, teacher-forced)."""
    rng = np.random.default_rng(0)
    vocab = engine.config.vocab_size
    tokens = rng.integers(7, vocab, size=(2, PROMPT + steps)).astype(np.int32)
    full = np.asarray(engine.model(engine.params, tokens, np.ones_like(tokens, bool)).logits)
    padded = np.zeros((2, MAX_LENGTH), np.int32)
    padded[:, :PROMPT] = tokens[:, :PROMPT]
    cache = engine.model(engine.params, padded, padded != 0).cache
    worst = 0.0
    for s in range(steps):
        position = PROMPT + s
        out = engine.model.decode(
            engine.params, cache, tokens[:, position], np.full(2, position, np.int32)
        )
        cache = out.cache
        worst = max(worst, float(np.abs(np.asarray(out.logits) - full[:, position]).max()))
    return worst


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("tp", [1, 2])
def test_decode_equals_prefill_at_every_config_branch(name, tp):
    assert _decode_vs_prefill(_engine(name, tp)) < 5e-5


def test_decode_with_a_folded_rotation_equals_prefill():
    # Every all-reduce quantized (no size gate): decode runs on the rotated weight copies, as
    # the prefill does; quantization noise makes the two differ slightly, not wildly.
    engine = _engine("tiny", 2, quantize_all=True)
    assert engine.model.rotation is not None
    assert _decode_vs_prefill(engine) < 0.1


def _weight_copies(hlo: str) -> list[str]:
    """The entry computation's fusions that transpose or copy a layer's weight matrix."""
    entry = hlo[hlo.index("\nENTRY") :]
    parameter = r"(%param[.\d]*) = \w+\[([\d,]*)\].* parameter\(\d+\).*params\[\\'layer_"
    params = re.findall(parameter, entry)
    weights = {name for name, dims in params if "," in dims}  # matrices, not norm scales
    computations = dict(re.findall(r"\n(%fused_computation[.\d]*) .*?\{\n(.*?)\n\}", hlo, re.S))
    copies = []
    for line in entry.splitlines():
        match = re.search(r" fusion\(([^)]*)\).*calls=(%fused_computation[.\d]*)", line)
        if not match or not weights & set(match.group(1).split(", ")):
            continue
        body = computations.get(match.group(2), "")
        if " transpose(" in body or " copy(" in body:
            copies.append(line.strip()[:160])
    return copies


@pytest.mark.parametrize("name", ["tiny", "fused-qkv", "gating-dff"])
def test_decode_program_copies_no_weight(name):
    runner = DeviceRunner(_engine(name, 2))
    hlo = runner.decode_program(rows=2, capacity=MAX_LENGTH).hlo_text()
    assert "params[\\'layer_0\\']" in hlo  # the probe sees the weights
    assert _weight_copies(hlo) == []


def test_a_decode_of_the_caches_first_rows_leaves_the_others_alone():
    """Decoding the first 2 rows of a 4-row cache gives the tokens and KV entries a 2-row
    cache gives, bit for bit, and the other rows' entries stay as they were."""
    engine = _engine("tiny", 2)
    runner = DeviceRunner(engine)
    rng = np.random.default_rng(3)
    padded = np.zeros((4, MAX_LENGTH), np.int32)
    padded[:, :PROMPT] = rng.integers(7, engine.config.vocab_size, size=(4, PROMPT))
    cache = engine.model(engine.params, padded, padded != 0).cache
    before = jax.tree.map(np.asarray, cache)
    tokens = runner.place(np.array([11, 12], np.int32))  # the next token of each
    lengths = runner.place(np.full(2, PROMPT, np.int32))
    sampling = sampling_inputs(SamplingBatch.for_rows([None, None], engine.config.vocab_size),
                               runner.place)  # fmt: skip
    decoder = engine.model.sampling_decoder("greedy")
    two_rows = jax.tree.map(lambda kv: jax.device_put(kv[:2], kv.sharding), cache)
    alone = decoder(engine.params, two_rows, tokens, lengths, sampling)
    within = decoder(engine.params, cache, tokens, lengths, sampling)
    np.testing.assert_array_equal(np.asarray(within.tokens), np.asarray(alone.tokens))
    for name, layer in within.cache.items():
        for kind, kv in layer.items():
            kv = np.asarray(kv)
            np.testing.assert_array_equal(kv[:2], np.asarray(alone.cache[name][kind]))
            np.testing.assert_array_equal(kv[2:], before[name][kind][2:])
            assert not np.array_equal(kv[:2], before[name][kind][:2])  # the step wrote there
