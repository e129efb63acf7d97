"""Test setup: import difftx from this checkout's src/ and give tests a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
os.environ.setdefault("DIFFTX_FLEX_COMPILE", "0")  # unfused flex in quick tests; compiled flex is a slow test


def cli_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("DIFFTX_FLEX_COMPILE", "0")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a child killed by a signal prints its threads' stacks
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_cli(*args, cwd=None, timeout=300, env=None) -> subprocess.CompletedProcess:
    """Run ``python -m difftx ARGS`` from this checkout; returns the CompletedProcess (text)."""
    return subprocess.run([sys.executable, "-m", "difftx", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env or cli_env())


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: tiny models run fastest so (and a shared CPU punishes OpenMP
    spinning).  Directories of tiny-model tests make it autouse in their conftest."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _keep_threads():
    """Torch's thread count as it was before the test: in-process CLI runs (``bench``, ``compare --workers 1``,
    ``train --threads``) set it and leave it, and later tests then ran on another count (slower, or other bits)."""
    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@pytest.fixture
def full_disk(monkeypatch):
    """``full_disk()`` makes os.fsync fail as a full disk (ENOSPC) from its second call on, in this write (the second
    file of a two-file write); it returns a function that restores os.fsync."""
    import os

    fsync = os.fsync

    def arm():
        calls = []

        def failing_fsync(fd):
            calls.append(fd)
            if len(calls) >= 2:
                raise OSError(28, "No space left on device")
            return fsync(fd)

        monkeypatch.setattr(os, "fsync", failing_fsync)
        return lambda: monkeypatch.setattr(os, "fsync", fsync)

    return arm
