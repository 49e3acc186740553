"""Ahead-of-time lowering for TPU v5e and H100 from this CPU host (no accelerator needed).

Each program is traced on an abstract mesh of the target's devices and lowered for it: the
Pallas kernel, every registered all-reduce at N = 2, 4 and 8 with its defaults and with
kernel="pallas", and the TP = 2 Gemma 3 270M prefill with equarx-int8. What crosses devices is
read from the lowered StableHLO: for the quantized all-reduces only integer payloads (int8
codes with their scales bit-cast beside them), never the 16-bit input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from equarx_serve.bench import lowering
from equarx_serve.collectives import get_all_reduce, list_all_reduces
from equarx_serve.kernels import block_quantize
from models.config import get_config

PLATFORMS = tuple(lowering.TARGETS)
KERNEL_CALL = {"tpu": "@tpu_custom_call", "cuda": "@__gpu$xla.gpu.triton"}
INTEGER_TYPES = {"i8", "ui8", "i16", "ui16", "i32", "ui32"}


def _lowered_text(platform: str, devices: int, build) -> str:
    mesh = lowering.abstract_mesh(platform, devices)
    with jax.sharding.use_abstract_mesh(mesh):
        return build(mesh).lower(lowering_platforms=(platform,)).as_text()


# --- the rounding the kernel and its reference share -----------------------------------------


def _same_as_round(values: np.ndarray) -> None:
    ours = np.asarray(jax.jit(block_quantize.round_half_to_even)(values))
    expected = np.asarray(jax.jit(jnp.round)(values))
    np.testing.assert_array_equal(ours.view(np.uint32), expected.view(np.uint32))


def test_round_half_to_even_on_ties_and_edges():
    ties = np.arange(-300, 300, dtype=np.float32) + np.float32(0.5)
    near = np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))
    edges = np.array(
        [0.0, -0.0, 2.0**23 - 0.5, 2.0**23, 2.0**24 + 2, -(2.0**23) + 0.5, 1e-45, -1e-45, 3e38],
        np.float32,
    )
    special = np.array([np.inf, -np.inf], np.float32)
    _same_as_round(np.concatenate([ties, *near, edges, special]))
    assert np.isnan(block_quantize.round_half_to_even(jnp.float32(np.nan)))


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(np.float32, 256, elements=st.floats(width=32, allow_nan=False)))
def test_round_half_to_even_matches_round(values):
    _same_as_round(values)


# --- the kernel -------------------------------------------------------------------------------


@pytest.mark.parametrize("received", [0, 2])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_kernel_lowers_to_the_platforms_compiler(platform, received):
    text = _lowered_text(platform, 2, lowering.kernel_program(received))
    assert KERNEL_CALL[platform] in text


# --- every all-reduce -------------------------------------------------------------------------


def _cases() -> list:
    return [
        pytest.param(name, options, devices, id=f"{name}-{variant}-{devices}")
        for name in list_all_reduces()
        for variant, options in lowering.variants(name).items()
        for devices in lowering.DEVICE_COUNTS
    ]


def test_the_pallas_variant_is_lowered_for_equarx():
    assert lowering.variants("equarx-int8")["pallas"] == {"kernel": "pallas"}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize(("name", "options", "devices"), _cases())
def test_all_reduce_lowers_and_sends_what_it_should(platform, name, options, devices):
    text = _lowered_text(platform, devices, lowering.all_reduce_program(name, options))
    sent = lowering.collectives_of(text)
    assert sent, "an all-reduce over several devices must have collectives"
    if get_all_reduce(name).quantized:
        floats = [c for c in sent if c.dtype not in INTEGER_TYPES]
        assert not floats, f"{name} sends floats: {floats}"
        assert sum(c.bytes for c in sent) < devices * lowering.MESSAGE_BYTES
    if name == "equarx-int8":  # the quantizer is the Pallas kernel on TPU and GPU by default
        assert KERNEL_CALL[platform] in text


def test_collectives_of_reads_regions_and_tuples():
    text = """
      %3 = "stablehlo.all_reduce"(%2) <{replica_groups = dense<0> : tensor<1x1xi64>}> ({
      ^bb0(%a: tensor<bf16>, %b: tensor<bf16>):
        %5 = stablehlo.add %a, %b : tensor<bf16>
        stablehlo.return %5 : tensor<bf16>
      }) : (tensor<8x4xbf16>) -> tensor<8x4xbf16>
      %4 = "stablehlo.all_gather"(%1) <{all_gather_dim = 0 : i64}> : (tensor<16xui8>) -> tensor<32xui8>
      %6:2 = "stablehlo.all_to_all"(%7, %8) <{}> : (tensor<2xi8>, tensor<3xf32>) -> (tensor<2xi8>, tensor<3xf32>)
    """  # noqa: E501
    assert lowering.collectives_of(text) == (
        lowering.Collective("all_reduce", "bf16", 64),
        lowering.Collective("all_gather", "ui8", 32),
        lowering.Collective("all_to_all", "i8", 2),
        lowering.Collective("all_to_all", "f32", 12),
    )


# --- the model --------------------------------------------------------------------------------


@pytest.mark.parametrize("platform", PLATFORMS)
def test_prefill_lowers_with_int8_on_the_wire(platform):
    tokens = lowering.PREFILL_TOKENS  # 2.5 MiB messages: above the size gate (1 MiB)
    text = _lowered_text(platform, 2, lowering.prefill_program("equarx-int8", tokens))
    sent = lowering.collectives_of(text)
    config = get_config("gemma3-270m")
    floats = [c for c in sent if c.dtype not in INTEGER_TYPES]
    # The one float collective is the vocab-parallel embedding's lookup psum of [1, T, D]
    # (exact: one non-zero term an element); every row-parallel all-reduce sends integers.
    assert floats == [lowering.Collective("all_reduce", "bf16", tokens * config.embed_dim * 2)]
    quantized = [c for c in sent if c.dtype in INTEGER_TYPES]
    assert len(quantized) >= 2 * config.num_layers
    assert KERNEL_CALL[platform] in text
