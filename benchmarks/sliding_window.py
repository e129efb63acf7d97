"""Training speed with a sliding window (``ModelConfig.sliding_window``), side by side with full causal attention.

    python benchmarks/sliding_window.py [--preset small] [--attentions softmax,diff] [--shape 4x512]
        [--windows 128] [--dtypes fp32,bf16] [--repeats 5] [--threads 2]

For each attention kind, dtype and window: the preset's model and one AdamW training step as the trainer runs it
(bf16: autocast, the trainer's attention backend), on random tokens.  Three arms, in alternating order over
``--repeats`` interleaved repeats (median seconds per step, wall clock), the same weights in each:

* ``causal``: no window;
* ``window``: the window as the native attention kernels take it (each block of queries multiplies only the keys
  from its first query's window on);
* ``torch blocks``: the same window through the fused path's torch blocks, without the native attention kernels
  (the path without a C compiler, or with key padding), which also multiply only each block's window of keys.
  Before 2026-11-28 (fifteenth session) this arm was the path for every window, masked over the whole causal
  triangle: its numbers then are in docs/performance.md, "Sliding windows".

Prints a markdown table and writes ``OUT/sliding_window.md``.  With ``--attention-only``: one DIFF layer's attention
alone (``difftx.nn.fused.fused_attention``, 8 heads of 32, forward + backward, random inputs) for the same arms, in
``OUT/sliding_window_attention.md``.  With ``--inference``: one softmax layer's attention without autograd (8 heads of
64), ``--queries`` queries after the rest of ``--shape``'s keys (1: a decoding step), through SDPA (the window as a
dense mask) and the fused path (the window's keys only), in ``OUT/sliding_window_inference.md``.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import torch

from difftx.benchmarking.steps import adamw_step, interleaved_medians, switched, trainer_model
from difftx.config import ModelConfig
from difftx.nn import fused, native
from difftx.nn.mask import AttnMask


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
    ap.add_argument("--inference", action="store_true", help="one softmax layer's attention without autograd: SDPA "
                    "against the fused path")
    ap.add_argument("--queries", default="1,3,512", help="--inference: queries after the cached keys")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    b, n = (int(v) for v in args.shape.split("x"))
    rows = []
    if args.inference:
        return _inference(args, b, n)
    for attention in ([] if args.attention_only else args.attentions.split(",")):
        for dtype in args.dtypes.split(","):
            bf16 = dtype == "bf16"
            for window in (int(v) for v in args.windows.split(",")):
                cfg = ModelConfig.from_preset(args.preset, attention=attention, max_seq_len=n)
                g = torch.Generator().manual_seed(1)
                x, y = (torch.randint(0, cfg.vocab_size, (b, n), generator=g) for _ in range(2))
                arms = {}
                for arm, w in (("causal", None), ("window", window), ("torch blocks", window)):
                    model, opt = trainer_model(cfg.replace(sliding_window=w), bf16, n)
                    arms[arm] = functools.partial(adamw_step, model, opt, x, y, bf16)
                arms["torch blocks"] = switched(arms["torch blocks"], native, "attention_ok", lambda *a, **k: False)
                med = interleaved_medians(arms, args.repeats)
                rows.append((attention, dtype, window, med))
                print(f"{attention} {dtype} window {window}: "
                      + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in med.items()), flush=True)
    if args.attention_only:
        return _attention_only(args, b, n)
    lines = _header(f"# Sliding window: training step time ({args.preset}, {b} x {n} tokens, {args.threads} threads)",
                    f"python benchmarks/sliding_window.py --preset {args.preset} --attentions {args.attentions} "
                    f"--shape {args.shape} --windows {args.windows} --dtypes {args.dtypes} --repeats {args.repeats} "
                    f"--threads {args.threads}",
                    "Median seconds per AdamW step (forward, backward, optimizer) over interleaved repeats; ratios to "
                    "the causal arm (below 1: faster).")
    lines += ["| attention | dtype | window | causal ms | window ms | ratio | torch blocks ms | ratio |",
              "|---|---|---|---|---|---|---|---|"]
    for attention, dtype, window, med in rows:
        c = med["causal"]
        lines.append(f"| {attention} | {dtype} | {window} | {c * 1e3:.0f} | {med['window'] * 1e3:.0f} | "
                     f"{med['window'] / c:.2f} | {med['torch blocks'] * 1e3:.0f} | {med['torch blocks'] / c:.2f} |")
    _write(lines, args.out, "sliding_window.md")


def _attention_only(args, b: int, n: int) -> None:
    g = torch.Generator().manual_seed(0)
    h, d = 8, 32
    lines = _header(f"# Sliding window: one DIFF layer's attention, forward + backward ({b} x {n} tokens, {h} heads "
                    f"of {d}, {args.threads} threads)",
                    f"python benchmarks/sliding_window.py --attention-only --shape {args.shape} --windows "
                    f"{args.windows} --dtypes {args.dtypes} --repeats {args.repeats} --threads {args.threads}",
                    "Median milliseconds over interleaved repeats; ratios to the causal arm.")
    lines += ["| dtype | window | causal ms | window ms | ratio | torch blocks ms | ratio |", "|---|---|---|---|---|---|---|"]
    for dtype in args.dtypes.split(","):
        dt = torch.bfloat16 if dtype == "bf16" else torch.float32
        q = torch.randn(b, 2, h, n, d, generator=g).to(dt).requires_grad_()
        k = torch.randn(b, 2, h, n, d, generator=g).to(dt).requires_grad_()
        v = torch.randn(b, h, n, 2 * d, generator=g).to(dt).requires_grad_()
        lam = torch.tensor(0.3, requires_grad=True)
        for window in (int(w) for w in args.windows.split(",")):

            def run(mask: AttnMask) -> float:
                t0 = time.perf_counter()
                fused.fused_attention(q, k, v, mask, d ** -0.5, lam).sum().backward()
                return time.perf_counter() - t0

            windowed = AttnMask(causal=True, n_q=n, n_k=n, window=window)
            arms = {"causal": functools.partial(run, AttnMask(causal=True, n_q=n, n_k=n)),
                    "window": functools.partial(run, windowed),
                    "torch blocks": switched(functools.partial(run, windowed), native, "attention_ok",
                                              lambda *a, **kw: False)}
            med = {name: t * 1e3 for name, t in interleaved_medians(arms, args.repeats).items()}
            c = med["causal"]
            lines.append(f"| {dtype} | {window} | {c:.1f} | {med['window']:.1f} | {med['window'] / c:.2f} | "
                         f"{med['torch blocks']:.1f} | {med['torch blocks'] / c:.2f} |")
            print(lines[-1], flush=True)
    _write(lines, args.out, "sliding_window_attention.md")


def _inference(args, b: int, n: int) -> None:
    from difftx.nn import backends

    g = torch.Generator().manual_seed(0)
    h, d = 8, 64
    lines = _header(f"# Sliding window: one softmax layer's attention without autograd ({b} x {n} keys, {h} heads of "
                    f"{d}, {args.threads} threads)",
                    f"python benchmarks/sliding_window.py --inference --shape {args.shape} --windows {args.windows} "
                    f"--queries {args.queries} --dtypes {args.dtypes} --repeats {args.repeats} --threads {args.threads}",
                    "Median milliseconds over interleaved repeats (SDPA's dense mask built in each call, as in a "
                    "model's first layer); speed-up = SDPA / fused.")
    lines += ["| dtype | window | queries | SDPA ms | fused ms | speed-up |", "|---|---|---|---|---|---|"]
    for dtype in args.dtypes.split(","):
        dt = torch.bfloat16 if dtype == "bf16" else torch.float32
        k, v = (torch.randn(b, h, n, d, generator=g).to(dt) for _ in range(2))
        for window in (int(w) for w in args.windows.split(",")):
            for nq in (int(x) for x in args.queries.split(",")):
                q = torch.randn(b, h, nq, d, generator=g).to(dt)

                def run(path: str) -> float:
                    mask = AttnMask(causal=True, n_q=nq, n_k=n, q_start=n - nq, window=window)
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        if path == "sdpa":
                            backends.sdpa(q, k, v, mask, d ** -0.5)
                        else:
                            fused.fused_attention(q[:, None], k[:, None], v, mask, d ** -0.5)
                    return time.perf_counter() - t0

                med = interleaved_medians({p: functools.partial(run, p) for p in ("sdpa", "fused")}, args.repeats)
                lines.append(f"| {dtype} | {window} | {nq} | {med['sdpa'] * 1e3:.2f} | {med['fused'] * 1e3:.2f} | "
                             f"{med['sdpa'] / med['fused']:.1f} |")
                print(lines[-1], flush=True)
    _write(lines, args.out, "sliding_window_inference.md")


def _header(title: str, command: str, what: str) -> list:
    """A table's first lines: its title, this machine, the command that makes it, what its cells are."""
    return [title, "", f"Machine: {native.cpuinfo_value('model name') or 'unknown CPU'}, torch {torch.__version__}.", "",
            f"Command: `{command}`", "", what, ""]


def _write(lines: list, out: str, name: str) -> None:
    text = "\n".join(lines) + "\n"
    print(text)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / name).write_text(text)


if __name__ == "__main__":
    main()
