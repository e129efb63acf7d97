"""Which bfloat16 products run faster split in two halves than whole, on this CPU's thread count.

torch's bfloat16 GEMM on the CPU (oneDNN) keeps some products on one thread, or splits them badly; difftx's
``Linear`` runs the ones listed in ``difftx.nn.linear`` as two halves (``_FORWARD_COLUMN_HALVES``,
``_WGRAD_COLUMN_HALVES`` and ``_mm``'s row-halves rule).  This script measures each listed shape and its
neighbours, whole against halves, interleaved (whole, halves, whole, ...), and prints a markdown table of
medians, so the tables can be checked or extended on another machine or torch version.

    python benchmarks/performance/gemm_split.py --threads 2 --rounds 7
    python benchmarks/performance/gemm_split.py --threads 2 --rounds 7 --step   # the whole training step

``--step`` times ``difftx bench``'s bfloat16 training step (small preset, 4 x 512 tokens, transformer and diff)
with the split products on and off (``_forward``/``_mm`` replaced by the plain product), interleaved.

Layouts, as in a training step of ``Linear``:
* ``forward``: x (m, k) @ W^T with W (n, k) row-major (F.linear); halves are halves of W's rows.
* ``wgrad``: a (m, k) with rows padded to k + 32 (the transposing kernel's output) @ b (k, n) row-major;
  halves are b's column halves (``cols``) or a's row halves (``rows``).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from difftx.nn import linear as L
from difftx.runtime import keep_freed_memory

FORWARD = [(2048, 512, 1408), (1024, 512, 1408), (4096, 512, 1408), (2048, 512, 1536), (2048, 512, 512),
           (2048, 1408, 512), (2048, 512, 2816)]
WGRAD = [(512, 2048, 1408), (512, 1024, 1408), (512, 4096, 1408), (512, 2048, 1536), (512, 2048, 512),
         (384, 2048, 512), (512, 2048, 384), (384, 2048, 384), (512, 2048, 256)]


def _time(f, min_s: float = 0.03) -> float:
    for _ in range(3):
        f()
    t = time.perf_counter()
    f()
    n = max(3, int(min_s / max(time.perf_counter() - t, 1e-6)))
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n


def _forward_arms(m, k, n):
    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    out, h = torch.empty(m, n, dtype=torch.bfloat16), n // 2

    def halves():
        torch.mm(x, w[:h].t(), out=out[:, :h])
        torch.mm(x, w[h:].t(), out=out[:, h:])
    return {"whole": lambda: F.linear(x, w), "cols": halves}


def _wgrad_arms(m, k, n):
    a, b = torch.randn(m, k + 32).bfloat16()[:, :k], torch.randn(k, n).bfloat16()
    out = torch.empty(m, n, dtype=torch.bfloat16)

    def cols():
        torch.mm(a, b[:, :n // 2], out=out[:, :n // 2])
        torch.mm(a, b[:, n // 2:], out=out[:, n // 2:])

    def rows():
        torch.mm(a[:m // 2], b, out=out[:m // 2])
        torch.mm(a[m // 2:], b, out=out[m // 2:])
    return {"whole": lambda: a @ b, "cols": cols, "rows": rows}


def _listed(kind, m, k, n) -> str:
    if kind == "forward":
        return "cols" if (m, k, n) in L._FORWARD_COLUMN_HALVES else "whole"
    if (m, k, n) in L._WGRAD_COLUMN_HALVES:
        return "cols"
    return "whole" if (m > 512 or n > 512 or m * n < 384 * 512 or m % 32) else "rows"


def _step_ab(rounds: int) -> None:
    from difftx.benchmarking.speed import BenchConfig, _train_step, build_arms

    plain = {"_forward": lambda x, w, b: F.linear(x, w, b), "_mm": lambda a, b: a @ b}
    split = {name: getattr(L, name) for name in plain}
    bc = BenchConfig(arms=["transformer", "diff"], peers=False)
    g = torch.Generator().manual_seed(0)
    print("| arm | step ms, splits on | step ms, off | off / on |\n|---|---:|---:|---:|")
    for arm in build_arms(bc, torch.device("cpu")):
        x, y = (torch.randint(0, arm.cfg.vocab_size, (bc.batch_size, bc.seq_len), generator=g) for _ in range(2))
        times = {"on": [], "off": []}
        for r in range(rounds + 1):
            for name, fns in (("on", split), ("off", plain)):
                for attr, fn in fns.items():
                    setattr(L, attr, fn)
                t = time.perf_counter()
                _train_step(arm, x, y, "bf16", torch.device("cpu"))
                if r:  # round 0 warms up both
                    times[name].append(time.perf_counter() - t)
        for attr, fn in split.items():
            setattr(L, attr, fn)
        on, off = (sorted(v)[len(v) // 2] * 1e3 for v in (times["on"], times["off"]))
        print(f"| {arm.name} | {on:.0f} | {off:.0f} | {off / on:.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--step", action="store_true", help="time the bf16 training step, splits on against off")
    args = ap.parse_args()
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, medians of {args.rounds} interleaved rounds (ms)\n")
    if args.step:
        return _step_ab(args.rounds)
    print("| layout | m x k x n | whole | cols | rows | fastest | difftx runs |")
    print("|---|---|---:|---:|---:|---|---|")
    for kind, shapes, arms_of in (("forward", FORWARD, _forward_arms), ("wgrad", WGRAD, _wgrad_arms)):
        for m, k, n in shapes:
            arms = arms_of(m, k, n)
            times = {name: [] for name in arms}
            for _ in range(args.rounds):
                for name, f in arms.items():
                    times[name].append(_time(f))
            med = {name: sorted(v)[len(v) // 2] * 1e3 for name, v in times.items()}
            cell = {name: f"{med[name]:.3f}" if name in med else "" for name in ("whole", "cols", "rows")}
            print(f"| {kind} | {m} x {k} x {n} | {cell['whole']} | {cell['cols']} | {cell['rows']} | "
                  f"{min(med, key=med.get)} | {_listed(kind, m, k, n)} |", flush=True)


if __name__ == "__main__":
    main()
