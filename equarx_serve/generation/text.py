"""Text around the model: the Gemma 3 chat template, and a tokenizer for random-init models."""

from __future__ import annotations

import functools
import string
from collections.abc import Sequence
from typing import Any

from models.tokenizer import Tokenizer, set_bpe_specs

__all__ = ["byte_tokenizer", "chat_prompt"]

_CHAT_ROLES = {"user": "user", "assistant": "model", "model": "model"}


def _message_text(index: int, message: Any) -> tuple[str, str]:
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
        raise ValueError(f"message {index} must be a dict with 'role' and 'content'")
    role, content = message["role"], message["content"]
    if isinstance(content, list):  # OpenAI-style parts: only text is supported
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise ValueError(f"message {index}: only text content parts are supported")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    if not isinstance(content, str):
        raise ValueError(f"message {index}: content must be a string, got {type(content).__name__}")
    if role != "system" and role not in _CHAT_ROLES:
        raise ValueError(
            f"message {index}: unknown role {role!r}; valid: system, user, assistant (or model)"
        )
    return role, content


def chat_prompt(messages: Sequence[dict]) -> str:
    """The Gemma 3 chat template, ready for the model's turn:

        <start_of_turn>user\\n{system}\\n\\n{user}<end_of_turn>\\n
        <start_of_turn>model\\n{assistant}<end_of_turn>\\n ... <start_of_turn>model\\n

    A system message may come first only; as Gemma has no system role, its text is prepended
    to the first user turn. After it, turns alternate user / assistant ("model" also accepted),
    starting and ending with user. BOS is not included: `Tokenizer.encode` adds it.
    ValueError for anything else.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role', 'content'} dicts")
    parsed = [_message_text(i, m) for i, m in enumerate(messages)]
    system = None
    if parsed and parsed[0][0] == "system":
        system = parsed.pop(0)[1]
    if not parsed:
        raise ValueError("messages must contain at least one user message")
    turns = []
    for i, (role, content) in enumerate(parsed):
        expected = "user" if i % 2 == 0 else "model"
        if role == "system":
            raise ValueError("a system message may only come first")
        if _CHAT_ROLES[role] != expected:
            raise ValueError(
                "roles must alternate user/assistant, starting with user "
                f"(after an optional system message); turn {i} is {role!r}"
            )
        if i == 0 and system is not None:
            content = f"{system}\n\n{content}"
        turns.append(f"<start_of_turn>{expected}\n{content}<end_of_turn>\n")
    if parsed[-1][0] != "user":
        raise ValueError("the last message must be a user message (the model answers it)")
    return "".join(turns) + "<start_of_turn>model\n"


@functools.cache
def byte_tokenizer(vocab_size: int) -> Tokenizer:
    """A SentencePiece tokenizer of exactly `vocab_size` pieces for random-init test models
    (which ship none): Gemma's special ids (<pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4),
    <start_of_turn> and <end_of_turn>, 256 byte pieces (any text encodes), then printable ASCII
    characters and letter pairs. Needs vocab_size >= 263."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    piece = sp_pb2.ModelProto.SentencePiece
    special = [
        ("<pad>", piece.CONTROL),
        ("<eos>", piece.CONTROL),
        ("<bos>", piece.CONTROL),
        ("<unk>", piece.UNKNOWN),
        ("<mask>", piece.CONTROL),
        ("<start_of_turn>", piece.USER_DEFINED),
        ("<end_of_turn>", piece.USER_DEFINED),
    ]
    if vocab_size < len(special) + 256:
        raise ValueError(f"byte_tokenizer needs vocab_size >= {len(special) + 256}")
    chars = ["▁" if c == " " else c for c in string.printable[:95]]
    words = [*chars, *[f"▁{c}" for c in string.ascii_lowercase]]
    words += [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]
    words += [f"<unused{i}>" for i in range(vocab_size)]
    proto = sp_pb2.ModelProto()
    for text, kind in special:
        proto.pieces.add(piece=text, score=0.0, type=kind)
    for b in range(256):
        proto.pieces.add(piece=f"<0x{b:02X}>", score=0.0, type=piece.BYTE)
    for i, word in enumerate(words[: vocab_size - len(proto.pieces)]):
        kind = piece.CONTROL if word.startswith("<unused") else piece.NORMAL
        proto.pieces.add(piece=word, score=-float(i), type=kind)
    set_bpe_specs(proto, {"pad": 0, "eos": 1, "bos": 2, "unk": 3}, add_dummy_prefix=False)
    return Tokenizer(proto.SerializeToString(), source=f"byte_tokenizer({vocab_size})")
