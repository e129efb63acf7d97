"""A miniature study shared by the compare tests (run once per session through the CLI)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import run_cli

# a miniature of the default study: 3 arms (softmax, DIFF, DNT under mSGDW), 2 seeds, both tasks, tiny budgets
MINI = ["--arms", "transformer:adamw,diff:adamw,dnt:msgdw", "--seeds", "2", "--set", "n_layers=1",
        "--set", "d_model=64", "--steps", "12", "--retrieval-steps", "12", "--eval-points", "2", "--eval-batches", "2",
        "--outlier-tokens", "512", "--tail-batches", "2", "--retrieval-samples", "8", "--no-progress"]


def make_corpus(path: Path, n_bytes: int = 200_000) -> Path:
    """A small local corpus: the first bytes of this Python's standard library source (deterministic)."""
    text, size = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        t = f.read_text(encoding="utf-8", errors="replace")
        text.append(t)
        size += len(t)
        if size >= n_bytes:
            break
    path.write_text("".join(text)[:n_bytes], encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="session")
def mini_args(corpus, tmp_path_factory) -> list[str]:
    return [*MINI, "--data", str(corpus), "--cache-dir", str(tmp_path_factory.mktemp("cache"))]


@pytest.fixture(scope="session")
def mini_study(mini_args, tmp_path_factory):
    """(out dir, results dict, completed process) of the miniature study."""
    out = tmp_path_factory.mktemp("study") / "out"
    p = run_cli("compare", "--out", out, *mini_args, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), p
