"""The package's namespace: a plain ``import difftx`` reaches its subpackages as attributes, imported on first use."""

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest


def test_subpackages_are_attributes_after_a_plain_import():
    code = (
        "import sys, difftx\n"
        "assert 'difftx.evals' not in sys.modules and 'transformers' not in sys.modules\n"
        "assert callable(difftx.data.load_tokenizer) and difftx.evals.__name__ == 'difftx.evals'\n"
        "assert difftx.optim.__name__ == 'difftx.optim' and difftx.train.__name__ == 'difftx.train'\n"
        "try:\n"
        "    difftx.no_such_thing\n"
        "except AttributeError as e:\n"
        "    assert 'no_such_thing' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def _tracked_files(root):
    try:
        p = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        p = None
    if p is None or p.returncode != 0 or not p.stdout:
        pytest.skip("needs a git checkout (the tracked files are what a release is built from)")
    return [f for f in p.stdout.decode().split("\0") if f]


def test_sdist_and_wheel_carry_what_tests_and_runs_need(tmp_path):
    """The sdist, built as ``python -m build`` does (sdist, then the wheel from the unpacked sdist), from a copy of
    the tracked files plus build leftovers: it holds every tracked test (conftest.py and the subfolders, not only
    tests/test*.py), the docs tests/test_docs.py runs and the benchmark scripts tests run, not the benchmarks'
    results, caches or compiled libraries; the wheel holds every non-Python file of the package (the native
    kernels' C source, compiled at run time)."""
    pytest.importorskip("setuptools", minversion="77")
    root = Path(__file__).resolve().parents[1]
    tracked = _tracked_files(root)
    tree = tmp_path / "tree"
    for rel in tracked:
        if (root / rel).is_file():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, tree / rel)
    junk = ["tests/__pycache__/conftest.cpython-311.pyc", "src/difftx/nn/cpu_kernels-0.so",
            "tests/.pytest_cache/v/cache/lastfailed", "src/difftx/nn/__pycache__/native.cpython-311.pyc"]
    for rel in junk:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(b"junk")

    def build(kind, src, out):
        # a setuptools deprecation in the build is a build that a later setuptools refuses: an error here
        code = ("import warnings; from setuptools.warnings import SetuptoolsDeprecationWarning as W; "
                "warnings.simplefilter('error', W); "
                f"from setuptools import build_meta as b; print(b.build_{kind}({str(out)!r}))")
        p = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return out / p.stdout.strip().splitlines()[-1]

    sdist = build("sdist", tree, tmp_path / "dist")
    with tarfile.open(sdist) as tar:
        top = sdist.name[: -len(".tar.gz")]
        names = {m.name[len(top) + 1:] for m in tar.getmembers() if m.isfile()}
        tar.extractall(tmp_path / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    wanted = [f for f in tracked
              if f.startswith(("src/", "tests/", "docs/")) or f in ("README.md", "pyproject.toml", "MANIFEST.in")
              or (f.startswith("benchmarks/") and "/results/" not in f and f.endswith((".py", ".sh")))]
    lacking = [f for f in wanted if f not in names]
    assert not lacking, f"the sdist lacks {len(lacking)} tracked files: {lacking[:8]}"
    leftovers = [n for n in names if "/results/" in n or n in junk]
    assert not leftovers, f"results or build leftovers in the sdist: {leftovers[:8]}"

    wheel = build("wheel", tmp_path / "unpacked" / top, tmp_path / "wheel")
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = set(zf.namelist())
    data = [f[len("src/"):] for f in tracked if f.startswith("src/difftx/") and not f.endswith(".py")]
    assert "difftx/nn/cpu_kernels.c" in data
    lacking = [f for f in data if f not in in_wheel]
    assert not lacking, f"package files the wheel lacks: {lacking}"
    assert not [n for n in in_wheel if n.endswith((".so", ".pyc"))]
