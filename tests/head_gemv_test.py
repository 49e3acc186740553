"""The native CPU head kernel (`equarx_serve/kernels/head_gemv.py`) against its reference."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_of
from jax.sharding import PartitionSpec as P

from equarx_serve.cache_root import CACHE_ENV
from equarx_serve.kernels import head_gemv, native
from models import vocab_parallel

pytestmark = pytest.mark.skipif(
    not head_gemv.native_available(), reason="no C++ compiler: the kernel cannot be built"
)


def _operands(rows: int, dim: int, vocab: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, dim)), jnp.bfloat16)
    table = jnp.asarray(rng.standard_normal((vocab, dim)) * 0.05, jnp.bfloat16)
    return x, table


def _exact(x: jax.Array, table: jax.Array) -> np.ndarray:
    return np.asarray(x, np.float64) @ np.asarray(table, np.float64).T


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9, 17])
@pytest.mark.parametrize("dim", [640, 48, 17])
def test_matmul_equals_the_exact_product(rows, dim):
    """Every row count (several passes above 8) and dims with and without a tail of lanes:
    within f32 rounding of the exact sums, like XLA's dot."""
    x, table = _operands(rows, dim, vocab=67)
    native = np.asarray(jax.jit(head_gemv.matmul)(x, table))
    reference = np.asarray(jax.jit(head_gemv.reference)(x, table))
    assert native.dtype == np.float32 and native.shape == (rows, 67)
    bound = 1e-5 * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(table, np.float64)).T)
    exact = _exact(x, table)
    assert np.all(np.abs(native - exact) <= bound + 1e-30)
    assert np.all(np.abs(reference - exact) <= bound + 1e-30)


def test_matmul_rejects_bad_shapes():
    x, table = _operands(2, 16, vocab=8)
    with pytest.raises(ValueError, match=r"want x \[B, D\] and table \[V, D\]"):
        head_gemv.matmul(x, table[:, :8])
    with pytest.raises(ValueError, match="want x"):
        head_gemv.matmul(x[0], table)


def test_float32_table_takes_the_reference():
    """The kernel reads bf16 tables; others go through XLA's dot, bit for bit."""
    x, table = _operands(2, 32, vocab=16)
    table = table.astype(jnp.float32)
    got = jax.jit(head_gemv.matmul)(x, table)
    np.testing.assert_array_equal(got, jax.jit(head_gemv.reference)(x, table))
    assert "custom_call" not in jax.jit(head_gemv.matmul).lower(x, table).as_text()


def test_the_kernel_is_a_custom_call_and_can_be_switched_off(monkeypatch):
    x, table = _operands(2, 32, vocab=16)

    def program() -> str:  # traced afresh (jit caches traces by function)
        return jax.jit(lambda x, table: head_gemv.matmul(x, table)).lower(x, table).as_text()

    assert head_gemv.KERNEL.target in program()
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert not head_gemv.native_available()
    assert head_gemv.KERNEL.target not in program()


def test_a_failed_compile_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    """No library for this source in a fresh cache and a compiler that fails: a clear error
    from the build, and registration says False with a warning (callers use XLA's dot)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="failed"):
        head_gemv.KERNEL.build()
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-written left
    with caplog.at_level(logging.WARNING, "equarx_serve.kernels"):
        assert native.register.__wrapped__(head_gemv.KERNEL) is False
    assert "unavailable, using XLA's dot" in caplog.text


def test_the_library_is_built_once_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    first = head_gemv.KERNEL.build()
    stamp = first.stat().st_mtime_ns
    monkeypatch.setenv("CXX", "false")  # a second build would fail
    assert head_gemv.KERNEL.build() == first and first.stat().st_mtime_ns == stamp


def test_vocab_parallel_logits_use_the_kernel_and_match_xla():
    """`logits_block` in a 2-device shard_map: the kernel for a few rows, XLA's dot above
    MAX_ROWS, and the same logits (bf16) within one rounding, the same argmax."""
    mesh = mesh_of(2)
    for rows in (1, 2, head_gemv.MAX_ROWS, head_gemv.MAX_ROWS + 1):
        x, table = _operands(rows, 64, vocab=256, seed=rows)

        def logits(x, table):
            return vocab_parallel.logits_block(x, table)

        sharded = jax.jit(
            jax.shard_map(logits, mesh=mesh, in_specs=(P(), P("tp", None)), out_specs=P(None, "tp"))
        )
        text = sharded.lower(x, table).as_text()
        assert (head_gemv.KERNEL.target in text) == (rows <= head_gemv.MAX_ROWS)
        got = np.asarray(sharded(x, table), np.float32)
        want = np.asarray(jnp.einsum("BD,VD->BV", x, table), np.float32)
        np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6)
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_rows_times_table_uses_the_kernel_where_it_pays():
    """`rows_times_table` (the decode step's gating product, the head's logits): the kernel
    up to MAX_ROWS bf16 rows, XLA's dot above and for f32, the same values within one
    rounding."""
    for rows, dtype in (
        (2, jnp.bfloat16),
        (head_gemv.MAX_ROWS + 1, jnp.bfloat16),
        (2, jnp.float32),
    ):
        x, weight = (a.astype(dtype) for a in _operands(rows, 64, vocab=96, seed=rows))
        program = jax.jit(head_gemv.rows_times_table).lower(x, weight).as_text()
        assert (head_gemv.KERNEL.target in program) == (
            rows <= head_gemv.MAX_ROWS and dtype == jnp.bfloat16
        )
        got = jax.jit(head_gemv.rows_times_table)(x, weight)
        want = jax.lax.dot_general(x, weight, (((1,), (1,)), ((), ())))
        assert got.dtype == dtype
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2**-7, atol=1e-6
        )
