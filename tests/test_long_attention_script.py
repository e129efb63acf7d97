"""benchmarks/performance/long_attention.py: it times the block rows fused_attention gives the float32 kernel
(or each of --rows), and refuses bf16 without AMX in one line."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from difftx.nn import fused, native

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "performance" / "long_attention.py"
needs_native = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
                                  reason="no C compiler: the native kernels cannot be built here")


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1", "--threads", "1", *args],
                          capture_output=True, text=True, timeout=300)


def _rows(out):
    """(N, block rows, forward ms, backward ms) of each table row."""
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
             if line.startswith("| ") and line[2].isdigit()]
    return [(int(c[0]), int(c[1]), float(c[2]), float(c[4])) for c in cells]


@needs_native
def test_times_the_rows_fused_attention_picks_and_each_of_rows():
    r = _run("--lengths", "96,2048", "--heads", "1", "--dim", "32")
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stdout)
    want = [fused.native_rows(fused.chunk_size(1, 2, 1, n, n, 4), n, n, 2, threads=1) for n in (96, 2048)]
    assert [(n, c) for n, c, _, _ in rows] == [(96, want[0]), (2048, want[1])] and want[1] > want[0]
    assert all(f > 0 and b > 0 for _, _, f, b in rows)
    r = _run("--lengths", "96", "--heads", "1", "--dim", "32", "--maps", "1", "--rows", "48,96")
    assert r.returncode == 0, r.stderr
    assert [(n, c) for n, c, _, _ in _rows(r.stdout)] == [(96, 48), (96, 96)]


def test_bf16_needs_amx_or_avx512_bf16():
    if native.bf16_attention():
        pytest.skip("this CPU has AMX or AVX512-BF16: the bf16 kernel runs")
    r = _run("--dtype", "bf16", "--lengths", "64")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == "the bf16 attention kernel needs a CPU with AMX or AVX512-BF16"
