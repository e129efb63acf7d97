"""Token shards: a corpus tokenised once into a memory-mapped file, reused on every rerun.

Layout under ``cache_dir/shards/<key>/``: ``tokens.bin`` (uint16 when the
vocabulary fits, else uint32; documents separated by the tokenizer's EOS when it
has one) and ``manifest.json`` (tokenizer fingerprint, per-source content hashes
and token counts, dtype).  The key hashes the tokenizer and the corpus
contents, so a changed file or tokenizer gets a fresh shard and an unchanged one
is reused; the bytes tokenized are hashed as they are read, and a file that changed since the key was made is
refused rather than cached under its old hash.  The manifest is written last, atomically: a shard without one is an
interrupted build and is rebuilt, as is a damaged one: a manifest that does not fit the key or the tokens file's
length, or ids outside the vocabulary (checked on every load, one pass over the file).

The train/validation split is deterministic: the last ``val_fraction`` of the
token stream is validation (nanoGPT's split for a single file).

:class:`WindowSampler` draws the (seq_len + 1)-token windows of a training
step as a pure function of ``(seed, step)``: resuming needs no sampler state,
and the windows of a step are the same whatever the number of processes or
micro-batches they are split into.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..errors import DataError
from .corpus import Corpus
from .tokenizers import Tokenizer

SHARD_FORMAT = 5  # 2: pieces and BPE segments cut at pre-token boundaries (1 could cut a whitespace run);
# 3: a piece with no boundary after its last newline but its end waits for the next (2 cut it there), and no
# cut falls inside a special token written in the text (2 could split a literal "<|endoftext|>"), nor anywhere in
# the text of a tokenizer without a pre-tokenizer (2 cut after newlines: Llama 2's Prepend normalizer added tokens);
# 4: cuts at the pre-token boundaries encoding makes around a special token (3 cut "<|endoftext|>'s" after the "'");
# 5: text with no newline for 64K characters is cut at pre-token boundaries found from a space or any position (4
# encoded a one-line file whole; a stretch of 4096 characters that is one pre-token is now cut in it)
TOKENS_FILE = "tokens.bin"
MANIFEST_FILE = "manifest.json"


def default_cache_dir() -> Path:
    """``$DIFFTX_CACHE``, else ``$DIFFTX_CACHE_DIR`` (the kernels' variable: either moves the whole cache), else
    ``$XDG_CACHE_HOME/difftx``, else ``~/.cache/difftx``."""
    from ..runtime import cache_root

    return cache_root("DIFFTX_CACHE", "DIFFTX_CACHE_DIR")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass
class TokenData:
    tokens: np.ndarray  # memory-mapped, the whole stream
    n_train: int
    manifest: dict
    path: Path

    @property
    def train(self) -> np.ndarray:
        return self.tokens[: self.n_train]

    @property
    def val(self) -> np.ndarray:
        return self.tokens[self.n_train:]


def shard_key(corpus: Corpus, tokenizer: Tokenizer) -> str:
    return hashlib.sha256(f"{SHARD_FORMAT}:{tokenizer.fingerprint()}:{corpus.fingerprint()}".encode()).hexdigest()[:16]


def _read_manifest(folder: Path, tokenizer: Optional[Tokenizer] = None) -> Optional[dict]:
    """The shard's manifest, or None where the shard is not whole (an interrupted build, or damaged: rebuilt).

    Checked: the manifest's shape, and that it fits the key (format, ``tokenizer``'s fingerprint and dtype);
    per-source token counts adding up to ``n_tokens``; the tokens file's length against them.  The ids themselves
    are checked by :func:`_ids_fit`."""
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(manifest, dict) or manifest.get("dtype") not in ("uint16", "uint32"):
        return None  # damaged: rebuilt like an interrupted build
    n, sources, tok = manifest.get("n_tokens"), manifest.get("sources"), manifest.get("tokenizer")
    if type(n) is not int or n <= 0 or manifest.get("shard_format") != SHARD_FORMAT:
        return None
    if not isinstance(sources, list) or not all(isinstance(s, dict) and type(s.get("tokens")) is int
                                                for s in sources) or sum(s["tokens"] for s in sources) != n:
        return None
    if not isinstance(manifest.get("corpus"), str) or not isinstance(manifest.get("corpus_fingerprint"), str) \
            or not isinstance(tok, dict):
        return None
    if tokenizer is not None and (tok.get("fingerprint") != tokenizer.fingerprint()
                                  or manifest["dtype"] != token_dtype(tokenizer.vocab_size).name):
        return None
    size = (folder / TOKENS_FILE).stat().st_size if (folder / TOKENS_FILE).is_file() else -1
    if size != n * np.dtype(manifest["dtype"]).itemsize:
        return None
    return manifest


def _unusable(folder: Path, name: str, why: str) -> DataError:
    """A token cache entry the file system will not let be read or written (``tokens.bin`` replaced by a directory,
    no permission): one line naming it and the fix, not an OSError naming a temporary file."""
    return DataError(f"{folder / name}: {why}; the token cache entry {folder} cannot be used: delete that folder (the "
                     "next run rebuilds it) or give another --cache-dir")


def _size(n: int) -> str:
    return f"{n / 2 ** 30:,.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB" if n >= 2 ** 20 else f"{n:,} bytes"


def raise_if_disk_full(path: Path, e: OSError, needed: int = 0, written: int = 0) -> None:
    """Raise one DataError naming the cache file ``path`` when ``e`` says the disk (or the quota) is full, with the
    size the file needs (``needed``) or what was written of it when the disk filled (``written``), where known.

    ``e`` names the temporary file the write went to first, gone by the time the message is read (deleted, or
    never made), or no file at all (a failed write() names none); the file it was for and the fix are what the user
    needs.  Other errors return.
    """
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        size = f"; {_size(needed)} needed" if needed else f"; {_size(written)} written when it filled" if written \
            else ""
        raise DataError(f"{path}: cannot be written, out of disk space ({e.strerror or e}{size}); free space on that "
                        "disk or point $DIFFTX_CACHE (or --cache-dir) at another one") from None


def raise_if_not_writable(path: Path, e: OSError, what: str = "cannot be written") -> None:
    """Raise one DataError naming the cache file (or folder) ``path`` when ``e`` says the cache cannot be written
    there: no permission (EACCES, EPERM) or a read-only file system (EROFS).

    As for a full disk, ``e`` names the temporary file the write went to (never made) or the folder ``mkdir`` could
    not make; the folder that refused it, the parent of the one named, is the one to fix.  Other errors return.
    """
    if e.errno == errno.EROFS:
        raise DataError(f"{path}: {what} ({e.strerror or e}); point $DIFFTX_CACHE (or --cache-dir) at a folder on a "
                        "writable disk") from None
    if e.errno in (errno.EACCES, errno.EPERM):
        where = Path(os.fsdecode(e.filename)).parent if isinstance(e.filename, (str, bytes)) else path.parent
        raise DataError(f"{path}: {what} ({e.strerror or e}); fix the permissions of {where} or point $DIFFTX_CACHE "
                        "(or --cache-dir) at a folder you can write to") from None


def raise_if_cache_unwritable(path: Path, e: OSError, needed: int = 0) -> None:
    """:func:`raise_if_disk_full`, then :func:`raise_if_not_writable`: the one DataError for a cache file that a
    full disk, a missing permission or a read-only file system kept from being written.  Other errors return."""
    raise_if_disk_full(path, e, needed=needed)
    raise_if_not_writable(path, e)


def _open_tokens(folder: Path, manifest: dict) -> np.ndarray:
    try:
        return np.memmap(folder / TOKENS_FILE, dtype=np.dtype(manifest["dtype"]), mode="r")
    except OSError as e:
        raise _unusable(folder, TOKENS_FILE, f"cannot be read ({e.strerror or e})") from None


def _ids_fit(tokens: np.ndarray, vocab_size: int, chunk: int = 1 << 24) -> bool:
    """Every id of a shard is in the vocabulary (bytes damaged on disk are ids the model's embedding cannot take);
    one pass over the file, in chunks."""
    if vocab_size >= 1 << (8 * tokens.dtype.itemsize):
        return True  # every value of the dtype is an id
    return all(int(tokens[i:i + chunk].max()) < vocab_size for i in range(0, len(tokens), chunk))


TAIL_CHARS = 1 << 16  # _tokenise looks for a cut in this many characters at the end of the text read so far


def _tail(parts: list[str], n: int) -> str:
    """The last ``n`` characters of ``"".join(parts)`` (all of it when shorter), without joining all of it."""
    out, k = [], 0
    for part in reversed(parts):
        out.append(part[max(0, len(part) - (n - k)):])
        k += len(out[-1])
        if k >= n:
            break
    return "".join(reversed(out))


def _tail_cut(tokenizer: Tokenizer, tail: str) -> Optional[int]:
    """Where the text ending in ``tail`` may be cut for encoding (an index into ``tail``), or None: the tokenizer's
    :meth:`~difftx.data.tokenizers.Tokenizer.cut` from the start of the line holding the character 4096 before the
    end, or from 8192 characters before the end where that line is longer (cut() reads a few characters before
    where it cuts and up to 4096 after the newline or space it starts from)."""
    n = len(tail)
    cut = tokenizer.cut(tail, max(tail.rfind("\n", 0, max(0, n - 4096)) + 1, n - 8192, 0))
    return cut if 0 < cut < n else None


def _tokenise(corpus: Corpus, tokenizer: Tokenizer, folder: Path, progress: bool) -> dict:
    from tqdm.auto import tqdm

    from ..io import atomic_write_text

    dtype = token_dtype(tokenizer.vocab_size)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where the entry's folder (or the cache's) should be, or a cache not writable
        raise_if_not_writable(folder, e, "cannot make the token cache entry")
        raise DataError(f"{folder}: cannot make the token cache entry ({e.strerror or e}); give another --cache-dir "
                        "or remove the file in its way") from None
    tmp = folder / f".{TOKENS_FILE}.{os.getpid()}.tmp"
    sources, total, text_tokens = [], 0, 0
    eos = np.asarray([tokenizer.eos_id], dtype=dtype) if tokenizer.eos_id is not None else None
    bar = tqdm(total=corpus.nbytes(), unit="B", unit_scale=True, desc="tokenising", disable=not progress,
               leave=False)
    try:
        with open(tmp, "wb") as f:
            for src in corpus.sources:
                count, pending, digest = 0, [], hashlib.sha256()
                for piece, end in src.pieces(digest):
                    # a piece ends at a newline (or a space) the tokenizer may not cut at: its tail goes with the
                    # next piece.  What waits is kept as a list and joined once: it was joined with each piece, which
                    # was quadratic where nothing could be cut (a tokenizer without a pre-tokenizer, a long line)
                    pending.append(piece)
                    if end:
                        text, pending = "".join(pending), []
                    else:
                        tail = _tail(pending, TAIL_CHARS)
                        cut = _tail_cut(tokenizer, tail)
                        if cut is None:
                            # no safe cut before the piece's end (its last line is long, or only whitespace follows
                            # the newline cut() started from): the piece's trailing newline may merge with what the
                            # next piece starts with ('\n' + '    def'), so the whole text waits for more
                            continue
                        text = "".join(pending)
                        cut += len(text) - len(tail)
                        text, pending = text[:cut], [text[cut:]]
                    ids = tokenizer.encode_array(text)
                    if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                        raise DataError(f"{src.name}: the tokenizer produced id {int(ids.max())} outside its "
                                        f"vocabulary of {tokenizer.vocab_size}")
                    f.write(ids.astype(dtype).tobytes())
                    count += ids.size
                    text_tokens += ids.size
                    if end and eos is not None:
                        f.write(eos.tobytes())
                        count += 1
                    bar.update(len(text.encode("utf-8")) if src.kind != "hf" else 0)
                src.check_read(digest)  # the key hashed these bytes: a file changed since is not cached under it
                sources.append({"path": src.name, "kind": src.kind, "sha256": src.sha256(), "tokens": count})
                total += count
            f.flush()
            os.fsync(f.fileno())
        if text_tokens == 0:  # end-of-text tokens alone (a JSONL of empty texts, with an EOS-bearing tokenizer)
            raise DataError(f"{corpus.description}: no tokens (the data holds no text); give non-empty text")
        try:
            os.replace(tmp, folder / TOKENS_FILE)
        except OSError as e:  # e names the temporary file, deleted below
            raise_if_cache_unwritable(folder / TOKENS_FILE, e)
            raise _unusable(folder, TOKENS_FILE, f"cannot be written ({e.strerror or e})") from None
    except OSError as e:
        # a full disk while the temporary file is made, written, flushed or closed: e names that file (gone by
        # then) or none; tokens.bin, if there is one, is untouched.  Other errors (reading the corpus) pass on
        raise_if_disk_full(folder / TOKENS_FILE, e, written=tmp.stat().st_size if tmp.exists() else 0)
        if e.filename == str(tmp):  # making it: no permission in the folder, or a read-only file system
            raise_if_not_writable(folder / TOKENS_FILE, e)
        raise
    finally:
        bar.close()
        if tmp.exists():
            tmp.unlink()
    manifest = {
        "shard_format": SHARD_FORMAT,
        "tokenizer": {"kind": tokenizer.kind, "fingerprint": tokenizer.fingerprint(),
                      "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id},
        "corpus": corpus.description,
        "corpus_fingerprint": corpus.fingerprint(),
        "sources": sources,
        "n_tokens": total,
        "dtype": dtype.name,
    }
    try:
        atomic_write_text(folder / MANIFEST_FILE, json.dumps(manifest, indent=1))
    except OSError as e:
        raise_if_cache_unwritable(folder / MANIFEST_FILE, e)
        raise _unusable(folder, MANIFEST_FILE, f"cannot be written ({e.strerror or e})") from None
    return manifest


def prepare_tokens(corpus: Corpus, tokenizer: Tokenizer, cache_dir: Optional[Path] = None,
                   val_fraction: float = 0.1, progress: bool = True, build: bool = True) -> TokenData:
    """Tokenise ``corpus`` into the cache (or reuse the shard from an earlier run) and memory-map it.

    ``build=False`` only opens an existing shard (the non-zero ranks of a
    distributed run, after rank 0 built it).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = cache_dir / "shards" / shard_key(corpus, tokenizer)
    manifest = _read_manifest(folder, tokenizer)
    if manifest is not None and build and not _ids_fit(_open_tokens(folder, manifest), tokenizer.vocab_size):
        manifest = None  # damaged: rebuilt (rank 0 checks; the other ranks read what it checked or built)
    if manifest is None:
        if not build:
            raise DataError(f"{folder}: token shard missing (rank 0 should have built it)")
        for name in (TOKENS_FILE, MANIFEST_FILE):  # found before the corpus is tokenised, not after
            if (folder / name).is_dir() and not (folder / name).is_symlink():
                raise _unusable(folder, name, "a directory, not a file")
        manifest = _tokenise(corpus, tokenizer, folder, progress)
    tokens = _open_tokens(folder, manifest)
    n = len(tokens)
    n_train = n - int(round(n * val_fraction)) if val_fraction > 0 else n
    return TokenData(tokens, n_train, dict(manifest, val_fraction=val_fraction, n_train=n_train,
                                           n_val=n - n_train, path=str(folder)), folder)


class SplitTooSmall(DataError):
    """A train or validation split shorter than one window (``seq_len + 1`` tokens).  ``advice`` names the
    fix in the caller's flags (``difftx train``'s by default; ``difftx compare`` has no --val-fraction)."""

    def __init__(self, what: str, n_tokens: int, seq_len: int,
                 advice: str = "give more data, a smaller --seq-len or a different --val-fraction"):
        self.what, self.n_tokens, self.seq_len = what, n_tokens, seq_len
        super().__init__(f"the {what} split has {n_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}; {advice}")


class WindowSampler:
    """(seq_len + 1)-token windows of a token array: inputs x = w[:-1], targets y = w[1:].

    ``offsets(step, n)`` draws the window starts of one step from a generator
    seeded by ``(seed, step)``, uniformly over the array (nanoGPT's sampling,
    made stateless).  ``fixed(n)`` is the same ``n`` windows on every call (the
    validation set).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, what: str = "train"):
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.span = len(tokens) - seq_len  # number of valid starts
        if self.span < 1:
            raise SplitTooSmall(what, len(tokens), seq_len)

    def offsets(self, step: int, n: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 0, step])))
        return rng.integers(0, self.span, size=n)

    def fixed(self, n: int, seed: int = 0) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 1])))
        return rng.integers(0, self.span, size=n)

    def gather(self, offsets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        w = np.stack([np.asarray(self.tokens[o: o + self.seq_len + 1], dtype=np.int64) for o in offsets])
        w = torch.from_numpy(w)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()
