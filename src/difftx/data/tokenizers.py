"""Tokenizers: ``byte`` (UTF-8 bytes, vocabulary 256), ``char`` (a vocabulary
built from the corpus, as nanoGPT's shakespeare_char) and ``bpe`` (byte-level
BPE trained locally with the ``tokenizers`` library, or any saved Hugging Face
``tokenizer.json``).

Every tokenizer saves itself to one JSON file (``tokenizer.json``) and
:func:`load_tokenizer` reads it back (a file, or a directory holding one): a
difftx file has a ``difftx_tokenizer`` key, anything else with a ``model`` key
is read as a Hugging Face tokenizer.  ``fingerprint()`` is a stable hash of
what the tokenizer maps, used by the token-shard manifest and the BPE cache.

:func:`build_tokenizer` turns ``--tokenizer byte|char|bpe|PATH`` into a
tokenizer; trained BPE vocabularies are cached under ``cache_dir`` keyed by the
corpus hash and the vocabulary size, so a rerun reuses the same file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np

from ..errors import DataError

TOKENIZER_FILE = "tokenizer.json"
LINE_SPAN = 1 << 16  # HFTokenizer.cut: a cut follows a newline within this many characters, else any position


class Tokenizer:
    kind = "base"
    vocab_size: int
    eos_id: Optional[int] = None
    bos_id: Optional[int] = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as an int64 array (subclasses vectorise it for the token shards)."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def cut(self, text: str, pos: int) -> int:
        """An index >= ``pos`` (``len(text)`` at most) where ``text`` may be cut so that encoding the two sides
        alone gives ``encode(text)``'s ids.  Byte and char tokenizers: anywhere."""
        return min(pos, len(text))

    def to_dict(self) -> dict:
        raise NotImplementedError

    def to_json(self) -> str:
        """The text of its tokenizer.json (what :meth:`save` writes)."""
        return json.dumps(self.to_dict(), ensure_ascii=False)

    def save(self, path) -> Path:
        from ..io import atomic_write_text

        path = Path(path)
        if path.is_dir() or not path.suffix:
            path = path / TOKENIZER_FILE
        atomic_write_text(path, self.to_json())
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

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

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

    def encode_array(self, text: str) -> np.ndarray:
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        if not hasattr(self, "_lut"):
            codes = np.array([ord(c) for c in self.chars], dtype=np.int64)
            self._lut = np.full(int(codes.max()) + 1, -1, dtype=np.int64)
            self._lut[codes] = np.arange(len(codes))
        ids = np.full(points.shape, -1, dtype=np.int64)
        known = points < len(self._lut)
        ids[known] = self._lut[points[known]]
        if (ids < 0).any():
            self.encode(chr(int(points[int(np.argmax(ids < 0))])))  # raises the DataError naming it
        return ids

    def to_dict(self) -> dict:
        return {"difftx_tokenizer": "char", "chars": self.chars}


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer (kind ``bpe``): trained here or loaded from tokenizer.json.

    Encoding never adds special tokens; ``eos_id`` is the first of the usual
    end-of-text tokens the vocabulary has (documents are separated by it), ``bos_id`` the first of the usual
    beginning-of-text ones (None when it has none: GPT-2's, whose BOS is its EOS).
    """

    kind = "bpe"
    EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
    BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")

    def __init__(self, tok):
        self.tok = tok
        # the largest id + 1 (the model's embedding rows): a vocabulary may leave ids unused, and counting its
        # entries then left the largest ids (an EOS among them) past the embedding
        self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True),
                              max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1)
        self.eos_id = next((i for i in map(tok.token_to_id, self.EOS_NAMES) if i is not None), None)
        self.bos_id = next((i for i in map(tok.token_to_id, self.BOS_NAMES) if i is not None), None)
        self._json = tok.to_str()
        # added tokens ("<|endoftext|>", ...) are matched in the raw text before pre-tokenization: a cut may not
        # fall inside one (nor, for an lstrip / rstrip token, inside the whitespace it absorbs)
        added = tok.get_added_tokens_decoder().values() if hasattr(tok, "get_added_tokens_decoder") else ()
        self._added = [(a.content, bool(a.lstrip), bool(a.rstrip)) for a in added if a.content]
        # cutting needs pre-token boundaries; without a pre-tokenizer (Llama 2 / Mistral tokenizer.json files)
        # merges may span a newline, and a Prepend normalizer ('▁') marks the start of every encoded
        # segment: such text is encoded whole; so is that of a pre-tokenizer that adds a space to the start of
        # every input (ByteLevel add_prefix_space, Metaspace without splitting): a cut may fall before a
        # pre-token that does not start with one
        data = json.loads(self._json)
        normalizer, pre = json.dumps(data.get("normalizer")), json.dumps(data.get("pre_tokenizer"))
        self._cuttable = tok.pre_tokenizer is not None and '"Prepend"' not in normalizer \
            and '"add_prefix_space": true' not in pre and '"split": false' not in pre

    def _inside_added_token(self, text: str, c: int) -> bool:
        """Whether cutting ``text`` at ``c`` would split an added token's occurrence (or its stripped spaces)."""
        for content, lstrip, rstrip in self._added:
            n = len(content)
            j = text.find(content, max(0, c - n + 1), c + n - 1)
            if j != -1:
                return True
            if lstrip:  # the token at c (or after spaces from c on) absorbs the spaces before it
                k = c
                while k < len(text) and text[k].isspace():
                    k += 1
                if k > c or (c > 0 and text[c - 1].isspace()):
                    if text.startswith(content, k):
                        return True
            if rstrip:  # the token ending at c (or before spaces up to c) absorbs the spaces after it
                k = c
                while k > 0 and text[k - 1].isspace():
                    k -= 1
                if (k < c or (c < len(text) and text[c].isspace())) and text.endswith(content, 0, k):
                    return True
        return False

    @classmethod
    def from_str(cls, text: str, source: str = "tokenizer") -> "HFTokenizer":
        tokenizers = _require_tokenizers()
        try:
            return cls(tokenizers.Tokenizer.from_str(text))
        except Exception as e:  # the Rust deserializer raises plain Exceptions
            raise DataError(f"{source}: not a readable Hugging Face tokenizer.json ({str(e)[:120]})") from None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def _pre_token_starts(self, window: str) -> list[int]:
        """Where the pre-tokens of ``window`` start as encoding splits it: added tokens are taken out of the text
        first and each piece between them pre-tokenized alone (the pre-tokenizer on the raw text splits
        "<|endoftext|>'s" as '|>\'' + 's', where encoding keeps "'s" whole)."""
        enc = self.tok.encode(window, add_special_tokens=False)
        words = enc.word_ids
        return [start for k, (start, _) in enumerate(enc.offsets)
                if k == 0 or words[k] is None or words[k] != words[k - 1]]

    def _anchor(self, text: str, pos: int) -> int:
        """Where :meth:`cut` starts its window in a stretch with no newline: the first space from ``pos`` on that
        follows a character other than whitespace (a pre-token starts there under the GPT-2 and Llama 3 / GPT-4
        patterns, which have no look-behind: the window is split as the whole text is), else ``pos``, moved past a
        run of digits (those patterns group digits in threes from the run's start) and out of an added token."""
        at, end = pos, min(len(text), pos + 4096)
        while True:
            k = text.find(" ", at, end)
            if k < 0:
                break
            if k > 0 and not text[k - 1].isspace() and not self._inside_added_token(text, k):
                return k
            at = k + 1
        at = pos
        while at < end and at > 0 and text[at - 1].isnumeric() and text[at].isnumeric():
            at += 1
        while at < end and self._inside_added_token(text, at):
            at += 1
        return at

    def cut(self, text: str, pos: int) -> int:
        """A pre-token boundary after the first newline from ``pos`` on, or where no newline follows ``pos`` within
        :data:`LINE_SPAN` characters (a text of one line was encoded whole, on one thread and with all of its
        memory at once), after :meth:`_anchor`: the window from there is encoded alone (:meth:`_pre_token_starts`)
        and the first boundary is taken that is not one of the window's first two starts (the first pre-token
        may be the end of one that began before the window, as ':' + '\n', spaces + newlines or "'" + "'s", and the
        next may start inside one) and not right after whitespace (a whitespace pre-token's end depends on what
        follows it: '  \n\n' + '\n' + 'def' in the text, '  \n\n\n' at a segment's end).  No such boundary in 4096
        characters: just after the newline, or at the anchor; these are the places where the ids of the two sides
        may differ from ``encode(text)``'s, in a stretch of 4096 characters that is one pre-token or whitespace (a
        run of letters or of spaces that long).  Without a pre-tokenizer, or with a normalizer that prepends to
        every input: ``len(text)`` (no cut)."""
        if pos >= len(text) or not self._cuttable:
            return len(text)
        nl = text.find("\n", pos, pos + LINE_SPAN)
        at = nl if nl >= 0 else self._anchor(text, pos)
        for width in (256, 4096):  # a short window almost always holds such a boundary
            window = text[at:at + width]
            for start in self._pre_token_starts(window)[2:]:
                if not window[start - 1].isspace() and not self._inside_added_token(text, at + start):
                    return at + start
        if at + 4096 >= len(text):
            return len(text)
        return nl + 1 if nl >= 0 else at

    def encode_array(self, text: str, segment: int = 1 << 16) -> np.ndarray:
        """Encode in ~64 KB segments (parallel in Rust; same result every run), cut at pre-token boundaries
        (:meth:`cut`), so the ids are ``encode(text)``'s."""
        parts, start = [], 0
        while start < len(text):
            end = self.cut(text, start + segment)
            parts.append(text[start:end])
            start = end
        ids = [i for seg in self.encode_batch(parts) for i in seg] if parts else []
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        # ids outside the vocabulary are skipped, as by the byte and char tokenizers (a negative one, the -100
        # of unscored targets, was an OverflowError)
        return self.tok.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size], skip_special_tokens=False)

    def to_dict(self) -> dict:
        return json.loads(self._json)

    def to_json(self) -> str:
        return self._json

    def save(self, path) -> Path:
        from ..io import atomic_write_text

        path = Path(path)
        if path.is_dir() or not path.suffix:
            path = path / TOKENIZER_FILE
        atomic_write_text(path, self.to_json())
        return path

    def fingerprint(self) -> str:
        return hashlib.sha256(self._json.encode()).hexdigest()[:16]


def _require_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataError("the bpe tokenizer needs the `tokenizers` package: pip install 'difftx[bpe]'") from None
    return tokenizers


BPE_FORMAT = 1  # bump when train_bpe changes what it produces (invalidates the cache)


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenisation) with ``<|endoftext|>``, trained on ``texts``.

    Deterministic for the same texts in the same order.
    """
    tokenizers = _require_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise DataError(f"bpe vocabulary size must be at least 257 (256 bytes + <|endoftext|>); got {vocab_size}")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return HFTokenizer(tok)


def build_tokenizer(spec: str, texts: Optional[Callable[[], Iterable[str]]] = None, corpus_hash: str = "",
                    bpe_vocab_size: int = 4096, cache_dir: Optional[Path] = None) -> Tokenizer:
    """``byte``, ``char``, ``bpe`` or a path to a saved tokenizer.

    ``texts()`` yields the corpus (needed by ``char`` and ``bpe``); ``corpus_hash``
    keys the BPE cache in ``cache_dir/tokenizers``.
    """
    if spec == "byte":
        return ByteTokenizer()
    if spec in ("char", "bpe"):
        if texts is None:
            raise DataError(f"the {spec} tokenizer is built from the training corpus; give --data or a saved tokenizer")
        if spec == "char":
            chars: set[str] = set()
            for t in texts():
                chars.update(t)
            return CharTokenizer(chars)
        cached = None
        if cache_dir is not None:
            key = hashlib.sha256(f"bpe{BPE_FORMAT}:{bpe_vocab_size}:{corpus_hash}".encode()).hexdigest()[:16]
            cached = Path(cache_dir) / "tokenizers" / f"bpe-{bpe_vocab_size}-{key}.json"
            if cached.is_file():
                return load_tokenizer(cached)
            if cached.is_dir():  # save() would write tokenizer.json into it, and every run would train again
                raise DataError(f"{cached}: a directory, not a BPE vocabulary cache file; remove it (the next run "
                                "trains the vocabulary again and caches it there) or give another --cache-dir")
        tok = train_bpe(texts(), bpe_vocab_size)
        if cached is not None:
            try:
                tok.save(cached)
            except OSError as e:  # e names save()'s temporary file (gone by then), the folder it made, or no file
                from .shards import raise_if_cache_unwritable

                raise_if_cache_unwritable(cached, e, needed=len(tok._json.encode()))
                raise
        return tok
    path = Path(spec).expanduser()  # '~' as --data takes it (no shell expands '--tokenizer=~/...')
    if not path.exists():
        raise DataError(f"--tokenizer {spec!r}: not byte, char, bpe or an existing tokenizer.json / directory")
    return load_tokenizer(path)


def is_hf_tokenizer_json(data) -> bool:
    """Whether parsed tokenizer.json ``data`` is a Hugging Face ``tokenizers`` file (not a difftx one)."""
    return isinstance(data, dict) and "difftx_tokenizer" not in data and isinstance(data.get("model"), dict)


def tokenizer_from_dict(data: dict, source: str = "tokenizer") -> Tokenizer:
    kind = data.get("difftx_tokenizer") if isinstance(data, dict) else None
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        chars = data.get("chars")
        if not isinstance(chars, list) or not all(isinstance(c, str) and len(c) == 1 for c in chars):
            raise DataError(f"{source}: a char tokenizer needs 'chars', a list of single characters; "
                            "the file is corrupt")
        return CharTokenizer(chars)
    if is_hf_tokenizer_json(data):
        return HFTokenizer.from_str(json.dumps(data), source)
    raise DataError(f"{source}: not a difftx or Hugging Face tokenizer (unknown kind {kind!r})")


def load_tokenizer(path) -> Tokenizer:
    """Read a tokenizer saved by :meth:`Tokenizer.save` (a file or a directory holding tokenizer.json)."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"{path}: tokenizer file not found")
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: tokenizer is not valid JSON ({e})") from None
    if is_hf_tokenizer_json(data):
        return HFTokenizer.from_str(text, str(path))  # keep the file's exact bytes (and fingerprint)
    return tokenizer_from_dict(data, str(path))
