"""The OpenAI protocol: request bodies, the error type and its JSON shape.

Errors follow OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, built in one
place (`APIError`); FastAPI's validation errors become 400s with the field as `param`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "UNSUPPORTED",
    "APIError",
    "ChatBody",
    "ChatMessage",
    "CompletionBody",
    "ErrorBody",
    "SamplingBody",
    "bad_request",
    "unavailable",
    "validation_api_error",
]


class APIError(Exception):
    """An error answered as OpenAI does: `status` and `{"error": {...}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "param": self.param}
        return {"error": error | {"code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, type="server_error", code=code)


class _Strict(BaseModel):
    # Strict: "5" is not an int, true is not a number; unknown fields are ignored (clients send
    # e.g. "user" or "logprobs": null), except the features below when they ask for something.
    model_config = ConfigDict(strict=True, extra="ignore")


# OpenAI parameters this server does not implement: 400 unless set to their no-op value.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    # With no tools there is nothing to choose: "required" or a named function is refused.
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}


MAX_STOP_SEQUENCES = 4  # as OpenAI


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's extension (usage in every chunk): refused rather than ignored.
    continuous_usage_stats: Literal[False] = False


class SamplingBody(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # extras: checked by UNSUPPORTED
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)  # extension; above the vocabulary: all tokens
    seed: int | None = None  # its low 32 bits are used
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=1)  # only 1

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionBody(SamplingBody):
    # OpenAI's forms: a string, a list of strings, token ids, a list of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error answer (OpenAI's shape)."""

    error: ErrorDetail


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens


def _is_type_tag(part: str) -> bool:
    """pydantic's name of a union member in an error location ("str", "list[int]",
    "TextPart"), as opposed to a field name or a list index."""
    return not part.isdigit() and (not part.isidentifier() or not part.islower() or part in _TYPES)


_TYPES = {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_api_error(error: RequestValidationError) -> APIError:
    """FastAPI's 422 turned into OpenAI's 400: the first problem, with its field as param."""
    errors = error.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg"))
        return bad_request(f"the body is not valid JSON: {detail}", None, "invalid_json")
    if first.get("type") == "missing" and not loc:
        return bad_request("the body must be a JSON object", None, "invalid_json")
    param = ".".join(p for p in loc if not _is_type_tag(p)) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if "input" in first and first.get("type") != "missing":
        message += f" (got {json.dumps(first['input'], default=str)[:100]})"
    more = len(errors) - 1
    if more:
        message += f"; and {more} more problem{'s' * (more > 1)}"
    return bad_request(message, param, first.get("type"))
