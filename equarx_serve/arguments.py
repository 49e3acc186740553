"""Command-line value types shared by every `equarx-serve` command (and the link probe): each
parser takes the text of one value and raises ValueError with a message for the user;
`argument_type` turns that message into argparse's usage error (exit code 2)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable


class UsageError(Exception):
    """A bad command line, reported as a usage error (exit code 2) without a traceback."""


def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < minimum:
            raise ValueError(f"invalid value {text!r}: must be an integer >= {minimum}")
        return int(text)

    return parse


def chunks_or_auto(text: str) -> int | str:
    """`overlap_chunks`: an integer >= 1, or "auto" (chosen by the run: `collectives.overlap`)."""
    return "auto" if text.strip() == "auto" else int_at_least(1)(text)


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be > 0, got {text}")
    return value


def argument_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """`parse` for argparse: its ValueError message becomes the usage error."""

    def argument_type(text: str) -> object:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return argument_type
