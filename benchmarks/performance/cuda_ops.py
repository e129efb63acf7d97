"""Where a DIFF training step goes on a GPU, against the Transformer twin's, and two of DIFF's GPU-path ops old
against new (needs CUDA).

    python benchmarks/performance/cuda_ops.py [--preset small] [--shapes 4x512,16x2048] [--out FILE.json]

1. One training step (forward, backward, AdamW) of the preset's Transformer and DIFF twins under bf16
   autocast, profiled by torch.profiler: wall time, GPU kernel time, kernels launched, and DIFF's ops with the
   most GPU time.  A step whose wall time far exceeds its kernel time is bound by launches (Python, dispatch).
2. Ops, forward + backward, at one DIFF layer's shapes: the per-head RMSNorm through difftx's CPU-shaped
   autograd function (``fused._RMSNorm``) against torch's ``F.rms_norm`` (what ``fused.rms_norm`` runs on
   CUDA), and the two maps' combine ``upcast(o1) - lam * upcast(o2)`` through autograd against
   ``backends.combine`` (time and the bytes autograd keeps for the backward).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from difftx import ModelConfig, build_model  # noqa: E402
from difftx.nn import backends, fused  # noqa: E402
from difftx.optim import build_optimizer  # noqa: E402

DEV = torch.device("cuda")  # --device cpu: a dry run of the script itself (no GPU numbers)


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, repeats: int = 20) -> float:
    """Median seconds of ``fn`` (after two warm-ups), synchronised."""
    for _ in range(2):
        fn()
    out = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def profile_step(preset: str, b: int, n: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for arm in ("transformer", "diff"):
        torch.manual_seed(0)
        cfg = ModelConfig.from_preset(preset, **({} if arm == "transformer" else {"attention": "diff"}),
                                      max_seq_len=max(n, 512))
        model = build_model(cfg).to(DEV)
        opt = build_optimizer(model, "adamw", lr=1e-4, weight_decay=0.1)
        x = torch.randint(0, cfg.vocab_size, (b, n), device=DEV)

        def step():
            with torch.autocast(DEV.type, dtype=torch.bfloat16):
                loss = model(x, targets=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        wall = _time(step, 10)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            _sync()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu = sum(e.device_time for e in kernels) / 1e6  # us -> s
        top = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]
        rows.append({"arm": arm, "batch": b, "seq_len": n, "wall_s": wall, "gpu_kernel_s": gpu,
                     "kernels": len(kernels),
                     "top_ops": [{"op": e.key, "calls": e.count, "gpu_ms": e.device_time_total / 1e3} for e in top]})
        del model, opt
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def ops(b: int, n: int, h: int, d: int) -> list[dict]:
    rows = []
    x = torch.randn(b, n, h, 2 * d, device=DEV, requires_grad=True)
    w = torch.ones(2 * d, device=DEV, requires_grad=True)
    dy = torch.randn(b, n, h, 2 * d, device=DEV, dtype=torch.bfloat16)

    def norm(f):
        def run():
            y = f()
            torch.autograd.backward(y, dy)
        return run

    old = _time(norm(lambda: fused._RMSNorm.apply(x, w, 1e-5, 0.8, torch.bfloat16, False)))  # torch path
    new = _time(norm(lambda: F.rms_norm(x, (2 * d,), w * 0.8, 1e-5).to(torch.bfloat16)))
    rows.append({"op": "head RMSNorm fwd+bwd", "old_ms": old * 1e3, "new_ms": new * 1e3})
    o1, o2 = (torch.randn(b, h, n, 2 * d, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    lam = torch.tensor(0.3, device=DEV, requires_grad=True)
    g = torch.randn(b, h, n, 2 * d, device=DEV)

    def comb(f):
        def run():
            torch.autograd.backward(f(), g)
        return run

    def saved(f):
        if DEV.type != "cuda":
            return float("nan")
        _sync()
        before = torch.cuda.memory_allocated()
        y = f()
        kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
        del y
        return kept

    expr = lambda: o1.float() - lam * o2.float()  # noqa: E731
    fn = lambda: backends.combine(o1, o2, lam)  # noqa: E731
    rows.append({"op": "combine fwd+bwd", "old_ms": _time(comb(expr)) * 1e3, "new_ms": _time(comb(fn)) * 1e3,
                 "old_saved_MB": saved(expr) / 2**20, "new_saved_MB": saved(fn) / 2**20})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--shapes", default="4x512,16x2048")
    p.add_argument("--out")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    global DEV
    DEV = torch.device(args.device)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    cfg = ModelConfig.from_preset(args.preset, attention="diff")
    result = {"device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", "torch": torch.__version__, "steps": [], "ops": []}
    for b, n in shapes:
        result["steps"] += profile_step(args.preset, b, n)
        result["ops"] += [dict(r, batch=b, seq_len=n) for r in ops(b, n, cfg.n_heads, cfg.head_dim)]
    print(f"# {result['device']}, torch {result['torch']}, preset {args.preset}, bf16 autocast\n")
    print("| arm | tokens | wall ms | GPU kernel ms | kernels |\n|---|---|---:|---:|---:|")
    for r in result["steps"]:
        print(f"| {r['arm']} | {r['batch']}x{r['seq_len']} | {r['wall_s'] * 1e3:.1f} | {r['gpu_kernel_s'] * 1e3:.1f} | "
              f"{r['kernels']} |")
    for r in result["steps"]:
        if r["arm"] == "diff":
            print(f"\nDIFF {r['batch']}x{r['seq_len']}, ops by GPU time:\n")
            print("| op | calls | GPU ms |\n|---|---:|---:|")
            for t in r["top_ops"]:
                print(f"| {t['op'][:70]} | {t['calls']} | {t['gpu_ms']:.2f} |")
    print("\n| op | tokens | old ms | new ms | old saved MB | new saved MB |\n|---|---|---:|---:|---:|---:|")
    for r in result["ops"]:
        print(f"| {r['op']} | {r['batch']}x{r['seq_len']} | {r['old_ms']:.3f} | {r['new_ms']:.3f} | "
              f"{r.get('old_saved_MB', float('nan')):.0f} | {r.get('new_saved_MB', float('nan')):.0f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
