"""Incremental detokenization with stop strings.

    detok = Detokenizer(tokenizer, stop=("\\n\\n",))
    delta = detok.add(token, last=False)  # TextDelta: newly streamable text, stopped?

Each token re-decodes the request's tokens (SentencePiece merges pieces across token
boundaries, so text is only final in context). Text that could still become a stop string,
or an incomplete UTF-8 character (decoded as U+FFFD), is held back until it resolves: a stop
string is never streamed. When one appears, the text is cut before it and the tokens that
produced it (and anything after) are dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

__all__ = ["Detokenizer", "TextDelta"]

_REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 byte sequence decodes to


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class TextDelta:
    """text: newly streamable text (possibly ""); stopped: a stop string ended the text."""

    text: str
    stopped: bool = False


class Detokenizer:
    """One request's generated text (see module doc)."""

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0  # characters of `text` streamed

    def add(self, token: int, *, last: bool = False) -> TextDelta:
        """Appends one token; `last`: no more will come, so nothing is held back."""
        self.tokens.append(token)
        self.text = self.tokenizer.decode(self.tokens)
        at = _stop_index(self.text, self.stop, max(0, self.sent - self._longest_stop))
        if at is not None:
            delta = self.text[self.sent : at]
            self._cut(at)
            return TextDelta(delta, stopped=True)
        end = len(self.text) if last else len(self.text) - _held_back(self.text, self.stop)
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return TextDelta(delta)

    def unsent(self) -> str:
        """The text held back so far (what a request that ends now has not streamed)."""
        return self.text[self.sent :]

    def _cut(self, at: int) -> None:
        """Cuts the text before index `at` and keeps the tokens inside it."""
        text = self.text[:at]
        keep = len(self.tokens)
        while keep and len(self.tokenizer.decode(self.tokens[:keep])) > len(text):
            keep -= 1
        self.tokens, self.text, self.sent = self.tokens[:keep], text, len(text)


def _stop_index(text: str, stops: Sequence[str], start: int) -> int | None:
    """Where the earliest stop string in text[start:] begins, or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters to hold back: an incomplete UTF-8 character, or the
    longest suffix of `text` that begins a stop string."""
    held = len(text) - len(text.rstrip(_REPLACEMENT))
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                held = max(held, n)
                break
    return held
