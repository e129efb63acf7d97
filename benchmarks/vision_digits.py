"""The DNT vision comparison at CPU scale: ViT vs V-DNT, AdamW vs mSGDW, DIFF-ViT, on the built-in digits.

Every arm is one ``difftx train --domain vision`` command in its own process, timed from process
start to exit (wall) and by the child's CPU time (user + system; with ``--threads 1`` that is
about the wall time of the same run on a quiet machine).  All arms share the data split
(scikit-learn's 1797 digits: 1259 train, 179 val, 359 test), the budget (the digits recipe:
40 epochs of batch 32 = 1574 steps, 3 warmup epochs, cosine) and the seed; they differ only
in what the arm names:

    vdnt-adamw   V-DNT tiny (S5 norms, RMSNorm), AdamW 2e-3          recipe vdnt-tiny-adamw
    vit-adamw    ViT tiny (S1 pre-norm, LayerNorm), AdamW 2e-3       recipe vit-tiny-adamw
    vdnt-msgdw   V-DNT tiny, mSGDW 0.1                               recipe vdnt-tiny-msgdw
    vit-msgdw    ViT tiny, mSGDW 0.1                                 recipe vit-tiny-msgdw
    diffvit-adamw  DIFF-ViT: vit-tiny-adamw --attention diff (matched parameters: 2 differential heads)
    diffvdnt-adamw V-DNT with differential attention: vdnt-tiny-adamw --attention diff

    python benchmarks/vision_digits.py [--arms vdnt-adamw,vit-adamw,...] [--seeds 0[,1,2]]
        [--threads 1] [--out benchmarks/results] [--name vision_digits]

With several seeds the arms run interleaved (A B C ... A B C ...) and the table reports the
median and the range.  The acceptance check of issue 9 is the ``vdnt-adamw`` row: test
accuracy >= 97% within 5 minutes (300 s, process start to exit).  Prints a markdown table and
writes ``NAME.json`` / ``.md`` (default ``vision_digits``) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_ACC, TARGET_S = 0.97, 300.0

# arm -> (recipe, extra flags, description)
ARMS = {
    "vdnt-adamw": ("vdnt-tiny-adamw", [], "V-DNT, AdamW"),
    "vit-adamw": ("vit-tiny-adamw", [], "ViT, AdamW"),
    "vdnt-msgdw": ("vdnt-tiny-msgdw", [], "V-DNT, mSGDW"),
    "vit-msgdw": ("vit-tiny-msgdw", [], "ViT, mSGDW"),
    "diffvit-adamw": ("vit-tiny-adamw", ["--attention", "diff"], "DIFF-ViT, AdamW"),
    "diffvdnt-adamw": ("vdnt-tiny-adamw", ["--attention", "diff"], "DIFF V-DNT, AdamW"),
}


def run_arm(arm: str, seed: int, threads: int, work: Path, steps=None, domain_opts=()) -> dict:
    recipe, flags, _ = ARMS[arm]
    out = work / f"{arm}-s{seed}"
    cmd = [sys.executable, "-m", "difftx", "train", "--domain", "vision", "--recipe", recipe, *flags,
           "--seed", str(seed), "--threads", str(threads), "--no-progress", "--out", str(out)]
    if steps:
        cmd += ["--steps", str(steps)]
    for o in domain_opts:
        cmd += ["--domain-opt", o]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"arm {arm} (seed {seed}) failed:\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = {k: v for r in rows for k, v in r.items()}  # the last value of every key
    cfg = json.loads((out / "config.json").read_text())
    from difftx.accounting import count_parameters
    from difftx.config import ModelConfig

    train_rows = [r for r in rows if "loss" in r]
    return {"arm": arm, "seed": seed, "recipe": recipe, "flags": flags,
            "attention": cfg["model"]["attention"], "norms": cfg["model"]["norms"],
            "optimizer": cfg["train"]["optimizer"], "lr": cfg["train"]["lr"],
            "params": count_parameters(ModelConfig.from_dict(cfg["model"])), "steps": last["step"],
            "test_acc": last["test_acc"], "val_acc": last["val_acc"], "test_loss": last["test_loss"],
            "final_train_loss": train_rows[-1]["loss"], "train_s": train_rows[-1]["elapsed"],
            "images_per_s": train_rows[-1]["tokens"] / train_rows[-1]["elapsed"],
            "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "command": " ".join(cmd[1:])}


def summarise(results: list[dict], arms: list[str]) -> list[dict]:
    table = []
    for arm in arms:
        rs = [r for r in results if r["arm"] == arm]
        accs = [r["test_acc"] for r in rs]
        med = {k: statistics.median(r[k] for r in rs) for k in ("test_acc", "val_acc", "wall_s", "cpu_s",
                                                                  "train_s", "images_per_s")}
        table.append({"arm": arm, "what": ARMS[arm][2], "params": rs[0]["params"], "steps": rs[0]["steps"],
                      "seeds": len(rs), "test_acc_min": min(accs), "test_acc_max": max(accs), **med,
                      "meets_target": all(r["test_acc"] >= TARGET_ACC and r["wall_s"] <= TARGET_S for r in rs)})
    return table


def markdown(table: list[dict], meta: dict) -> str:
    lines = ["| arm | model, optimizer | params | steps | test acc (median) | range | val acc | wall s | "
             "CPU s | train s | img/s | >= 97% in 300 s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for t in table:
        rng = f"{t['test_acc_min']:.2%}..{t['test_acc_max']:.2%}" if t["seeds"] > 1 else "-"
        lines.append(f"| {t['arm']} | {t['what']} | {t['params']:,} | {t['steps']} | {t['test_acc']:.2%} | {rng} | "
                     f"{t['val_acc']:.2%} | {t['wall_s']:.0f} | {t['cpu_s']:.0f} | {t['train_s']:.0f} | "
                     f"{t['images_per_s']:.0f} | {'yes' if t['meets_target'] else 'no'} |")
    lines.append("")
    lines.append(f"{meta['seeds_run']} seed(s) per arm, --threads {meta['threads']}, load average at start "
                 f"{meta['load_start']:.1f} / end {meta['load_end']:.1f} on {meta['cpus']} CPUs; wall = process start "
                 "to exit (imports and data included), CPU = the child's user + system time.")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms (default: all: {', '.join(ARMS)})")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; arms run interleaved per seed (0)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per arm (1: the fastest for these sizes)")
    p.add_argument("--steps", type=int, help="override the recipe's budget (a quick smoke run; not the benchmark)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="where the JSON and .md go")
    p.add_argument("--domain-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="a vision option for every arm, merged with the recipe's (repeatable)")
    p.add_argument("--name", default="vision_digits", help="file name of the results (NAME.json, NAME.md)")
    args = p.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        p.error(f"unknown arm(s) {', '.join(bad)}; known: {', '.join(ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    sys.path.insert(0, str(ROOT / "src"))
    meta = {"threads": args.threads, "steps_override": args.steps, "domain_opts": args.domain_opt,
            "seeds_run": len(seeds), "seeds": seeds,
            "cpus": os.cpu_count(),
            "load_start": os.getloadavg()[0], "python": platform.python_version(), "machine": platform.machine(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": "python benchmarks/vision_digits.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    import torch

    meta["torch"] = torch.__version__
    results = []
    with tempfile.TemporaryDirectory(prefix="difftx-vision-bench-") as work:
        for seed in seeds:
            for arm in arms:
                r = run_arm(arm, seed, args.threads, Path(work), args.steps, args.domain_opt)
                results.append(r)
                print(f"  {arm:<15} seed {seed}: test_acc {r['test_acc']:.4f}  wall {r['wall_s']:.0f}s  "
                      f"cpu {r['cpu_s']:.0f}s", flush=True)
    meta["load_end"] = os.getloadavg()[0]
    table = summarise(results, arms)
    md = markdown(table, meta)
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "table": table, "runs": results}, indent=2))
    (out / f"{args.name}.md").write_text(f"# Vision on the built-in digits (CPU)\n\nCommand: `{meta['command']}`"
                                          f" ({meta['started']}, torch {meta['torch']})\n\n{md}\n")
    print(f"wrote {out / args.name}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
