"""Shared fixtures for the evaluation tests: tiny models, a checkpoint, a haystack text."""

from __future__ import annotations

import pytest

import difftx
from difftx.data import ByteTokenizer

from evals_helpers import haystack_text, tiny_model


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models: one thread (tests/conftest.py)."""
    yield


@pytest.fixture
def tok():
    return ByteTokenizer()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """A saved tiny DIFF model + byte tokenizer (the run-directory layout load_model/load_tokenizer accept)."""
    d = tmp_path_factory.mktemp("ckpt")
    difftx.save_model(tiny_model("diff"), d)
    ByteTokenizer().save(d)
    (d / "haystack.txt").write_text(haystack_text(), encoding="utf-8")
    return d
