"""What the step engine reports: typed events, and a request's result.

TokenEvent     a generated token and its newly streamable text (possibly "")
FinishedEvent  the request is done: its `Completion` (finish reason, tokens, text, timings)
ErrorEvent     the request failed (its own error, the others run on)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from enum import StrEnum

__all__ = [
    "Completion",
    "ErrorEvent",
    "ErrorKind",
    "Event",
    "FinishReason",
    "FinishedEvent",
    "TokenEvent",
]


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, <end_of_turn> or a stop string
    LENGTH = "length"  # max_tokens
    CANCELLED = "cancelled"  # aborted (the client went away, or the caller said so)


class ErrorKind(StrEnum):
    INVALID_REQUEST = "invalid_request"  # the request cannot run (HTTP 400)
    INTERNAL = "internal"  # its step failed (500)
    UNAVAILABLE = "unavailable"  # the engine can run no more steps (503)


@dataclasses.dataclass
class Completion:
    """One request's result.

    Attributes:
      prompt_tokens: The prompt's token ids.
      tokens: The generated ids, without EOS / <end_of_turn> and without the tokens of (or
        after the start of) a stop string.
      text: The generated text (cut before a stop string).
      finish_reason: See `FinishReason`.
      prefill_ms: The prefill of the batch this request was admitted with.
      time_to_first_token_ms: From the request's arrival to its first token (includes waiting
        for a slot).
      decode_ms: From the first token to the last.
      decode_tokens_per_s: Tokens after the first, per second of decode_ms (0 if none).
    """

    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    finish_reason: FinishReason
    prefill_ms: float
    time_to_first_token_ms: float
    decode_ms: float
    decode_tokens_per_s: float


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    request_id: Hashable
    token: int
    text: str  # newly streamable text; "" while text is held back


@dataclasses.dataclass(frozen=True)
class FinishedEvent:
    """`unsent`: text held back (a possible stop string's start, an incomplete character)
    when the request ended otherwise (EOS, cancelled); `completion.text` includes it."""

    request_id: Hashable
    completion: Completion
    unsent: str = ""


@dataclasses.dataclass(frozen=True)
class ErrorEvent:
    request_id: Hashable
    message: str
    kind: ErrorKind = ErrorKind.INTERNAL


Event = TokenEvent | FinishedEvent | ErrorEvent
