"""Tokenizers: ``byte`` (UTF-8 bytes, vocabulary 256) and ``char`` (a vocabulary built from the corpus).

Every tokenizer saves itself to one JSON file (``tokenizer.json``) and
:func:`load_tokenizer` reads it back (a file, or a directory holding one).
``fingerprint()`` is a stable hash of what the tokenizer maps, used by the
token-shard manifest.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Optional

from ..errors import DataError

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    kind = "base"
    vocab_size: int
    eos_id: Optional[int] = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def to_dict(self) -> dict:
        raise NotImplementedError

    def save(self, path) -> Path:
        from ..io import atomic_write_text

        path = Path(path)
        if path.is_dir() or not path.suffix:
            path = path / TOKENIZER_FILE
        atomic_write_text(path, json.dumps(self.to_dict(), ensure_ascii=False))
        return path

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes; every text is encodable; decoding replaces invalid sequences."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return {"difftx_tokenizer": "byte"}


class CharTokenizer(Tokenizer):
    """One id per distinct character of the training corpus, sorted (nanoGPT's shakespeare_char)."""

    kind = "char"

    def __init__(self, chars: Iterable[str]):
        self.chars = sorted(set(chars))
        if not self.chars:
            raise DataError("char tokenizer: the corpus has no characters")
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.chars)

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(set(text))

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise DataError(
                f"char tokenizer: character {e.args[0]!r} is not in its vocabulary of {self.vocab_size}; "
                "build the vocabulary from a corpus that contains it or use --tokenizer byte"
            ) from None

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids if 0 <= int(i) < self.vocab_size)

    def to_dict(self) -> dict:
        return {"difftx_tokenizer": "char", "chars": self.chars}


def tokenizer_from_dict(data: dict, source: str = "tokenizer") -> Tokenizer:
    kind = data.get("difftx_tokenizer") if isinstance(data, dict) else None
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        return CharTokenizer(data["chars"])
    raise DataError(f"{source}: not a difftx tokenizer (unknown kind {kind!r})")


def load_tokenizer(path) -> Tokenizer:
    """Read a tokenizer saved by :meth:`Tokenizer.save` (a file or a directory holding tokenizer.json)."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"{path}: tokenizer file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: tokenizer is not valid JSON ({e})") from None
    return tokenizer_from_dict(data, str(path))
