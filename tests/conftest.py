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


@pytest.fixture(autouse=True)
def _cpu_only(request, monkeypatch):
    """The suite runs on the CPU, as CI does, on a GPU machine too: there device "auto" picked the GPU and changed
    what tests measure (a study's workers and threads, eval's native-kernel line, a compare pool's jobs: four
    failures in a run on an H200).  tests/test_cuda.py and tests/nn/test_triton_diff.py (the Triton kernels) are the
    GPU's; subprocesses get CUDA_VISIBLE_DEVICES="" from cli_env."""
    if request.path.name not in ("test_cuda.py", "test_triton_diff.py") and torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def sigint_default():
    """SIGINT as Python's default handler (KeyboardInterrupt) for a test that raises it: a suite started in the
    background by a non-interactive shell (``pytest &``, nohup) inherits SIGINT ignored, and a raised SIGINT then
    did nothing."""
    import signal

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def load_owned(path) -> dict:
    """safetensors' ``load_file`` as tensors that own their memory: before safetensors 0.8 they were views of the
    file's memory map, so a test that rewrote a file it had loaded and then read the loaded tensors again died
    of SIGBUS (safetensors 0.4.3-0.7.0)."""
    from safetensors.torch import load_file

    return {k: v.clone() for k, v in load_file(str(path)).items()}


# Features of newer torch than the oldest the project declares: their tests skip, with the reason, on an older one
needs_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="Muon needs torch >= 2.9 (torch.optim.Muon)")


def patch_mkdir(monkeypatch, mkdir) -> None:
    """``mkdir`` in place of os.mkdir for os.makedirs and pathlib's ``Path.mkdir`` too: Python 3.10's pathlib holds
    its own reference to os.mkdir (in ``_NormalAccessor``), which patching ``os.mkdir`` alone leaves in place."""
    import pathlib

    monkeypatch.setattr(os, "mkdir", mkdir)
    accessor = getattr(pathlib, "_NormalAccessor", None)
    if accessor is not None and "mkdir" in vars(accessor):
        monkeypatch.setattr(accessor, "mkdir", staticmethod(mkdir))


def cli_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("DIFFTX_FLEX_COMPILE", "0")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a child killed by a signal prints its threads' stacks
    env["CUDA_VISIBLE_DEVICES"] = ""  # on the CPU, as in-process tests are (_cpu_only)
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
