"""Block-wise int8 quantizer: the Pallas kernel (interpreted on CPU) and the XLA:CPU variant
against the jnp reference, the quantization error bound, and the non-finite code."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equarx_serve.kernels import block_quantize as bq

Payload = tuple[jax.Array, jax.Array]

# The reference, jitted: XLA compiles `absmax / 127` to a multiply by the reciprocal, as it does
# in the kernel and in the collectives; op-by-op (eager) dispatch divides exactly instead.
reference = jax.jit(bq.accumulate_quantize_reference, static_argnames="scale_dtype")
kernel = functools.partial(bq.accumulate_quantize, interpret=True)
# The collectives' kernel="jnp" path.
xla = jax.jit(bq.accumulate_quantize_xla, static_argnames="scale_dtype")


def random_rows(rng: np.random.Generator, rows: int, block: int, dtype=jnp.float32) -> jax.Array:
    """[rows, block] normal values with a different magnitude (1e-3 .. 1e3) per row."""
    magnitudes = 10.0 ** rng.uniform(-3, 3, size=(rows, 1))
    return jnp.asarray(rng.standard_normal((rows, block)) * magnitudes, dtype)


def random_payloads(rng: np.random.Generator, rows: int, block: int, k: int) -> tuple:
    """k payloads as a sender would make them, some holding the non-finite code."""
    payloads = []
    for _ in range(k):
        q, s = reference(random_rows(rng, rows, block))
        q = q.at[0, 0].set(bq.NONFINITE_CODE) if rows > 4 else q
        payloads.append((q, s))
    return tuple(payloads)


def assert_same_bits(got: Payload, want: Payload) -> None:
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert got[1].dtype == want[1].dtype
    bits = np.dtype(f"u{got[1].dtype.itemsize}")
    np.testing.assert_array_equal(np.asarray(got[1]).view(bits), np.asarray(want[1]).view(bits))


def check_kernel_matches_reference(
    rows: int, block: int, k: int, dtype, scale_dtype=jnp.float32
) -> None:
    rng = np.random.default_rng(rows * 1000 + block + k)
    local = random_rows(rng, rows, block, dtype)
    received = tuple((q, s.astype(scale_dtype)) for q, s in random_payloads(rng, rows, block, k))
    want = reference(local, received, scale_dtype=scale_dtype)
    for quantize in (kernel, xla):
        q, s = quantize(local, received, scale_dtype=scale_dtype)
        assert q.shape == (rows, block) and q.dtype == jnp.int8
        assert s.shape == (rows, 1) and s.dtype == scale_dtype
        assert_same_bits((q, s), want)


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("block", [64, 256])
@pytest.mark.parametrize("rows", [1, 8, 32, 96, 512, 1024])
def test_kernels_match_reference_for_every_shape(rows: int, block: int, k: int):
    check_kernel_matches_reference(rows, block, k, jnp.bfloat16)


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_kernels_match_reference_for_every_dtype(dtype, k: int):
    check_kernel_matches_reference(96, 256, k, dtype)


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("rows", [8, 96])
def test_kernels_match_reference_with_bfloat16_scales(rows: int, k: int):
    check_kernel_matches_reference(rows, 32, k, jnp.bfloat16, scale_dtype=jnp.bfloat16)


def test_bfloat16_scales_are_the_float32_ones_rounded_up():
    x = random_rows(np.random.default_rng(5), 256, 32)
    _, s32 = reference(x)
    q16, s16 = reference(x, scale_dtype=jnp.bfloat16)
    s32, s16 = np.asarray(s32, np.float64), np.asarray(s16, np.float64)
    assert (s16 >= s32).all() and (s16 < s32 * (1 + 2**-7)).all()
    assert (s16 > s32).mean() > 0.9  # almost no f32 scale is a bfloat16 number already
    # No element clips, and the error stays within half of the (larger) step.
    assert np.abs(np.asarray(q16)).max() <= bq.INT8_MAX
    err = np.abs(np.asarray(x, np.float64) - np.asarray(bq.dequantize(q16, s16), np.float64))
    assert (err <= s16 / 2 * (1 + 1e-5)).all()
    # Values already in bfloat16 stay; others go to the next bfloat16 value up (8-bit
    # significand: steps of 2^-7 between 1 and 2).
    values = jnp.array([1.0, 1.0 + 2**-20, 1.5 - 2**-20, bq.FLOAT32_TINY], jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(bq.round_up_to_bfloat16(values)), [1.0, 1.0 + 2**-7, 1.5, bq.FLOAT32_TINY]
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_round_trip_error_is_at_most_half_a_step(dtype):
    x = random_rows(np.random.default_rng(1), 64, 256, dtype)
    q, s = reference(x)
    assert np.abs(np.asarray(q)).max() == bq.INT8_MAX  # the absmax element maps to +-127
    err = np.abs(np.asarray(x, np.float64) - np.asarray(bq.dequantize(q, s), np.float64))
    half_step = np.asarray(s, np.float64) / 2
    assert (err <= half_step * (1 + 1e-5)).all(), (err / half_step).max()


def test_scale_is_row_absmax_over_127():
    x = random_rows(np.random.default_rng(2), 32, 64)
    _, s = reference(x)
    absmax = np.abs(np.asarray(x)).max(axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(s), absmax / 127, rtol=1e-6)


def test_zero_rows_get_the_floor_scale_and_zero_codes():
    x = jnp.zeros((32, 256), jnp.float32).at[5].set(1.0)
    q, s = kernel(x)
    zero_rows = np.arange(32) != 5
    assert (np.asarray(s)[zero_rows] == bq.FLOAT32_TINY).all()
    assert (np.asarray(q)[zero_rows] == 0).all()
    deq = np.asarray(bq.dequantize(q, s))
    assert not np.isnan(deq).any()
    assert (deq[zero_rows] == 0).all()


def test_tiny_and_denormal_rows_stay_finite():
    rows = np.array([[1e-30], [1e-37], [1e-39], [1e-44]]) * np.linspace(-1, 1, 64)
    x = jnp.asarray(rows, jnp.float32)
    q, s = kernel(x)
    assert_same_bits((q, s), reference(x))
    assert_same_bits(xla(x), reference(x))
    deq = np.asarray(bq.dequantize(q, s))
    assert np.isfinite(np.asarray(s)).all() and (np.asarray(s) > 0).all()
    assert np.isfinite(deq).all()
    assert (np.abs(np.asarray(q)) <= bq.INT8_MAX).all()
    np.testing.assert_allclose(deq[0], np.asarray(x)[0], rtol=0, atol=1e-30 / 254 * 1.01)


@pytest.mark.parametrize("quantize", [kernel, xla, reference], ids=["pallas", "xla", "reference"])
def test_nonfinite_elements_get_their_own_code_and_spare_the_row(quantize):
    x = random_rows(np.random.default_rng(3), 8, 64)
    bad = {(1, 3): np.nan, (1, 40): np.inf, (6, 0): -np.inf, (7, 63): np.nan}
    x_bad = x
    for idx, value in bad.items():
        x_bad = x_bad.at[idx].set(value)
    # The same rows with the non-finite elements replaced by 0 (not each row's absmax).
    x_zeroed = x.at[tuple(np.array(list(bad)).T)].set(0.0)
    q, s = quantize(x_bad)
    q0, s0 = quantize(x_zeroed)
    bad_mask = np.zeros(x.shape, bool)
    bad_mask[tuple(np.array(list(bad)).T)] = True
    q, q0 = np.asarray(q), np.asarray(q0)
    assert (q[bad_mask] == bq.NONFINITE_CODE).all()
    assert (q[~bad_mask] != bq.NONFINITE_CODE).all()
    np.testing.assert_array_equal(q[~bad_mask], q0[~bad_mask])
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))
    deq = np.asarray(bq.dequantize(q, s))
    assert np.isnan(deq[bad_mask]).all() and np.isfinite(deq[~bad_mask]).all()


def test_nonfinite_code_survives_accumulation():
    rng = np.random.default_rng(4)
    local = random_rows(rng, 8, 64).at[2, 2].set(np.nan)
    (q1, s1), (q2, s2) = random_payloads(rng, 8, 64, 2)  # q1[0, 0] and q2[0, 0] are -128
    q2 = q2.at[5, 9].set(bq.NONFINITE_CODE)
    for quantize in (kernel, xla, reference):
        q, _ = quantize(local, ((q1, s1), (q2, s2)))
        codes = np.argwhere(np.asarray(q) == bq.NONFINITE_CODE).tolist()
        assert codes == [[0, 0], [2, 2], [5, 9]]


def test_dequantize_of_the_nonfinite_code_is_nan():
    q = jnp.array([[-128, -127, 0, 127]], jnp.int8)
    deq = np.asarray(bq.dequantize(q, jnp.array([[2.0]], jnp.float32)))
    assert np.isnan(deq[0, 0])
    np.testing.assert_array_equal(deq[0, 1:], [-254.0, 0.0, 254.0])


@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_lowers_to_a_mosaic_call_for_tpu(scale_dtype):
    local = jnp.zeros((64, 256), jnp.bfloat16)
    received = ((jnp.zeros((64, 256), jnp.int8), jnp.ones((64, 1), scale_dtype)),)
    f = lambda x, r: bq.accumulate_quantize(x, r, interpret=False, scale_dtype=scale_dtype)
    lowered = jax.jit(f).trace(local, received).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()


def test_padded_rows_and_row_tile_invariants():
    for rows in range(1, 3000):
        padded = bq.padded_rows(rows)
        tile = bq.row_tile(padded)
        assert rows <= padded < rows + bq.MIN_ROW_TILE, rows
        assert padded % tile == 0, rows
        assert tile & (tile - 1) == 0, rows  # a power of two
        if padded <= bq.MIN_ROW_TILE:
            assert tile == padded, rows
        else:
            assert bq.MIN_ROW_TILE <= tile <= bq.MAX_ROW_TILE, rows
    assert bq.row_tile(1024) == bq.MAX_ROW_TILE
    assert bq.row_tile(96) == 32


@pytest.mark.parametrize("rows", [33, 100, 1000])
def test_row_counts_that_no_tile_divides_raise(rows: int):
    with pytest.raises(ValueError, match="multiple"):
        bq.row_tile(rows)
    with pytest.raises(ValueError):
        kernel(jnp.zeros((rows, 64), jnp.float32))


def _payload(shape=(32, 64), q_dtype=jnp.int8, scale_shape=(32, 1), scale_dtype=jnp.float32):
    return jnp.zeros(shape, q_dtype), jnp.ones(scale_shape, scale_dtype)


@pytest.mark.parametrize(
    ("local_shape", "received"),
    [
        ((2048,), ()),
        ((2, 32, 64), ()),
        ((32, 64), (_payload(shape=(32, 128)),)),
        ((32, 64), (_payload(q_dtype=jnp.int16),)),
        ((32, 64), (_payload(scale_shape=(32,)),)),
        ((32, 64), (_payload(scale_shape=(16, 1)),)),
        ((32, 64), (_payload(scale_dtype=jnp.bfloat16),)),  # the default scales are f32
        ((32, 64), (_payload(), _payload(shape=(16, 64)))),
    ],
    ids=[
        "1d-local",
        "3d-local",
        "q-block",
        "q-dtype",
        "scale-rank",
        "scale-rows",
        "scale-dtype",
        "second-payload",
    ],
)
def test_bad_shapes_raise(local_shape: tuple[int, ...], received: tuple):
    with pytest.raises(ValueError):
        kernel(jnp.zeros(local_shape, jnp.float32), received)
