"""Native float32 attention at long context: milliseconds and GFLOP/s of the forward and the backward.

One DIFF layer's attention (two maps over a 2d-wide value, ``--heads`` heads of ``--dim``) or one
Transformer head set (``--maps 1``), causal, batch 1, through ``difftx.nn.native`` directly (no autograd,
no projections), so the numbers are the kernel's own.  FLOPs count the products the causal kernel does
(each map's Q K^T and the combined map times V forward; the maps again, dV, dP, dQ and dK backward), about
half the full N x N rectangle.  Best of ``--rounds`` per length.

    python benchmarks/performance/long_attention.py --lengths 512,2048,8192,16384 --threads 1 --timer cpu

To compare two checkouts, run it alternately with each one's ``src`` on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import time

import torch

from difftx.nn import native
from difftx.nn import fused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,2048,4096,8192,16384")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--maps", type=int, default=2, choices=(1, 2))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--timer", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    if native.library() is None:
        raise SystemExit("the native kernels are not built here")
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.timer == "cpu" else time.perf_counter
    m, h, d = args.maps, args.heads, args.dim
    dv = 2 * d if m == 2 else d
    print(f"{args.threads} thread(s), {args.timer} time, {m} map(s), {h} heads of {d}, value {dv}\n")
    print("| N | block rows | forward ms | forward GFLOP/s | backward ms | backward GFLOP/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.lengths.split(",")):
        g = torch.Generator().manual_seed(n)
        q = torch.randn(1, m, h, n, d, generator=g)
        k3 = torch.randn(m * h, n, d, generator=g)
        v = torch.randn(1, h, n, dv, generator=g)
        dout = torch.randn(1, n, h, dv, generator=g)
        chunk = fused.chunk_size(1, m, h, n, n, 4)
        if hasattr(fused, "native_rows"):  # the rows fused_attention gives the kernel
            chunk = fused.native_rows(chunk, n, n, m)
        else:  # checkouts before it
            chunk = max(fused.NATIVE_CHUNK, chunk // fused.MIN_CHUNK * fused.NATIVE_CHUNK)
        lam = 0.5 if m == 2 else 0.0
        pairs = n * (n + 1) / 2  # causal (query, key) pairs per head
        fwd_flop = 2 * pairs * h * (m * d + dv)
        bwd_flop = 2 * pairs * h * (3 * m * d + 2 * dv)
        best_f = best_b = float("inf")
        for _ in range(args.rounds):
            t0 = clock()
            out, lse = native.attention_forward(q, k3, v, True, 0, chunk, d ** -0.5, lam, None, True)
            t1 = clock()
            native.attention_backward(q, k3, v, dout, lse, True, 0, chunk, d ** -0.5, lam, None)
            t2 = clock()
            best_f, best_b = min(best_f, t1 - t0), min(best_b, t2 - t1)
        print(f"| {n} | {chunk} | {best_f * 1e3:.1f} | {fwd_flop / best_f / 1e9:.1f} | {best_b * 1e3:.1f} | "
              f"{bwd_flop / best_b / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
