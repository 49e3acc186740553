"""The all-reduce interface and its registry.

An all-reduce is a callable used inside `jax.shard_map`: `y = ar(x, axis_name)` returns what
`jax.lax.psum(x, axis_name)` would, with the same shape and dtype. Each implementation is a
frozen dataclass whose fields are its typed, validated options, registered under a name:

    ar = get_all_reduce("equarx-int8", block_size=256)
    y = jax.shard_map(lambda x: ar(x, "tp"), mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))(x)

The base class is the plain collective (`lax.psum`); faster implementations override `reduce`
and `wire_bytes`. What callers need to know without running one is part of the interface:
`quantized` (the wire format is lossy) and `is_gated(num_elements, dtype)` (a message of that
size goes to the plain collective instead, e.g. a size gate), so `quantizes(...)` says whether a
given message is actually quantized; `ungated()` is the same method with any gate turned off.
A method that rotates its input before quantizing (`equarx-int8`'s Hadamard) says so with
`foldable_rotation`; a model may fold that rotation into the weights that produce the input and
reduce with `with_rotated_input()`, which applies only the inverse. `exact_sum` is the f32
value an all-reduce approximates, for measuring its error.
Users add their own with `register_all_reduce` (`registry.py`); the built-in ones register
in `baselines.py` (`psum`, `psum-f32`, `ring`, `naive-int8`) and `equarx.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from equarx_serve.kernels.native import target_platform

if TYPE_CHECKING:
    from equarx_serve.collectives.hadamard import HadamardRotation

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def axis_size_or_raise(axis_name: str) -> int:
    """The size of a named mesh axis, or a ValueError naming the axis when it is not bound."""
    try:
        return lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(
            f"unknown axis name {axis_name!r}: an all-reduce must be called inside jax.shard_map "
            "over a mesh that has this axis"
        ) from e


def check_float_dtype(x: jax.Array, name: str) -> None:
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} reduces floating-point arrays (float32, bfloat16, float16); got {x.dtype}. "
            "Use the 'psum' all-reduce for integer data."
        )


@dataclasses.dataclass(frozen=True)
class AllReduce:
    """Base all-reduce: `lax.psum` in the input dtype. Subclasses override `reduce`."""

    name: ClassVar[str] = "psum"
    # Whether messages that pass the gate travel in a lossy (quantized) format.
    quantized: ClassVar[bool] = False

    def __call__(self, x: jax.Array, axis_name: str) -> jax.Array:
        axis_size = axis_size_or_raise(axis_name)
        if axis_size == 1:
            return x
        return self.reduce(x, axis_name, axis_size)

    def reduce(self, x: jax.Array, axis_name: str, axis_size: int) -> jax.Array:
        return lax.psum(x, axis_name)

    def wire_bytes(self, num_elements: int, dtype: jnp.dtype, axis_size: int) -> int:
        """Bytes each device puts on the wire, counting an all-reduce as a bandwidth-optimal
        ring (2(N-1)/N of the operand). On CPU, XLA widens 16-bit all-reduces to f32."""
        return ring_all_reduce_bytes(num_elements * psum_wire_itemsize(dtype), axis_size)

    def options(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def is_gated(self, num_elements: int, dtype: jnp.dtype) -> bool:
        """True when a message of `num_elements` of `dtype` is sent to plain `lax.psum` rather
        than through this method (a size gate). The base method has no gate."""
        return False

    def gate_bytes(self) -> int | None:
        """The message size below which `is_gated` holds in this run; None: no gate."""
        return None

    def quantizes(self, num_elements: int, dtype: jnp.dtype) -> bool:
        """True when such a message actually travels quantized (lossy)."""
        return self.quantized and not self.is_gated(num_elements, dtype)

    def ungated(self) -> AllReduce:
        """This method with its gate off (every message goes through it); itself if none."""
        return self

    @property
    def foldable_rotation(self) -> HadamardRotation | None:
        """The orthonormal rotation this method applies to its input and lets its caller fold
        into the weights producing that input (then reduce with `with_rotated_input()`); None
        when there is none."""
        return None

    def with_rotated_input(self) -> AllReduce:
        """This method for inputs already rotated by `foldable_rotation`: the same sum, the
        forward transform skipped, only the inverse applied to the result."""
        raise ValueError(f"{self.name} has no input rotation to fold")

    def exact_sum(self, x: jax.Array, axis_name: str) -> jax.Array:
        """The f32 value this all-reduce of `x` approximates: `psum` of x in f32."""
        return lax.psum(x.astype(jnp.float32), axis_name)

    def one_shot_parts(self, x: jax.Array, axis_size: int) -> OneShotParts | None:
        """This all-reduce of x over `axis_size` devices as one exchange of bytes (its one-shot
        form, `OneShotParts`), for a transport that moves the bytes itself
        (`collectives.overlap`); None where it has none (then `reduce` runs). The base method
        sends x's own bits and sums in f32."""
        return raw_one_shot_parts(x, x.dtype)


@dataclasses.dataclass(frozen=True)
class OneShotParts:
    """An all-reduce as one exchange: every device sends `payload` (u8 [bytes], its whole
    message encoded) to every other, and `combine` maps the payloads of all N devices (u8
    [N (source rank), bytes]) to the sum, decoded and added in rank order so that every device
    computes the same bits."""

    payload: jax.Array
    combine: Callable[[jax.Array], jax.Array]


def raw_one_shot_parts(x: jax.Array, wire_dtype: jnp.dtype) -> OneShotParts:
    """x's values in `wire_dtype`, their bits on the wire, summed in f32 and cast back."""
    values = x.astype(wire_dtype)
    payload = lax.bitcast_convert_type(values, jnp.uint8).reshape(-1)
    itemsize = jnp.dtype(wire_dtype).itemsize

    def combine(gathered: jax.Array) -> jax.Array:
        n = gathered.shape[0]
        by_rank = gathered.reshape(n, *x.shape, *((itemsize,) if itemsize > 1 else ()))
        by_rank = lax.bitcast_convert_type(by_rank, wire_dtype).astype(jnp.float32)
        return sum_in_rank_order(by_rank).astype(x.dtype)

    return OneShotParts(payload, combine)


def sum_in_rank_order(by_rank: jax.Array) -> jax.Array:
    """by_rank [N (source rank), ...] summed k = 0, 1, ..., N - 1, as every device does, so
    replicas get the same bits. Added one by one: one elementwise pass (`jnp.sum` over the
    leading axis is a reduce that XLA:CPU runs ~4x slower, measured at 16 MiB)."""
    return functools.reduce(operator.add, [by_rank[k] for k in range(by_rank.shape[0])])


def ring_all_reduce_bytes(operand_bytes: int, axis_size: int) -> int:
    return 2 * (axis_size - 1) * operand_bytes // axis_size


def psum_wire_itemsize(dtype: jnp.dtype) -> int:
    itemsize = jnp.dtype(dtype).itemsize
    if target_platform() == "cpu" and itemsize < 4:
        return 4
    return itemsize


AllReduceFn = Callable[[jax.Array, str], jax.Array]
