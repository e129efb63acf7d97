"""Native attention at long context: milliseconds and GFLOP/s of the forward and the backward.

One DIFF layer's attention (two maps over a 2d-wide value, ``--heads`` heads of ``--dim``) or one
Transformer head set (``--maps 1``), causal, batch 1, through ``difftx.nn.native`` directly (no autograd,
no projections), so the numbers are the kernel's own.  FLOPs count the products the causal kernel does
(each map's Q K^T and the combined map times V forward; the maps again, dV, dP, dQ and dK backward), about
half the full N x N rectangle.  Best of ``--rounds`` per length.

    python benchmarks/performance/long_attention.py --lengths 512,2048,8192,16384 --threads 1 --timer cpu

To compare two checkouts, run it alternately with each one's ``src`` on PYTHONPATH.  ``--rows 48,192`` times
each block height in one process (the kernel takes any multiple of 6 in float32, of 32 in bf16) instead of
the one ``fused_attention`` picks; ``--dtype bf16`` times the bf16 kernel (CPUs with AMX or AVX512-BF16), whose blocks
``fused_attention`` leaves at the block path's rows (64 at long keys): the sweep to run before giving it
taller blocks too.
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
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--rows", default="", help="comma list of block heights to time (default: fused_attention's)")
    args = ap.parse_args()
    if native.library() is None:
        raise SystemExit("the native kernels are not built here")
    if args.dtype == "bf16" and not native.bf16_attention():
        raise SystemExit("the bf16 attention kernel needs a CPU with AMX or AVX512-BF16")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.timer == "cpu" else time.perf_counter
    m, h, d = args.maps, args.heads, args.dim
    dv = 2 * d if m == 2 else d
    print(f"{args.dtype}, {args.threads} thread(s), {args.timer} time, {m} map(s), {h} heads of {d}, value {dv}\n")
    print("| N | block rows | forward ms | forward GFLOP/s | backward ms | backward GFLOP/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.lengths.split(",")):
        g = torch.Generator().manual_seed(n)
        q, k3, v, dout = (torch.randn(*shape, generator=g).to(dtype)
                          for shape in ((1, m, h, n, d), (m * h, n, d), (1, h, n, dv), (1, n, h, dv)))
        lam = 0.5 if m == 2 else 0.0
        pairs = n * (n + 1) / 2  # causal (query, key) pairs per head
        fwd_flop = 2 * pairs * h * (m * d + dv)
        bwd_flop = 2 * pairs * h * (3 * m * d + 2 * dv)
        for chunk in [int(r) for r in args.rows.split(",")] if args.rows else [default_rows(dtype, m, h, n)]:
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


def default_rows(dtype: torch.dtype, m: int, h: int, n: int) -> int:
    """The block rows fused_attention gives the kernel for one sequence of n tokens with grad (batch 1)."""
    chunk = fused.chunk_size(1, m, h, n, n, dtype.itemsize)
    if dtype == torch.bfloat16:
        return chunk
    if hasattr(fused, "native_rows"):
        return fused.native_rows(chunk, n, n, m)
    return max(fused.NATIVE_CHUNK, chunk // fused.MIN_CHUNK * fused.NATIVE_CHUNK)  # checkouts before it


if __name__ == "__main__":
    main()
