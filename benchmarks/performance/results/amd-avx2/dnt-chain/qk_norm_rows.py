"""QK-norm + RoPE of one projection (4 x 512 tokens, 8 heads of 64, fp32): the norm on the head view (B, H, N, d)
(before 2026-11-26: the norm copies its input, and its gradient, to contiguous rows) against the norm on the
projection's rows (B, N, H, d) then the head view; interleaved in one process, medians of 25.

    python benchmarks/performance/results/amd-avx2/dnt-chain/qk_norm_rows.py 1   # threads
"""

import statistics
import sys
import time

import torch

from difftx.nn.norms import RMSNorm
from difftx.nn.rope import apply_rope

th = int(sys.argv[1]) if len(sys.argv) > 1 else 1
torch.set_num_threads(th)
clock = time.process_time if th == 1 else time.perf_counter
b, t, h, d = 4, 512, 8, 64
norm = RMSNorm(d)
x = torch.randn(b, t, h * d)
cos, sin = torch.randn(1, 1, t, d // 2), torch.randn(1, 1, t, d // 2)
g = torch.randn(b, h, t, d)


def heads(p):
    return p.view(b, t, h, d).transpose(1, 2)


def head_view(p):
    return apply_rope(norm(heads(p)), cos, sin, "half")


def rows(p):
    return apply_rope(heads(norm(p.view(b, t, h, d)).view(b, t, h * d)), cos, sin, "half")


res = {k: [] for k in ("head view, fwd+bwd", "rows, fwd+bwd", "head view, no grad", "rows, no grad")}
for _ in range(25):
    for name, f in (("head view", head_view), ("rows", rows)):
        p = x.clone().requires_grad_()
        t0 = clock()
        f(p).backward(g)
        res[f"{name}, fwd+bwd"].append(clock() - t0)
        with torch.no_grad():
            t0 = clock()
            f(x)
            res[f"{name}, no grad"].append(clock() - t0)
print(f"{th} thread(s); outputs equal: {torch.equal(head_view(x), rows(x))}")
med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
for k, v in med.items():
    print(f"{k}: {v:.2f} ms")
print(f"head view / rows: fwd+bwd {med['head view, fwd+bwd'] / med['rows, fwd+bwd']:.2f}x, "
      f"no grad {med['head view, no grad'] / med['rows, no grad']:.2f}x")
