"""benchmarks/performance/bf16_loss_curves.py --merge: which runs it pairs, and the paired-by-seed line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "performance" / "bf16_loss_curves.py"
ARGS = {"preset": "small", "attention": "diff", "steps": 500, "batch_size": 4, "seq_len": 512}


def _doc(path, runs, native="on"):
    path.write_text(json.dumps({"args": dict(ARGS, native=native), "runs": [
        {"seed": s, "dtype": d, "final_loss": loss, "tokens_per_s": tps} for s, d, loss, tps in runs]}))
    return path


def _merge(*specs):
    r = subprocess.run([sys.executable, str(SCRIPT), "--merge", *map(str, specs)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_merge_pairs_one_files_fp32_with_anothers_bf16(tmp_path):
    a = _doc(tmp_path / "a.json", [(0, "fp32", 2.0, 100), (0, "bf16", 2.5, 300),
                                   (1, "fp32", 2.2, 100), (1, "bf16", 2.6, 300)])
    b = _doc(tmp_path / "b.json", [(0, "bf16", 2.1, 200), (1, "bf16", 2.1, 200)], native="off")
    out = _merge(f"{a}:fp32", f"{b}:bf16")
    assert "| 0 | 2.0000 | 2.1000 | +0.1000 | 2.00x |" in out  # a's fp32, b's bf16 (not a's bf16 at 2.5)
    assert "| 1 | 2.2000 | 2.1000 | -0.1000 | 2.00x |" in out
    assert "bf16 pure torch, fp32 native kernels" in out
    assert "bf16 higher in 1 of 2 seeds" in out
    whole = _merge(a)  # without a filter every run of the file counts
    assert "| 0 | 2.0000 | 2.5000 | +0.5000 | 3.00x |" in whole and "bf16 higher in 2 of 2 seeds" in whole
    assert "(1 file merged; bf16 native kernels, fp32 native kernels)" in whole
