"""Decoding's few-row float32 products: torch's F.linear against difftx's native kernel, and what that does to
cached decoding, side by side in one process.

With one token per sequence, each projection of a decoding step is a few rows times a whole weight, so its time
is reading the weight.  ``difftx.nn.linear.linear`` sends float32 inference products of at most ``FEW_ROWS``
rows to ``native.few_rows_linear`` (``FEW_ROWS`` is 8 on AMD CPUs, where this was measured, and 0 elsewhere).
This script prints two tables:

1. Products at the ``small`` preset's shapes (and a 32000-word head): the weight read in GB/s by F.linear,
   by the same product as W @ x^T (torch, the other operand order) and by the native kernel, per row count.
   Each weight is one of a set of ~100 MB, so it comes from memory, as in a model.
2. Greedy cached decoding (``--decode-tokens`` after a ``--seq-len`` prompt, batch ``--batch-size``) of the
   Transformer and DIFF twins, tokens/s with the few-row kernel off (``FEW_ROWS = 0``: F.linear, the code
   before it) and on (``--rows``, default 8), interleaved over ``--rounds`` rounds; medians and on/off ratios.

    python benchmarks/performance/few_rows.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from difftx import ModelConfig
from difftx.models import build_model
from difftx.nn import linear as L
from difftx.nn import native

SHAPES = [(512, 1408), (1408, 512), (512, 512), (512, 32000)]  # (k, n): W is (n, k)
ROWS = [1, 2, 4, 8, 16]


def _rate(f, weights, x, rounds: int = 3) -> float:
    """GB/s of weight read: f(x, w) over every weight, best of ``rounds`` passes."""
    for w in weights:
        f(x, w)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for w in weights:
            f(x, w)
        best = min(best, (time.perf_counter() - t) / len(weights))
    return weights[0].numel() * 4 / best / 1e9


def products_table() -> list[str]:
    arms = {"F.linear": lambda x, w: F.linear(x, w), "W @ x^T": lambda x, w: (w @ x.t()).t(),
            "native": native.few_rows_linear}
    lines = ["| k x n | rows | " + " | ".join(f"{a} GB/s" for a in arms) + " | native / F.linear |",
             "|---|---:|" + "---:|" * (len(arms) + 1)]
    for k, n in SHAPES:
        weights = [torch.randn(n, k) for _ in range(max(2, (100 << 20) // (4 * k * n)))]
        for m in ROWS:
            x = torch.randn(m, k)
            rates = {a: _rate(f, weights, x) for a, f in arms.items()}
            lines.append(f"| {k} x {n} | {m} | " + " | ".join(f"{r:.1f}" for r in rates.values())
                         + f" | {rates['native'] / rates['F.linear']:.2f} |")
    return lines


def _decode_seconds(model, prompt, n_new: int) -> float:
    with torch.no_grad():
        cache = model.new_cache(prompt.shape[0], prompt.shape[1] + n_new)
        logits = model(prompt, cache=cache).logits
        t = time.perf_counter()
        for _ in range(n_new):
            logits = model(logits[:, -1:].argmax(-1), cache=cache).logits
        return time.perf_counter() - t


def decode_table(preset: str, batch: int, seq_len: int, n_new: int, rounds: int, on: int) -> list[str]:
    lines = ["| arm | F.linear (FEW_ROWS = 0) tok/s | native (FEW_ROWS = %d) tok/s | native / F.linear |" % on,
             "|---|---:|---:|---:|"]
    default = L.FEW_ROWS
    for attention in ("softmax", "diff"):
        cfg = ModelConfig.from_preset(preset, attention=attention)
        torch.manual_seed(0)
        model = build_model(cfg).eval()
        prompt = torch.randint(0, cfg.vocab_size, (batch, seq_len - n_new))
        times: dict = {0: [], on: []}
        try:
            for r in range(rounds + 1):  # round 0 warms up
                for rows in ((0, on) if r % 2 else (on, 0)):
                    L.FEW_ROWS = rows
                    s = _decode_seconds(model, prompt, n_new)
                    if r:
                        times[rows].append(s)
        finally:
            L.FEW_ROWS = default
        off_tps, on_tps = (batch * n_new / statistics.median(times[k]) for k in (0, on))
        name = "Transformer" if attention == "softmax" else "DIFF"
        lines.append(f"| {name} | {off_tps:.1f} | {on_tps:.1f} | {on_tps / off_tps:.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=8, help="FEW_ROWS of the 'native' decoding arm (default 8)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if native.library() is None:
        raise SystemExit(f"few_rows.py: the native kernels are not built here ({native.status()})")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU vendor {native.cpu_vendor() or '?'}, "
          f"FEW_ROWS default {L.FEW_ROWS}, native: {native.status()}\n")
    print("\n".join(products_table()))
    print()
    print("\n".join(decode_table(args.preset, args.batch_size, args.seq_len, args.decode_tokens, args.rounds,
                                 args.rows)))


if __name__ == "__main__":
    main()
