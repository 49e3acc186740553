"""The all-reduce registry and the text form of a method, `name:key=value,...`.

This module does not import JAX: the command line parses `--all-reduce` and `--methods` with
`parse_method` before the host device count is set. The built-in all-reduces register
themselves when first asked for (`get_all_reduce`, `list_all_reduces`).

    spec = parse_method("equarx-int8:block_size=64")  # MethodSpec(label, name, options)
    ar = get_all_reduce(spec.name, **spec.options)     # an AllReduce, options validated
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from equarx_serve.collectives.base import AllReduce

# Imported on first use; each registers its all-reduces (in this order: `list_all_reduces`).
_BUILTIN_MODULES = ("baselines", "equarx")

_REGISTRY: dict[str, type[AllReduce]] = {}


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """`name` or `name:key=value,key=value`; `label` is the spec as written, without spaces."""

    label: str
    name: str
    options: dict[str, object]


def _parse_value(text: str) -> object:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    try:
        return int(text)
    except ValueError:
        return text


def parse_method(text: str) -> MethodSpec:
    """`equarx-int8:schedule=ring,rotation=hadamard` -> its name and options (values parsed as
    int, bool, None or else str). Names and options are checked by `get_all_reduce`."""
    label = re.sub(r"\s+", "", text)
    name, _, option_text = label.partition(":")
    options: dict[str, object] = {}
    for item in filter(None, option_text.split(",")):
        key, sep, value = item.partition("=")
        if not (sep and key) or key in options:
            raise ValueError(f"invalid method {text!r}: options are key=value,key=value")
        options[key] = _parse_value(value)
    if not name:
        raise ValueError(f"invalid method {text!r}: no all-reduce name")
    return MethodSpec(label, name, options)


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(f"equarx_serve.collectives.{module}")


def register_all_reduce(cls: type[AllReduce]) -> type[AllReduce]:
    """Registers an `AllReduce` subclass under `cls.name` (usable as a class decorator)."""
    from equarx_serve.collectives.base import AllReduce

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
    """The registered names: the built-ins in `_BUILTIN_MODULES` order (whichever module was
    imported first), then users' in the order they registered."""
    _load_builtins()
    # `psum` is the interface itself (`base.AllReduce`), registered by `baselines`.
    modules = [f"equarx_serve.collectives.{module}" for module in ("base", *_BUILTIN_MODULES)]

    def rank(name: str) -> int:
        module = _REGISTRY[name].__module__
        return modules.index(module) if module in modules else len(modules)

    return sorted(_REGISTRY, key=rank)


def get_all_reduce(name: str | MethodSpec | AllReduce, **options: object) -> AllReduce:
    """The all-reduce registered as `name` (or a `MethodSpec`'s), configured with `options`.

    An `AllReduce` instance passes through unchanged (options must then be empty).
    Raises ValueError for an unknown name or option, listing what is valid.

    In a run of several processes (`jax.distributed.initialize`), the defaults that depend on
    the link (`slice_bytes="auto"`, two-shot's pieces) go by the link `transport` measured:
    without a `measure_link()` or `assume_link(...)` before, the first all-reduce traced
    measures it there (collective: every process traces the same program, so all reach it at
    the same point). One process (fake CPU devices, one host): no link, no slicing.
    """
    _load_builtins()
    from equarx_serve.collectives.base import AllReduce

    if isinstance(name, AllReduce):
        if options:
            raise ValueError("options can only be given with an all-reduce name, not an instance")
        return name
    if isinstance(name, MethodSpec):
        name, options = name.name, {**name.options, **options}
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
