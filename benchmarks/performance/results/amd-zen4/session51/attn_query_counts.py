"""bf16 DIFF attention forward + backward through fused_attention at N queries (B=4, 4 heads, d=64, dv=128, causal,
2 threads): the median of 15 calls.  PYTHONPATH=<worktree>/src python3 attn_query_counts.py N"""
import sys, time, torch, difftx
from difftx.nn import fused
from difftx.nn.mask import AttnMask
torch.set_num_threads(2)
n = int(sys.argv[1]); b, m, h, hk, d, dv = 4, 2, 4, 4, 64, 128
g = torch.Generator().manual_seed(0)
q = torch.randn(b, m, h, n, d, generator=g).bfloat16().requires_grad_()
k = torch.randn(b, m, hk, n, d, generator=g).bfloat16().requires_grad_()
v = torch.randn(b, hk, n, dv, generator=g).bfloat16().requires_grad_()
lam = torch.tensor(0.5, requires_grad=True)
mask = AttnMask(causal=True, n_q=n, n_k=n, q_start=0)
def step():
    o = fused.fused_attention(q, k, v, mask, d ** -0.5, lam)
    o.float().sum().backward()
for _ in range(3): step()
ts = []
for _ in range(15):
    t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
ts.sort(); print(difftx.__file__.split('/')[2], n, f"{ts[len(ts)//2]*1e3:.2f} ms")
