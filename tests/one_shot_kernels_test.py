"""One-shot EQuARX's native kernels (`equarx_serve/kernels/one_shot.py`) against their jnp
references, and in the all-reduce."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import AXIS, lower_all_reduce, mesh_of, run_all_reduce
from jax.sharding import PartitionSpec as P

from equarx_serve.collectives import get_all_reduce
from equarx_serve.collectives.hadamard import block_hadamard
from equarx_serve.kernels import native, one_shot

pytestmark = pytest.mark.skipif(
    not one_shot.DEQUANTIZE.available(), reason="no C++ compiler: the kernel cannot be built"
)


def _payloads(k: int, rows: int, block: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Codes over the whole int8 range (the non-finite code -128 included) and scales from
    denormal to large, so every path of the arithmetic runs."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(-128, 128, (k, rows, block), dtype=np.int8)
    exponents = rng.integers(-44, 36, (k, rows)).astype(np.float64)
    scales = (rng.random((k, rows)) * 10.0**exponents).astype(np.float32)
    return codes, scales


def _bits(x: jax.Array) -> np.ndarray:
    return np.asarray(x).view(np.uint16)


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize(
    ("k", "rows", "block"),
    [(2, 1000, 64), (1, 7, 64), (3, 33, 128), (4, 5, 256), (2, 100, 32), (2, 9, 8), (2, 3, 2)],
)
def test_the_decode_kernel_gives_the_references_bits(k, rows, block, hadamard, scale_dtype):
    codes, scales = _payloads(k, rows, block)
    packed = one_shot.pack(codes, jnp.asarray(scales, scale_dtype))
    codec = dict(block=block, hadamard=hadamard, scale_dtype=scale_dtype)
    apply = jax.jit(lambda p: one_shot.dequantize_rotate(p, **codec))
    reference = jax.jit(lambda p: one_shot.dequantize_rotate_reference(p, **codec))
    assert "custom_call" in apply.lower(packed).as_text()
    np.testing.assert_array_equal(_bits(apply(packed)), _bits(reference(packed)))


def test_the_decode_reference_is_the_dense_rotation_of_the_sum_within_one_rounding():
    codes, scales = _payloads(2, 512, 64, seed=1)
    scales = np.full_like(scales, 0.01)  # no NaN rows, no overflow: plain values
    codes = np.where(codes == -128, -127, codes).astype(np.int8)
    got = np.asarray(
        one_shot.dequantize_rotate_reference(one_shot.pack(codes, scales), block=64, hadamard=True)
    ).astype(np.float64)
    summed = (codes.astype(np.float32) * scales[..., None]).sum(0, dtype=np.float32)
    dense = np.asarray(block_hadamard(jnp.asarray(summed), form="dense"), np.float64)
    # bf16 keeps 8 bits: one rounding of the result is at most 2^-8 relative.
    np.testing.assert_allclose(got, dense, rtol=2**-8, atol=1e-6)


def test_a_non_finite_code_makes_its_rotated_row_nan_and_only_that_row():
    codes, scales = np.ones((2, 3, 64), np.int8), np.ones((2, 3), np.float32)
    codes[1, 1, 5] = -128
    out = np.asarray(
        one_shot.dequantize_rotate(one_shot.pack(codes, scales), block=64, hadamard=True),
        np.float32,
    )
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all()


def test_large_values_do_not_overflow_inside_the_transform():
    """Halving between stages keeps every stage within twice the output's bound: a row of
    2^123 in one payload (an output of 2^126 in its first element) stays finite."""
    codes, scales = np.ones((1, 1, 64), np.int8), np.full((1, 1), 2.0**123, np.float32)
    out = np.asarray(
        one_shot.dequantize_rotate(one_shot.pack(codes, scales), block=64, hadamard=True),
        np.float32,
    )
    assert out[0, 0] == 2.0**126 and (out[0, 1:] == 0).all()


@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize(("rows", "block"), [(1000, 64), (7, 2), (33, 128), (5, 256), (9, 8)])
def test_the_quantize_kernel_gives_the_references_bits(rows, block, hadamard):
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, block)) * 10.0 ** rng.integers(-30, 30, (rows, 1))
    x[0, 1], x[-1, 0], x[rows // 2] = np.nan, np.inf, 0.0  # non-finite values, a zero row
    x = jnp.asarray(x, jnp.bfloat16)
    quantize = jax.jit(lambda v: one_shot.rotate_quantize(v, hadamard=hadamard))
    reference = jax.jit(lambda v: one_shot.rotate_quantize_reference(v, hadamard=hadamard))
    assert "custom_call" in quantize.lower(x).as_text()
    np.testing.assert_array_equal(np.asarray(quantize(x)), np.asarray(reference(x)))


def test_quantize_then_decode_is_within_the_quantization_error():
    """One payload through both kernels: the rotation undone, each value within half a
    quantization step (of its rotated row's scale, spread back by the orthonormal rotation)."""
    x = jnp.asarray(np.random.default_rng(2).standard_normal((256, 64)), jnp.bfloat16)
    packed = one_shot.rotate_quantize(x, hadamard=True)
    back = np.asarray(one_shot.dequantize_rotate(packed[None], block=64, hadamard=True), np.float64)
    scales = np.asarray(one_shot.unpack(packed[None], 64)[1][0], np.float64)
    error = np.sqrt(np.mean((back - np.asarray(x, np.float64)) ** 2, axis=1))
    assert (error <= scales * 0.5 + np.abs(np.asarray(x, np.float64)).max(1) * 2**-8).all()


def test_pack_and_unpack_round_trip():
    codes, scales = _payloads(3, 5, 16)
    back_codes, back_scales = one_shot.unpack(one_shot.pack(codes, scales), 16)
    np.testing.assert_array_equal(back_codes, codes)
    np.testing.assert_array_equal(np.asarray(back_scales).view(np.uint32), scales.view(np.uint32))


@pytest.mark.parametrize(
    ("shape", "dtype", "block", "match"),
    [
        ((2, 68), jnp.uint8, 48, "power of two"),
        ((2, 68), jnp.uint8, 512, "power of two"),
        ((2, 70), jnp.uint8, 64, "whole rows"),
        ((2, 68), jnp.int8, 64, "u8"),
        ((68,), jnp.uint8, 64, "u8"),
    ],
)
def test_bad_input_raises_a_clear_error(shape, dtype, block, match):
    with pytest.raises(ValueError, match=match):
        one_shot.dequantize_rotate(jnp.zeros(shape, dtype), block=block, hadamard=True)


def test_switched_off_they_are_the_references(monkeypatch):
    packed = one_shot.pack(*_payloads(2, 4, 64))
    x = jnp.zeros((4, 64), jnp.bfloat16)
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    decode = jax.jit(lambda p: one_shot.dequantize_rotate(p, block=64, hadamard=True))
    quantize = jax.jit(lambda v: one_shot.rotate_quantize(v, hadamard=True))
    assert "custom_call" not in decode.lower(packed).as_text()
    assert "custom_call" not in quantize.lower(x).as_text()


def test_the_kernels_count_as_faster_only_in_an_avx512_build(monkeypatch):
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next(line for line in cpuinfo if line.startswith("flags")).split()
    assert one_shot.vectorized() == ("avx512f" in flags)
    assert one_shot.pays(64) == one_shot.vectorized()
    ar, mesh = get_all_reduce("equarx-int8", min_size_bytes=0), mesh_of(2)

    def program_text() -> str:  # traced afresh: conftest's programs are cached across tests
        body = lambda b: ar(b[0], AXIS)[None]
        program = jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
        return jax.jit(program).lower(jnp.ones((2, 64, 640), jnp.bfloat16)).as_text()

    targets = (one_shot.DEQUANTIZE.target, one_shot.QUANTIZE.target)
    assert all(target in program_text() for target in targets) == one_shot.vectorized()
    monkeypatch.setattr(one_shot, "vectorized", lambda: False)
    assert not one_shot.pays(64)
    hlo = program_text()
    assert not any(target in hlo for target in targets)
    assert "all_gather" in hlo  # still the quantized path, with XLA's ops


# --- in the all-reduce ------------------------------------------------------------------------


def test_one_shot_equarx_uses_the_kernels_only_where_they_apply():
    n, x = 2, np.random.default_rng(0).standard_normal((2, 64, 640)).astype(jnp.bfloat16)
    targets = (one_shot.QUANTIZE.target, one_shot.DEQUANTIZE.target)
    default = get_all_reduce("equarx-int8", min_size_bytes=0)
    for form in (default, default.with_rotated_input()):
        assert all(target in lower_all_reduce(form, x, n) for target in targets)
    for options in (dict(rotation=None), dict(scale_dtype="float32")):
        form = get_all_reduce("equarx-int8", min_size_bytes=0, **options)
        assert all(target in lower_all_reduce(form, x, n) for target in targets), options
    target = one_shot.DEQUANTIZE.target
    for other in (
        get_all_reduce("equarx-int8", min_size_bytes=0, kernel="jnp"),
        get_all_reduce("equarx-int8", min_size_bytes=0, schedule="two-shot"),
        get_all_reduce("equarx-int8", min_size_bytes=0, block_size=64, inverse="codes"),
    ):
        assert target not in lower_all_reduce(other, x, n), other
    assert target not in lower_all_reduce(default, x.astype(np.float32), n)  # f32 out


@pytest.mark.parametrize("rotated_input", [False, True])
@pytest.mark.parametrize(("n", "differ"), [(2, 0.01), (4, 0.02)])  # one-shot, two-shot
def test_with_the_kernels_the_all_reduce_matches_the_xla_ops_within_one_rounding(
    n, differ, rotated_input
):
    x = np.random.default_rng(n).standard_normal((n, 96, 640)).astype(jnp.bfloat16)
    fast = get_all_reduce("equarx-int8", min_size_bytes=0)
    slow = get_all_reduce("equarx-int8", min_size_bytes=0, kernel="jnp")
    if rotated_input:
        fast, slow = fast.with_rotated_input(), slow.with_rotated_input()
    got, want = run_all_reduce(fast, x, n), run_all_reduce(slow, x, n)
    assert all((got[0].view(np.uint16) == g.view(np.uint16)).all() for g in got)  # replicas
    got, want = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6)
    assert np.mean(got != want) < differ


@pytest.mark.parametrize(("shape", "slice_bytes"), [((96, 640), 0), ((97, 641), 9_000)])
def test_without_a_rotation_the_kernels_give_the_xla_ops_bits(shape, slice_bytes):
    """Quantize and decode are the reference's arithmetic on both paths, with nothing between;
    also in slices read from and written to the message in place, the last one padded."""
    n = 2
    x = np.random.default_rng(3).standard_normal((n, *shape)).astype(jnp.bfloat16)
    x[0, 3, 7], x[1, 5, 9] = np.nan, np.inf  # the non-finite code too
    options = dict(min_size_bytes=0, rotation=None, slice_bytes=slice_bytes)
    fast = get_all_reduce("equarx-int8", **options)
    slow = get_all_reduce("equarx-int8", **options, kernel="jnp")
    if slice_bytes:
        assert fast.for_axis_size(n).slices_for(x[0].size, jnp.bfloat16, n) > 2
    np.testing.assert_array_equal(
        run_all_reduce(fast, x, n).view(np.uint16), run_all_reduce(slow, x, n).view(np.uint16)
    )


def test_sliced_one_shot_decodes_each_lane_while_the_next_is_on_the_wire():
    """XLA:CPU runs a program as a DAG whose edges include buffer reuse, and its collectives in
    schedule order: the lanes must be all-gathered in the order their decodes are chained in,
    no all-gather may reuse a buffer an earlier decode reads (every all-gathered buffer is held
    until the last decode), and the encoders run one after another (each holds the previous
    payload), or the decodes wait for the transfers, or the first transfer for every encoder."""
    n, x = 2, np.zeros((2, 64, 640), jnp.bfloat16)
    ar = get_all_reduce("equarx-int8", min_size_bytes=0, slice_bytes=8192)
    assert ar.for_axis_size(n).slices_for(x[0].size, jnp.bfloat16, n) > 4
    lines = lower_all_reduce(ar, x, n).split("ENTRY")[1].splitlines()
    gathers = [line.split("=")[0].strip() for line in lines if " all-gather(" in line]
    decodes = [line for line in lines if 'custom_call_target="equarx_dequantize_rotate' in line]
    assert len(decodes) == len(gathers) > 4
    calls = [re.sub(r"/\*.*?\*/", "", decode).split("custom-call(")[1] for decode in decodes]
    operands = [call.split(")")[0].split(", ") for call in calls]
    assert [first for first, *_ in operands] == gathers  # lane k's decode reads lane k's bytes
    assert set(gathers) <= set(operands[-1])  # the last decode holds every lane's bytes
    encoders = {  # lane k + 1's encoder holds lane k's payload: the encoders run in lane order
        line.split("=")[0].strip(): re.sub(r"/\*.*?\*/", "", line).split("custom-call(")[1]
        for line in lines
        if f'custom_call_target="{one_shot.QUANTIZE.target}"' in line
    }
    held_payloads = [call.split(")")[0].split(", ")[1:] for call in encoders.values()]
    assert sorted(len(held) for held in held_payloads) == [0] + [1] * (len(gathers) - 1)
    bitcasts = dict(re.findall(r"(%bitcast[.\d]*) = \S+ bitcast\((%[\w.]+)\)", "\n".join(lines)))
    assert {bitcasts.get(name, name) for held in held_payloads for name in held} < set(encoders)


def test_held_operands_change_nothing_and_need_an_out_array():
    packed = one_shot.pack(*_payloads(2, 3, 64))
    out = jnp.ones(300, jnp.bfloat16)
    codec = dict(block=64, start=64, hadamard=True)
    held = (jnp.zeros(5, jnp.uint8), jnp.ones((2, 3), jnp.float32))
    decode = jax.jit(lambda p, o, *h: one_shot.dequantize_rotate_into(o, p, held=h, **codec))
    want = one_shot.dequantize_rotate_into(out, packed, **codec)
    np.testing.assert_array_equal(_bits(decode(packed, out, *held)), _bits(want))
    with pytest.raises(ValueError, match="held"):
        one_shot.dequantize_rotate_into(
            jax.ShapeDtypeStruct(out.shape, out.dtype), packed, held=held, **codec
        )


# --- slices of a message, read and written in place --------------------------------------------


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize(
    ("start", "rows"),
    [(0, 15), (64, 5), (896, 3), (960, 1), (960, 4), (1000, 2), (1024, 3)],
)  # whole rows, a row cut by the end of x, rows of zeros past it, a start past it
def test_quantizing_rows_of_a_message_gives_the_padded_rows_bits(
    start, rows, hadamard, scale_dtype
):
    rng = np.random.default_rng(start + rows)
    flat = rng.standard_normal(1000) * 10.0 ** rng.integers(-20, 20, 1000)
    flat[[3, 970]] = np.nan, np.inf
    x = jnp.asarray(flat.reshape(8, 125), jnp.bfloat16)  # read flat, whatever its shape
    padded = jnp.pad(x.reshape(-1), (0, 64 * 64))[start : start + rows * 64].reshape(rows, 64)
    quantize = jax.jit(
        lambda v: one_shot.rotate_quantize_rows(
            v, block=64, start=start, rows=rows, hadamard=hadamard, scale_dtype=scale_dtype
        )
    )
    assert "custom_call" in quantize.lower(x).as_text()
    want = one_shot.rotate_quantize_reference(padded, hadamard=hadamard, scale_dtype=scale_dtype)
    np.testing.assert_array_equal(np.asarray(quantize(x)), np.asarray(want))


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize(("start", "rows"), [(0, 4), (128, 3), (960, 1), (960, 2), (1024, 2)])
def test_decoding_into_a_message_writes_its_range_and_nothing_else(start, rows, fresh, scale_dtype):
    codes, scales = _payloads(2, rows, 64, seed=start)
    packed = one_shot.pack(codes, jnp.asarray(scales, scale_dtype))
    before = jnp.asarray(np.random.default_rng(1).standard_normal((8, 125)), jnp.bfloat16)
    into = jax.ShapeDtypeStruct(before.shape, before.dtype) if fresh else before
    codec = dict(block=64, hadamard=True, scale_dtype=scale_dtype)
    decode = jax.jit(
        lambda p, out: one_shot.dequantize_rotate_into(
            into if fresh else out, p, start=start, **codec
        )
    )
    got = _bits(decode(packed, before)).reshape(-1)
    values = _bits(one_shot.dequantize_rotate_reference(packed, **codec))
    end = min(1000, start + rows * 64)
    np.testing.assert_array_equal(got[start:end], values.reshape(-1)[: max(0, end - start)])
    if not fresh:  # the rest of the buffer is kept; a fresh one's rest is unset
        kept = np.ones(1000, bool)
        kept[start:end] = False
        np.testing.assert_array_equal(got[kept], _bits(before).reshape(-1)[kept])


def test_decoding_into_a_message_is_the_reference_where_the_kernel_is_off(monkeypatch):
    packed = one_shot.pack(*_payloads(1, 2, 64))
    before = jnp.ones(200, jnp.bfloat16)
    decode = jax.jit(
        lambda p, out: one_shot.dequantize_rotate_into(out, p, block=64, start=100, hadamard=False)
    )
    want = _bits(decode(packed, before))
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    decode = jax.jit(
        lambda p, out: one_shot.dequantize_rotate_into(out, p, block=64, start=100, hadamard=False)
    )
    assert "custom_call" not in decode.lower(packed, before).as_text()
    np.testing.assert_array_equal(_bits(decode(packed, before)), want)


_QUANTIZE_ROWS = dict(x=jnp.zeros(300, jnp.bfloat16), block=64, start=0, rows=1, hadamard=True)
_DECODE_INTO = dict(
    out=jnp.zeros(300, jnp.bfloat16), packed=jnp.zeros((2, 68), jnp.uint8), block=64, start=0,
    hadamard=True,
)  # fmt: skip


@pytest.mark.parametrize(
    ("function", "defaults", "bad", "match"),
    [
        (one_shot.rotate_quantize_rows, _QUANTIZE_ROWS, dict(start=-1), "start"),
        (one_shot.rotate_quantize_rows, _QUANTIZE_ROWS, dict(rows=0), "rows"),
        (one_shot.rotate_quantize_rows, _QUANTIZE_ROWS, dict(block=48), "power of two"),
        (one_shot.rotate_quantize_rows, _QUANTIZE_ROWS, dict(x=jnp.zeros(9, jnp.float32)), "bf16"),
        (one_shot.dequantize_rotate_into, _DECODE_INTO, dict(start=-64), "start"),
        (one_shot.dequantize_rotate_into, _DECODE_INTO, dict(out=jnp.zeros(9)), "bf16"),
        (one_shot.dequantize_rotate_into, _DECODE_INTO, dict(packed=jnp.zeros((2, 67), jnp.uint8)),
         "whole rows"),
        (one_shot.dequantize_rotate_into, _DECODE_INTO, dict(scale_dtype="bfloat16"),
         "whole rows of 64 codes \\+ a bfloat16 scale"),
        (one_shot.dequantize_rotate_into, _DECODE_INTO, dict(scale_dtype="float16"), "scale_dtype"),
        (one_shot.rotate_quantize_rows, _QUANTIZE_ROWS, dict(scale_dtype="int8"), "scale_dtype"),
    ],
)  # fmt: skip
def test_slices_of_a_message_reject_bad_input_clearly(function, defaults, bad, match):
    with pytest.raises(ValueError, match=match):
        function(**{**defaults, **bad})


# --- two-shot's last step: each chunk decoded and rotated back ---------------------------------


def _chunks(k: int, rows: int, block: int, scale_dtype: str, seed: int = 0) -> np.ndarray:
    """K chunk payloads as two-shot all-gathers them: codes, then scales in `scale_dtype`."""
    codes, scales = _payloads(k, rows, block, seed)
    scale_bytes = np.asarray(jnp.asarray(scales, scale_dtype)).view(np.uint8).reshape(k, -1)
    return np.concatenate([codes.view(np.uint8).reshape(k, -1), scale_bytes], axis=1)


@pytest.mark.parametrize(
    ("k", "rows", "block", "group", "scale_dtype"),
    [
        (4, 64, 32, 64, "bfloat16"),  # the N > 2 default
        (3, 12, 16, 64, "float32"),
        (2, 8, 64, 64, "float32"),
        (2, 12, 8, 32, "bfloat16"),
        (2, 16, 8, 64, "float32"),  # group 64 of blocks under a vector register: the plain loop
        (1, 4, 64, 128, "float32"),
    ],
)
def test_the_each_decode_kernel_gives_the_references_bits(k, rows, block, group, scale_dtype):
    packed = _chunks(k, rows, block, scale_dtype)
    args = dict(block=block, group=group, scale_dtype=scale_dtype)
    apply = jax.jit(lambda p: one_shot.decode_rotate_each(p, **args))
    reference = jax.jit(lambda p: one_shot.decode_rotate_each_reference(p, **args))
    assert one_shot.DECODE_EACH.target in apply.lower(packed).as_text()
    got = apply(packed)
    assert got.shape == (k, rows, block) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(got), _bits(reference(packed)))


def test_each_decode_is_the_dense_rotation_of_each_decoded_chunk_within_one_rounding():
    codes, scales = _payloads(3, 64, 32, seed=2)
    codes = np.where(codes == -128, -127, codes).astype(np.int8)
    scales = np.full_like(scales, 0.01)
    packed = np.concatenate(
        [codes.view(np.uint8).reshape(3, -1), scales.view(np.uint8).reshape(3, -1)], axis=1
    )
    got = one_shot.decode_rotate_each(packed, block=32, group=64, scale_dtype="float32")
    decoded = (codes.astype(np.float32) * scales[..., None]).reshape(3, 32, 64)
    want = np.asarray(block_hadamard(jnp.asarray(decoded))).reshape(3, 64, 32)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-7, atol=1e-6)


def test_a_non_finite_code_makes_its_group_nan_and_only_that_group():
    codes, scales = np.ones((2, 8, 32), np.int8), np.ones((2, 8), np.float32)
    codes[1, 5, 3] = -128  # chunk 1, rows 4-5 form its group 2
    packed = np.concatenate(
        [codes.view(np.uint8).reshape(2, -1), scales.view(np.uint8).reshape(2, -1)], axis=1
    )
    got = np.asarray(
        one_shot.decode_rotate_each(packed, block=32, group=64, scale_dtype="float32"), np.float32
    )
    nan = np.isnan(got)
    assert nan[1, 4:6].all() and nan.sum() == 64


@pytest.mark.parametrize(
    ("shape", "block", "group", "scale_dtype", "match"),
    [
        ((2, 4 * 34), 32, 48, "bfloat16", "power of two"),
        ((2, 4 * 34), 64, 32, "bfloat16", "dividing group"),
        ((2, 3 * 34), 32, 64, "bfloat16", "whole groups"),
        ((2, 4 * 34), 32, 64, "float16", "scale_dtype"),
        ((4 * 34,), 32, 64, "bfloat16", "want packed payloads"),
    ],
)
def test_each_decode_rejects_a_bad_layout(shape, block, group, scale_dtype, match):
    with pytest.raises(ValueError, match=match):
        one_shot.decode_rotate_each(
            jnp.zeros(shape, jnp.uint8), block=block, group=group, scale_dtype=scale_dtype
        )


def test_two_shot_equarx_decodes_with_the_kernel_only_where_it_applies():
    n, x = 4, np.random.default_rng(4).standard_normal((4, 64, 640)).astype(jnp.bfloat16)
    target = one_shot.DECODE_EACH.target
    default = get_all_reduce("equarx-int8", min_size_bytes=0)
    for form in (default, default.with_rotated_input()):
        assert (target in lower_all_reduce(form, x, n)) == one_shot.decodes_each(32, 64)
    for other in (
        get_all_reduce("equarx-int8", min_size_bytes=0, kernel="jnp"),
        get_all_reduce(
            "equarx-int8", min_size_bytes=0, block_size=32, scale_dtype="bfloat16", inverse="codes"
        ),
        get_all_reduce("equarx-int8", min_size_bytes=0, schedule="ring"),
        get_all_reduce("equarx-int8", min_size_bytes=0, rotation=None),
    ):
        assert target not in lower_all_reduce(other, x, n), other
    assert target not in lower_all_reduce(default, x.astype(np.float32), n)  # f32 out


def test_sliced_two_shot_runs_its_collectives_in_pipelined_order_and_holds_its_buffers():
    """As for one-shot: lane k's permutes, then lane k - 1's all-gather, in the schedule, and
    the last decode holds every received and all-gathered buffer, so that a lane's reduce and
    decode overlap the next lane's transfers (XLA:CPU: see the one-shot test above)."""
    n, x = 4, np.zeros((4, 64, 640), jnp.bfloat16)
    ar = get_all_reduce("equarx-int8", min_size_bytes=0, num_slices=3)
    if not (one_shot.quantizes_chunks(32, 64) and one_shot.decodes_each(32, 64)):
        pytest.skip("the two-shot kernels do not run on this CPU")
    lines = lower_all_reduce(ar, x, n).split("ENTRY")[1].splitlines()
    kinds = [
        kind for line in lines for kind in ("all-gather(", "collective-permute(") if kind in line
    ]
    permutes, gather = "collective-permute(", "all-gather("
    assert kinds == [permutes] * 3 + ([permutes] * 3 + [gather]) * 2 + [gather]
    names = {line.split("=")[0].strip() for line in lines if any(k in line for k in kinds)}
    decodes = [
        line for line in lines if f'custom_call_target="{one_shot.DECODE_EACH.target}"' in line
    ]
    assert len(decodes) == 3
    held = re.sub(r"/\*.*?\*/", "", decodes[-1]).split("custom-call(")[1].split(")")[0]
    assert names <= set(held.split(", "))


def test_held_operands_of_the_each_decode_change_nothing():
    packed = jnp.asarray(_chunks(2, 4, 32, "bfloat16"))
    codec = dict(block=32, group=64, scale_dtype="bfloat16")
    held = (jnp.zeros(3, jnp.uint8),)
    got = jax.jit(lambda p, h: one_shot.decode_rotate_each(p, held=(h,), **codec))(packed, *held)
    np.testing.assert_array_equal(_bits(got), _bits(one_shot.decode_rotate_each(packed, **codec)))


@pytest.mark.parametrize(("block", "pieces"), [(32, [(0, 4), (4, 6), (10, 6)]), (64, [(0, 8)])])
def test_the_each_decode_fills_a_buffer_piece_by_piece(monkeypatch, block, pieces):
    """The pieces of an all-gather (rows of every chunk) decoded into one buffer give the whole
    decode, through the kernel (aliased) and as jnp ops."""
    k, rows = 3, 16
    packed = _chunks(k, rows, block, "bfloat16", seed=5)
    codec = dict(block=block, group=64, scale_dtype="bfloat16")
    per_row = block + 2

    def piecewise(packed: jax.Array) -> jax.Array:
        codes, scales = packed[:, : rows * block], packed[:, rows * block :]
        out = jax.ShapeDtypeStruct((k, rows, block), jnp.bfloat16)
        for first, count in pieces:
            piece = jnp.concatenate(
                [codes[:, first * block : (first + count) * block],
                 scales[:, first * 2 : (first + count) * 2]], axis=1
            )  # fmt: skip
            assert piece.shape == (k, count * per_row)
            out = one_shot.decode_rotate_each(piece, into=out, first=first, **codec)
        return out

    whole = jax.jit(lambda p: one_shot.decode_rotate_each(p, **codec))(packed)
    whole_reference = jax.jit(lambda p: one_shot.decode_rotate_each_reference(p, **codec))(packed)
    got, want = _native_and_reference(monkeypatch, piecewise, jnp.asarray(packed))
    covered = pieces[-1][0] + pieces[-1][1]  # rows past it: zeros as jnp ops, unset natively
    np.testing.assert_array_equal(got[:, :covered].view(np.uint16), _bits(whole)[:, :covered])
    zeros_past = whole_reference.at[:, covered:].set(0)
    np.testing.assert_array_equal(want.view(np.uint16), _bits(zeros_past))


@pytest.mark.parametrize(
    ("into", "first", "match"),
    [
        (jax.ShapeDtypeStruct((2, 4, 32), jnp.bfloat16), 2, "past into"),
        (jax.ShapeDtypeStruct((3, 8, 32), jnp.bfloat16), 0, "want into"),
        (jax.ShapeDtypeStruct((2, 8, 64), jnp.bfloat16), 0, "want into"),
        (jax.ShapeDtypeStruct((2, 8, 32), jnp.float32), 0, "want into"),
        (jax.ShapeDtypeStruct((2, 8, 32), jnp.bfloat16), -2, "start"),
    ],
)
def test_each_decode_into_a_buffer_rejects_rows_it_cannot_hold(into, first, match):
    packed = jnp.zeros((2, 4 * 34), jnp.uint8)
    with pytest.raises(ValueError, match=match):
        one_shot.decode_rotate_each(
            packed, block=32, group=64, scale_dtype="bfloat16", into=into, first=first
        )


# --- two-shot's reduce-scatter: every chunk encoded, the own chunk reduced ----------------------


def _message(size: int, seed: int) -> jax.Array:
    """bf16 values over many magnitudes, with NaN, Inf and a run of zeros."""
    rng = np.random.default_rng(seed)
    flat = rng.standard_t(3, size) * 10.0 ** rng.integers(-20, 20, size)
    flat[[1, size // 2]], flat[size // 3 : size // 3 + 64] = (np.nan, -np.inf), 0.0
    return jnp.asarray(flat, jnp.bfloat16)


def _native_and_reference(monkeypatch, function, *args) -> tuple[np.ndarray, np.ndarray]:
    """function(*args) through the kernel (checked to be a custom call), then as jnp ops."""
    native_fn = jax.jit(function)
    assert "custom_call" in native_fn.lower(*args).as_text()
    got = np.asarray(native_fn(*args))
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    reference_fn = jax.jit(lambda *a: function(*a))
    assert "custom_call" not in reference_fn.lower(*args).as_text()
    return got, np.asarray(reference_fn(*args))


@pytest.mark.parametrize(
    ("block", "group", "scale_dtype", "hadamard", "chunks", "start", "rows"),
    [
        (32, 64, "bfloat16", True, 4, 0, 16),  # the N > 2 default
        (32, 64, "bfloat16", False, 4, 256, 16),  # the model's form: no rotation here
        (16, 64, "float32", True, 2, 64, 20),
        (64, 64, "float32", True, 3, 3008, 2),  # the last chunks cut by x's end, then zeros
        (8, 64, "bfloat16", True, 2, 0, 24),  # blocks under a vector register: the plain loop
        (32, 128, "float32", True, 2, 128, 8),
        (32, 32, "bfloat16", False, 1, 5000, 2),  # wholly past x's end
    ],
)
def test_the_chunk_encoder_gives_the_references_bits(
    monkeypatch, block, group, scale_dtype, hadamard, chunks, start, rows
):
    x = _message(3100, seed=rows)
    args = dict(block=block, group=group, scale_dtype=scale_dtype, hadamard=hadamard)
    encode = lambda v: one_shot.rotate_quantize_chunks(
        v, start=start, rows=rows, chunks=chunks, **args
    )
    got, want = _native_and_reference(monkeypatch, encode, x)
    assert got.shape == (chunks, rows * (block + (2 if scale_dtype == "bfloat16" else 4)))
    np.testing.assert_array_equal(got, want)


def test_bfloat16_scales_are_rounded_up_so_that_no_code_clips():
    """Every row's largest value keeps |code| <= 127 with the scale it travels with."""
    x = _message(4096, seed=9)
    packed = one_shot.rotate_quantize_chunks(
        x, block=32, group=64, scale_dtype="bfloat16", hadamard=True, start=0, rows=128, chunks=1
    )
    codes, scales = one_shot._split(packed, 128, 32, "bfloat16")
    rotated = np.asarray(one_shot._walsh_hadamard(x.astype(jnp.float32).reshape(-1, 64)))
    rows = rotated.reshape(128, 32)
    finite = np.where(np.isfinite(rows), np.abs(rows), 0).max(1)
    assert (finite <= 127 * np.asarray(scales[0])).all()
    assert (np.asarray(codes) >= -127).sum() == np.isfinite(rows).sum()


@pytest.mark.parametrize(
    ("k", "block", "group", "scale_dtype", "hadamard", "start"),
    [
        (3, 32, 64, "bfloat16", True, 1024),  # the N = 4 default, standalone
        (3, 32, 64, "bfloat16", False, 0),  # the model's form
        (1, 64, 64, "float32", True, 512),
        (2, 16, 64, "float32", True, 2944),  # cut by x's end
        (7, 8, 64, "bfloat16", True, 64),  # the plain loop
        (0, 32, 64, "bfloat16", True, 128),  # nothing received: the encoder's payload
    ],
)
def test_the_chunk_reducer_gives_the_references_bits(
    monkeypatch, k, block, group, scale_dtype, hadamard, start
):
    rows = 8
    x = _message(3000, seed=k)
    received = [jnp.asarray(p) for p in _chunks(k, rows, block, scale_dtype, seed=3)] if k else []
    args = dict(block=block, group=group, scale_dtype=scale_dtype, hadamard=hadamard, rows=rows)
    reduce = lambda v, s, *r: one_shot.reduce_chunk(v, s, r, **args)
    got, want = _native_and_reference(monkeypatch, reduce, x, jnp.int32(start), *received)
    np.testing.assert_array_equal(got, want)
    if k == 0:  # the same payload the encoder gives for those rows
        encoded = one_shot.rotate_quantize_chunks(
            x, start=start, rows=rows, chunks=1, **{a: args[a] for a in args if a != "rows"}
        )
        np.testing.assert_array_equal(got, np.asarray(encoded)[0])


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (dict(group=48), "power of two"),
        (dict(group=16), "multiple of block"),
        (dict(rows=3), "whole groups"),
        (dict(received=[jnp.zeros(10, jnp.uint8)]), "received payloads"),
        (dict(scale_dtype="float16"), "scale_dtype"),
    ],
)
def test_the_chunk_reducer_rejects_bad_input_clearly(bad, match):
    args = dict(block=32, group=64, scale_dtype="bfloat16", hadamard=True, rows=4)
    received = bad.pop("received", [jnp.zeros(4 * 34, jnp.uint8)])
    with pytest.raises(ValueError, match=match):
        one_shot.reduce_chunk(jnp.zeros(256, jnp.bfloat16), 0, received, **{**args, **bad})


def test_a_piece_of_a_chunk_reduces_to_the_rows_of_the_whole_chunks_payload(monkeypatch):
    """Rows first .. first + count - 1 of the own chunk against those rows of whole received
    payloads, or of a payload that travelled as pieces (firsts per payload): the payload of
    those rows of the whole chunk's reduction, through the kernel and as jnp ops."""
    rows, block, per_row = 16, 32, 34
    x = _message(3000, seed=8)
    received = [jnp.asarray(p) for p in _chunks(3, rows, block, "bfloat16", seed=6)]
    args = dict(block=block, group=64, scale_dtype="bfloat16", hadamard=True)
    whole = np.asarray(one_shot.reduce_chunk(x, 512, received, rows=rows, **args))
    codes, scales = whole[: rows * block], whole[rows * block :]
    first, count = 6, 4
    want = np.concatenate(
        [codes[first * block : (first + count) * block], scales[first * 2 : (first + count) * 2]]
    )
    # payload 0 as two pieces (rows 0-3 and 4-15), the piece here in the second
    tail = one_shot.reduce_chunk(x, 512 + 4 * block, [], rows=rows - 4, **args)  # any bytes
    tail_codes = np.asarray(received[0])[4 * block : rows * block]
    tail_scales = np.asarray(received[0])[rows * block + 4 * 2 :]
    split = jnp.asarray(np.concatenate([tail_codes, tail_scales]))
    assert split.shape == tail.shape == ((rows - 4) * per_row,)
    start = jnp.int32(512 + first * block)

    def piece(x, start, *payloads):
        return one_shot.reduce_chunk(
            x, start, payloads, rows=count, firsts=[first - 4, first, first], **args
        )

    got, reference = _native_and_reference(monkeypatch, piece, x, start, split, *received[1:])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(reference, want)


@pytest.mark.parametrize(
    ("firsts", "match"),
    [([0, 0], "a first row per received payload"), ([13], "R >= 17"), ([-1], "start")],
)
def test_the_chunk_reducer_rejects_rows_past_a_received_payload(firsts, match):
    args = dict(block=32, group=64, scale_dtype="bfloat16", hadamard=True, rows=4)
    received = [jnp.zeros(16 * 34, jnp.uint8)]
    with pytest.raises(ValueError, match=match):
        one_shot.reduce_chunk(jnp.zeros(256, jnp.bfloat16), 0, received, firsts=firsts, **args)


def test_two_shot_equarx_reduce_scatters_with_the_kernels_only_where_they_apply():
    n, x = 4, np.random.default_rng(4).standard_normal((4, 64, 640)).astype(jnp.bfloat16)
    targets = (one_shot.QUANTIZE.target, one_shot.REDUCE_CHUNK.target)
    default = get_all_reduce("equarx-int8", min_size_bytes=0)
    for form in (default, default.with_rotated_input()):
        text = lower_all_reduce(form, x, n)
        calls = re.findall(r'custom_call_target="(\w+)"', text)
        # the N - 1 chunks it sends each encoded on its own, then its own chunk reduced
        expected = n if one_shot.quantizes_chunks(32, 64) else 0
        assert calls.count(one_shot.REDUCE_CHUNK.target) == expected, calls
    for other in (
        get_all_reduce("equarx-int8", min_size_bytes=0, kernel="jnp"),
        get_all_reduce("equarx-int8", min_size_bytes=0, schedule="ring"),
        get_all_reduce("equarx-int8", min_size_bytes=0, block_size=32, rotation_block=128),
    ):
        text = lower_all_reduce(other, x, n)
        assert not any(t in text for t in targets), other
    assert one_shot.REDUCE_CHUNK.target not in lower_all_reduce(default, x.astype(np.float32), n)
