"""Token shards: manifest, reuse on rerun, dtype, deterministic split, stateless window sampling."""

import errno
import io
import json
import os

import numpy as np
import pytest

from difftx.data.corpus import resolve_corpus
from difftx.data.shards import MANIFEST_FILE, TOKENS_FILE, WindowSampler, prepare_tokens, token_dtype
from difftx.data.tokenizers import ByteTokenizer, CharTokenizer
from difftx.errors import DataError
from ..conftest import patch_mkdir


@pytest.fixture
def two_files(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("hello world\n" * 50)
    (d / "b.txt").write_text("goodbye moon\n" * 30)
    return d


def test_manifest_and_contents(two_files, tmp_path):
    corpus = resolve_corpus(str(two_files))
    tok = CharTokenizer.from_text("".join(corpus.texts()))
    data = prepare_tokens(corpus, tok, tmp_path / "cache", val_fraction=0.1, progress=False)
    m = json.loads((data.path / MANIFEST_FILE).read_text())
    assert m["tokenizer"]["fingerprint"] == tok.fingerprint() and m["dtype"] == "uint16"
    assert [s["tokens"] for s in m["sources"]] == [600, 390]  # char tokenizer: no EOS between documents
    assert m["sources"][0]["sha256"] == corpus.sources[0].sha256()
    assert tok.decode(data.tokens) == "hello world\n" * 50 + "goodbye moon\n" * 30
    assert data.n_train == 990 - 99 and len(data.val) == 99  # the last 10% is validation
    np.testing.assert_array_equal(data.val, data.tokens[891:])


def test_rerun_reuses_the_shard_and_a_change_rebuilds_it(two_files, tmp_path):
    cache, tok = tmp_path / "cache", ByteTokenizer()
    first = prepare_tokens(resolve_corpus(str(two_files)), tok, cache, progress=False)
    stamp = os.stat(first.path / TOKENS_FILE).st_mtime_ns
    again = prepare_tokens(resolve_corpus(str(two_files)), tok, cache, progress=False)
    assert again.path == first.path and os.stat(again.path / TOKENS_FILE).st_mtime_ns == stamp
    (two_files / "b.txt").write_text("changed\n" * 30)
    changed = prepare_tokens(resolve_corpus(str(two_files)), tok, cache, progress=False)
    assert changed.path != first.path
    # an interrupted build (no manifest) is rebuilt, not trusted
    (changed.path / MANIFEST_FILE).unlink()
    rebuilt = prepare_tokens(resolve_corpus(str(two_files)), tok, cache, progress=False)
    assert (rebuilt.path / MANIFEST_FILE).is_file() and len(rebuilt.tokens) == len(changed.tokens)


def test_dtype_follows_the_vocabulary():
    assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(100_288) == np.uint32


def test_window_sampler_is_a_pure_function_of_seed_and_step():
    tokens = np.arange(1000, dtype=np.uint16)
    s = WindowSampler(tokens, seq_len=8, seed=3)
    a, b = s.offsets(5, 12), s.offsets(5, 12)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, s.offsets(6, 12))
    assert not np.array_equal(a, WindowSampler(tokens, 8, seed=4).offsets(5, 12))
    assert a.min() >= 0 and a.max() <= 1000 - 9
    x, y = s.gather(a[:2])
    assert x.shape == (2, 8) and (y[:, :-1] == x[:, 1:]).all() and (y[:, -1] == x[:, -1] + 1).all()
    np.testing.assert_array_equal(s.fixed(6), s.fixed(6))


def test_too_little_data_is_a_clear_error():
    with pytest.raises(DataError, match="fewer than seq_len"):
        WindowSampler(np.arange(8, dtype=np.uint16), seq_len=16, seed=0, what="validation")


CODE = "def f():\n\n\n    return 1\n\n  \n\tx = 2  \nclass A:\n    pass  \n\n\n" * 40


def test_bpe_shards_are_the_tokenizers_own_encoding(tmp_path, monkeypatch):
    """A file read in small pieces and encoded in small segments: a byte-level BPE keeps a run of newlines and
    spaces as one pre-token, so cutting inside one would change the ids.  The shard is encode(file) + EOS."""
    from difftx.data import corpus as corpus_mod
    from difftx.data.tokenizers import train_bpe

    monkeypatch.setattr(corpus_mod, "PIECE_BYTES", 64)
    (tmp_path / "code.txt").write_text(CODE)
    tok = train_bpe(iter([CODE]), 300)
    assert tok.encode_array(CODE, segment=7).tolist() == tok.encode(CODE)
    data = prepare_tokens(resolve_corpus(str(tmp_path / "code.txt")), tok, tmp_path / "cache", progress=False)
    assert data.tokens.tolist() == tok.encode(CODE) + [tok.eos_id]


def test_empty_texts_with_an_eos_tokenizer_are_no_data(tmp_path):
    """A JSONL of empty texts gave a shard of end-of-text tokens only with a tokenizer that has one (bpe), and a
    run trained on them; without one (byte) it was already 'no tokens'."""
    from difftx.data.tokenizers import train_bpe

    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n' * 50)
    tok = train_bpe(iter([CODE]), 300)
    assert tok.eos_id is not None
    for t in (tok, ByteTokenizer()):
        with pytest.raises(DataError, match="no tokens"):
            prepare_tokens(resolve_corpus(str(tmp_path / "empty.jsonl")), t, tmp_path / "cache", progress=False)


def test_bpe_shards_do_not_cut_after_a_piece_whose_last_line_is_long(tmp_path, monkeypatch):
    """A piece whose last line is longer than 4096 characters has no pre-token boundary after its last newline
    but its end; that newline merges with the indentation that starts the next piece ('\\n' + '    word'), so
    the piece may not be encoded alone: the shard must still be encode(file) + EOS."""
    from difftx.data import corpus as corpus_mod
    from difftx.data.tokenizers import train_bpe

    monkeypatch.setattr(corpus_mod, "PIECE_BYTES", 6000)
    text = "word " * 1100 + "\n" + "    " + "word " * 1100 + "\n" + "    y = 1\n"
    (tmp_path / "long.txt").write_text(text)
    tok = train_bpe(iter([text]), 300)
    data = prepare_tokens(resolve_corpus(str(tmp_path / "long.txt")), tok, tmp_path / "cache", progress=False)
    assert data.tokens.tolist() == tok.encode(text) + [tok.eos_id]


@pytest.mark.parametrize("bad", ["[]", "null", '{"n_tokens": 600, "dtype": "nonsense"}', '{"dtype": "uint16"}'])
def test_a_damaged_manifest_is_rebuilt(two_files, tmp_path, bad):
    """A manifest.json that is JSON but not a manifest was an AttributeError / TypeError traceback; it is
    treated like an interrupted build: the shard is rebuilt."""
    corpus = resolve_corpus(str(two_files))
    tok = ByteTokenizer()
    data = prepare_tokens(corpus, tok, tmp_path / "cache", progress=False)
    (data.path / MANIFEST_FILE).write_text(bad)
    again = prepare_tokens(corpus, tok, tmp_path / "cache", progress=False)
    assert again.tokens.tolist() == data.tokens.tolist()
    assert json.loads((data.path / MANIFEST_FILE).read_text())["n_tokens"] == len(data.tokens)


@pytest.mark.parametrize("name", ["a.txt", "a.jsonl"])
def test_a_file_changed_after_it_was_hashed_is_not_cached_under_its_old_contents(tmp_path, name):
    """The shard key hashed the files before they were read: a file changed in between (being written, replaced
    while the tokenizer was built) was tokenized in its new state and cached under its old hash, and a later run on
    the old contents reused tokens of other text.  What was read is hashed now, and a change is refused."""
    path = tmp_path / name
    old, new = ["old text here\n" * 20, "new words instead\n" * 20]

    def write(text):
        path.write_text(json.dumps({"text": text}) + "\n" if name.endswith(".jsonl") else text)

    write(old)
    cache, tok = tmp_path / "cache", ByteTokenizer()
    corpus = resolve_corpus(str(path))
    corpus.fingerprint()  # hashed first, as by the tokenizer build of difftx train
    write(new)
    with pytest.raises(DataError, match=f"{path}: changed while it was read.*rerun"):
        prepare_tokens(corpus, tok, cache, progress=False)
    assert not list(cache.rglob(MANIFEST_FILE)) and not list(cache.rglob("*.tmp"))
    write(old)
    data = prepare_tokens(resolve_corpus(str(path)), tok, cache, progress=False)
    assert tok.decode(data.tokens) == old
    write(new)
    data = prepare_tokens(resolve_corpus(str(path)), tok, cache, progress=False)
    assert tok.decode(data.tokens) == new


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "dtype", "no sources", "counts"])
def test_a_damaged_shard_is_rebuilt_not_used(two_files, tmp_path, damage):
    """Only the tokens file's length was checked against the manifest: a tokens.bin of the right length holding
    other bytes (ids past the vocabulary, which the model's embedding cannot take), a manifest whose dtype, token
    counts or sources do not fit the shard (read as other ids, or a KeyError in the run's description) were used,
    and an empty tokens.bin under n_tokens 0 was a ValueError traceback.  Each is rebuilt now."""
    corpus = resolve_corpus(str(two_files))
    tok = ByteTokenizer()
    data = prepare_tokens(corpus, tok, tmp_path / "cache", progress=False)
    want, tokens, manifest = data.tokens.tolist(), data.path / TOKENS_FILE, data.path / MANIFEST_FILE
    m = json.loads(manifest.read_text())
    del data
    if damage == "truncated":
        tokens.write_bytes(tokens.read_bytes()[:100])
    elif damage == "garbage":
        tokens.write_bytes(b"\xff" * tokens.stat().st_size)
    elif damage == "empty":
        tokens.write_bytes(b"")
        m["n_tokens"] = 0
    elif damage == "dtype":
        m.update(dtype="uint32", n_tokens=m["n_tokens"] // 2)
    elif damage == "no sources":
        del m["sources"]
    elif damage == "counts":
        tokens.write_bytes(tokens.read_bytes() + b"\x00\x00")
        m["n_tokens"] += 1
    manifest.write_text(json.dumps(m))
    again = prepare_tokens(resolve_corpus(str(two_files)), tok, tmp_path / "cache", progress=False)
    assert again.tokens.dtype == np.uint16 and again.tokens.tolist() == want
    assert [s["tokens"] for s in again.manifest["sources"]] == [600, 390] and again.manifest["n_tokens"] == 990


def _recording(monkeypatch, tok, name):
    """Patch ``tok.name`` to record the length of the text of each call."""
    lengths, method = [], getattr(tok, name)
    monkeypatch.setattr(tok, name, lambda text, *a, **k: lengths.append(len(text)) or method(text, *a, **k))
    return lengths


@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_a_one_line_file_is_tokenised_in_bounded_parts_with_the_files_ids(tmp_path, monkeypatch, kind):
    """A file of one line was read whole and encoded in one call (a BPE on one thread, 7 GB of memory for 40 MB).
    It is encoded in parts of bounded size now, and the shard is still encode(file) + EOS."""
    from difftx.data import corpus as corpus_mod
    from difftx.data.tokenizers import train_bpe

    monkeypatch.setattr(corpus_mod, "PIECE_BYTES", 4096)
    text = "".join(f"Tom's dog {i} can't ({i * 7919}) sit,  then  ran!  " for i in range(3000))
    (tmp_path / "one_line.txt").write_text(text)
    tok = train_bpe(iter([text]), 300) if kind == "bpe" else ByteTokenizer()
    encoded = _recording(monkeypatch, tok, "encode_array")
    data = prepare_tokens(resolve_corpus(str(tmp_path / "one_line.txt")), tok, tmp_path / "cache", progress=False)
    want = tok.encode(text) + ([tok.eos_id] if tok.eos_id is not None else [])
    assert data.tokens.tolist() == want
    assert sum(encoded) == len(text) and len(encoded) > 10
    assert max(encoded) <= 8192 + 4096 + 4096  # what waits for a cut, plus a piece


def test_a_tokenizer_that_is_never_cut_does_not_rejoin_the_text_for_every_piece(tmp_path, monkeypatch):
    """Nothing may be cut for a tokenizer without a pre-tokenizer: the text read so far was joined with each piece
    and searched for a cut again, quadratic in the file's size.  The search looks at a bounded tail, the text is
    joined once, and the shard is still encode(file) + EOS."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, normalizers, trainers

    from difftx.data import corpus as corpus_mod
    from difftx.data import shards
    from difftx.data.tokenizers import HFTokenizer

    monkeypatch.setattr(corpus_mod, "PIECE_BYTES", 1024)
    monkeypatch.setattr(shards, "TAIL_CHARS", 2048, raising=False)
    text = "".join(f"Hello world {i}\nsecond line here\n" for i in range(3000))
    raw = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    raw.train_from_iterator([text], trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"],
                                                        show_progress=False))
    tok = HFTokenizer(raw)
    searched, encoding = [], []
    cut, encode_array = tok.cut, tok.encode_array

    def searching(text, pos):
        if not encoding:  # encode_array's own segments are not the search for a cut in what was read
            searched.append(len(text))
        return cut(text, pos)

    monkeypatch.setattr(tok, "cut", searching)
    monkeypatch.setattr(tok, "encode_array", lambda text: encoding.append(1) or encode_array(text))
    (tmp_path / "t.txt").write_text(text)
    data = prepare_tokens(resolve_corpus(str(tmp_path / "t.txt")), tok, tmp_path / "cache", progress=False)
    assert data.tokens.tolist() == tok.encode(text) + [tok.eos_id]
    assert len(encoding) == 1  # encoded whole, once
    assert len(searched) > 50 and max(searched) <= 2048 + 1024  # the tail searched, not all that was read


def _shard_folder(two_files, tmp_path):
    data = prepare_tokens(resolve_corpus(str(two_files)), ByteTokenizer(), tmp_path / "cache", progress=False)
    return data.path


def _assert_names_the_entry_and_the_fix(message, folder, name):
    assert "\n" not in message and message.startswith(f"{folder / name}: ")
    assert "delete that folder (the next run rebuilds it)" in message and str(folder) in message
    assert "--cache-dir" in message


@pytest.mark.parametrize("name, manifest", [(TOKENS_FILE, True), (TOKENS_FILE, False), (MANIFEST_FILE, False)])
def test_a_directory_in_place_of_a_shard_file_is_one_error_naming_the_cache_entry(two_files, tmp_path, monkeypatch,
                                                                               name, manifest):
    """tokens.bin replaced by a directory was an OSError naming the temporary file the rebuild wrote (deleted by
    then), after the whole corpus had been tokenised; one DataError names the entry and the fix, before tokenising,
    and the fix works."""
    folder = _shard_folder(two_files, tmp_path)
    if not manifest:
        (folder / MANIFEST_FILE).unlink(missing_ok=True)
    (folder / name).unlink(missing_ok=True)
    (folder / name).mkdir()
    (folder / name / "x").write_text("something")
    tok = ByteTokenizer()
    encoded = _recording(monkeypatch, tok, "encode_array")
    with pytest.raises(DataError) as e:
        prepare_tokens(resolve_corpus(str(two_files)), tok, tmp_path / "cache", progress=False)
    _assert_names_the_entry_and_the_fix(str(e.value), folder, name)
    assert "a directory, not a file" in str(e.value) and encoded == []
    import shutil

    shutil.rmtree(folder)
    again = prepare_tokens(resolve_corpus(str(two_files)), ByteTokenizer(), tmp_path / "cache", progress=False)
    assert again.path == folder and tok.decode(again.tokens) == "hello world\n" * 50 + "goodbye moon\n" * 30


def test_an_unreadable_tokens_file_is_one_error_naming_the_cache_entry(two_files, tmp_path, monkeypatch):
    """A tokens.bin that cannot be opened (no permission: simulated, tests may run as root) was a bare
    PermissionError."""
    from difftx.data import shards

    folder = _shard_folder(two_files, tmp_path)
    memmap = np.memmap

    def refuse(path, *args, **kwargs):
        if str(path) == str(folder / TOKENS_FILE):
            raise PermissionError(13, "Permission denied", str(path))
        return memmap(path, *args, **kwargs)

    monkeypatch.setattr(shards.np, "memmap", refuse)
    with pytest.raises(DataError) as e:
        prepare_tokens(resolve_corpus(str(two_files)), ByteTokenizer(), tmp_path / "cache", progress=False)
    _assert_names_the_entry_and_the_fix(str(e.value), folder, TOKENS_FILE)
    assert "cannot be read (Permission denied)" in str(e.value)


def _train_one_step(corpus, cache, out, capsys) -> tuple[int, str]:
    """``difftx train`` of a tiny byte model on ``corpus`` for one step with ``--cache-dir cache``: (exit code,
    stderr)."""
    from difftx.cli import main

    code = main(["train", "--data", str(corpus), "--cache-dir", str(cache), "--tokenizer", "byte", "--d-model", "32",
                 "--n-layers", "1", "--n-heads", "2", "--seq-len", "16", "--batch-size", "2", "--steps", "1",
                 "--dtype", "fp32", "--no-progress", "--out", str(out)])
    return code, capsys.readouterr().err


def test_difftx_train_with_a_directory_as_tokens_bin_says_one_line_and_exits_2(two_files, tmp_path, capsys):
    cache = tmp_path / "cache"
    corpus = two_files / "a.txt"
    folder = prepare_tokens(resolve_corpus(str(corpus)), ByteTokenizer(), cache, progress=False).path
    (folder / TOKENS_FILE).unlink()
    (folder / TOKENS_FILE).mkdir()
    code, err = _train_one_step(corpus, cache, tmp_path / "run", capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"difftx train: error: {folder / TOKENS_FILE}: a directory, not a file; "), err
    assert "delete that folder" in err and "--cache-dir" in err


class _FullDisk(io.FileIO):
    """A file on a disk with ``room`` bytes free: a write past them is ENOSPC, as the kernel reports it (an OSError
    naming no file)."""

    room = 0

    def write(self, data):
        if self.tell() + memoryview(data).nbytes > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


@pytest.mark.parametrize("room", [None, 0, 1500])
def test_a_full_disk_while_writing_the_tokens_names_tokens_bin_and_keeps_the_old_one(two_files, tmp_path,
                                                                                      monkeypatch, room):
    """The disk filling while the tokens were written was an OSError naming the temporary file they went to, which
    no longer exists (making it failed: room None), or no file at all (a write failed).  One DataError names tokens.bin
    (with what was written when the disk filled) and the fix; the temporary file is gone and the tokens.bin of an
    interrupted build is left as it was."""
    from difftx.data import shards

    folder = _shard_folder(two_files, tmp_path)
    (folder / MANIFEST_FILE).unlink()  # an interrupted build: rebuilt, its tokens.bin replaced only once written
    before = (folder / TOKENS_FILE).read_bytes()

    def full_open(path, mode="r", *args, **kwargs):
        if room is None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        f = _FullDisk(path, "w")
        f.room = room
        return f

    monkeypatch.setattr(shards, "open", full_open, raising=False)
    with pytest.raises(DataError) as e:
        prepare_tokens(resolve_corpus(str(two_files)), ByteTokenizer(), tmp_path / "cache", progress=False)
    message = str(e.value)
    assert "\n" not in message and ".tmp" not in message, message
    assert message.startswith(f"{folder / TOKENS_FILE}: cannot be written, out of disk space (No space left on "
                              "device"), message
    # a.txt's 600 bytes are 1200 bytes of uint16 ids: written; b.txt's are not
    assert ("; 1,200 bytes written when it filled)" in message) == (room == 1500), message
    assert message.endswith("free space on that disk or point $DIFFTX_CACHE (or --cache-dir) at another one")
    assert sorted(p.name for p in folder.iterdir()) == [TOKENS_FILE]  # no temporary file left
    assert (folder / TOKENS_FILE).read_bytes() == before


def test_a_full_disk_while_writing_the_manifest_names_it(two_files, tmp_path, monkeypatch):
    """The manifest, written last: a full disk there named manifest.json with the advice for a broken cache entry
    (delete the folder); the advice is the full disk's now."""
    from difftx import io as difftx_io

    def full(path, text):  # as atomic_write_text fails when it cannot make its temporary file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path.parent / f".{path.name}.x1y2z3.tmp"))

    monkeypatch.setattr(difftx_io, "atomic_write_text", full)
    with pytest.raises(DataError) as e:
        prepare_tokens(resolve_corpus(str(two_files)), ByteTokenizer(), tmp_path / "cache", progress=False)
    (folder,) = (tmp_path / "cache" / "shards").iterdir()
    assert str(e.value).startswith(f"{folder / MANIFEST_FILE}: cannot be written, out of disk space ("), str(e.value)
    assert "delete that folder" not in str(e.value) and "$DIFFTX_CACHE" in str(e.value)
    assert sorted(p.name for p in folder.iterdir()) == [TOKENS_FILE]  # no manifest: the next run rebuilds


def _refusing_mkdir(monkeypatch, cache, code):
    """``cache`` exists but nothing can be made in it (no permission, or a read-only file system: simulated, tests may
    run as root): os.mkdir of a folder in it fails as the kernel reports it, naming that folder."""
    mkdir = os.mkdir

    def refuse(path, *args, **kwargs):
        if os.path.dirname(os.fspath(path)) == str(cache):
            raise OSError(code, os.strerror(code), os.fspath(path))
        return mkdir(path, *args, **kwargs)

    patch_mkdir(monkeypatch, refuse)


def _assert_cannot_be_written(message, path, code, folder):
    """One line naming ``path`` (not a temporary file), why (the kernel's words) and the fix: ``folder``'s
    permissions, or a cache folder that can be written."""
    assert "\n" not in message and ".tmp" not in message and "delete that folder" not in message, message
    assert message.startswith(f"{path}: "), message
    assert f"({os.strerror(code)}); " in message, message
    if code == errno.EROFS:
        assert message.endswith("; point $DIFFTX_CACHE (or --cache-dir) at a folder on a writable disk"), message
    else:
        assert message.endswith(f"; fix the permissions of {folder} or point $DIFFTX_CACHE (or --cache-dir) at a "
                                "folder you can write to"), message


@pytest.mark.parametrize("where, code", [("entry", errno.EACCES), ("entry", errno.EROFS), ("tokens", errno.EACCES),
                                         ("tokens", errno.EPERM), ("tokens", errno.EROFS), ("manifest", errno.EACCES),
                                         ("manifest", errno.EROFS)])
def test_a_cache_folder_that_cannot_be_written_is_one_error_naming_the_cache_file(two_files, tmp_path, monkeypatch,
                                                                                  where, code):
    """A cache folder without write permission, or on a read-only file system, was a PermissionError (or OSError)
    naming the temporary file that was never made (tokens.bin, manifest.json), or the advice for a file in the way
    (the entry's folder).  One DataError names the cache file or folder and the fix; no temporary file is left and
    the tokens.bin of an interrupted build is kept."""
    import tempfile

    from difftx.data import shards

    cache = tmp_path / "cache"
    if where == "entry":  # an empty cache folder that cannot be written: the shards' folder cannot be made in it
        cache.mkdir()
        _refusing_mkdir(monkeypatch, cache, code)
    else:
        folder = _shard_folder(two_files, tmp_path)
        (folder / MANIFEST_FILE).unlink()  # an interrupted build: rebuilt, its tokens.bin replaced only once written
        before = (folder / TOKENS_FILE).read_bytes()
    if where == "tokens":
        def refuse(path, mode="r", *args, **kwargs):
            raise OSError(code, os.strerror(code), str(path))  # open() of the temporary file, as the kernel says

        monkeypatch.setattr(shards, "open", refuse, raising=False)
    elif where == "manifest":
        mkstemp = tempfile.mkstemp

        def refuse(prefix="", suffix="", dir=None):
            if prefix.startswith(f".{MANIFEST_FILE}."):
                raise OSError(code, os.strerror(code), os.path.join(dir, f"{prefix}x1y2z3{suffix}"))
            return mkstemp(prefix=prefix, suffix=suffix, dir=dir)

        monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(DataError) as e:
        prepare_tokens(resolve_corpus(str(two_files)), ByteTokenizer(), cache, progress=False)
    message = str(e.value)
    if where == "entry":
        assert list(cache.iterdir()) == []
        folder = cache / "shards" / shards.shard_key(resolve_corpus(str(two_files)), ByteTokenizer())
        _assert_cannot_be_written(message, folder, code, cache)
        assert message.startswith(f"{folder}: cannot make the token cache entry ("), message
        return
    name = TOKENS_FILE if where == "tokens" else MANIFEST_FILE
    _assert_cannot_be_written(message, folder / name, code, folder)
    assert message.startswith(f"{folder / name}: cannot be written ("), message
    assert sorted(p.name for p in folder.iterdir()) == [TOKENS_FILE]  # no temporary file, no manifest
    assert (folder / TOKENS_FILE).read_bytes() == before


@pytest.mark.parametrize("where, code", [("entry", errno.EACCES), ("entry", errno.EROFS), ("tokens", errno.EACCES)])
def test_difftx_train_with_a_cache_dir_that_cannot_be_written_says_one_line_and_exits_2(two_files, tmp_path,
                                                                                         monkeypatch, capsys, where,
                                                                                         code):
    """``difftx train --cache-dir`` at a folder that cannot be written: one line naming the cache entry or tokens.bin
    (not the temporary file, with "check the path, its permissions and free space") and the fix, exit code 2."""
    from difftx.data import shards

    cache, corpus = tmp_path / "cache", two_files / "a.txt"
    if where == "entry":
        cache.mkdir()
        _refusing_mkdir(monkeypatch, cache, code)
        folder = cache / "shards" / shards.shard_key(resolve_corpus(str(corpus)), ByteTokenizer())
        path, where_to_fix = folder, cache
    else:
        folder = prepare_tokens(resolve_corpus(str(corpus)), ByteTokenizer(), cache, progress=False).path
        (folder / MANIFEST_FILE).unlink()
        path, where_to_fix = folder / TOKENS_FILE, folder

        def refuse(path, mode="r", *args, **kwargs):
            raise OSError(code, os.strerror(code), str(path))

        monkeypatch.setattr(shards, "open", refuse, raising=False)
    code_, err = _train_one_step(corpus, cache, tmp_path / "run", capsys)
    assert code_ == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"difftx train: error: {path}: "), err
    _assert_cannot_be_written(err.rstrip("\n").removeprefix("difftx train: error: "), path, code, where_to_fix)
