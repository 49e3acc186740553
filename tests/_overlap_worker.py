"""One process of prefill_overlap_processes_test.py: the tiny model's prefill at TP = 2 across
2 processes (one CPU device each, gloo), whole and in chunks whose all-reduces move beside XLA
(`collectives.overlap`).

    python tests/_overlap_worker.py --coordinator HOST:PORT --num-processes 2 --process-id I

Prints one JSON line: for each all-reduce and chunk count, the SHA-256 of the logits and of
this process's KV cache shard (real tokens), their max abs difference from the unchunked run
of the same all-reduce, the share of tokens whose top-1 agrees with it and how far below its
best logit it puts a flipped one, and how many callbacks
(the exchange's) the program has; and for every chunked run, one more prefill's exchanges as
`bench prefill`'s timeline records them.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from equarx_serve.bench import prefill_timeline
from equarx_serve.collectives import get_all_reduce
from equarx_serve.distributed import multiprocess
from models.config import get_config
from models.gemma3 import TensorParallelGemma3, init_params, mask_from_lengths

CONFIG = get_config("tiny")
SEQ_LEN = 80
LENGTHS = (80, 37)  # a full prompt and a right-padded one
METHODS = (
    ("psum-f32", {}, jnp.float32),
    ("ring", {}, jnp.bfloat16),
    ("equarx-int8", {"min_size_bytes": 0}, jnp.bfloat16),
)
CHUNKS = (1, 2, 3)  # 3: chunks of 26, 27 and 27 tokens


def batch() -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(0).integers(5, CONFIG.vocab_size, (len(LENGTHS), SEQ_LEN))
    mask = np.asarray(mask_from_lengths(np.asarray(LENGTHS), SEQ_LEN))
    return np.where(mask, tokens, 0).astype(np.int32), mask


def local(array: jax.Array) -> np.ndarray:
    (shard,) = array.addressable_shards
    return np.asarray(shard.data, np.float32)


def top1_gap(reference: np.ndarray, logits: np.ndarray) -> float:
    """How far below the reference's best logit the reference puts `logits`' top-1 token, the
    most over all tokens: 0 where the top-1 agree; small where a near tie flipped."""
    rows = np.arange(len(reference))
    return float((reference.max(-1) - reference[rows, logits.argmax(-1)]).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    multiprocess.add_process_flags(parser)
    args = parser.parse_args()
    multiprocess.initialize(args.coordinator, args.num_processes, args.process_id)
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    tokens, mask = batch()
    report: dict[str, object] = {"process_id": args.process_id}
    for name, options, dtype in METHODS:
        params = init_params(CONFIG, jax.random.PRNGKey(0), dtype)
        whole = None
        for chunks in CHUNKS:
            model = TensorParallelGemma3(
                CONFIG, mesh, get_all_reduce(name, **options), overlap_chunks=chunks
            )
            placed = model.shard_params(params)
            out = model(placed, tokens, mask)
            gathered = model.gathered(out.logits).addressable_data(0)  # [B, L, V], every vocab
            logits = np.asarray(gathered, np.float32)[mask]
            # real tokens only: a padding token's entries are never read (and differ)
            cache = np.concatenate([local(a)[mask].ravel() for a in jax.tree.leaves(out.cache)])
            text = model._forward[False, False].lower(placed, tokens, mask).as_text()
            whole = whole or (logits, cache)
            if chunks > 1:
                run = lambda model=model, placed=placed: jax.block_until_ready(
                    model(placed, tokens, mask).logits
                )
                times = prefill_timeline.record(run)
                report[f"{name}/{chunks}/timeline"] = {
                    "exchanges": len(times),
                    "ordered": bool(
                        np.all(times[:, 0] <= times[:, 3]) & np.all(times[:, 2] <= times[:, 3])
                    ),
                }
            report[f"{name}/{chunks}"] = {
                "logits_sha256": hashlib.sha256(logits.tobytes()).hexdigest(),
                "cache_sha256": hashlib.sha256(cache.tobytes()).hexdigest(),
                "logits_max_abs": float(np.abs(logits - whole[0]).max()),
                "top1_agree": float((logits.argmax(-1) == whole[0].argmax(-1)).mean()),
                "top1_gap": top1_gap(whole[0], logits),
                "cache_max_abs": float(np.abs(cache - whole[1]).max()),
                "exchanges": text.count("callback") + text.count("equarx_exchange_start"),
            }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
