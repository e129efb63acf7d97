"""bf16 autocast against fp32 training: loss curves within seed noise, and the speed-up.

    python benchmarks/performance/bf16_loss_curves.py --data input.txt [--preset tiny] [--attention diff]
        [--steps 500] [--seeds 0,1,2] [--batch-size 8] [--seq-len 256] [--lr 1e-3] [--out FILE.json]
        [--dtypes fp32,bf16] [--native off]
    python benchmarks/performance/bf16_loss_curves.py --merge A.json B.json   # the runs of several --out files together
    python benchmarks/performance/bf16_loss_curves.py --merge A.json:fp32 B.json:bf16   # A's fp32 runs, B's bf16 runs

``--native off`` trains on the pure-torch path (no difftx native kernels): with ``--dtypes bf16`` and a
merge against an earlier run's fp32 runs it tells whether a bf16 - fp32 gap is torch's bf16 autocast
itself or difftx's kernels.

A short, self-contained loop (byte tokens, AdamW, cosine schedule with warmup, the same data
order for both dtypes at a seed) so the claim can be checked before the full trainer exists.
For each seed it trains once in fp32 and once under bf16 autocast and reports the final
training loss (mean of the last 10%) and tokens/s.  "Within seed noise" means the mean
bf16 - fp32 difference in final loss is smaller than two standard errors of the fp32 runs'
spread across seeds.  Prints a markdown table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from difftx import ModelConfig, build_model  # noqa: E402
from difftx.optim import build_optimizer, lr_at, set_lr  # noqa: E402


def batches(data: torch.Tensor, steps: int, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        chunk = torch.stack([data[i:i + seq + 1] for i in idx.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


def train(args, data, seed: int, dtype: str) -> dict:
    torch.manual_seed(seed)
    cfg = ModelConfig.from_preset(args.preset, attention=args.attention, max_seq_len=args.seq_len)
    model = build_model(cfg)
    opt = build_optimizer(model, "adamw", lr=args.lr, weight_decay=0.1)
    losses, t0 = [], time.perf_counter()
    for step, (x, y) in enumerate(batches(data, args.steps, args.batch_size, args.seq_len, seed)):
        set_lr(opt, lr_at(step, args.steps, args.lr, "cosine", warmup=args.steps // 20, min_lr=args.lr / 10))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = model(x, targets=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    tail = losses[-max(1, args.steps // 10):]
    return {"seed": seed, "dtype": dtype, "final_loss": statistics.mean(tail), "losses": losses,
            "tokens_per_s": args.steps * args.batch_size * args.seq_len / seconds}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="/work/shared/data/tinyshakespeare.txt", help="a UTF-8 text file")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--attention", default="diff", choices=["softmax", "diff", "diff2"])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int)
    p.add_argument("--dtypes", default="fp32,bf16", help="which of fp32, bf16 to train (default both)")
    p.add_argument("--native", default="on", choices=["on", "off"],
                   help="off: difftx's native CPU kernels disabled (the pure-torch path)")
    p.add_argument("--out")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="train nothing: report the runs of these --out files together (same settings, other "
                        "seeds); FILE:fp32 or FILE:bf16 takes only that dtype's runs of FILE")
    args = p.parse_args()
    if args.merge:
        runs, docs = [], []
        for spec in args.merge:
            name, _, only = spec.rpartition(":") if spec.endswith((":fp32", ":bf16")) else (spec, "", "")
            docs.append(json.loads(Path(name).read_text()))
            runs += [dict(r, native=docs[-1]["args"].get("native", "on")) for r in docs[-1]["runs"]
                     if not only or r["dtype"] == only]
        a = docs[0]["args"]
        paths = sorted({f"{r['dtype']} {'native kernels' if r['native'] == 'on' else 'pure torch'}" for r in runs})
        report(f"{a['preset']} {a['attention']}, {a['steps']} steps, batch {a['batch_size']} x {a['seq_len']} "
               f"({len(docs)} file{'s' * (len(docs) > 1)} merged; {', '.join(paths)})", runs)
        return
    dtypes = args.dtypes.split(",")
    if not dtypes or any(d not in ("fp32", "bf16") for d in dtypes):
        sys.exit(f"bf16_loss_curves.py: error: --dtypes {args.dtypes}: choose from fp32, bf16 (comma-separated)")
    if args.native == "off":
        from difftx.nn import native
        native.ENABLED = False
    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.data)
    if not path.is_file():
        sys.exit(f"bf16_loss_curves.py: error: --data {path} is not a file; pass a text file")
    data = torch.tensor(list(path.read_bytes()), dtype=torch.long)
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for dtype in [d for d in ("fp32", "bf16") if d in dtypes]:  # interleaved: drifting load hits both alike
            runs.append(train(args, data, seed, dtype))
            r = runs[-1]
            print(f"seed {seed} {dtype}: final loss {r['final_loss']:.4f}, {r['tokens_per_s']:.0f} tok/s",
                  file=sys.stderr)
    title = (f"{args.preset} {args.attention}, {args.steps} steps, batch {args.batch_size} x {args.seq_len}")
    summary = report(title, runs) if len(dtypes) == 2 else None
    if summary is None:
        print("one dtype trained: compare it with --merge A.json:fp32 B.json:bf16", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "args": vars(args),
                                              "summary": summary, "runs": runs}, indent=2))


def report(title: str, runs: list) -> dict:
    """Print the markdown table and the seed-noise verdict of ``runs``; return the summary."""
    fp32 = sorted((r for r in runs if r["dtype"] == "fp32"), key=lambda r: r["seed"])
    bf16 = sorted((r for r in runs if r["dtype"] == "bf16"), key=lambda r: r["seed"])
    if [r["seed"] for r in fp32] != [r["seed"] for r in bf16]:
        sys.exit("bf16_loss_curves.py: error: every seed needs one fp32 and one bf16 run")
    diffs = [b["final_loss"] - f["final_loss"] for f, b in zip(fp32, bf16)]
    spread = statistics.stdev([r["final_loss"] for r in fp32]) if len(fp32) > 1 else float("nan")
    se = spread / math.sqrt(len(fp32)) if len(fp32) > 1 else float("nan")
    speedup = statistics.median(b["tokens_per_s"] / f["tokens_per_s"] for f, b in zip(fp32, bf16))
    paired_se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    summary = {"mean_final_loss_diff_bf16_minus_fp32": statistics.mean(diffs), "fp32_seed_std": spread,
               "within_seed_noise": abs(statistics.mean(diffs)) < 2 * se if len(fp32) > 1 else None,
               "paired_diff_se": paired_se, "seeds_bf16_higher": sum(d > 0 for d in diffs),
               "bf16_speedup_tokens_per_s": speedup}
    print(f"# bf16 autocast vs fp32: {title}\n")
    print("| seed | fp32 final loss | bf16 final loss | bf16 - fp32 | speed-up |\n|---:|---:|---:|---:|---:|")
    for f, b in zip(fp32, bf16):
        print(f"| {f['seed']} | {f['final_loss']:.4f} | {b['final_loss']:.4f} | "
              f"{b['final_loss'] - f['final_loss']:+.4f} | {b['tokens_per_s'] / f['tokens_per_s']:.2f}x |")
    print(f"\nfp32 seed std {spread:.4f}; mean difference {summary['mean_final_loss_diff_bf16_minus_fp32']:+.4f}; "
          f"within seed noise (|mean diff| < 2 s.e.): {summary['within_seed_noise']}; "
          f"median bf16 speed-up {speedup:.2f}x")
    print(f"Paired by seed (the same init and batches): bf16 higher in {summary['seeds_bf16_higher']} of {len(diffs)} "
          f"seeds, s.e. of the mean difference {paired_se:.4f}.")
    return summary

if __name__ == "__main__":
    main()
