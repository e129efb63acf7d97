"""The training-memory floor (``difftx.accounting.training_memory_floor``) against measured peaks.

``difftx train`` and ``difftx compare`` refuse a run whose floor exceeds the free memory.  That is
only right if the floor never exceeds what a run really needs: this script measures, for models of
several sizes, attentions, norm placements, optimizers, precisions and shapes, the peak memory of a
training step as the trainer runs it (fp32 weights and optimizer state, plus the high-water mark of
the tensors one step allocates: ``difftx.benchmarking.memory.measured_training_memory``), and
prints it beside the floor.  Every ratio measured / floor must be >= 1 (the floor holds), and at
most ``difftx.train.memory_check.TYPICAL`` (the premise of its "may run out of memory" warning).

    python benchmarks/memory_floor.py [--quick] [--out benchmarks/results]

Writes ``memory_floor.json`` and ``memory_floor.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from difftx.accounting import training_memory_floor
from difftx.benchmarking.memory import measured_training_memory
from difftx.config import ModelConfig

# (preset, model overrides, batch, seq, optimizer, bf16)
CASES = [
    ("nano", {}, 12, 64, "adamw", False),
    ("nano", {"attention": "diff"}, 12, 64, "adamw", False),
    ("nano", {"attention": "diff2"}, 2, 1024, "adamw", False),
    ("nano", {"norms": "dnt"}, 2, 1024, "msgdw", False),
    ("tiny", {"attention": "diff"}, 2, 256, "adamw", False),
    ("tiny", {"attention": "diff"}, 2, 256, "adamw", True),
    ("tiny", {}, 2, 256, "adamw", True),
    ("tiny", {"attention": "diff"}, 1, 4096, "adamw", False),
    ("tiny", {"attention": "diff", "norms": "dnt"}, 1, 4096, "msgdw", False),
    ("tiny", {"attention": "diff", "ffn_dim": 64}, 2, 512, "sgd", False),
    ("tiny", {"attention": "diff", "attn_backend": "eager"}, 2, 1024, "adamw", False),
    ("small", {}, 4, 512, "adamw", False),
    ("small", {"attention": "diff"}, 4, 512, "adamw", False),
    ("small", {"attention": "diff", "norms": "dnt"}, 4, 512, "msgdw", False),
    ("small", {"attention": "diff"}, 1, 512, "muon", False),
    ("nanogpt", {"attention": "diff"}, 12, 64, "adamw", False),
    ("gpt2-124m", {}, 1, 256, "adamw", False),
    ("vit-tiny", {}, 64, None, "adamw", False),
    ("vdnt-tiny", {"attention": "diff"}, 64, None, "msgdw", False),
]
QUICK = [0, 1, 3, 5, 9, 10, 17]


def measure(preset: str, overrides: dict, batch: int, seq, optimizer: str, bf16: bool) -> dict:
    """The measured peak of a training step and the floor, for one case."""
    if seq is not None:
        overrides = {"max_seq_len": max(seq, ModelConfig.from_preset(preset).max_seq_len), **overrides}
    cfg = ModelConfig.from_preset(preset, **overrides)
    got = measured_training_memory(cfg, batch, seq or 0, optimizer, bf16)
    floor = training_memory_floor(cfg, batch, seq or 0, optimizer=optimizer, momentum=0.9, bf16=bf16)
    return {"preset": preset, "overrides": overrides, "batch": batch, "seq_len": seq, "optimizer": optimizer,
            "dtype": "bf16" if bf16 else "fp32", "parameters": floor["parameters"],
            "measured_state": got["state"], "measured_step": got["step"], "measured_total": got["total"],
            "floor_state": floor["state"], "floor_step": floor["step"], "floor_total": floor["total"],
            "ratio": got["total"] / floor["total"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"only cases {QUICK}")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cases = [CASES[i] for i in QUICK] if args.quick else CASES
    rows = []
    mib = 2 ** 20
    lines = ["| preset | changes | batch x seq | optimizer | dtype | params | measured MiB (state + step) | "
             "floor MiB (state + step) | measured / floor |", "|---|---|---|---|---|---:|---:|---:|---:|"]
    for case in cases:
        r = measure(*case)
        rows.append(r)
        changes = ", ".join(f"{k}={v}" for k, v in r["overrides"].items() if k != "max_seq_len") or "-"
        lines.append(f"| {r['preset']} | {changes} | {r['batch']} x {r['seq_len'] or 'image'} | {r['optimizer']} | "
                     f"{r['dtype']} | {r['parameters']:,} | {r['measured_total'] / mib:.1f} "
                     f"({r['measured_state'] / mib:.1f} + {r['measured_step'] / mib:.1f}) | "
                     f"{r['floor_total'] / mib:.1f} ({r['floor_state'] / mib:.1f} + {r['floor_step'] / mib:.1f}) | "
                     f"{r['ratio']:.2f} |")
        print(lines[-1], flush=True)
    worst = min(r["ratio"] for r in rows)
    held = "the floor held in every case" if worst >= 1 else "FLOOR EXCEEDED"
    summary = f"Smallest measured / floor: {worst:.2f} ({held}); largest: {max(r['ratio'] for r in rows):.2f}."
    print(summary)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python benchmarks/memory_floor.py" + (" --quick" if args.quick else ""),
            "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    (out / "memory_floor.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    head = ["# Training-memory floor against measured peaks", "",
            f"Command: `{meta['command']}` ({meta['date']}, torch {meta['torch']}, 1 thread).", "",
            "Measured: fp32 weights and optimizer state after a first step, plus the high-water mark of tensor "
            "bytes one training step allocates (torch.profiler memory events). Floor: "
            "`difftx.accounting.training_memory_floor`, which `difftx train` and `difftx compare` compare with the "
            "free memory before they start.", ""]
    (out / "memory_floor.md").write_text("\n".join(head + lines + ["", summary, ""]))


if __name__ == "__main__":
    main()
