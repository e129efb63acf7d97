"""Muon's optimizer step on a CPU: torch.optim.Muon (Newton-Schulz in bf16) against difftx's Muon (fp32 on a
CPU without bf16 matmul hardware), with AdamW for scale.

    python benchmarks/muon_cpu.py [--preset small] [--repeats 3] [--out benchmarks/results]

Random gradients on every parameter of the preset's DIFF model; the Muon arms update its 2-D hidden
matrices (as ``build_optimizer(model, "muon")`` splits them), AdamW every parameter.  One thread.
Prints a markdown table (median seconds per step) and writes ``muon_cpu.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from difftx.config import ModelConfig
from difftx.models import build_model
from difftx.optim import Muon, build_optimizer
from difftx.runtime import native_bf16_matmul


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_model(ModelConfig.from_preset(args.preset, attention="diff"))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    split = build_optimizer(model, "muon", lr=1e-3, weight_decay=0.1)
    matrices = [p for g in split.optimizers[0].param_groups for p in g["params"]]
    kw = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    arms = {
        "torch.optim.Muon (bf16 Newton-Schulz)": torch.optim.Muon(matrices, **kw),
        "difftx Muon, fp32 Newton-Schulz": Muon(matrices, ns_dtype=torch.float32, **kw),
        "AdamW (all parameters)": build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.1),
    }
    times = {name: [] for name in arms}
    for _ in range(args.repeats):  # interleaved
        for name, opt in arms.items():
            t = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t)
    fast = statistics.median(times["difftx Muon, fp32 Newton-Schulz"])
    lines = [f"# Muon's step on this CPU ({args.preset} preset, DIFF, {len(matrices)} matrices, "
             f"{sum(p.numel() for p in matrices):,} parameters; native bf16 matmul: "
             f"{native_bf16_matmul('cpu')})", "",
             f"Command: `python benchmarks/muon_cpu.py --preset {args.preset} --repeats {args.repeats}` "
             f"(torch {torch.__version__}, 1 thread, {time.strftime('%Y-%m-%d', time.gmtime())}).", "",
             "| optimizer | s per step (median) | runs | / difftx Muon |", "|---|---:|---|---:|"]
    for name, ts in times.items():
        med = statistics.median(ts)
        lines.append(f"| {name} | {med:.3f} | {', '.join(f'{t:.2f}' for t in ts)} | {med / fast:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "muon_cpu.md").write_text(text)


if __name__ == "__main__":
    main()
