"""Where a CPU training step's time goes: torch.profiler's operators by self CPU time, one table per arm.

    python benchmarks/performance/cpu_step_profile.py [--arms transformer,diff] [--dtype bf16] [--threads 2]

The bench's training step (``difftx bench``: small preset, 4 x 512 tokens unless ``--batch-size``, AdamW, bf16 autocast), a warm-up
step, then ``--steps`` profiled ones; prints the top ``--top`` operators with their share of the step, and the
share of the step in matrix products (aten::mm, addmm, addmm_, bmm, baddbmm; the native attention kernel's own products count as the rest) against the rest.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from difftx.benchmarking.speed import BenchConfig, _train_step, build_arms
from difftx.runtime import keep_freed_memory

GEMM = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", default="transformer,diff")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--batch-size", type=int, default=4, help="sequences of 512 tokens per step (default: 4)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    bc = BenchConfig(arms=args.arms.split(","), peers=False, batch_size=args.batch_size)
    device = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    for arm in build_arms(bc, device):
        x = torch.randint(0, arm.cfg.vocab_size, (bc.batch_size, bc.seq_len), generator=g)
        y = torch.randint(0, arm.cfg.vocab_size, (bc.batch_size, bc.seq_len), generator=g)
        _train_step(arm, x, y, args.dtype, device)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                _train_step(arm, x, y, args.dtype, device)
        rows = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        total = sum(e.self_cpu_time_total for e in rows)
        gemm = sum(e.self_cpu_time_total for e in rows if e.key in GEMM)
        print(f"\n## {arm.name}, {args.dtype}, {args.threads} threads, {bc.batch_size} x {bc.seq_len} tokens: {total / 1e3 / args.steps:.0f} ms a step "
              f"(self CPU time), matrix products {100 * gemm / total:.1f}%\n")
        print("| operator | calls a step | ms a step | share |\n|---|---:|---:|---:|")
        for e in sorted(rows, key=lambda e: -e.self_cpu_time_total)[: args.top]:
            print(f"| {e.key} | {e.count // args.steps} | {e.self_cpu_time_total / 1e3 / args.steps:.1f} | "
                  f"{100 * e.self_cpu_time_total / total:.1f}% |")


if __name__ == "__main__":
    main()
