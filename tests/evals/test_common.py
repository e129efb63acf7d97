"""corpus_text: the one place evaluations get a corpus from."""


def test_corpus_text_of_a_directory_says_which_files_it_skipped(tmp_path, capsys):
    """A directory corpus's skipped binary files are named on stderr, as difftx train names them (the note moved
    out of the corpus reader, which eval's corpus_text also uses)."""
    from difftx.evals.common import corpus_text

    (tmp_path / "a.txt").write_text("some text to evaluate on\n" * 20)
    (tmp_path / "b.bin").write_bytes(b"\x00\x01\x02" * 100)
    assert "some text" in corpus_text(tmp_path)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "skipped 1 empty or binary file(s)" in err and "b.bin" in err, err
