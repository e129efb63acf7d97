"""One bf16 DIFF (2 maps x 4 heads of 64) and one Transformer (8 heads of 64) attention layer of the small preset at
4 x 512 tokens on the CPU's fused kernel: forward, and forward + backward, ms (median of 21), at a few query-block
heights of the backward (the forward's block is fused_attention's own); the gradients' bits against the default's.

    python benchmarks/performance/results/amd-zen5/session60/attention_layer.py   (2 threads)
"""
import time

import torch

import difftx.nn.fused as fused
from difftx.nn import native
from difftx.nn.fused import fused_attention
from difftx.nn.mask import AttnMask

torch.set_num_threads(2)
real = native.attention_backward
ROWS = [None]
fused.native.attention_backward = lambda q, k3, v, dout, lse, causal, q_start, chunk, *a, **k: real(
    q, k3, v, dout, lse, causal, q_start, ROWS[0] or chunk, *a, **k)


def median_ms(f, reps=21):
    for _ in range(3):
        f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[reps // 2] * 1e3


B, N, D = 4, 512, 64
for m, h in ((2, 4), (1, 8)):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, m, h, N, D, generator=g).bfloat16().requires_grad_()
    k = torch.randn(B, m, h, N, D, generator=g).bfloat16().requires_grad_()
    v = torch.randn(B, h, N, 2 * D if m == 2 else D, generator=g).bfloat16().requires_grad_()
    lam = torch.tensor(0.5, requires_grad=True) if m == 2 else None
    mask = AttnMask(True, N, N)
    ins = [t for t in (q, k, v, lam) if t is not None]
    go = torch.randn_like(fused_attention(q, k, v, mask, 0.125, lam))
    fwd = median_ms(lambda: fused_attention(q, k, v, mask, 0.125, lam))
    ref = None
    for rows in (None, 64, 96, 192):
        ROWS[0] = rows
        grads = lambda: torch.autograd.grad(fused_attention(q, k, v, mask, 0.125, lam), ins, go)  # noqa: E731
        got = grads()
        ref = ref or got
        same = all(torch.equal(a, b) for a, b in zip(got, ref))
        print(f"{'DIFF' if m == 2 else 'Transformer'}: forward {fwd:.2f} ms; forward + backward (backward blocks of "
              f"{rows or 'the default'} rows) {median_ms(grads):.2f} ms; gradients the default's bits: {same}")
