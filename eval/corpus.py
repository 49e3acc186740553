"""Evaluation text: the built-in corpora, a user's own, and their cut into fixed windows.

Two built-in corpora, two different kinds of text, both shipped with every CPython, so a fresh
machine has them without a download, and both fixed for a given Python version (their SHA-256
goes into every report, so runs on different Pythons are never silently compared):
  python-reference  (the default) CPython's reference documentation, `pydoc_data.topics`
                    (the text `help("if")` prints): ~490 KB of English technical prose,
                    ~118K Gemma tokens.
  python-stdlib     the source code of the standard library's top-level modules
                    (`<stdlib>/*.py`, sorted by name; no packages, no tests): ~4.6 MB of
                    Python code with its comments and docstrings.
A user's text comes from `--text PATH`: a text file (one document), a JSON-lines file (one
document per line, in its "text" field), or a folder of such files (`*.txt`, `*.md`,
`*.jsonl`, recursively, in sorted order).

Windows (`make_windows`): the documents are tokenized without BOS and concatenated in order,
each followed by EOS; the stream is cut into consecutive, non-overlapping windows of
`seq_len - 1` tokens and each gets BOS in front, so every window is a full `seq_len` tokens
(no padding) and starts the way Gemma's training sequences do. `num_seqs` windows are taken
evenly spaced over the stream (all of them if there are fewer), the same for every method.
Greedy-decoding prompts (`greedy_prompts`) are BOS + stream tokens from their own evenly
spaced places, so that many prompts do not repeat the windows' starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

DEFAULT_CORPUS = "python-reference"
STDLIB_CORPUS = "python-stdlib"
TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIX = ".jsonl"


class TextTokenizer(Protocol):
    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Documents in order; `name` says where they came from, `sha256` what they are."""

    name: str
    documents: tuple[str, ...]

    @property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        for document in self.documents:
            digest.update(hashlib.sha256(document.encode()).digest())
        return digest.hexdigest()

    @property
    def num_chars(self) -> int:
        return sum(len(d) for d in self.documents)

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "documents": len(self.documents),
            "chars": self.num_chars,
            "sha256": self.sha256,
        }


def _python_reference() -> Corpus:
    """CPython's reference topics (`pydoc_data.topics`), in sorted topic order."""
    from pydoc_data.topics import topics

    documents = tuple(topics[key] for key in sorted(topics))
    return Corpus(f"{DEFAULT_CORPUS} (pydoc_data.topics, Python {platform.python_version()})",
                  documents)  # fmt: skip


def _python_stdlib() -> Corpus:
    """The standard library's top-level modules' source, one document per file, by name."""
    stdlib = Path(sysconfig.get_path("stdlib"))
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise ValueError(
            f"{STDLIB_CORPUS}: no *.py files in {stdlib} (this Python ships its standard "
            "library compiled only); use --text"
        )
    documents = tuple(f.read_text(encoding="utf-8") for f in files)
    return Corpus(f"{STDLIB_CORPUS} ({stdlib}/*.py, Python {platform.python_version()})",
                  documents)  # fmt: skip


CORPORA: dict[str, Callable[[], Corpus]] = {
    DEFAULT_CORPUS: _python_reference,
    STDLIB_CORPUS: _python_stdlib,
}


def named_corpus(name: str) -> Corpus:
    """A built-in corpus by name (`CORPORA`); ValueError naming the valid ones."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; built in: {', '.join(CORPORA)}")
    return CORPORA[name]()


def default_corpus() -> Corpus:
    return named_corpus(DEFAULT_CORPUS)


def _read_jsonl(path: Path) -> list[str]:
    documents = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f'{path}:{number}: each line must be an object with a "text" string')
        documents.append(record["text"])
    return documents


def _read_file(path: Path) -> list[str]:
    if path.suffix == JSONL_SUFFIX:
        return _read_jsonl(path)
    try:
        return [path.read_text(encoding="utf-8")]
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None


def load_corpus(path: Path) -> Corpus:
    """A user's corpus from a text file, a JSON-lines file or a folder of them (see module
    doc). ValueError when it is missing, unreadable or holds no text."""
    path = Path(path)
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*") if p.is_file() and p.suffix in (*TEXT_SUFFIXES, JSONL_SUFFIX)
        )
        if not files:
            raise ValueError(f"{path}: no *.txt, *.md or *.jsonl files in this folder")
    elif path.is_file():
        files = [path]
    else:
        raise ValueError(f"{path}: no such file or folder")
    documents = tuple(d for f in files for d in _read_file(f) if d.strip())
    if not documents:
        raise ValueError(f"{path}: no text in it")
    return Corpus(str(path), documents)


def token_stream(corpus: Corpus, tokenizer: TextTokenizer) -> np.ndarray:
    """Every document's tokens (no BOS), each followed by EOS, concatenated: [N] int32."""
    pieces = [
        np.asarray(tokenizer.encode(d, add_bos=False, add_eos=True), np.int32)
        for d in corpus.documents
    ]
    return np.concatenate(pieces)


def make_windows(stream: np.ndarray, bos_id: int, *, seq_len: int, num_seqs: int) -> np.ndarray:
    """[num_seqs, seq_len] int32: BOS + `seq_len - 1` stream tokens each, non-overlapping,
    evenly spaced over the stream (fewer rows when the stream holds fewer windows)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (BOS and a token to score), got {seq_len}")
    if num_seqs < 1:
        raise ValueError(f"num_seqs must be >= 1, got {num_seqs}")
    body = seq_len - 1
    available = len(stream) // body
    if available == 0:
        raise ValueError(
            f"the corpus has {len(stream)} tokens: too short for one window of {seq_len}"
        )
    starts = np.linspace(0, available - 1, min(num_seqs, available)).round().astype(int) * body
    windows = np.empty((len(starts), seq_len), np.int32)
    windows[:, 0] = bos_id
    for row, start in enumerate(starts):
        windows[row, 1:] = stream[start : start + body]
    return windows


def greedy_prompts(stream: np.ndarray, bos_id: int, prompt_len: int, count: int) -> list[list[int]]:
    """`count` prompts of BOS + `prompt_len - 1` stream tokens, non-overlapping and evenly
    spaced over the stream (fewer when it is shorter): greedy-decoding prompts."""
    if prompt_len < 2:
        raise ValueError(f"prompt_len must be >= 2 (BOS and a token), got {prompt_len}")
    body = prompt_len - 1
    available = len(stream) // body
    starts = np.linspace(0, available - 1, min(count, available)).round().astype(int) * body
    return [[bos_id, *stream[start : start + body].tolist()] for start in starts]
