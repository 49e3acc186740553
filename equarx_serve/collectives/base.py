"""The all-reduce interface and its registry.

An all-reduce is a callable used inside `jax.shard_map`: `y = ar(x, axis_name)` returns what
`jax.lax.psum(x, axis_name)` would, with the same shape and dtype. Each implementation is a
frozen dataclass whose fields are its typed, validated options, registered under a name:

    ar = get_all_reduce("equarx-int8", block_size=256)
    y = jax.shard_map(lambda x: ar(x, "tp"), mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))(x)

The base class is the plain collective (`lax.psum`); faster implementations override `reduce`
and `wire_bytes`. Users add their own with `register_all_reduce`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

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


def ring_all_reduce_bytes(operand_bytes: int, axis_size: int) -> int:
    return 2 * (axis_size - 1) * operand_bytes // axis_size


def psum_wire_itemsize(dtype: jnp.dtype) -> int:
    itemsize = jnp.dtype(dtype).itemsize
    if jax.default_backend() == "cpu" and itemsize < 4:
        return 4
    return itemsize


@dataclasses.dataclass(frozen=True)
class PsumF32(AllReduce):
    """Upcast to f32, `lax.psum`, cast back: the numerical reference."""

    name: ClassVar[str] = "psum-f32"

    def reduce(self, x: jax.Array, axis_name: str, axis_size: int) -> jax.Array:
        return lax.psum(x.astype(jnp.float32), axis_name).astype(x.dtype)

    def wire_bytes(self, num_elements: int, dtype: jnp.dtype, axis_size: int) -> int:
        return ring_all_reduce_bytes(num_elements * 4, axis_size)


_REGISTRY: dict[str, type[AllReduce]] = {}


def register_all_reduce(cls: type[AllReduce]) -> type[AllReduce]:
    """Registers an `AllReduce` subclass under `cls.name` (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, AllReduce)):
        raise TypeError(f"register_all_reduce takes an AllReduce subclass, got {cls!r}")
    if not dataclasses.is_dataclass(cls) or "name" not in vars(cls):
        raise TypeError(
            f"{cls.__name__} must be a frozen dataclass that sets `name: ClassVar[str]`"
        )
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"an all-reduce named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def list_all_reduces() -> list[str]:
    return list(_REGISTRY)


def get_all_reduce(name: str | AllReduce, **options: object) -> AllReduce:
    """The all-reduce registered as `name`, configured with `options`.

    An `AllReduce` instance passes through unchanged (options must then be empty).
    Raises ValueError for an unknown name or option, listing what is valid.
    """
    if isinstance(name, AllReduce):
        if options:
            raise ValueError("options can only be given with an all-reduce name, not an instance")
        return name
    if name not in _REGISTRY:
        raise ValueError(f"unknown all-reduce {name!r}; registered: {', '.join(_REGISTRY)}")
    cls = _REGISTRY[name]
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for all-reduce {name!r}; valid: {valid or 'none'}"
        )
    return cls(**options)


AllReduceFn = Callable[[jax.Array, str], jax.Array]

register_all_reduce(AllReduce)
register_all_reduce(PsumF32)
