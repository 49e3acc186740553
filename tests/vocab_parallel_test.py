"""The vocab-parallel head (`models/vocab_parallel.py`) on logits sharded over TP = 2 and 4 fake
devices, against the replicated computations on the gathered logits: greedy and seeded top-k /
top-p sampling exactly as `sampling.sample_tokens`, the eval's metrics as `eval.metrics`, the
embedding lookup and the logits; and what crosses devices (from the compiled HLO)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_of
from jax.sharding import PartitionSpec as P

from equarx_serve.bench.hlo_bytes import collective_wire_bytes
from equarx_serve.generation.sampling import sample_tokens
from eval import metrics
from models import vocab_parallel as vp

AXIS = vp.AXIS
VOCAB = 512
TPS = (2, 4)


def _sharded(fn, tp: int, logits_spec: P, num_replicated: int):
    """jit(shard_map(fn)) with the first argument split over the vocabulary (its last axis)
    and `num_replicated` more arguments replicated."""
    mesh = mesh_of(tp)
    in_specs = (logits_spec,) + (P(),) * num_replicated
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False))


def _logits(batch, seed, *, scale=3.0, vocab=VOCAB):
    return np.random.default_rng(seed).standard_normal((batch, vocab)).astype(np.float32) * scale


# -- argmax and top-k ----------------------------------------------------------------------------


@pytest.mark.parametrize("tp", TPS)
def test_argmax_equals_argmax_of_gathered_logits_ties_and_nan(tp):
    logits = _logits(6, 0)
    logits[1, [10, 300, 500]] = 50.0  # a tie across shards: the lowest index wins
    logits[2, [300, 301]] = 50.0  # a tie inside one shard
    logits[3, [7, 400]] = np.nan  # NaN: the first NaN, as jnp.argmax
    logits[4, 450] = np.nan
    logits[5] = 0.0  # all equal
    got = _sharded(vp.argmax, tp, P(None, AXIS), 0)(logits)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(logits, axis=-1)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_first_max_equals_max_and_argmax(dtype, seed):
    """The local maximum and its first index are numpy's max (NaN if the row holds one) and
    jnp.argmax's, with NaN, infinities, signed zeros and ties drawn into the rows."""
    rng = np.random.default_rng(seed)
    logits = np.round(rng.standard_normal((16, 300)) * 2)  # many ties
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0])
    for row in range(16):
        where = rng.integers(0, 300, rng.integers(0, 4))
        logits[row, where] = rng.choice(specials, len(where))
    logits[0] = -np.inf
    logits = jnp.asarray(logits, dtype)
    best, index = jax.jit(vp._first_max)(logits)
    np.testing.assert_array_equal(np.asarray(index), np.asarray(jnp.argmax(logits, axis=-1)))
    want_best = np.max(np.asarray(logits, np.float32), axis=-1)  # NaN where a row holds one
    np.testing.assert_array_equal(np.asarray(best, np.float32), want_best)
    assert index.dtype == jnp.int32


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("k", [1, 5, 40, 200])
def test_top_k_equals_top_k_of_gathered_logits(tp, k):
    logits = _logits(3, k)
    logits[0, [3, 260, 511]] = 9.0  # ties across shards
    logits[1] = np.round(logits[1])  # many ties
    fn = _sharded(functools.partial(vp.top_k, k=k), tp, P(None, AXIS), 0)
    values, indices = fn(logits)
    want_values, want_indices = jax.lax.top_k(jnp.asarray(logits), k)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))


# -- sampling ------------------------------------------------------------------------------------


def _rows(temperature, top_k, top_p, seeds):
    return (
        np.asarray(temperature, np.float32),
        np.asarray(top_k, np.int32),
        np.asarray(top_p, np.float32),
        np.asarray(seeds, np.uint32),
    )


def _assert_sampling_equal(tp, logits, rows, mode, max_k=0, steps=12, candidates=None):
    """For `steps` consecutive steps (new keys each), the sharded sample equals
    `sampling.sample_tokens` on the whole logits, row by row."""
    options = {} if candidates is None else {"candidates": candidates}
    sharded = _sharded(
        functools.partial(vp.sample, mode=mode, max_k=max_k, **options), tp, P(None, AXIS), 5
    )
    drawn = []
    for step in range(steps):
        step_ids = np.full(logits.shape[0], step, np.int32) + np.arange(logits.shape[0])
        args = (*rows, step_ids)
        want = np.asarray(sample_tokens(logits, *args, mode=mode, max_k=max_k))
        got = np.asarray(sharded(logits, *args))
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
        drawn.append(got)
    return np.stack(drawn)  # [steps, B]


@pytest.mark.parametrize("tp", TPS)
def test_greedy_sampling_is_exact(tp):
    logits = _logits(4, 1)
    rows = _rows([0, 0, 0, 0], [0] * 4, [1.0] * 4, [0, 1, 2, 3])
    drawn = _assert_sampling_equal(tp, logits, rows, "greedy", steps=2)
    np.testing.assert_array_equal(drawn[0], np.argmax(logits, axis=-1))


@pytest.mark.parametrize("tp", TPS)
def test_temperature_sampling_is_exact(tp):
    logits = _logits(4, 2, scale=1.0)
    rows = _rows([1.0, 0.7, 0.0, 2.0], [0] * 4, [1.0] * 4, [5, 6, 7, 2**32 - 1])
    drawn = _assert_sampling_equal(tp, logits, rows, "temperature")
    assert len(set(drawn[:, 0].tolist())) > 1  # it does sample


@pytest.mark.parametrize("tp", TPS)
def test_top_k_sampling_is_exact(tp):
    logits = _logits(5, 3, scale=1.0)
    rows = _rows([1.0, 1.0, 0.5, 0.0, 1.5], [1, 3, 17, 0, 0], [1.0] * 5, [1, 2, 3, 4, 5])
    drawn = _assert_sampling_equal(tp, logits, rows, "top_k", max_k=17)
    assert np.all(drawn[:, 0] == np.argmax(logits[0]))  # top-1 is greedy
    top3 = set(np.argsort(-logits[1])[:3].tolist())
    assert set(drawn[:, 1].tolist()) <= top3


@pytest.mark.parametrize("tp", TPS)
def test_top_p_sampling_is_exact_settled_and_falling_back(tp):
    """Peaked rows (settled by 8 candidates a device), a flat row and a top-k beyond the
    candidates (both fall back to the gathered logits), top_p = 1, a greedy row."""
    logits = _logits(7, 4, scale=4.0)
    logits[3] = 0.0  # flat: the nucleus spans ~90% of the vocabulary
    rows = _rows(
        [1.0, 0.8, 1.0, 1.0, 1.0, 1.0, 0.0],
        [0, 5, 0, 0, 100, 0, 0],
        [0.9, 0.5, 0.3, 0.9, 0.95, 1.0, 0.5],
        [11, 12, 13, 14, 15, 16, 17],
    )
    _assert_sampling_equal(tp, logits, rows, "top_p", candidates=8)
    _assert_sampling_equal(tp, logits, rows, "top_p")  # the default candidates


@pytest.mark.parametrize("tp", TPS)
def test_top_p_candidates_settle_peaked_rows_only(tp):
    """The candidates alone give the reference's threshold for rows they settle; a flat row
    and a top-k beyond them are not settled (they take the gathered fallback)."""
    logits = _logits(4, 5, scale=4.0)
    logits[2] = 0.0
    top_k_ = np.asarray([0, 3, 0, 50], np.int32)
    top_p = np.asarray([0.6, 0.9, 0.6, 0.9], np.float32)
    fn = _sharded(
        functools.partial(vp.top_p_threshold_from_candidates, candidates=8),
        tp,
        P(None, AXIS),
        2,
    )
    threshold, settled = (np.asarray(a) for a in fn(logits, top_k_, top_p))
    np.testing.assert_array_equal(settled, [True, True, False, False])
    want = _reference_top_p_threshold(logits, top_k_, top_p)
    np.testing.assert_array_equal(threshold[:2], want[:2])


def _reference_top_p_threshold(scaled, top_k_, top_p):
    """`sampling.sample_tokens`'s top-p threshold, written out in numpy (float64 sums)."""
    out = []
    for row, k, p in zip(scaled, top_k_, top_p, strict=True):
        ordered = np.sort(row)[::-1]
        if k:
            ordered = ordered[:k]
        probs = np.exp(ordered - ordered[0])
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        count = max(int(np.sum(before < p)), 1)
        out.append([ordered[count - 1]])
    return np.asarray(out, np.float32)


def test_bad_sampling_mode():
    fn = _sharded(functools.partial(vp.sample, mode="beam"), 2, P(None, AXIS), 5)
    with pytest.raises(ValueError, match="unknown sampling mode 'beam'"):
        fn(_logits(1, 0), *_rows([1.0], [0], [1.0], [0]), np.zeros(1, np.int32))


# -- metrics -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", TPS)
def test_token_metrics_equal_those_of_gathered_logits(tp):
    rng = np.random.default_rng(6)
    reference = rng.standard_normal((2, 9, VOCAB)).astype(np.float32) * 3
    logits = reference + rng.standard_normal(reference.shape).astype(np.float32) * 0.3
    float32 = reference + rng.standard_normal(reference.shape).astype(np.float32) * 0.1
    logits[1, 4, 17] = np.inf  # a non-finite logit is counted
    targets = rng.integers(0, VOCAB, (2, 9)).astype(np.int32)
    targets[0, :3] = [0, VOCAB - 1, VOCAB // tp]  # shard edges
    mesh = mesh_of(tp)
    split = P(None, None, AXIS)
    sharded = jax.jit(
        jax.shard_map(
            vp.token_metrics,
            mesh=mesh,
            in_specs=(split, split, split, P()),
            out_specs=P(),
            check_vma=False,
        )
    )
    got = {k: np.asarray(v) for k, v in sharded(reference, float32, logits, targets).items()}
    base = metrics.baseline(reference, float32)
    want = {k: np.asarray(v) for k, v in metrics.token_metrics(base, logits, targets).items()}
    assert set(got) == set(want)
    finite = np.ones((2, 9), bool)
    finite[1, 4] = False  # log-softmax, KL and errors of the row with Inf are NaN/Inf in both
    for name in ("top1", "top5", "nonfinite"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for name in ("nll", "kl", "kl_to_float32", "max_abs", "mean_abs", "cosine"):
        np.testing.assert_allclose(
            got[name][finite], want[name][finite], rtol=2e-5, atol=2e-6, err_msg=name
        )
    assert got["nonfinite"][1, 4] == 1


# -- the head and the embedding ------------------------------------------------------------------


@pytest.mark.parametrize("tp", TPS)
def test_embed_equals_the_replicated_lookup(tp):
    rng = np.random.default_rng(7)
    table = rng.standard_normal((VOCAB, 32)).astype(np.float32)
    tokens = rng.integers(0, VOCAB, (3, 11)).astype(np.int32)
    tokens[0, :4] = [0, VOCAB - 1, VOCAB // tp - 1, VOCAB // tp]
    got = _sharded(lambda t, x: vp.embed(x, t), tp, P(AXIS, None), 1)(table, tokens)
    np.testing.assert_array_equal(np.asarray(got), table[tokens] * np.sqrt(32).astype(np.float32))


@pytest.mark.parametrize("rows", [(3,), (1,), (1, 1)])  # one row: computed as two (XLA:CPU)
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_logits_block_gathered_equal_the_whole_head(softcap, rows):
    rng = np.random.default_rng(8)
    table = rng.standard_normal((VOCAB, 32)).astype(np.float32)
    x = rng.standard_normal((*rows, 32)).astype(np.float32) * 4

    def head(table_block, x):
        return vp.gather(vp.logits_block(x, table_block, softcap=softcap))

    got = _sharded(head, 4, P(AXIS, None), 1)(table, x)
    want = x @ table.T
    if softcap is not None:
        want = np.tanh(want / softcap) * softcap
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


# -- what crosses devices ------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "max_k"), [("greedy", 0), ("temperature", 0), ("top_k", 8)])
def test_sampling_sends_candidates_not_logits(mode, max_k):
    """Per device on the wire: a few numbers a row, far below one row of logits."""
    tp, batch, vocab = 2, 4, 8192
    fn = _sharded(functools.partial(vp.sample, mode=mode, max_k=max_k), tp, P(None, AXIS), 5)
    logits = jax.ShapeDtypeStruct((batch, vocab), jnp.float32)
    rows = [jax.ShapeDtypeStruct((batch,), d) for d in (jnp.float32, jnp.int32, jnp.float32)]
    rows += [jax.ShapeDtypeStruct((batch,), jnp.uint32), jax.ShapeDtypeStruct((batch,), jnp.int32)]
    hlo = fn.lower(logits, *rows).compile().as_text()
    wire = sum(collective_wire_bytes(hlo, tp).values())
    assert 0 < wire <= batch * (4 * max_k + 32) * 4
