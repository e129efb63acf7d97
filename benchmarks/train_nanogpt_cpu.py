"""nanoGPT's shakespeare_char CPU recipe, trained by difftx (softmax, DIFF, DNT), optionally beside nanoGPT itself.

The recipe (nanoGPT README, "I only have a macbook"): 4 layers, 128 wide, 4 heads, block 64, batch 12,
2000 iterations, AdamW 1e-3 (0.9, 0.99), cosine to 1e-4 after 100 warmup steps, weight decay 0.1,
clip 1.0, dropout 0, character level; validation over 200 batches every 250 steps.  difftx runs it
as ``difftx train --recipe nanogpt-char`` (the ``nanogpt`` preset: GELU MLP, LayerNorm, learned
positions, tied embeddings; arms ``softmax*``, ``diff``, ``dnt``, ``diff-dnt``) or with difftx's own
Transformer baseline at the same shape (the ``nano`` preset: LLaMA-style RoPE, SwiGLU, RMSNorm,
untied, SwiGLU width 341 so its 803,712 parameters match the GPT's 805,248; arms ``transformer*``),
each arm in its own process, timed from process start to exit.

    python benchmarks/train_nanogpt_cpu.py --data PATH/tinyshakespeare.txt [--nanogpt-dir PATH/nanoGPT]
        [--arms softmax-fp32,softmax,diff,dnt,diff-dnt,transformer,transformer-diff,transformer-dnt]
        [--repeats 1] [--out benchmarks/results]

``--nanogpt-dir`` runs a checkout of karpathy/nanoGPT you provide (nothing of it is copied into
this repository): its data files are written in a temporary work directory exactly as its
``data/shakespeare_char/prepare.py`` would (90/10 split, sorted characters), and its
``train.py`` runs there with the README's CPU flags (eval_iters 200, the config's default).
With ``--repeats N`` the arms run interleaved (A B C A B C ...) and the table reports medians.
Prints a markdown table and writes ``train_nanogpt_cpu.json`` / ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

_LLAMA = ["--dtype", "bf16", "--preset", "nano", "--set", "ffn_dim=341"]
# arm name -> (difftx flags, description)
ARMS = {
    "softmax-fp32": (["--dtype", "fp32"], "softmax (nanoGPT's GPT), fp32"),
    "softmax": (["--dtype", "bf16"], "softmax (nanoGPT's GPT), bf16 autocast"),
    "diff": (["--dtype", "bf16", "--attention", "diff"], "DIFF V1, 2 differential heads of 32, bf16"),
    "dnt": (["--dtype", "bf16", "--norms", "dnt", "--set", "norm=rms", "--set", "init=xavier"],
            "DNT norms (S5), RMSNorm, Xavier init, bf16"),
    "diff-dnt": (["--dtype", "bf16", "--attention", "diff", "--norms", "dnt", "--set", "norm=rms",
                  "--set", "init=xavier"], "DIFF V1 inside DNT, bf16"),
    # difftx's Transformer baseline (the DIFF paper's LLaMA-style model) at the same shape and parameter count
    "transformer": (_LLAMA, "difftx Transformer (RoPE, SwiGLU, RMSNorm), bf16"),
    "transformer-diff": ([*_LLAMA, "--attention", "diff"], "its DIFF V1 twin, 2 differential heads of 32, bf16"),
    "transformer-dnt": ([*_LLAMA, "--norms", "dnt", "--set", "init=xavier"], "it with DNT norms (S5), Xavier init, bf16"),
}
NANOGPT_FLAGS = ["--device=cpu", "--compile=False", "--eval_iters=200", "--log_interval=100", "--block_size=64",
                 "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
                 "--lr_decay_iters=2000", "--dropout=0.0"]


def timed(cmd: list[str], **kw) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run ``cmd``; returns (process, wall seconds, CPU seconds of the child: user + system).

    CPU seconds are what a shared machine distorts least: with one thread they approximate
    the wall time the same run takes on a quiet machine.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc, wall, cpu


def run_difftx(arm: str, data: Path, work: Path, steps: int) -> dict:
    out = work / f"difftx-{arm}-{time.time_ns()}"
    cmd = [sys.executable, "-m", "difftx", "train", "--recipe", "nanogpt-char", "--data", str(data), "--out", str(out),
           "--no-progress", "--log-every", "100", "--diag-every", "0", "--cache-dir", str(work / "cache"),
           "--steps", str(steps), *ARMS[arm][0]]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc, wall, cpu = timed(cmd, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"difftx arm {arm} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if "val_loss" in r]
    train_rows = [r for r in rows if "tokens_per_s" in r]
    cfg = json.loads((out / "config.json").read_text())
    from difftx.accounting import count_parameters
    from difftx.config import ModelConfig

    return {"arm": arm, "impl": "difftx", "description": ARMS[arm][1], "val_loss": val[-1]["val_loss"],
            "val_curve": [(r["step"], round(r["val_loss"], 4)) for r in val], "wall_s": wall, "cpu_s": cpu,
            "train_s": train_rows[-1]["elapsed"], "params": count_parameters(ModelConfig.from_dict(cfg["model"])),
            "command": " ".join(["difftx", *cmd[3:]])}


def prepare_nanogpt_data(text: str, work: Path) -> Path:
    """What nanoGPT's data/shakespeare_char/prepare.py writes, from a local file instead of a download."""
    folder = work / "data" / "shakespeare_char"
    folder.mkdir(parents=True, exist_ok=True)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    n = len(text)
    for name, part in (("train", text[: int(n * 0.9)]), ("val", text[int(n * 0.9):])):
        np.array([stoi[c] for c in part], dtype=np.uint16).tofile(folder / f"{name}.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    return folder


def run_nanogpt(nanogpt: Path, data: Path, work: Path, steps: int) -> dict:
    wd = work / f"nanogpt-{time.time_ns()}"
    wd.mkdir()
    prepare_nanogpt_data(data.read_text(encoding="utf-8"), wd)
    (wd / "configurator.py").symlink_to(nanogpt / "configurator.py")  # train.py exec()s it from the cwd
    flags = [f if not f.startswith(("--max_iters", "--lr_decay_iters")) else f"{f.split('=')[0]}={steps}"
             for f in NANOGPT_FLAGS]
    cmd = [sys.executable, str(nanogpt / "train.py"), str(nanogpt / "config" / "train_shakespeare_char.py"), *flags,
           f"--out_dir={wd / 'out'}"]
    proc, wall, cpu = timed(cmd, cwd=wd)
    if proc.returncode != 0:
        raise SystemExit(f"nanoGPT failed:\n{proc.stderr[-3000:]}")
    evals = [(int(s), float(v)) for s, _, v in
             re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", proc.stdout)]
    params = re.search(r"number of parameters: ([\d.]+)M", proc.stdout + proc.stderr)
    return {"arm": "nanogpt", "impl": "nanoGPT", "description": "karpathy/nanoGPT train.py, fp32 (its CPU path)",
            "val_loss": evals[-1][1], "val_curve": evals, "wall_s": wall, "cpu_s": cpu, "train_s": None,
            "params": int(float(params.group(1)) * 1e6) if params else None,
            "command": "python train.py config/train_shakespeare_char.py " + " ".join(flags)}


def summarise(runs: list[dict]) -> list[dict]:
    by_arm: dict[str, list[dict]] = {}
    for r in runs:
        by_arm.setdefault(r["arm"], []).append(r)
    rows = []
    for arm, rs in by_arm.items():
        row = dict(rs[0])
        for k in ("val_loss", "wall_s", "cpu_s", "train_s"):
            vals = [r[k] for r in rs if r[k] is not None]
            row[k] = statistics.median(vals) if vals else None
        row["repeats"] = len(rs)
        rows.append(row)
    ref = next((r for r in rows if r["arm"] == "nanogpt"), None)
    for r in rows:
        r["wall_vs_nanogpt"] = r["wall_s"] / ref["wall_s"] if ref else None
        r["cpu_vs_nanogpt"] = r["cpu_s"] / ref["cpu_s"] if ref else None
    return rows


def table(rows: list[dict], steps: int) -> str:
    lines = [f"| arm | what | params | val loss @{steps} | wall s | CPU s | CPU / nanoGPT | wall / nanoGPT |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        params = f"{r['params'] / 1e6:.3f}M" if r["params"] else "?"
        cpu_ratio = f"{r['cpu_vs_nanogpt']:.2f}" if r["cpu_vs_nanogpt"] else "-"
        ratio = f"{r['wall_vs_nanogpt']:.2f}" if r["wall_vs_nanogpt"] else "-"
        lines.append(f"| {r['arm']} | {r['description']} | {params} | {r['val_loss']:.4f} | {r['wall_s']:.1f} | "
                     f"{r['cpu_s']:.1f} | {cpu_ratio} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, type=Path, help="tinyshakespeare.txt (or any text file)")
    p.add_argument("--nanogpt-dir", type=Path, help="a checkout of karpathy/nanoGPT to run beside difftx")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated difftx arms from {', '.join(ARMS)}")
    p.add_argument("--steps", type=int, default=2000, help="training iterations (2000: the recipe)")
    p.add_argument("--repeats", type=int, default=1, help="interleaved repeats per arm; the table shows medians")
    p.add_argument("--threads", type=int, help="torch threads for every arm and nanoGPT (OMP_NUM_THREADS); "
                                               "default: torch's own choice")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="where the JSON / md go")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    if not args.data.is_file():
        p.error(f"--data {args.data}: no such file")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every subprocess
    runs = []
    with tempfile.TemporaryDirectory(prefix="difftx-bench-") as tmp:
        work = Path(tmp)
        for rep in range(args.repeats):
            order = (["nanogpt"] if args.nanogpt_dir else []) + arms
            for arm in order:
                r = run_nanogpt(args.nanogpt_dir.resolve(), args.data.resolve(), work, args.steps) \
                    if arm == "nanogpt" else run_difftx(arm, args.data.resolve(), work, args.steps)
                print(f"[{rep + 1}/{args.repeats}] {arm}: val loss {r['val_loss']:.4f}, wall {r['wall_s']:.1f}s, "
                      f"CPU {r['cpu_s']:.1f}s", flush=True)
                runs.append(r)
    rows = summarise(runs)
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or
           platform.machine(), "cpu_count": os.cpu_count(), "torch_threads": args.threads or torch.get_num_threads(),
           "load_avg_at_end": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M")}
    md = table(rows, args.steps)
    print("\n" + md)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/train_nanogpt_cpu.py " + " ".join(sys.argv[1:])
    (args.out / "train_nanogpt_cpu.json").write_text(json.dumps({"command": command, "env": env, "rows": rows,
                                                                 "runs": runs}, indent=1))
    (args.out / "train_nanogpt_cpu.md").write_text(f"{md}\n\nCommand: `{command}`\n\nEnvironment: {json.dumps(env)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
