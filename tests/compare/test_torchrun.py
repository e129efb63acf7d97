"""``difftx compare`` under torchrun (2 CPU processes, gloo): jobs train on both ranks, rank 0 writes the study."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import cli_env

from .conftest import MINI


@pytest.mark.slow
def test_study_under_torchrun(corpus, tmp_path):
    out = tmp_path / "out"
    args = MINI + ["--seeds", "1", "--arms", "transformer:adamw,diff:adamw"]  # the later flags win
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "difftx",
           "compare", "--out", str(out), *args, "--data", str(corpus), "--cache-dir", str(tmp_path / "cache"),
           "--device", "cpu"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(OMP_NUM_THREADS=1), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert set(res["arms"]) == {"transformer-adamw", "diff-adamw"}
    assert res["scale"]["corpus"]["tokens_per_run"] == 12 * 16 * 64 * 2  # the global batch: 2 processes
    cfg = json.loads((out / "runs" / "corpus" / "diff-adamw" / "seed0-lr0.004" / "config.json").read_text())
    assert cfg["world_size"] == 2
    assert (out / "report.md").is_file()
