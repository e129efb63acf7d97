"""tests/nn/test_triton_diff.py under Triton's interpreter on the CPU, in a child process: ``TRITON_INTERPRET=1``
must be set before triton is first imported, which in this process may already have happened (transformers and
torch's compiler import it where it is installed).  Skipped without Triton (torch's CPU wheels ship without it;
.ci/run installs it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU test_triton_diff.py runs the compiled kernels itself")
def test_triton_kernels_under_the_interpreter():
    target = Path(__file__).with_name("test_triton_diff.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                        "-W", "ignore::RuntimeWarning", "-rfEs", str(target)],
                       env=env, capture_output=True, text=True, timeout=900, cwd=Path(__file__).parents[2])
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], tail
