"""Text corpora for ``difftx train --data``: what a path means, read the same way every time.

``--data`` may be

* a text file (UTF-8),
* a directory (every non-hidden file below it, sorted; binary files are skipped
  with a warning) or a glob pattern (``'books/*.txt'``),
* a JSONL file (``*.jsonl``): one JSON object per line, the document in ``text_field``,
* a local Hugging Face ``datasets`` directory saved with ``save_to_disk``
  (needs the ``datasets`` extra; the ``train`` split of a DatasetDict),
* nothing: the built-in corpus, the top-level modules of this Python's own
  standard library (``sysconfig``), about 5 MB of text on every machine with no
  download.

A corpus is a list of :class:`Source` objects.  ``Corpus.pieces()`` yields
``(text, end_of_document)`` in a fixed order; big files come in pieces cut at
newlines (in a block with none, a line longer than a piece: at a space, else
between characters) so nothing needs the whole corpus, or a whole line, in
memory.  ``Corpus.fingerprint()`` hashes the contents (not the names), so the
token cache is reused exactly when the text is the same.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from ..errors import DataError

PIECE_BYTES = 8 << 20  # read text files in pieces of about this many bytes, cut at newlines (else spaces)
SNIFF_BYTES = 8192


def binary_reason(path: Path) -> Optional[str]:
    """Why ``path`` is not text, judged on its first 8 KiB (a NUL byte, or bytes that are not UTF-8, with the
    offset), or None."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if b"\x00" in head:
        return f"a NUL byte at offset {head.index(0)}"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # a multi-byte character cut at the sniff boundary is fine
            return f"not UTF-8: bad byte at offset {e.start}"
    return None


def looks_binary(path: Path) -> bool:
    """A NUL byte in the first 8 KiB, or bytes that are not UTF-8 there."""
    return binary_reason(path) is not None


def _cut_without_newline(data: bytes) -> int:
    """Where a block with no newline is cut (a line longer than a piece, or a file of one line, was held whole and
    each block appended to it, quadratic in its length): before its last space, so the words on both sides stay
    whole, else before the last character that starts in it (never inside a UTF-8 character); 0 when neither is
    past its start.  Token shards join the pieces again where the tokenizer may not cut (``shards._tokenise``)."""
    space = data.rfind(b" ")
    if space > 0:
        return space
    for k in range(len(data) - 1, max(0, len(data) - 4) - 1, -1):
        if data[k] & 0xC0 != 0x80:  # not a continuation byte: a character starts here
            return k
    return len(data) if len(data) >= 4 else 0  # 4 continuation bytes are no UTF-8: decoding names the offset


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class Source:
    """One file (``text`` or ``jsonl``) or one saved Hugging Face dataset (``hf``)."""

    path: Path
    kind: str = "text"
    text_field: str = "text"
    _hash: Optional[str] = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return str(self.path)

    def nbytes(self) -> int:
        if self.kind == "hf":
            return sum(p.stat().st_size for p in self.path.rglob("*.arrow"))
        return self.path.stat().st_size

    def sha256(self) -> str:
        if self._hash is None:
            if self.kind == "hf":
                state = sorted(self.path.rglob("state.json"))
                h = hashlib.sha256(self.text_field.encode())
                for s in state:
                    h.update(s.read_bytes())
                self._hash = h.hexdigest()
            else:
                self._hash = self._file_hash(_sha256_file(self.path))
        return self._hash

    def _file_hash(self, file_sha256: str) -> str:
        tag = f"{self.kind}:{self.text_field}:" if self.kind == "jsonl" else ""
        return hashlib.sha256((tag + file_sha256).encode()).hexdigest()

    def pieces(self, digest=None) -> Iterator[tuple[str, bool]]:
        """``digest``: a ``hashlib.sha256()`` that takes every byte read of a file (not of a saved dataset), for
        :meth:`check_read`."""
        if self.kind == "text":
            yield from self._text_pieces(digest)
        elif self.kind == "jsonl":
            yield from self._jsonl_pieces(digest)
        else:
            yield from self._hf_pieces()

    def check_read(self, digest) -> None:
        """Refuse a file whose bytes read (``digest``, filled by :meth:`pieces`) are not those :meth:`sha256`
        hashed: it changed in between, and what was read is not the contents the corpus is known by."""
        if self.kind != "hf" and self._file_hash(digest.hexdigest()) != self.sha256():
            raise DataError(f"{self.path}: changed while it was read (its contents differ from when the corpus was "
                            "hashed); rerun once nothing is writing to it")

    def _decode(self, data: bytes, offset: int) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{self.path}: not UTF-8 text (bad byte at offset {offset + e.start}); "
                            "convert it to UTF-8 or leave it out of --data") from None

    def _text_pieces(self, digest=None) -> Iterator[tuple[str, bool]]:
        offset, carry = 0, b""
        with open(self.path, "rb") as f:
            while True:
                block = f.read(PIECE_BYTES)
                if not block:
                    break
                if digest is not None:
                    digest.update(block)
                data = carry + block  # carry holds no newline and comes from one block: each byte is copied twice
                cut = data.rfind(b"\n") + 1 or _cut_without_newline(data)
                if cut == 0:  # a few bytes of one character so far: keep reading
                    carry = data
                    continue
                carry = data[cut:]
                if b"\x00" in data[:cut]:
                    raise DataError(f"{self.path}: contains NUL bytes (binary data); leave it out of --data")
                yield self._decode(data[:cut], offset), False
                offset += cut
        if b"\x00" in carry:
            raise DataError(f"{self.path}: contains NUL bytes (binary data); leave it out of --data")
        yield self._decode(carry, offset), True

    def _jsonl_pieces(self, digest=None) -> Iterator[tuple[str, bool]]:
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if digest is not None:
                    digest.update(raw)
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise DataError(f"{self.path}:{lineno}: not a JSON object ({str(e)[:80]})") from None
                text = obj.get(self.text_field) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    raise DataError(f"{self.path}:{lineno}: no string field {self.text_field!r}; "
                                    "pick the field with --text-field")
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:  # a lone surrogate escape ("\ud800"): no text a tokenizer can take
                    raise DataError(f"{self.path}:{lineno}: field {self.text_field!r} holds an unpaired surrogate "
                                    "escape (\\ud800-\\udfff), not text; fix or drop that line") from None
                yield text, True

    def _hf_pieces(self) -> Iterator[tuple[str, bool]]:
        ds = load_hf_dataset(self.path)
        if self.text_field not in ds.column_names:
            raise DataError(f"{self.path}: dataset has no column {self.text_field!r} "
                            f"(columns: {', '.join(ds.column_names)}); pick one with --text-field")
        for batch in ds.iter(batch_size=1000):
            for text in batch[self.text_field]:
                if isinstance(text, str):
                    yield text, True


def load_hf_dataset(path: Path):
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: a Hugging Face datasets directory needs the `datasets` package: "
                        "pip install 'difftx[datasets]'") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    return ds


@dataclass
class Corpus:
    """``notes``: what the reader left out (files skipped); ``difftx train`` prints them once every input check
    has passed, so a run that fails prints its error alone."""

    sources: list[Source]
    description: str
    notes: list[str] = field(default_factory=list)

    def pieces(self) -> Iterator[tuple[str, bool]]:
        for s in self.sources:
            yield from s.pieces()

    def texts(self) -> Iterator[str]:
        for text, _ in self.pieces():
            yield text

    def documents(self) -> Iterator[str]:
        """Each document whole (a file's pieces joined; :meth:`texts` gives the pieces, which may end in the middle
        of a line)."""
        parts: list[str] = []
        for text, end in self.pieces():
            parts.append(text)
            if end:
                yield "".join(parts)
                parts = []

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.sources)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for s in self.sources:
            h.update(s.sha256().encode())
        return h.hexdigest()[:16]

    def to_dict(self) -> dict:
        return {"description": self.description, "fingerprint": self.fingerprint(),
                "sources": [{"path": s.name, "kind": s.kind, "sha256": s.sha256()} for s in self.sources]}


def _is_hf_dataset_dir(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "dataset_info.json").is_file() and (path / "state.json").is_file())


def _file_source(path: Path, text_field: str) -> Source:
    return Source(path, "jsonl" if path.suffix == ".jsonl" else "text", text_field)


def _check_not_empty(src: Source) -> None:
    if src.kind == "hf":
        return
    if src.path.stat().st_size == 0:
        raise DataError(f"{src.path}: the file is empty; give a file with some text")
    if src.kind == "text" and src.path.stat().st_size <= SNIFF_BYTES:
        if not src.path.read_bytes().strip():
            raise DataError(f"{src.path}: the file holds only whitespace; give a file with some text")


def _collect(paths: list[Path], what: str, text_field: str) -> Corpus:
    files = sorted(p for p in paths if p.is_file())
    sources, skipped = [], []
    for p in files:
        if p.stat().st_size == 0 or (p.suffix != ".jsonl" and looks_binary(p)):
            skipped.append(p)
            continue
        sources.append(_file_source(p, text_field))
    note = f"skipped {len(skipped)} empty or binary file(s) in {what} (first: {skipped[0]})" if skipped else None
    if not sources:
        raise DataError(f"{what}: no text files found{f' ({note})' if note else ''}; give a text file, a directory "
                        "of text files, a glob, a .jsonl file or a saved Hugging Face dataset")
    return Corpus(sources, what, [note] if note else [])


def builtin_corpus() -> Corpus:
    """The top-level ``*.py`` modules of this Python's standard library, sorted (about 5 MB)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise DataError(f"no built-in corpus: found no Python sources in {stdlib}; pass --data PATH")
    corpus = _collect(files, f"built-in corpus: Python {sys.version.split()[0]} standard library ({stdlib}/*.py)",
                      "text")
    return corpus


def _visible(folder: Path) -> list[Path]:
    """What is below ``folder``, less hidden files and folders (.git, .cache) and what is in them."""
    return [p for p in folder.rglob("*") if not any(part.startswith(".") for part in p.relative_to(folder).parts)]


def resolve_corpus(data: Optional[str], text_field: str = "text") -> Corpus:
    """Turn ``--data`` into a :class:`Corpus`; raises DataError naming a missing, empty or binary path."""
    if data is None or data == "builtin":
        return builtin_corpus()
    if any(c in data for c in "*?[") and not Path(data).expanduser().exists():  # 'notes [draft].txt' is a file
        matches = [Path(p) for p in globlib.glob(os.path.expanduser(data), recursive=True)]
        if not matches:
            raise DataError(f"--data {data!r}: the pattern matches no files")
        paths = [f for m in matches for f in ([m] if m.is_file() else _visible(m))]
        return _collect(paths, f"--data {data!r}", text_field)
    path = Path(data).expanduser()
    if not path.exists():
        raise DataError(f"--data {data}: no such file or directory")
    if path.is_dir():
        if _is_hf_dataset_dir(path):
            return Corpus([Source(path, "hf", text_field)], f"Hugging Face dataset {path}")
        return _collect(_visible(path), str(path), text_field)
    src = _file_source(path, text_field)
    _check_not_empty(src)
    why = binary_reason(path) if src.kind == "text" else None
    if why:
        raise DataError(f"{path}: looks like a binary file ({why}); --data needs UTF-8 text")
    return Corpus([src], str(path))
