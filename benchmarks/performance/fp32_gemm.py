"""Float32 products on torch's GEMM (MKL) against oneDNN, and what that does to float32 training and prefill, side
by side in one process.

``difftx.nn.linear`` runs every float32 product of a training call (forward, dx, weight gradient) and float32
inference past ``FEW_ROWS`` rows on oneDNN (``torch.ops.mkldnn._linear_pointwise``) where ``ONEDNN_FP32`` holds:
on AMD CPUs with AVX-512, where torch's MKL takes a path at less than half the AVX-512 rate.  This script prints:

1. The cores' float32 FMA peak (an unrolled AVX-512 FMA loop, one thread), when a C compiler is there.
2. Products at the ``small`` preset's training shapes (2048 tokens), GFLOP/s per form: y = x W^T, dx = dY W and
   dW = dY^T x, torch (``@``) against oneDNN as difftx calls it (dW: the cheaper of its two operand forms), on
   one thread and on ``--threads``.
3. The Transformer and DIFF twins of ``small``: a float32 AdamW training step (4 x 512 tokens) and a prefill
   (no grad), tokens/s with ONEDNN_FP32 off (torch's GEMM, the code before it) and on, interleaved over
   ``--rounds`` rounds; medians and on/off ratios.

    python benchmarks/performance/fp32_gemm.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

from difftx import ModelConfig
from difftx.benchmarking.steps import adamw_step, interleaved_medians, switched, trainer_model
from difftx.models import build_model
from difftx.nn import linear as L

SHAPES = [(2048, 512, 1408), (2048, 1408, 512), (2048, 512, 512)]  # (m, k, n): x (m, k), W (n, k)

_FMA_LOOP = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
int main(void) {
    __m512 a[12], b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)i);
    const long n = 100000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long k = 0; k < n; k++)
        for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(a[i], b, c);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    float s = 0;
    for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(a[i]);
    double t = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
    printf("%.1f %g\n", n * 12.0 * 32 / t / 1e9, s);
    return 0;
}
"""


def fma_peak() -> str:
    """One core's AVX-512 float32 FMA rate in GFLOP/s, or why it was not measured."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return "not measured (no C compiler)"
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "fma.c"), os.path.join(d, "fma")
        with open(src, "w") as f:
            f.write(_FMA_LOOP)
        built = subprocess.run([cc, "-O2", "-mavx512f", "-mfma", "-funroll-loops", src, "-o", exe],
                               capture_output=True, text=True)
        if built.returncode:
            return "not measured (the compiler has no AVX-512)"
        ran = subprocess.run([exe], capture_output=True, text=True)
        if ran.returncode:
            return "not measured (this CPU has no AVX-512)"
        return f"{float(ran.stdout.split()[0]):.0f} GFLOP/s"


def _median_time(f, repeats: int = 7) -> float:
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def products_table(threads: list[int]) -> list[str]:
    lines = ["| threads | m x k x n | form | torch GFLOP/s | oneDNN GFLOP/s | oneDNN / torch |",
             "|---:|---|---|---:|---:|---:|"]
    before = torch.get_num_threads()
    try:
        for t in threads:
            torch.set_num_threads(t)
            for m, k, n in SHAPES:
                g = torch.Generator().manual_seed(0)
                x, w, dy = (torch.randn(*s, generator=g) for s in ((m, k), (n, k), (m, n)))
                grads = [None, None]
                forms = {
                    "y = x W^T": (lambda: x @ w.t(), lambda: L._onednn(x, w)),
                    "dx = dY W": (lambda: dy @ w, lambda: L._onednn(dy, w.t())),
                    "dW = dY^T x": (lambda: dy.t() @ x,
                                    lambda: L._onednn_weight_grads(x, [dy], [0], [torch.float32], grads)),
                }
                for form, (ours_torch, ours_dnn) in forms.items():
                    a, b = _median_time(ours_torch), _median_time(ours_dnn)
                    flops = 2 * m * k * n
                    lines.append(f"| {t} | {m} x {k} x {n} | {form} | {flops / a / 1e9:.0f} | {flops / b / 1e9:.0f} "
                                 f"| {a / b:.2f} |")
    finally:
        torch.set_num_threads(before)
    return lines


def models_table(rounds: int, batch: int, seq_len: int) -> list[str]:
    arms = {}
    x = torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(1))
    for kind, name in (("softmax", "transformer"), ("diff", "diff")):
        cfg = ModelConfig.from_preset("small", attention=kind)
        model, opt = trainer_model(cfg, False, seq_len)

        def train(model=model, opt=opt) -> float:
            return adamw_step(model, opt, x, x, False)

        torch.manual_seed(0)
        plain = build_model(cfg).eval()

        def prefill(plain=plain) -> float:
            t = time.perf_counter()
            with torch.no_grad():
                plain(x)
            return time.perf_counter() - t

        for phase, fn in (("train", train), ("prefill", prefill)):
            arms[(name, phase, "torch")] = switched(fn, L, "ONEDNN_FP32", False)
            arms[(name, phase, "onednn")] = switched(fn, L, "ONEDNN_FP32", True)
    med = interleaved_medians(arms, rounds)
    tokens = batch * seq_len
    lines = ["| arm | phase | torch's GEMM tok/s | oneDNN tok/s | oneDNN / torch |", "|---|---|---:|---:|---:|"]
    for name in ("transformer", "diff"):
        for phase in ("train", "prefill"):
            a, b = med[(name, phase, "torch")], med[(name, phase, "onednn")]
            lines.append(f"| {name} | {phase} | {tokens / a:.0f} | {tokens / b:.0f} | {a / b:.2f} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    args = p.parse_args()
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        raise SystemExit("fp32_gemm.py: this torch has no oneDNN linear op; nothing to compare")
    torch.set_num_threads(args.threads)
    from difftx.nn import native

    print(f"# float32 GEMM: torch's against oneDNN ({native.cpu_vendor() or 'unknown vendor'}, "
          f"{args.threads} threads, torch {torch.__version__}; ONEDNN_FP32 default here: {L.ONEDNN_FP32})\n")
    print(f"One core's AVX-512 FMA peak: {fma_peak()}\n")
    print("\n".join(products_table(sorted({1, args.threads}))))
    print(f"\nsmall preset, float32, {args.batch_size} x {args.seq_len} tokens, medians of {args.rounds} interleaved "
          "rounds:\n")
    print("\n".join(models_table(args.rounds, args.batch_size, args.seq_len)))


if __name__ == "__main__":
    main()
