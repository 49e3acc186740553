"""The overlapped prefill across processes (`collectives.overlap`): with one CPU device per
process the chunk all-reduces move beside XLA (`collectives.exchange`), and the prefill gives
the unchunked one's greedy tokens, its logits and KV cache up to rounding, the same logits on
every process."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest

from equarx_serve.distributed import multiprocess
from models.config import get_config

WORKER = Path(__file__).with_name("_overlap_worker.py")


@functools.cache
def reports() -> list[dict]:
    outputs = multiprocess.run_local_processes(
        [sys.executable, str(WORKER)], 2, timeout_s=600, env={"JAX_PLATFORMS": "cpu"}
    )
    return [json.loads(out.stdout.strip().splitlines()[-1]) for out in outputs]


@pytest.mark.parametrize("method", ["psum-f32", "ring", "equarx-int8"])
@pytest.mark.parametrize("chunks", [2, 3])
def test_chunks_exchanged_beside_xla_give_the_tokens_of_the_whole_prefill(method, chunks):
    """Every operation is per token or (attention) over the same keys: only rounding differs
    (per-chunk matmuls; softmax sums over a chunk's keys), within f32's or bf16's. equarx-int8
    requantizes the chunks' partial sums: a rounding step can move an int8 code, and the random
    tiny model has near ties that then flip (which ones depends on the CPU's bf16 dot: 2 of 117
    tokens on AVX-512F without BF16), so its top-1 may differ only where the whole run's own
    logits tie within the tolerance."""
    tolerance = 1e-4 if method == "psum-f32" else 0.1
    first, second = reports()
    for report in (first, second):
        whole, chunked = report[f"{method}/1"], report[f"{method}/{chunks}"]
        assert whole["exchanges"] == 0
        assert chunked["exchanges"] > 0  # the chunks did go through the exchange
        if method == "equarx-int8":
            assert chunked["top1_agree"] >= 0.95
            assert chunked["top1_gap"] < tolerance
        else:
            assert chunked["top1_agree"] == 1.0
        assert chunked["logits_max_abs"] < tolerance
        assert chunked["cache_max_abs"] < tolerance
    # Both processes computed the same logits (each its own cache shard).
    assert (
        first[f"{method}/{chunks}"]["logits_sha256"]
        == second[f"{method}/{chunks}"]["logits_sha256"]
    )


def test_the_timeline_records_every_exchange_of_one_prefill():
    layers = get_config("tiny").num_layers
    for report in reports():
        for chunks in (2, 3):
            timeline = report[f"equarx-int8/{chunks}/timeline"]
            assert timeline["exchanges"] == 2 * chunks * layers  # attn and mlp, every chunk
            assert timeline["ordered"]
