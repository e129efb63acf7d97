"""Corpus resolution: file, directory, glob, JSONL, the built-in corpus, and clear errors."""

import json

import pytest

from difftx.data.corpus import PIECE_BYTES, resolve_corpus
from difftx.errors import DataError


def _texts(corpus):
    return "".join(corpus.texts())


def test_file_directory_glob(tmp_path):
    (tmp_path / "b.txt").write_text("bravo\n")
    (tmp_path / "a.txt").write_text("alpha\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("charlie\n")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("secret\n")
    (tmp_path / "img.png").write_bytes(b"\x89PNG\x00\x00\x01")
    assert _texts(resolve_corpus(str(tmp_path / "a.txt"))) == "alpha\n"
    d = resolve_corpus(str(tmp_path))  # sorted, hidden and binary files left out
    assert [s.path.name for s in d.sources] == ["a.txt", "b.txt", "c.md"]
    assert _texts(d) == "alpha\nbravo\ncharlie\n"
    assert [s.path.name for s in resolve_corpus(str(tmp_path / "*.txt")).sources] == ["a.txt", "b.txt"]


def test_fingerprint_follows_contents_not_names(tmp_path):
    (tmp_path / "x.txt").write_text("same text\n")
    (tmp_path / "y.txt").write_text("same text\n")
    fx = resolve_corpus(str(tmp_path / "x.txt")).fingerprint()
    assert fx == resolve_corpus(str(tmp_path / "y.txt")).fingerprint()
    (tmp_path / "y.txt").write_text("other text\n")
    assert fx != resolve_corpus(str(tmp_path / "y.txt")).fingerprint()


def test_jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(["one", "two"])) + "\n")
    c = resolve_corpus(str(path), text_field="body")
    assert list(c.pieces()) == [("one", True), ("two", True)]
    with pytest.raises(DataError, match=r"docs.jsonl:1: no string field 'text'"):
        list(resolve_corpus(str(path)).pieces())
    path.write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(DataError, match=r"docs.jsonl:2: not a JSON object"):
        list(resolve_corpus(str(path)).pieces())
    path.write_text('{"text": "ok \\ud83d\\ude00"}\n{"text": "lone \\ud800 half"}\n')  # a pair is fine, a half not
    with pytest.raises(DataError, match=r"docs.jsonl:2: field 'text' holds an unpaired surrogate"):
        list(resolve_corpus(str(path)).pieces())


def test_big_files_come_in_pieces_cut_at_newlines(tmp_path):
    line = "é" * 99 + "\n"
    path = tmp_path / "big.txt"
    path.write_text(line * (PIECE_BYTES // 150))
    pieces = list(resolve_corpus(str(path)).pieces())
    assert len(pieces) >= 2 and all(t.endswith("\n") for t, _ in pieces if t)
    assert [end for _, end in pieces][-1] is True and "".join(t for t, _ in pieces) == path.read_text()


def test_builtin_corpus_is_the_standard_library():
    c = resolve_corpus(None)
    names = {s.path.name for s in c.sources}
    assert {"os.py", "json"} & names and "standard library" in c.description
    assert 1_000_000 < c.nbytes() < 50_000_000


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "no such file or directory"),
    (lambda p: p.write_text(""), "empty"),
    (lambda p: p.write_text("  \n\n"), "only whitespace"),
    (lambda p: p.write_bytes(b"\x00\x01\x02" * 100), r"binary file \(a NUL byte at offset 0\)"),
    (lambda p: p.write_bytes(b"ok" + b"\xff\xfe" * 100), r"binary file \(not UTF-8: bad byte at offset 2\)"),
])
def test_bad_paths(tmp_path, setup, message):
    path = tmp_path / "data.txt"
    setup(path)
    with pytest.raises(DataError, match=message):
        resolve_corpus(str(path))


def test_invalid_utf8_after_the_sniffed_head_names_the_offset(tmp_path):
    path = tmp_path / "late.txt"
    path.write_bytes(b"fine text\n" * 2000 + b"\xff oops\n")
    with pytest.raises(DataError, match=r"late.txt: not UTF-8 text \(bad byte at offset 20000\)"):
        list(resolve_corpus(str(path)).pieces())


def test_saved_hugging_face_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"content": ["first doc", "second doc"], "n": [1, 2]})
    ds.save_to_disk(str(tmp_path / "ds"))
    c = resolve_corpus(str(tmp_path / "ds"), text_field="content")
    assert c.sources[0].kind == "hf" and list(c.pieces()) == [("first doc", True), ("second doc", True)]
    fp = c.fingerprint()
    with pytest.raises(DataError, match="no column 'text'"):
        list(resolve_corpus(str(tmp_path / "ds")).pieces())
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert [t for t, _ in resolve_corpus(str(tmp_path / "dd"), text_field="content").pieces()] == ["first doc",
                                                                                                "second doc"]
    assert resolve_corpus(str(tmp_path / "ds"), text_field="content").fingerprint() == fp


@pytest.mark.parametrize("name", ["notes [draft].txt", "what?.txt", "a*b.txt"])
def test_an_existing_path_with_glob_characters_is_that_file(tmp_path, name):
    """A file whose name holds '[', '?' or '*' was taken for a glob pattern: '[draft]' matches one character,
    so --data 'notes [draft].txt' failed with 'the pattern matches no files' (or read other files)."""
    (tmp_path / name).write_text("the right text\n")
    (tmp_path / "notes d.txt").write_text("another file\n")
    (tmp_path / "whatx.txt").write_text("another file\n")
    (tmp_path / "a-long-b.txt").write_text("another file\n")
    c = resolve_corpus(str(tmp_path / name))
    assert [s.path.name for s in c.sources] == [name] and _texts(c) == "the right text\n"


def test_a_home_relative_glob_is_expanded(tmp_path, monkeypatch):
    """--data '~/books/*.txt' (quoted, or after '=', so no shell expands it) matched no files; a plain path
    expanded '~'."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "a.txt").write_text("alpha\n")
    assert _texts(resolve_corpus("~/books/*.txt")) == "alpha\n"


def test_a_glob_matching_a_directory_leaves_its_hidden_files_out(tmp_path):
    """--data DIR leaves hidden files and folders out (.git, .cache); a glob matching DIR read them all (a
    repository's .git/config, HEAD and hook scripts became training text)."""
    (tmp_path / "books" / ".git").mkdir(parents=True)
    (tmp_path / "books" / ".git" / "config").write_text("[core]\n")
    (tmp_path / "books" / ".notes.txt").write_text("private\n")
    (tmp_path / "books" / "a.txt").write_text("alpha\n")
    as_dir = resolve_corpus(str(tmp_path / "books"))
    as_glob = resolve_corpus(str(tmp_path / "book*"))
    assert [s.path for s in as_glob.sources] == [s.path for s in as_dir.sources] == [tmp_path / "books" / "a.txt"]


@pytest.mark.parametrize("unit", ["word ", "a  b ", "é", "日本語", "ab\t"])
def test_a_file_without_newlines_comes_in_pieces_no_bigger_than_two_blocks(tmp_path, monkeypatch, unit):
    """A file with no newline was held whole: each block was appended to all before it and searched again for a
    newline (quadratic in the file's size), and the file came as one piece.  It comes in pieces of at most two
    blocks now, cut before a space where the block has one, else between characters; together they are the file."""
    from difftx.data import corpus as corpus_mod

    monkeypatch.setattr(corpus_mod, "PIECE_BYTES", 64)
    text = unit * 3000
    path = tmp_path / "one_line.txt"
    path.write_text(text)
    pieces = list(resolve_corpus(str(path)).pieces())
    assert "".join(t for t, _ in pieces) == text
    assert [end for _, end in pieces] == [False] * (len(pieces) - 1) + [True]
    assert len(pieces) > len(text.encode()) // 128 and max(len(t.encode()) for t, _ in pieces) <= 2 * 64
    if " " in unit:  # cut before a space: the words on both sides are whole
        assert all(t.startswith(" ") for t, _ in pieces[1:])


def test_a_long_line_after_short_ones_comes_in_bounded_pieces(tmp_path, monkeypatch):
    from difftx.data import corpus as corpus_mod

    monkeypatch.setattr(corpus_mod, "PIECE_BYTES", 64)
    text = "short line\n" * 20 + "long line " * 2000 + "\nend\n"
    (tmp_path / "t.txt").write_text(text)
    pieces = [t for t, _ in resolve_corpus(str(tmp_path / "t.txt")).pieces()]
    assert "".join(pieces) == text and max(map(len, pieces)) <= 2 * 64


def test_bad_utf8_in_a_file_without_newlines_names_its_offset(tmp_path, monkeypatch):
    from difftx.data import corpus as corpus_mod

    monkeypatch.setattr(corpus_mod, "PIECE_BYTES", 64)
    path = tmp_path / "bad.txt"
    path.write_bytes(b"x" * 9000 + b"\x80\x80\x80\x80\x80" + b"y" * 300)
    with pytest.raises(DataError, match="bad byte at offset 9000"):
        list(resolve_corpus(str(path)).pieces())


def test_an_evaluation_corpus_of_big_files_joins_their_pieces_as_they_were(tmp_path, monkeypatch):
    """corpus_text joined every piece with a newline: a file longer than a piece got a blank line at each cut
    (pieces end at newlines) or a line broken in two (a line longer than a piece is cut before a space).  Files are
    joined by a newline, a file's pieces by nothing."""
    from difftx.data import corpus as corpus_mod
    from difftx.evals.common import corpus_text

    monkeypatch.setattr(corpus_mod, "PIECE_BYTES", 64)
    (tmp_path / "a.txt").write_text("one short line\n" * 30)
    (tmp_path / "b.txt").write_text("a single long line " * 40)
    assert corpus_text(tmp_path) == "one short line\n" * 30 + "\n" + "a single long line " * 40
    corpus = resolve_corpus(str(tmp_path))
    assert list(corpus.documents()) == [p.read_text() for p in sorted(tmp_path.glob("*.txt"))]
