"""The native decode-attention kernel (`equarx_serve/kernels/decode_attention.py`) against the
exact attention and its XLA reference, and in the model's decode step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equarx_serve.bench import lowering
from equarx_serve.kernels import decode_attention, native

pytestmark = pytest.mark.skipif(
    not decode_attention.native_available(), reason="no C++ compiler: the kernel cannot be built"
)


def _operands(b: int, s: int, n: int, k: int, h: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, 1, n, h)) * h**-0.5 * 2, jnp.bfloat16)
    key = jnp.asarray(rng.standard_normal((b, s, k, h)), jnp.bfloat16)
    value = jnp.asarray(rng.standard_normal((b, s, k, h)), jnp.bfloat16)
    return q, key, value


def _exact(q, key, value, first, last, softcap=None) -> np.ndarray:
    q, key, value = (np.asarray(a, np.float64) for a in (q, key, value))
    b, _, n, h = q.shape
    group = n // key.shape[2]
    out = np.zeros((b, 1, n, h))
    for row in range(b):
        lo, hi = max(first[row], 0), min(last[row], key.shape[1] - 1)
        for head in range(n):
            keys = key[row, lo : hi + 1, head // group]  # [L, H]
            logits = keys @ q[row, 0, head]
            if softcap is not None:
                logits = np.tanh(logits / softcap) * softcap
            p = np.exp(logits - logits.max())
            out[row, 0, head] = (p / p.sum()) @ value[row, lo : hi + 1, head // group]
    return out


def _close(got, exact):
    """Within bf16 roundings of the logits and probabilities: a few 2^-8 of the values."""
    np.testing.assert_allclose(np.asarray(got, np.float64), exact, atol=0.03, rtol=0.02)


@pytest.mark.parametrize(("n", "k", "h"), [(2, 1, 256), (4, 2, 16), (8, 1, 32), (3, 3, 20)])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_attend_equals_the_exact_attention(n, k, h, softcap):
    """Grouped heads (G = 1 to 8), a head size that is not a multiple of 16 (the plain loop),
    windows at the cache's start, middle and end, a single visible entry."""
    q, key, value = _operands(4, 40, n, k, h)
    first = jnp.asarray([0, 10, 39, 25], jnp.int32)
    last = jnp.asarray([39, 17, 39, 30], jnp.int32)
    got = jax.jit(decode_attention.attend, static_argnames="softcap")(
        q, key, value, first, last, softcap=softcap
    )
    assert got.dtype == jnp.bfloat16 and got.shape == q.shape
    exact = _exact(q, key, value, np.asarray(first), np.asarray(last), softcap)
    _close(got, exact)
    ref = decode_attention.reference(q, key, value, first, last, softcap=softcap)
    _close(ref, exact)


def test_a_row_with_no_visible_entry_gives_zeros_and_leaves_the_others_alone():
    q, key, value = _operands(2, 8, 2, 1, 16)
    first, last = jnp.asarray([5, 0], jnp.int32), jnp.asarray([4, 7], jnp.int32)
    got = np.asarray(jax.jit(decode_attention.attend)(q, key, value, first, last), np.float64)
    assert np.all(got[0] == 0) and np.all(np.isfinite(got))
    _close(got[1:], _exact(q[1:], key[1:], value[1:], [0], [7]))


def test_a_cache_with_more_rows_than_queries_is_read_in_place():
    """A step of 2 sequences in a 4-row cache: the first 2 rows, bit for bit what the exact-size
    cache gives; both kernel and reference."""
    q, key, value = _operands(4, 16, 2, 1, 16)
    first, last = jnp.asarray([0, 3], jnp.int32), jnp.asarray([15, 9], jnp.int32)
    for attend in (jax.jit(decode_attention.attend), decode_attention.reference):
        whole = np.asarray(attend(q[:2], key, value, first, last), np.float32)
        sliced = np.asarray(attend(q[:2], key[:2], value[:2], first, last), np.float32)
        np.testing.assert_array_equal(whole, sliced)
    _close(whole, _exact(q[:2], key[:2], value[:2], [0, 3], [15, 9]))


def test_bad_operands_are_refused():
    q, key, value = _operands(2, 8, 2, 1, 16)
    ends = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"want query \[B, 1, N, H\]"):
        decode_attention.attend(q[:, :, :, :8], key, value, ends, ends)
    with pytest.raises(ValueError, match="want query"):
        decode_attention.attend(q, key, value, ends[:1], ends)
    with pytest.raises(ValueError, match="want query"):
        decode_attention.attend(jnp.concatenate([q, q], 1), key, value, ends, ends)
    with pytest.raises(ValueError, match="want query"):  # fewer cache rows than queries
        decode_attention.attend(q, key[:1], value[:1], ends, ends)


def test_the_kernel_is_a_custom_call_on_cpu_only(monkeypatch):
    q, key, value = _operands(2, 8, 2, 1, 16)
    ends = jnp.zeros((2,), jnp.int32)

    def program() -> str:  # traced afresh
        return jax.jit(lambda *a: decode_attention.attend(*a)).lower(q, key, value, ends, ends)

    assert decode_attention.KERNEL.target in program().as_text()
    assert not decode_attention.pays(q.astype(jnp.float32), key.astype(jnp.float32))
    mesh = lowering.abstract_mesh("tpu", 1)
    with jax.sharding.use_abstract_mesh(mesh):
        assert not decode_attention.pays(q, key)  # a TPU program keeps the model's own path
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert decode_attention.KERNEL.target not in program().as_text()


def test_the_model_s_decode_step_with_the_kernel_matches_its_xla_attention(monkeypatch):
    """The tiny model's decode step in bf16 past the window (local layers see its last 8
    entries, global ones all): the kernel's logits within bf16 roundings of the XLA
    formulation's, the same top-1."""
    from model_sampling_test import ROWS, model_and_params, prefilled_cache

    from models.config import get_config
    from models.gemma3 import TensorParallelGemma3

    lengths = np.array([20, 9, 27], np.int32)

    def step_logits() -> np.ndarray:
        model, params = model_and_params(2)
        params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)  # the kernel's dtype
        model = TensorParallelGemma3(get_config("tiny"), model.mesh, "psum")  # new traces
        cache, tokens = prefilled_cache(model, params, lengths)
        text = model._decode.lower(params, cache, tokens[np.arange(ROWS), lengths], lengths)
        uses_kernel = decode_attention.KERNEL.target in text.as_text()
        step = model.decode(params, cache, tokens[np.arange(ROWS), lengths], lengths)
        return np.asarray(step.logits, np.float32), uses_kernel

    with_kernel, used = step_logits()
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    without, unused = step_logits()
    assert used and not unused
    np.testing.assert_allclose(with_kernel, without, atol=0.02 * np.abs(without).max())
    np.testing.assert_array_equal(with_kernel.argmax(-1), without.argmax(-1))
