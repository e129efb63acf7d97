import pytest

from ._helpers import write_corpus


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus.txt")


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


@pytest.fixture
def train_cli(corpus, cache):
    """In-process ``difftx train`` with the tiny model; returns (exit code, stdout, stderr)."""
    from difftx.cli import main

    def run(*args, capsys=None, tiny=True):
        base = ["train", "--data", str(corpus), "--cache-dir", str(cache)]
        if tiny:
            base += ["--tokenizer", "char", "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "16",
                     "--batch-size", "4", "--warmup", "1", "--dtype", "fp32", "--eval-batches", "2", "--no-progress",
                     "--seed", "7"]
        return main(base + [str(a) for a in args])

    return run


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models: one thread (tests/conftest.py)."""
    yield
