"""Tokenizers: round trips, local BPE (reproducible, cached), a saved HF tokenizer.json, load_tokenizer for all."""

import errno
import io
import json
import os

import numpy as np
import pytest

from difftx.data.tokenizers import (ByteTokenizer, CharTokenizer, HFTokenizer, build_tokenizer, load_tokenizer,
                                    train_bpe)
from difftx.errors import DataError
from ..conftest import patch_mkdir

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak. Ünïcödé ✓\n" * 30


@pytest.mark.parametrize("tok", [ByteTokenizer(), CharTokenizer.from_text(TEXT)])
def test_round_trip_and_vectorised_encoding(tok, tmp_path):
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    np.testing.assert_array_equal(tok.encode_array(TEXT), np.asarray(ids))
    back = load_tokenizer(tok.save(tmp_path))
    assert back.encode(TEXT) == ids and back.fingerprint() == tok.fingerprint()


def test_char_tokenizer_names_an_unknown_character():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(DataError, match="'z' is not in its vocabulary"):
        tok.encode_array("abz")


def test_bpe_is_reproducible_cached_and_round_trips(tmp_path):
    texts = lambda: iter([TEXT[i:i + 500] for i in range(0, len(TEXT), 500)])  # noqa: E731
    a = build_tokenizer("bpe", texts, "corpus-hash", 300, tmp_path)
    cached = list((tmp_path / "tokenizers").glob("bpe-300-*.json"))
    assert len(cached) == 1
    b = train_bpe(texts(), 300)
    assert a.fingerprint() == b.fingerprint()  # same corpus, same vocabulary
    c = build_tokenizer("bpe", lambda: iter(["unused"]), "corpus-hash", 300, tmp_path)
    assert c.fingerprint() == a.fingerprint()  # from the cache: the texts were not read
    assert a.kind == "bpe" and a.vocab_size == 300 and a.eos_id is not None
    ids = a.encode(TEXT)
    assert len(ids) < len(TEXT.encode()) / 2 and a.decode(ids) == TEXT
    np.testing.assert_array_equal(a.encode_array(TEXT), np.asarray(ids))
    assert load_tokenizer(a.save(tmp_path / "run")).encode(TEXT) == ids
    # a reloaded (or broadcast) tokenizer has the same fingerprint, so it finds the same token shard
    assert load_tokenizer(tmp_path / "run").fingerprint() == a.fingerprint()
    from difftx.data.tokenizers import tokenizer_from_dict
    assert tokenizer_from_dict(a.to_dict()).fingerprint() == a.fingerprint()



def _bpe_texts():
    return iter([TEXT[i:i + 500] for i in range(0, len(TEXT), 500)])


def _recording_training(monkeypatch) -> list:
    from difftx.data import tokenizers

    calls, train = [], tokenizers.train_bpe
    monkeypatch.setattr(tokenizers, "train_bpe", lambda texts, size: calls.append(size) or train(texts, size))
    return calls


def test_a_directory_in_place_of_the_bpe_cache_file_is_one_error_before_training(tmp_path, monkeypatch):
    """A cache file replaced by a directory was not found (is_file()), so every run trained the vocabulary again and
    save() wrote tokenizer.json inside the directory, where no run looks: slow, silently, for ever.  One DataError
    names it and the fix before training, and the fix works."""
    build_tokenizer("bpe", _bpe_texts, "corpus-hash", 300, tmp_path)
    (cached,) = (tmp_path / "tokenizers").glob("bpe-300-*.json")
    cached.unlink()
    cached.mkdir()
    (cached / "x").write_text("something")
    trained = _recording_training(monkeypatch)
    with pytest.raises(DataError) as e:
        build_tokenizer("bpe", _bpe_texts, "corpus-hash", 300, tmp_path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{cached}: a directory, not a BPE vocabulary cache file; ")
    assert "remove it" in message and "--cache-dir" in message
    assert trained == [] and [p.name for p in cached.iterdir()] == ["x"]  # not trained, nothing written into it
    import shutil

    shutil.rmtree(cached)
    first = build_tokenizer("bpe", _bpe_texts, "corpus-hash", 300, tmp_path)
    again = build_tokenizer("bpe", lambda: iter(["unused"]), "corpus-hash", 300, tmp_path)
    assert cached.is_file() and trained == [300] and again.fingerprint() == first.fingerprint()  # cached again


def test_difftx_train_with_a_directory_as_the_bpe_cache_file_says_one_line_and_exits_2(tmp_path, capsys):
    from difftx.cli import main
    from difftx.data.corpus import resolve_corpus

    corpus, cache = tmp_path / "a.txt", tmp_path / "cache"
    corpus.write_text(TEXT)
    data = resolve_corpus(str(corpus))
    build_tokenizer("bpe", data.texts, data.fingerprint(), 300, cache)  # the vocabulary `difftx train` caches
    (cached,) = (cache / "tokenizers").glob("bpe-300-*.json")
    cached.unlink()
    cached.mkdir()
    code = main(["train", "--data", str(corpus), "--cache-dir", str(cache), "--tokenizer", "bpe", "--bpe-vocab-size",
                 "300", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "16", "--batch-size", "2",
                 "--steps", "1", "--dtype", "fp32", "--no-progress", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"difftx train: error: {cached}: a directory, not a BPE vocabulary cache file; "), err


class _FullDisk(io.FileIO):
    """A file on a disk with no room left: a write is ENOSPC, as the kernel reports it (an OSError naming no
    file)."""

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["create", "write"])
def test_a_full_disk_while_caching_the_bpe_vocabulary_names_the_cache_file(tmp_path, monkeypatch, where):
    """The disk filling as the trained vocabulary was cached was an OSError naming the temporary file the write
    went to, which does not exist (making it failed), or no file (writing it failed).  One DataError names the cache
    file, the size it needs and the fix; the temporary file is gone and the cached vocabulary of another size is
    intact."""
    import tempfile

    from difftx import io as difftx_io

    build_tokenizer("bpe", _bpe_texts, "corpus-hash", 257, tmp_path)
    folder = tmp_path / "tokenizers"
    (other,) = folder.iterdir()
    before = other.read_bytes()
    if where == "create":
        def make(prefix="", suffix="", dir=None):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(dir, f"{prefix}x1y2z3{suffix}"))

        monkeypatch.setattr(tempfile, "mkstemp", make)
    else:
        monkeypatch.setattr(difftx_io.os, "fdopen", lambda fd, mode: _FullDisk(fd, "w"))
    with pytest.raises(DataError) as e:
        build_tokenizer("bpe", _bpe_texts, "corpus-hash", 300, tmp_path)
    monkeypatch.undo()
    assert list(folder.iterdir()) == [other] and other.read_bytes() == before  # no temporary file, nothing lost
    build_tokenizer("bpe", _bpe_texts, "corpus-hash", 300, tmp_path)  # with room again: cached where it says
    (cached,) = folder.glob("bpe-300-*")
    message = str(e.value)
    assert "\n" not in message and ".tmp" not in message, message
    assert message.startswith(f"{cached}: cannot be written, out of disk space (No space left on device; "), message
    assert f"; {cached.stat().st_size:,} bytes needed)" in message, message  # the size of the file it caches
    assert message.endswith("free space on that disk or point $DIFFTX_CACHE (or --cache-dir) at another one")


@pytest.mark.parametrize("where, code", [("create", errno.EACCES), ("create", errno.EPERM), ("create", errno.EROFS),
                                         ("folder", errno.EACCES), ("folder", errno.EROFS)])
def test_a_cache_folder_that_cannot_be_written_names_the_bpe_cache_file(tmp_path, monkeypatch, where, code):
    """A cache folder without write permission, or on a read-only file system (simulated: tests may run as root),
    was a PermissionError (or OSError) naming the temporary file that was never made, or the folder for the
    vocabularies that could not be made.  One DataError names the cache file, why and the fix; no temporary file is
    left and the cached vocabulary of another size is intact."""
    import tempfile

    folder = tmp_path / "tokenizers"
    if where == "create":  # the vocabularies' folder is there, but no file can be made in it
        build_tokenizer("bpe", _bpe_texts, "corpus-hash", 257, tmp_path)
        (other,) = folder.iterdir()
        before = other.read_bytes()

        def make(prefix="", suffix="", dir=None):
            raise OSError(code, os.strerror(code), os.path.join(dir, f"{prefix}x1y2z3{suffix}"))

        monkeypatch.setattr(tempfile, "mkstemp", make)
        refused = folder
    else:  # a cache folder in which the vocabularies' folder cannot be made
        mkdir = os.mkdir

        def make(path, *args, **kwargs):
            if os.fspath(path) == str(folder):
                raise OSError(code, os.strerror(code), os.fspath(path))
            return mkdir(path, *args, **kwargs)

        patch_mkdir(monkeypatch, make)
        refused = tmp_path
    with pytest.raises(DataError) as e:
        build_tokenizer("bpe", _bpe_texts, "corpus-hash", 300, tmp_path)
    monkeypatch.undo()
    if where == "create":
        assert list(folder.iterdir()) == [other] and other.read_bytes() == before  # no temporary file, nothing lost
    else:
        assert not folder.exists()
    build_tokenizer("bpe", _bpe_texts, "corpus-hash", 300, tmp_path)  # once it can be written: cached where it says
    (cached,) = folder.glob("bpe-300-*")
    message = str(e.value)
    assert "\n" not in message and ".tmp" not in message, message
    assert message.startswith(f"{cached}: cannot be written ({os.strerror(code)}); "), message
    if code == errno.EROFS:
        assert message.endswith("; point $DIFFTX_CACHE (or --cache-dir) at a folder on a writable disk"), message
    else:
        assert message.endswith(f"; fix the permissions of {refused} or point $DIFFTX_CACHE (or --cache-dir) at a "
                                "folder you can write to"), message


def test_a_saved_hugging_face_tokenizer_json_loads(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(str(tmp_path))  # a directory holding tokenizer.json
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 4 and tok.eos_id == 3
    assert tok.encode("hello world nope") == [1, 2, 0]


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"something": 1}))
    with pytest.raises(DataError, match="not a difftx or Hugging Face tokenizer"):
        load_tokenizer(tmp_path)
    with pytest.raises(DataError, match="built from the training corpus"):
        build_tokenizer("char")
    with pytest.raises(DataError, match="not byte, char, bpe"):
        build_tokenizer("wordpiece")


@pytest.mark.parametrize("chars", [None, 5, ["ab", "c"], [1, 2]])
def test_a_corrupt_char_tokenizer_file_is_one_data_error(tmp_path, chars):
    """No 'chars' was a KeyError, a non-list a TypeError; multi-character entries loaded a vocabulary whose
    entries can never match."""
    data = {"difftx_tokenizer": "char"}
    if chars is not None:
        data["chars"] = chars
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match="a char tokenizer needs 'chars'"):
        load_tokenizer(tmp_path)


def _assert_segments_and_shard_are_the_encoding(text, tok, tmp_path, monkeypatch):
    """Encoding in segments of any size, and a shard built from small pieces, give ``encode(text)`` (+ EOS)."""
    from difftx.data import corpus as corpus_mod
    from difftx.data.corpus import resolve_corpus
    from difftx.data.shards import prepare_tokens

    for segment in (1, 5, 20, 64):
        assert tok.encode_array(text, segment=segment).tolist() == tok.encode(text), segment
    monkeypatch.setattr(corpus_mod, "PIECE_BYTES", 64)
    (tmp_path / "stories.txt").write_text(text)
    data = prepare_tokens(resolve_corpus(str(tmp_path / "stories.txt")), tok, tmp_path / "cache", progress=False)
    assert data.tokens.tolist() == tok.encode(text) + [tok.eos_id]


def test_bpe_segments_never_split_a_special_token_written_in_the_text(tmp_path, monkeypatch):
    """Corpora such as TinyStories separate stories with a literal '<|endoftext|>' line; encode() matches it
    as the special token, so the segmented encoding (and the token shard) must not cut inside it (the cut was
    taken between the pre-tokens '<|' and 'endoftext')."""
    pytest.importorskip("tokenizers")
    from difftx.data.tokenizers import train_bpe

    text = "".join(f"Once upon a time {i}.\n<|endoftext|>\nThe end {i}\n" for i in range(40))
    tok = train_bpe(iter([text]), 300)
    assert tok.encode("<|endoftext|>") == [tok.eos_id]
    _assert_segments_and_shard_are_the_encoding(text, tok, tmp_path, monkeypatch)


def test_a_tokenizer_without_pre_tokenizer_is_encoded_whole(tmp_path, monkeypatch):
    """Llama 2 / Mistral tokenizer.json files have no pre-tokenizer and a Prepend('\u2581') normalizer: encoding
    a segment alone prepends '\u2581' to it (and merges may span the newline the cut was made after), so the
    segmented encoding and the shard differed from encode(); such a tokenizer is never cut."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers, trainers

    from difftx.data import corpus as corpus_mod
    from difftx.data.corpus import resolve_corpus
    from difftx.data.shards import prepare_tokens
    from difftx.data.tokenizers import HFTokenizer

    text = "".join(f"Hello world {i}\nsecond line here\n" for i in range(100))
    raw = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    raw.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Strip(" ", 1, 0)])
    raw.train_from_iterator([text], trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"],
                                                        show_progress=False))
    tok = HFTokenizer(raw)
    assert tok.encode_array(text, segment=100).tolist() == tok.encode(text)
    monkeypatch.setattr(corpus_mod, "PIECE_BYTES", 256)
    (tmp_path / "t.txt").write_text(text)
    data = prepare_tokens(resolve_corpus(str(tmp_path / "t.txt")), tok, tmp_path / "cache", progress=False)
    assert data.tokens.tolist() == tok.encode(text) + [tok.eos_id]


def test_a_byte_level_tokenizer_that_adds_a_prefix_space_is_encoded_whole():
    """ByteLevel(add_prefix_space=True) adds a space to the start of every input: a segment cut before ':' or a
    digit was encoded as ' :' (every segmented encoding differed from encode()); such a tokenizer is not cut."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from difftx.data.tokenizers import HFTokenizer

    text = "".join(f"x{i}:(ab cd)\n:12 ab\n\n" for i in range(60))
    raw = tokenizers.Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tok = HFTokenizer(raw)
    for segment in (3, 17, 64):
        assert tok.encode_array(text, segment=segment).tolist() == tok.encode(text), segment


def test_bpe_segments_are_cut_where_encoding_splits_pre_tokens_next_to_a_special_token(tmp_path, monkeypatch):
    """Encoding takes added tokens out of the text before pre-tokenizing the rest: "<|endoftext|>'s" is
    '<|endoftext|>' + "'s".  The cut was taken from the pre-tokenizer run on the raw text ('<|', 'endoftext',
    "|>'", 's'), between "'" and 's', so the segmented encoding (and the shard) differed from encode()."""
    pytest.importorskip("tokenizers")

    text = "".join(f"Tom's dog {i}\n<|endoftext|>'s tale\n\n<|endoftext|>ok then\n" for i in range(40))
    tok = train_bpe(iter([text]), 300)
    _assert_segments_and_shard_are_the_encoding(text, tok, tmp_path, monkeypatch)


def test_a_vocabulary_with_unused_ids_sizes_the_model_past_its_largest_id(tmp_path):
    """A tokenizer.json whose ids leave gaps ('</s>' at 9 in a vocabulary of 4 entries): vocab_size was the
    number of entries, so the EOS written between documents (never range-checked) was past the model's
    embedding.  vocab_size is the largest id + 1: every id the tokenizer or the shard holds is below it."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from difftx.data.corpus import resolve_corpus
    from difftx.data.shards import prepare_tokens

    hf = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "</s>": 9}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.eos_id == 9 and tok.vocab_size == 10
    (tmp_path / "a.txt").write_text("hello world\n" * 10)
    data = prepare_tokens(resolve_corpus(str(tmp_path / "a.txt")), tok, tmp_path / "cache", progress=False)
    assert data.tokens.tolist() == ([1, 2] * 10) + [9] and int(data.tokens.max()) < tok.vocab_size


def test_a_home_relative_tokenizer_path_is_expanded(tmp_path, monkeypatch):
    """--tokenizer=~/tok/tokenizer.json (no shell expands a '~' after '=') was 'not byte, char, bpe or an existing
    tokenizer.json', where --data expands it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    CharTokenizer.from_text("abc").save(tmp_path / "tok")
    assert build_tokenizer("~/tok/tokenizer.json").encode("cab") == [2, 0, 1]
    assert build_tokenizer("~/tok").encode("cab") == [2, 0, 1]


def test_every_tokenizer_decodes_targets_with_the_ignore_index():
    """Targets mark unscored positions with -100; byte and char decoding skip ids outside the vocabulary, the
    bpe one raised OverflowError on a negative id."""
    pytest.importorskip("tokenizers")
    for tok in (ByteTokenizer(), CharTokenizer.from_text(TEXT), train_bpe(iter([TEXT]), 300)):
        ids = tok.encode("Speak, speak.")
        assert tok.decode([-100, -100] + ids + [-100, tok.vocab_size]) == "Speak, speak.", tok.kind


def _one_line_text(seed: int, n: int = 4000) -> str:
    """Words, contractions, digit runs, punctuation, runs of spaces and tabs, CJK, special tokens: no newline."""
    import random

    rng = random.Random(seed)
    words = ["the", "dog's", "can't", "'", "''s", "12", "1234567", "3.5", "é", "naïve", "日本語", "<|endoftext|>",
             ",", "!!", "(x)", "--", "\t", "  ", "x", "Ünïcode", "'ll", "42nd"]
    return "".join(rng.choice(words) + rng.choice([" ", " ", " ", "", "  ", " \t "]) for _ in range(n))


@pytest.mark.parametrize("seed", range(3))
def test_bpe_encodes_a_text_without_newlines_in_segments_with_the_same_ids(seed, monkeypatch):
    """Segments were cut only after newlines: a text of one line was one segment (encoded on one thread, with all
    of its memory at once: 7 GB for a 40 MB line).  It is cut at pre-token boundaries now, into segments of about
    the size asked for, and the ids are still encode(text)'s."""
    pytest.importorskip("tokenizers")
    text = _one_line_text(seed)
    tok = train_bpe(iter([text]), 400)
    batches = []
    encode_batch = tok.encode_batch
    monkeypatch.setattr(tok, "encode_batch", lambda texts: batches.append(texts) or encode_batch(texts))
    for segment in (1, 7, 64, 1000):
        batches.clear()
        assert tok.encode_array(text, segment=segment).tolist() == tok.encode(text), segment
        parts = batches[0]
        assert "".join(parts) == text and len(parts) >= len(text) // (segment + 300), segment
        assert max(map(len, parts)) <= segment + 4096, segment


def test_bpe_cuts_a_one_line_file_of_digits_where_the_whole_text_is_cut(monkeypatch):
    """A Llama 3 / GPT-4 style pattern groups digits in threes from the start of a run: a window started inside
    the run would group them from elsewhere; cuts must still give encode(text)'s ids."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    raw = tokenizers.Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raw.decoder = decoders.ByteLevel()
    text = "".join(f"{7 ** i}" + ("" if i % 5 else ",x") for i in range(400))  # long digit runs, few spaces
    raw.train_from_iterator([text, _one_line_text(0)], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = HFTokenizer(raw)
    for t in (text, _one_line_text(1)):
        for segment in (1, 13, 200):
            assert tok.encode_array(t, segment=segment).tolist() == tok.encode(t), segment
