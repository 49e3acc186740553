"""Bytes each device puts on the wire, counted from a compiled program's HLO text.

`collective_wire_bytes(compiled.as_text(), axis_size)` finds every collective instruction and
charges it, per device, with the usual bus-bandwidth conventions (N = `axis_size`):

    collective-permute   operand bytes (each device sends its operand once)
    all-reduce           2 (N-1)/N x operand bytes (a bandwidth-optimal ring)
    all-gather           (N-1)/N x output bytes
    reduce-scatter       (N-1)/N x input bytes (= (N-1) x output bytes)
    all-to-all           (N-1)/N x operand bytes

Tuple-shaped (combined) collectives are summed over their elements. Asynchronous pairs are
counted once, at the `-start` (a `collective-permute-start` result is `(operand, output, ...)`,
an `all-gather-start` result `(operand, output)`); `-done` is skipped.

The operand size is read from the instruction's own result shape (identical for
collective-permute, all-reduce and all-to-all), so the text needs no operand shapes. The count
is static: a collective inside a loop body is counted once, not once per iteration.
"""

from __future__ import annotations

import re

COLLECTIVE_KINDS = (
    "collective-permute",
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
)

# Bits per element of every HLO primitive type that can appear in a collective.
_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64,
    "c64": 64, "c128": 128, "token": 0,
}  # fmt: skip
_NARROW_FLOAT = re.compile(r"f(?P<bits>[468])e\w+")  # f8e4m3fn, f4e2m1fn, f8e8m0fnu, ...

# `[ROOT] %name = <shape> <opcode>(`: the shape is everything up to the first ` word(`.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[^\s=]+\s*=\s*(?P<shape>.*?)\s(?P<op>[a-z][a-z0-9\-]*)\("
)
_ARRAY = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape: `f32[]`, `s8[2,16,256]{2,1,0}`, or a (nested) tuple of them."""
    total_bits = 0
    for match in _ARRAY.finditer(shape):
        dtype = match["dtype"]
        if dtype in _BITS:
            bits = _BITS[dtype]
        elif narrow := _NARROW_FLOAT.fullmatch(dtype):
            bits = int(narrow["bits"])
        else:
            raise ValueError(f"unknown HLO element type {dtype!r} in shape {shape!r}")
        elements = 1
        for dim in filter(None, match["dims"].split(",")):
            elements *= int(dim.strip().removeprefix("<="))
        total_bits += elements * bits
    return (total_bits + 7) // 8


def tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape `(a, b, ...)`; `[shape]` for an array shape."""
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    elements, depth, start = [], 0, 1
    for i, char in enumerate(shape):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if (char == "," and depth == 1) or depth == 0:
            elements.append(shape[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return [e for e in elements if e]


def _payload_bytes(op: str, shape: str) -> tuple[str, int] | None:
    """(kind, bytes of the operand, or of the output for all-gather) of one instruction."""
    if op.endswith("-done"):
        return None
    kind = op.removesuffix("-start")
    if kind not in COLLECTIVE_KINDS:
        return None
    if op.endswith("-start") and kind in ("collective-permute", "all-gather"):
        # (operand, output[, contexts]): the operand or the gathered output.
        element = tuple_elements(shape)[0 if kind == "collective-permute" else 1]
        return kind, shape_bytes(element)
    return kind, shape_bytes(shape)


def collective_wire_bytes(hlo_text: str, axis_size: int) -> dict[str, int]:
    """Bytes each device sends, per collective kind present in `hlo_text` (see module doc).

    `axis_size` is N, the number of devices each collective spans. Kinds that do not occur
    are absent from the result; an HLO without collectives gives `{}`.
    """
    if axis_size < 1:
        raise ValueError(f"axis_size must be >= 1, got {axis_size}")
    n = axis_size
    totals: dict[str, int] = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        payload = _payload_bytes(match["op"], match["shape"])
        if payload is None:
            continue
        kind, size = payload
        if kind == "all-reduce":
            sent = 2 * (n - 1) * size // n
        elif kind == "reduce-scatter":
            sent = (n - 1) * size  # the result is 1/N of the input
        elif kind in ("all-gather", "all-to-all"):
            sent = (n - 1) * size // n
        else:
            sent = size
        totals[kind] = totals.get(kind, 0) + sent
    return totals
