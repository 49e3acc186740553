"""The native int8 per-block kernel (`equarx_serve/kernels/block_gemv.py`) against the exact
product of x and the dequantized table, and its reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_of
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from equarx_serve.kernels import block_gemv, native

pytestmark = pytest.mark.skipif(
    not block_gemv.native_available(), reason="no C++ compiler: the kernel cannot be built"
)


def _operands(rows: int, inputs: int, outputs: int, group: int, *, offsets: bool, seed: int = 0):
    """x [rows, inputs] bf16 and a table in int8 blocks as the GGUF types give them: values in
    [-32, 31] (or [0, 15] with offsets, as Q4_K), positive scales, offsets (minima) >= 0."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, inputs)), jnp.bfloat16)
    low, high = (0, 16) if offsets else (-32, 32)
    values = jnp.asarray(rng.integers(low, high, (outputs, inputs)), jnp.int8)
    shape = (outputs, inputs // group)
    scales = jnp.asarray(rng.uniform(1e-4, 1e-2, shape), jnp.float32)
    mins = jnp.asarray(rng.uniform(0, 0.05, shape), jnp.float32) if offsets else None
    return x, values, scales, mins


def _table(values, scales, offsets) -> np.ndarray:
    """The dequantized table in f64 (exact: f32 scales and offsets times small integers)."""
    group = values.shape[1] // scales.shape[1]
    weight = np.asarray(values, np.float64) * np.repeat(np.asarray(scales, np.float64), group, 1)
    if offsets is not None:
        weight -= np.repeat(np.asarray(offsets, np.float64), group, 1)
    return weight


def _check_close_to_exact(got, x, values, scales, offsets):
    x64 = np.asarray(x, np.float64)
    table = _table(values, scales, offsets)
    exact = x64 @ table.T
    # f32 sums of terms of either sign: a few ulps of the sum of magnitudes (the offsets' term
    # is summed on its own, so it counts at full size).
    magnitude = np.abs(x64) @ np.abs(np.asarray(values, np.float64) * 1.0).T * np.max(scales)
    if offsets is not None:
        magnitude += np.abs(x64) @ np.abs(table).T + np.abs(x64).sum(1, keepdims=True) * np.max(
            offsets
        )
    assert got.dtype == np.float32 and got.shape == exact.shape
    assert np.all(np.abs(got - exact) <= 1e-5 * magnitude + 1e-30)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17])
@pytest.mark.parametrize(("group", "groups"), [(32, 20), (16, 40), (32, 1), (16, 3), (48, 5)])
@pytest.mark.parametrize("offsets", [False, True])
def test_matmul_equals_the_exact_product(rows, group, groups, offsets):
    """Every row count (several passes above 8), both group sizes the GGUF types use (unrolled)
    and one they do not (48: the loop over runs of 16), an odd number of groups (the even/odd
    totals' tail), with and without offsets."""
    x, values, scales, mins = _operands(rows, group * groups, 37, group, offsets=offsets)
    got = np.asarray(jax.jit(block_gemv.matmul)(x, values, scales, mins))
    _check_close_to_exact(got, x, values, scales, mins)
    ref = np.asarray(jax.jit(block_gemv.reference)(x, values, scales, mins))
    _check_close_to_exact(ref, x, values, scales, mins)


# The kernel's other ways to widen int8, built here with the CPU features they stand in for
# switched off (a CI machine may have any of them).
NARROWER_BUILDS = {"avx512f-without-vbmi": ("-mno-avx512vbmi",), "plain-loops": ("-mno-avx512f",)}


@pytest.fixture(scope="module", params=sorted(NARROWER_BUILDS))
def narrower_target(request) -> str:
    """The kernel compiled without some of this CPU's features, registered as a target of its
    own."""
    kernel = dataclasses.replace(
        block_gemv.KERNEL,
        target=f"{block_gemv.KERNEL.target}_{request.param.replace('-', '_')}",
        extra_flags=NARROWER_BUILDS[request.param],
    )
    if not native.register(kernel):
        pytest.skip(f"the {request.param} build of the kernel failed")
    return kernel.target


@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize(("group", "groups"), [(32, 7), (16, 5), (48, 3)])
@pytest.mark.parametrize("offsets", [False, True])
def test_builds_for_narrower_cpus_equal_the_exact_product(
    narrower_target, rows, group, groups, offsets
):
    x, values, scales, mins = _operands(rows, group * groups, 21, group, offsets=offsets)
    out = jax.ShapeDtypeStruct((rows, values.shape[0]), jnp.float32)
    empty = jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(narrower_target, out)
    got = np.asarray(jax.jit(call)(x, values, scales, empty if mins is None else mins))
    _check_close_to_exact(got, x, values, scales, mins)


def test_extreme_values_stay_exact_products():
    """int8's ends (-128, 127) and large bf16 inputs: products exact in f32, no overflow."""
    x = jnp.full((2, 64), 3.0e4, jnp.bfloat16).at[1].set(-1.5e-3)
    values = jnp.asarray(np.tile([-128, 127], (5, 32)), jnp.int8)
    scales = jnp.full((5, 2), 0.25, jnp.float32)
    got = np.asarray(jax.jit(block_gemv.matmul)(x, values, scales))
    _check_close_to_exact(got, x, values, scales, None)


def test_matmul_rejects_bad_operands():
    x, values, scales, mins = _operands(2, 64, 8, 32, offsets=True)
    with pytest.raises(ValueError, match=r"want x \[B, I\], values \[O, I\]"):
        block_gemv.matmul(x[:, :32], values, scales)
    with pytest.raises(ValueError, match="want x"):
        block_gemv.matmul(x, values, scales[:, :1].repeat(3, 1))  # 64 % 3 != 0
    with pytest.raises(ValueError, match="offsets"):
        block_gemv.matmul(x, values, scales, mins[:, :1])
    with pytest.raises(ValueError, match="int8"):
        block_gemv.matmul(x, values.astype(jnp.int32), scales)


def test_a_group_size_the_kernel_cannot_take_goes_through_the_reference():
    x, values, scales, _ = _operands(2, 24, 8, 8, offsets=False)  # G = 8: not 16's multiple
    program = jax.jit(block_gemv.matmul).lower(x, values, scales).as_text()
    assert block_gemv.KERNEL.target not in program
    got = np.asarray(jax.jit(block_gemv.matmul)(x, values, scales))
    _check_close_to_exact(got, x, values, scales, None)


def test_the_kernel_is_a_custom_call_and_can_be_switched_off(monkeypatch):
    x, values, scales, _ = _operands(2, 32, 8, 32, offsets=False)

    def program() -> str:  # traced afresh (jit caches traces by function)
        return jax.jit(lambda *a: block_gemv.matmul(*a)).lower(x, values, scales).as_text()

    assert block_gemv.KERNEL.target in program()
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert not block_gemv.native_available()
    assert block_gemv.KERNEL.target not in program()


def test_in_shard_map_each_device_multiplies_its_rows():
    """The head's use: a table split on O over 2 devices, x replicated; the gathered result
    is the whole product."""
    x, values, scales, mins = _operands(2, 64, 48, 32, offsets=True)
    sharded = jax.jit(
        jax.shard_map(
            block_gemv.matmul,
            mesh=mesh_of(2),
            in_specs=(P(), P("tp", None), P("tp", None), P("tp", None)),
            out_specs=P(None, "tp"),
        )
    )
    assert block_gemv.KERNEL.target in sharded.lower(x, values, scales, mins).as_text()
    _check_close_to_exact(np.asarray(sharded(x, values, scales, mins)), x, values, scales, mins)


def test_the_program_lowers_for_tpu_and_gpu_without_the_kernel():
    """Traced for an abstract TPU or GPU mesh, the program is the reference's einsums."""
    from equarx_serve.bench import lowering

    operands = _operands(2, 64, 16, 32, offsets=True)
    specs = (P(), P("tp", None), P("tp", None), P("tp", None))
    for platform in ("tpu", "cuda"):
        mesh = lowering.abstract_mesh(platform, 2)
        abstract = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
            for a, spec in zip(operands, specs, strict=True)
        ]
        sharded = jax.shard_map(
            block_gemv.matmul, mesh=mesh, in_specs=specs, out_specs=P(None, "tp")
        )
        with jax.sharding.use_abstract_mesh(mesh):
            lowered = jax.jit(sharded).trace(*abstract).lower(lowering_platforms=(platform,))
        text = lowered.as_text()
        assert block_gemv.KERNEL.target not in text and "dot_general" in text
