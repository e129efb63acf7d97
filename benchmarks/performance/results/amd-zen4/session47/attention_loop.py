"""The fused attention alone at the small preset (Transformer: B 4, 8 heads of 64, N 512, causal): forward or
forward + backward, in fp32 or bf16, for SECONDS; prints median and best milliseconds.

    python attention_loop.py fp32|bf16 THREADS fwd|fb SECONDS
"""
import sys, time, torch
from difftx.nn import fused
from difftx.nn.mask import AttnMask
from difftx.runtime import keep_freed_memory
torch.set_num_threads(int(sys.argv[2])); keep_freed_memory()
dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[sys.argv[1]]
mode = sys.argv[3]  # fwd | fb
b, h, n, d = 4, 8, 512, 64
g = torch.Generator().manual_seed(0)
q = torch.randn(b, 1, h, n, d, generator=g).to(dt)
k = torch.randn(b, 1, h, n, d, generator=g).to(dt)
v = torch.randn(b, h, n, d, generator=g).to(dt)
w = torch.randn(b, n, h, d, generator=g).to(dt)
mask = AttnMask(causal=True, n_q=n, n_k=n)
def step():
    if mode == "fwd":
        with torch.no_grad(): fused.fused_attention(q, k, v, mask, 0.125)
    else:
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        o = fused.fused_attention(qq, kk, vv, mask, 0.125); torch.autograd.backward(o, w)
for _ in range(3): step()
ts = []
t_end = time.time() + float(sys.argv[4])
while time.time() < t_end:
    t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
ts.sort(); print(sys.argv[1:], "median ms %.2f min %.2f n %d" % (ts[len(ts)//2]*1e3, ts[0]*1e3, len(ts)))
