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


def test_torch_versions_script_runs_the_tests_in_each_environment(tmp_path):
    """benchmarks/torch_versions.sh (the check of the declared torch range, docs in benchmarks/results/
    dependency_versions.md): an existing environment is used as it is, its versions and pytest's verdict printed
    one line a version; no version named is a usage error."""
    import os
    import subprocess
    import sys

    venv = tmp_path / "venv-9.9.9" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "python").chmod(0o755)
    script = str(BENCH / "torch_versions.sh")
    env = dict(os.environ, TESTS="tests/test_config.py -k preset")
    r = subprocess.run(["bash", script, str(tmp_path), "9.9.9"], capture_output=True, text=True, env=env,
                       timeout=300)
    line = r.stdout.strip()
    import platform

    want = f"9.9.9: python {platform.python_version()} torch {torch.__version__} transformers "
    assert r.returncode == 0 and line.startswith(want), (line, r.stderr)
    assert " rc=0 " in line and " passed" in line, line
    assert (tmp_path / "9.9.9.log").is_file()
    bad = subprocess.run(["bash", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "name at least one torch version" in bad.stderr


def test_document_masking_benchmark_runs_and_writes_its_table(tmp_path, one_thread, monkeypatch):
    """benchmarks/document_masking.py at a toy size: its table with the three arms and the memory columns; the
    document lengths it draws are runs of the ids 0, 1, 2, ... filling each row."""
    import sys

    mod = _load("document_masking.py")
    doc = mod.packed_documents(3, 40, 8, seed=1)
    assert doc.shape == (3, 40) and torch.equal(doc[:, 0], torch.zeros(3, dtype=torch.long))
    assert bool(((doc[:, 1:] - doc[:, :-1]) >= 0).all() and ((doc[:, 1:] - doc[:, :-1]) <= 1).all())
    assert torch.equal(doc, mod.packed_documents(3, 40, 8, seed=1))
    monkeypatch.setattr(sys, "argv", ["document_masking.py", "--preset", "nano", "--attentions", "diff", "--shape",
                                      "2x32", "--dtypes", "fp32", "--doc-lengths", "8", "--repeats", "1", "--threads",
                                      "1", "--memory", "--out", str(tmp_path)])
    mod.main()
    table = (tmp_path / "document_masking.md").read_text().splitlines()
    assert table[-1].startswith("| diff | fp32 | 8 |") and table[-1].count("|") == 13  # 12 columns


def test_sliding_window_benchmark_runs_and_writes_its_table(tmp_path, one_thread, monkeypatch):
    """benchmarks/sliding_window.py at a toy size: its table with the three arms, and the masked-blocks arm keeps
    the window off the native attention kernels (which it switches back on after each step)."""
    import sys

    from difftx.nn import native

    mod = _load("sliding_window.py")
    real = native.attention_ok
    monkeypatch.setattr(sys, "argv", ["sliding_window.py", "--preset", "nano", "--attentions", "diff", "--shape",
                                      "2x64", "--windows", "16", "--dtypes", "fp32", "--repeats", "1", "--threads",
                                      "1", "--out", str(tmp_path)])
    mod.main()
    assert native.attention_ok is real
    table = (tmp_path / "sliding_window.md").read_text().splitlines()
    assert table[-1].startswith("| diff | fp32 | 16 |") and table[-1].count("|") == 9  # 8 columns
    monkeypatch.setattr(sys, "argv", ["sliding_window.py", "--attention-only", "--shape", "1x64", "--windows", "16",
                                      "--dtypes", "fp32", "--repeats", "1", "--threads", "1", "--out", str(tmp_path)])
    mod.main()
    assert native.attention_ok is real
    table = (tmp_path / "sliding_window_attention.md").read_text().splitlines()
    assert table[-1].startswith("| fp32 | 16 |") and table[-1].count("|") == 8  # 7 columns
    monkeypatch.setattr(sys, "argv", ["sliding_window.py", "--inference", "--shape", "1x64", "--windows", "16",
                                      "--queries", "1,5", "--dtypes", "fp32", "--repeats", "1", "--threads", "1",
                                      "--out", str(tmp_path)])
    mod.main()
    table = (tmp_path / "sliding_window_inference.md").read_text().splitlines()
    assert table[-1].startswith("| fp32 | 16 | 5 |") and table[-1].count("|") == 7  # 6 columns


def test_interleaved_medians_alternate_the_order_and_a_switched_arm_puts_the_attribute_back():
    import types

    import pytest

    from difftx.benchmarking.steps import interleaved_medians, switched

    calls = []
    arms = {name: (lambda name=name, t=t: calls.append(name) or t) for name, t in (("a", 1.0), ("b", 2.0), ("c", 3.0))}
    assert interleaved_medians(arms, 3) == {"a": 1.0, "b": 2.0, "c": 3.0}
    assert "".join(calls) == "abc" + "abc" + "cba" + "abc"  # the warm-up, then alternating rounds
    obj = types.SimpleNamespace(flag=1)
    seen = []
    assert switched(lambda: seen.append(obj.flag) or 0.5, obj, "flag", 2)() == 0.5
    assert seen == [2] and obj.flag == 1

    def boom():
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        switched(boom, obj, "flag", 3)()
    assert obj.flag == 1
