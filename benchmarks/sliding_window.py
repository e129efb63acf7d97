"""Training speed with a sliding window (``ModelConfig.sliding_window``), side by side with full causal attention.

    python benchmarks/sliding_window.py [--preset small] [--attentions softmax,diff] [--shape 4x512]
        [--windows 128] [--dtypes fp32,bf16] [--repeats 5] [--threads 2]

For each attention kind, dtype and window: the preset's model and one AdamW training step as the trainer runs it
(bf16: autocast, the trainer's attention backend), on random tokens.  Three arms, in alternating order over
``--repeats`` interleaved repeats (median seconds per step, wall clock), the same weights in each:

* ``causal``: no window;
* ``window``: the window as the native attention kernels take it (each block of queries multiplies only the keys
  from its first query's window on);
* ``masked blocks``: the same window through the fused path's masked torch blocks over the whole causal triangle
  (the path before the kernels took windows; still the path without them).

Prints a markdown table and writes ``OUT/sliding_window.md``.  With ``--attention-only``: one DIFF layer's attention
alone (``difftx.nn.fused.fused_attention``, 8 heads of 32, forward + backward, random inputs) for the same arms, in
``OUT/sliding_window_attention.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from difftx.config import ModelConfig
from difftx.models import build_model
from difftx.nn import fused, native
from difftx.nn.mask import AttnMask
from difftx.optim import build_optimizer
from difftx.train.trainer import training_attention_backend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--attentions", default="softmax,diff")
    ap.add_argument("--shape", default="4x512")
    ap.add_argument("--windows", default="128")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attention-only", action="store_true", help="one DIFF layer's attention alone, not the model")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    b, n = (int(v) for v in args.shape.split("x"))
    attention_ok = native.attention_ok
    rows = []
    for attention in ([] if args.attention_only else args.attentions.split(",")):
        for dtype in args.dtypes.split(","):
            bf16 = dtype == "bf16"
            for window in (int(v) for v in args.windows.split(",")):
                cfg = ModelConfig.from_preset(args.preset, attention=attention, max_seq_len=n)
                models = {}
                for arm, w in (("causal", None), ("window", window), ("masked blocks", window)):
                    torch.manual_seed(0)
                    model = build_model(cfg.replace(sliding_window=w))
                    backend = training_attention_backend(cfg, torch.device("cpu"), torch.bfloat16 if bf16 else None, n)
                    if backend is not None:
                        model.set_attention_backend(backend)
                    models[arm] = (model, build_optimizer(model, "adamw", lr=1e-4, weight_decay=0.1))
                g = torch.Generator().manual_seed(1)
                x, y = (torch.randint(0, cfg.vocab_size, (b, n), generator=g) for _ in range(2))

                def step(arm: str) -> float:
                    model, opt = models[arm]
                    native.attention_ok = (lambda *a, **k: False) if arm == "masked blocks" else attention_ok
                    try:
                        t0 = time.perf_counter()
                        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                            loss = model(x, targets=y).loss
                        loss.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                        return time.perf_counter() - t0
                    finally:
                        native.attention_ok = attention_ok

                order = list(models)
                for arm in order:  # warm-up
                    step(arm)
                times = {k: [] for k in order}
                for r in range(args.repeats):
                    for arm in (order if r % 2 == 0 else order[::-1]):
                        times[arm].append(step(arm))
                med = {k: statistics.median(v) for k, v in times.items()}
                rows.append((attention, dtype, window, med))
                print(f"{attention} {dtype} window {window}: "
                      + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in med.items()), flush=True)
    if args.attention_only:
        return _attention_only(args, b, n)
    lines = [f"# Sliding window: training step time ({args.preset}, {b} x {n} tokens, {args.threads} threads)", "",
             f"Machine: {native.cpuinfo_value('model name') or 'unknown CPU'}, torch {torch.__version__}.", "",
             f"Command: `python benchmarks/sliding_window.py --preset {args.preset} --attentions {args.attentions} "
             f"--shape {args.shape} --windows {args.windows} --dtypes {args.dtypes} --repeats {args.repeats} "
             f"--threads {args.threads}`", "",
             "Median seconds per AdamW step (forward, backward, optimizer) over interleaved repeats; ratios to the "
             "causal arm (below 1: faster).", "",
             "| attention | dtype | window | causal ms | window ms | ratio | masked blocks ms | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for attention, dtype, window, med in rows:
        c = med["causal"]
        lines.append(f"| {attention} | {dtype} | {window} | {c * 1e3:.0f} | {med['window'] * 1e3:.0f} | "
                     f"{med['window'] / c:.2f} | {med['masked blocks'] * 1e3:.0f} | {med['masked blocks'] / c:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sliding_window.md").write_text(text)


def _attention_only(args, b: int, n: int) -> None:
    attention_ok = native.attention_ok
    g = torch.Generator().manual_seed(0)
    h, d = 8, 32
    lines = [f"# Sliding window: one DIFF layer's attention, forward + backward ({b} x {n} tokens, {h} heads of {d}, "
             f"{args.threads} threads)", "",
             f"Machine: {native.cpuinfo_value('model name') or 'unknown CPU'}, torch {torch.__version__}.", "",
             f"Command: `python benchmarks/sliding_window.py --attention-only --shape {args.shape} --windows "
             f"{args.windows} --dtypes {args.dtypes} --repeats {args.repeats} --threads {args.threads}`", "",
             "Median milliseconds over interleaved repeats; ratios to the causal arm.", "",
             "| dtype | window | causal ms | window ms | ratio | masked blocks ms | ratio |", "|---|---|---|---|---|---|---|"]
    for dtype in args.dtypes.split(","):
        dt = torch.bfloat16 if dtype == "bf16" else torch.float32
        q = torch.randn(b, 2, h, n, d, generator=g).to(dt).requires_grad_()
        k = torch.randn(b, 2, h, n, d, generator=g).to(dt).requires_grad_()
        v = torch.randn(b, h, n, 2 * d, generator=g).to(dt).requires_grad_()
        lam = torch.tensor(0.3, requires_grad=True)
        for window in (int(w) for w in args.windows.split(",")):
            masks = {"causal": AttnMask(causal=True, n_q=n, n_k=n), "window": AttnMask(causal=True, n_q=n, n_k=n,
                                                                                        window=window)}
            masks["masked blocks"] = masks["window"]

            def run(arm: str) -> float:
                native.attention_ok = (lambda *a, **kw: False) if arm == "masked blocks" else attention_ok
                try:
                    t0 = time.perf_counter()
                    fused.fused_attention(q, k, v, masks[arm], d ** -0.5, lam).sum().backward()
                    return time.perf_counter() - t0
                finally:
                    native.attention_ok = attention_ok

            order = list(masks)
            for arm in order:
                run(arm)
            times = {k: [] for k in order}
            for r in range(args.repeats):
                for arm in (order if r % 2 == 0 else order[::-1]):
                    times[arm].append(run(arm))
            med = {k: statistics.median(t) * 1e3 for k, t in times.items()}
            c = med["causal"]
            lines.append(f"| {dtype} | {window} | {c:.1f} | {med['window']:.1f} | {med['window'] / c:.2f} | "
                         f"{med['masked blocks']:.1f} | {med['masked blocks'] / c:.2f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sliding_window_attention.md").write_text(text)


if __name__ == "__main__":
    main()
