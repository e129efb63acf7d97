"""The benchmark scripts under benchmarks/ still run against the library they measure: a private function they
call keeps the signature they call it with (the scripts run rarely, some only on a GPU machine, so nothing
else notices)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def _load(rel: str):
    spec = importlib.util.spec_from_file_location(Path(rel).stem, BENCH / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cuda_ops_op_table_runs_on_the_cpu(one_thread, monkeypatch):
    """cuda_ops.py's old-against-new op table (``--device cpu`` is its dry run) calls ``fused._RMSNorm``
    directly: the Function gained a ``use_native`` argument and the script died with a TypeError."""
    mod = _load("performance/cuda_ops.py")
    monkeypatch.setattr(mod, "DEV", torch.device("cpu"))
    monkeypatch.setattr(mod, "_time", lambda fn, repeats=20: (fn(), 1e-3)[1])
    rows = mod.ops(1, 8, 2, 8)
    assert [r["op"] for r in rows] == ["head RMSNorm fwd+bwd", "combine fwd+bwd"]
