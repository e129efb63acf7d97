"""Shared by the training tests and the torchrun worker: tiny configs and a gradient recorder."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

TINY_MODEL = dict(d_model=32, n_layers=2, n_heads=2)
TINY_TRAIN = dict(tokenizer="char", seq_len=16, batch_size=4, steps=4, warmup=1, lr=3e-3, dtype="fp32",
                  eval_every=2, eval_batches=2, diag_every=0, log_every=1, progress=False, seed=7)


def tiny(data, cache, model=None, **train):
    from difftx.train import resolve_configs

    return resolve_configs(train={**TINY_TRAIN, "data": str(data), "cache_dir": str(cache), **train},
                           model={**TINY_MODEL, **(model or {})})


def write_corpus(path: Path, n_chars: int = 6000) -> Path:
    """A deterministic small text (no dependence on /work/shared)."""
    import random

    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "quickly", "home", "to"]
    lines, size = [], 0
    while size < n_chars:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 9))).capitalize() + "."
        lines.append(line)
        size += len(line) + 1
    path.write_text("\n".join(lines) + "\n")
    return path


def write_documents(path: Path, n: int = 120) -> Path:
    """A deterministic JSONL corpus of ``n`` short documents (a bpe tokenizer ends each with its EOS)."""
    import random

    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "delta", "stone", "river", "light", "north", "quiet", "seven"]
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))}) + "\n")
    return path


class GradRecorder:
    """Records the full (gathered) gradient of every parameter at every step, on every rank."""

    def __init__(self):
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer):
        from difftx.io import clean_state_dict
        from difftx.train.distributed import full_tensor

        g = {n: full_tensor(p.grad).detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        self.grads.append(clean_state_dict(g))


def losses(run_dir: Path, key: str = "loss") -> list[float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def cli_env(**extra) -> dict:
    """Environment for a `python -m difftx` / torchrun subprocess that imports this checkout."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a child killed by a signal prints its threads' stacks
    env["CUDA_VISIBLE_DEVICES"] = ""  # on the CPU, as in-process tests are (tests/conftest.py: _cpu_only)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_torchrun_worker(script: Path, data, cache, tmp: Path, nproc: int = 2) -> Path:
    """Launch ``script DATA CACHE OUT`` under torchrun (gloo, ``nproc`` CPU processes); returns OUT.

    Python's faulthandler is on in the workers, so a worker killed by a signal prints every thread's stack.
    One such death (seen once in CI: rank 0 aborted by the C++ runtime, "terminate called without an active
    exception", not reproduced in 36 local launches) is retried once, into a fresh OUT, with a warning that
    carries the first launch's stderr; a second death, or any other failure, fails the test."""
    import re
    import subprocess
    import sys
    import warnings

    env = cli_env(OMP_NUM_THREADS=1)
    for attempt in (1, 2):
        out = tmp / f"workers_{attempt}"
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(script), str(data), str(cache), str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        if proc.returncode == 0:
            return out
        report = torchrun_failure(proc)
        if attempt == 1 and re.search(r"Signal \d+ \(SIG(ABRT|SEGV|BUS)\) received", proc.stderr):
            warnings.warn(f"torchrun worker died by a signal; launched again. First launch:\n{report}")
            continue
        raise AssertionError(report)
    raise AssertionError("unreachable")


def torchrun_failure(proc) -> str:
    """What a failed torchrun launch printed, less the launcher's own traceback: the workers' stderr (with any
    faulthandler stacks) and the tail of their stdout."""
    err = proc.stderr
    cut = err.find("Traceback (most recent call last):\n  File \"<frozen runpy>\"")
    workers = err[:cut] if cut > 0 else err
    summary = err[err.find("Root Cause"):] if "Root Cause" in err else ""
    return (f"exit {proc.returncode}\n--- workers' stderr (last 6000 chars) ---\n{workers[-6000:]}\n"
            f"--- launcher ---\n{summary[:1200]}\n--- stdout (last 1500 chars) ---\n{proc.stdout[-1500:]}")


def phase(name: str) -> None:
    """A torchrun worker's progress on stderr (its rank, from torchrun's $RANK, and ``name``), so that a worker's
    death names the phase it died in (also after its process group is gone)."""
    print(f"rank {os.environ.get('RANK', '?')}: {name}", file=sys.stderr, flush=True)


def finish() -> None:
    """A torchrun worker's end, after its process group is destroyed and every result written: "done", then
    os._exit(0), skipping the interpreter's teardown, where the C++ runtime killed a worker after "done" (SIGABRT,
    "terminate called without an active exception", or SIGSEGV in a freed thread state: twice in a row in one
    .ci/run on 2026-11-27, not in 3 runs of the test file alone right after).  The results are already on disk."""
    phase("done")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

