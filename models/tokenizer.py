"""Gemma 3's SentencePiece tokenizer, rebuilt from a GGUF file's metadata or read from a
`.model` file.

Gemma 3's tokenizer is a SentencePiece BPE model with byte fallback. llama.cpp's GGUF keeps
its pieces, scores and types (`tokenizer.ggml.*`, model "llama" = SentencePiece) but not the
normalizer/trainer settings, and it rewrote a few entries from the Hugging Face
`added_tokens` list. `sentencepiece_proto_from_gguf` undoes that:

- `<unk>` is typed CONTROL there (HF "special"); SentencePiece needs exactly one UNKNOWN
  piece, at `tokenizer.ggml.unknown_token_id`.
- The whitespace-run pieces (ids 138-167, "▁▁" ... 31 x "▁") were stored with plain
  spaces; SentencePiece escapes spaces to "▁" before matching, so the plain-space versions
  never match: every " " in a piece is turned back into "▁".
- `<start_of_turn>` / `<end_of_turn>` are CONTROL there, which SentencePiece never matches in
  text; they are USER_DEFINED so that chat-formatted text ("<start_of_turn>user\\n...")
  encodes them as single tokens, as gemma's own chat sampler expects. The other control
  tokens (`<pad>`, `<eos>`, `<bos>`, `<mask>`, `<unusedN>`) stay CONTROL: typed text cannot
  produce them.

Settings (the normalizer is not in the GGUF file; each was checked, see tests/loading_test.py):
- normalizer "identity" (no NFKC): the vocabulary holds ~2,000 pieces that NFKC would have
  rewritten (full-width punctuation, "…", "ﬁ"), so training text was not NFKC-normalized;
- `add_dummy_prefix` false (GGUF `tokenizer.ggml.add_space_prefix` is false; "Hello" is the
  piece "Hello", not "▁Hello");
- `remove_extra_whitespaces` false (runs of spaces are pieces of their own);
- `escape_whitespaces` true (pieces carry "▁");
- `byte_fallback` true (the 256 `<0xNN>` BYTE pieces);
- `split_digits` true and `allow_whitespace_only_pieces` true are recorded as Gemma trains
  with them; they only affect training, not encoding (there are no multi-digit ASCII pieces).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_pb2

from models.gguf import open_gguf

__all__ = ["Tokenizer", "sentencepiece_proto_from_gguf"]

_WS = "▁"  # U+2581, SentencePiece's escaped space
_CHAT_TOKENS = ("<start_of_turn>", "<end_of_turn>")
_Piece = sp_pb2.ModelProto.SentencePiece

# The named special tokens looked up by piece (when the vocabulary has them).
_SPECIAL_PIECES = {
    "pad": "<pad>",
    "eos": "<eos>",
    "bos": "<bos>",
    "unk": "<unk>",
    "mask": "<mask>",
    "start_of_turn": "<start_of_turn>",
    "end_of_turn": "<end_of_turn>",
    "start_of_image": "<start_of_image>",
    "end_of_image": "<end_of_image>",
}


def _gguf_field(reader: Any, key: str, path: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"{path}: tokenizer metadata key {key} is missing")
    return field.contents()


def sentencepiece_proto_from_gguf(path_or_reader: Any) -> bytes:
    """A serialized SentencePiece `ModelProto` rebuilt from a GGUF file's tokenizer metadata.

    `path_or_reader` is a path or a reader from `models.gguf.open_gguf`.
    """
    if isinstance(path_or_reader, (str, os.PathLike)):
        path, reader = str(path_or_reader), open_gguf(path_or_reader)
    else:
        reader = path_or_reader
        path = str(getattr(reader.data, "filename", "<gguf>"))
    model = _gguf_field(reader, "tokenizer.ggml.model", path)
    if model != "llama":
        raise ValueError(
            f"{path}: tokenizer.ggml.model is {model!r}; only 'llama' (SentencePiece) is supported"
        )
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens", path)
    scores = _gguf_field(reader, "tokenizer.ggml.scores", path)
    types = _gguf_field(reader, "tokenizer.ggml.token_type", path)
    if not len(tokens) == len(scores) == len(types):
        raise ValueError(
            f"{path}: tokenizer arrays differ in length: tokens {len(tokens)}, "
            f"scores {len(scores)}, token_type {len(types)}"
        )
    ids = {
        name: int(_gguf_field(reader, f"tokenizer.ggml.{key}", path))
        for name, key in [
            ("unk", "unknown_token_id"),
            ("bos", "bos_token_id"),
            ("eos", "eos_token_id"),
            ("pad", "padding_token_id"),
        ]
    }
    for name, i in ids.items():
        if not 0 <= i < len(tokens):
            raise ValueError(f"{path}: {name} id {i} is outside the vocabulary ({len(tokens)})")
    add_space_prefix = reader.fields.get("tokenizer.ggml.add_space_prefix")
    add_dummy_prefix = bool(add_space_prefix.contents()) if add_space_prefix else False

    proto = sp_pb2.ModelProto()
    valid_types = set(_Piece.Type.values())
    for i, (piece, score, kind) in enumerate(zip(tokens, scores, types, strict=True)):
        kind = int(kind) if int(kind) in valid_types else _Piece.NORMAL
        if i == ids["unk"]:
            kind = _Piece.UNKNOWN
        elif kind == _Piece.UNKNOWN:  # only one UNKNOWN piece is allowed
            kind = _Piece.CONTROL
        if piece in _CHAT_TOKENS:
            kind = _Piece.USER_DEFINED
        proto.pieces.add(piece=piece.replace(" ", _WS), score=float(score), type=kind)

    set_bpe_specs(proto, ids, add_dummy_prefix=add_dummy_prefix)
    ts = proto.trainer_spec
    ts.split_digits = True
    ts.allow_whitespace_only_pieces = True
    ts.treat_whitespace_as_suffix = False
    return proto.SerializeToString()


def set_bpe_specs(proto: Any, ids: dict[str, int], *, add_dummy_prefix: bool) -> None:
    """Completes a `ModelProto` whose pieces are in place as a byte-fallback BPE model: the
    special ids ({"pad"|"eos"|"bos"|"unk": id}) and their pieces, and an identity normalizer
    that keeps whitespace (escaped as SentencePiece's U+2581)."""
    ts = proto.trainer_spec
    ts.model_type = sp_pb2.TrainerSpec.BPE
    ts.vocab_size = len(proto.pieces)
    ts.byte_fallback = True
    for name, i in ids.items():
        setattr(ts, f"{name}_id", i)
        setattr(ts, f"{name}_piece", proto.pieces[i].piece)
    ns = proto.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = add_dummy_prefix
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True


class Tokenizer:
    """A SentencePiece tokenizer with Gemma's special tokens.

    Build it with `Tokenizer.from_gguf(path)`, `Tokenizer.from_file("tokenizer.model")` or
    `Tokenizer(serialized_model_proto)`.
    """

    def __init__(self, model_proto: bytes, *, source: str = "<bytes>") -> None:
        self.source = source
        self._proto_bytes = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor()
        try:
            proto = sp_pb2.ModelProto()
            proto.ParseFromString(self._proto_bytes)
            if not proto.pieces:
                raise ValueError("no pieces")
            self._sp.LoadFromSerializedProto(self._proto_bytes)
        except Exception as e:
            raise ValueError(f"{source}: not a valid SentencePiece model: {e}") from e
        self.special_tokens: dict[str, int] = {}
        for name, piece in _SPECIAL_PIECES.items():
            i = self._sp.PieceToId(piece)
            if self._sp.IdToPiece(i) == piece:
                self.special_tokens[name] = i

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a SentencePiece `.model` file (e.g. the one shipped with a Gemma checkpoint)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer model file not found: {path}")
        return cls(path.read_bytes(), source=str(path))

    @classmethod
    def from_gguf(cls, path_or_reader: Any) -> Tokenizer:
        """Rebuild the tokenizer from a GGUF file's metadata (see the module docstring)."""
        source = (
            str(path_or_reader)
            if isinstance(path_or_reader, (str, os.PathLike))
            else str(getattr(path_or_reader.data, "filename", "<gguf>"))
        )
        return cls(sentencepiece_proto_from_gguf(path_or_reader), source=source)

    # -- ids ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._sp.GetPieceSize()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    @property
    def start_of_turn_id(self) -> int:
        return self.special_tokens["start_of_turn"]

    @property
    def end_of_turn_id(self) -> int:
        return self.special_tokens["end_of_turn"]

    @property
    def processor(self) -> spm.SentencePieceProcessor:
        """The underlying `sentencepiece.SentencePieceProcessor`."""
        return self._sp

    @property
    def serialized_model_proto(self) -> bytes:
        return self._proto_bytes

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the SentencePiece model (a `.model` file)."""
        Path(path).write_bytes(self._proto_bytes)

    # -- text --------------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, with BOS first when `add_bos` (EOS last when `add_eos`)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = list(self._sp.EncodeAsIds(text))
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: int | list[int] | np.ndarray | Any) -> str:
        """Text of token ids (control tokens such as BOS/EOS decode to nothing)."""
        arr = np.asarray(ids)
        if arr.ndim > 1:
            raise ValueError(f"decode expects a 0-d or 1-d sequence of ids, got shape {arr.shape}")
        flat = [int(i) for i in arr.reshape(-1)]
        bad = [i for i in flat if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary ({self.vocab_size}): {bad[:8]}")
        return self._sp.DecodeIds(flat)

    def pieces(self, text: str) -> list[str]:
        """The SentencePiece pieces of `text` (spaces shown as "▁")."""
        return list(self._sp.EncodeAsPieces(text))

    def id_to_piece(self, i: int) -> str:
        return self._sp.IdToPiece(int(i))

    def piece_to_id(self, piece: str) -> int:
        return self._sp.PieceToId(piece)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, source={self.source!r})"
