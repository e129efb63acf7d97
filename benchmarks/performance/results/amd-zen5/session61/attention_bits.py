"""The bf16 attention kernels' outputs and gradients at 56 shapes (causal or not, a cached prefix, a window,
N off the 32-row blocks, shared K, grouped heads), saved, and compared bit for bit with another run's.

    PYTHONPATH=/tmp/wt_start/src python attention_bits.py /tmp/ab_start.pt    (the start commit)
    python attention_bits.py /tmp/ab_now.pt
    python attention_bits.py --compare /tmp/ab_start.pt /tmp/ab_now.pt
"""
import sys, torch
from difftx.nn.fused import fused_attention
from difftx.nn.mask import AttnMask
torch.set_num_threads(2)
res = {}
cases = []
for (B, N, nk, qs, win) in ((4, 512, 512, 0, None), (2, 200, 200, 0, None), (1, 1000, 1000, 0, None),
                            (1, 100, 612, 512, None), (2, 300, 300, 0, 77), (1, 2048, 2048, 0, None),
                            (1, 37, 37, 0, None)):
    for (m, mk, h, hk, D, dv) in ((2, 2, 4, 4, 64, 128), (1, 1, 8, 8, 64, 64), (2, 1, 8, 4, 64, 64), (2, 2, 4, 2, 32, 64)):
        for causal in (True, False):
            cases.append((B, N, nk, qs, win, m, mk, h, hk, D, dv, causal))
for c in cases:
    B, N, nk, qs, win, m, mk, h, hk, D, dv, causal = c
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, m, h, N, D, generator=g).bfloat16().requires_grad_()
    k = torch.randn(B, mk, hk, nk, D, generator=g).bfloat16().requires_grad_()
    v = torch.randn(B, hk, nk, dv, generator=g).bfloat16().requires_grad_()
    lam = torch.tensor(0.5, requires_grad=True) if m == 2 else None
    mask = AttnMask(causal, N, nk, q_start=qs, window=win)
    ins = [t for t in (q, k, v, lam) if t is not None]
    out = fused_attention(q, k, v, mask, 0.125, lam)
    gr = torch.autograd.grad(out, ins, torch.randn(out.shape, generator=g).to(out.dtype))
    with torch.no_grad():
        out2 = fused_attention(q, k, v, mask, 0.125, lam)
    res[str(c)] = [out.detach(), out2] + list(gr)
if sys.argv[1] == "--compare":  # (the cases above ran anyway; cheap)
    a, b = torch.load(sys.argv[2]), torch.load(sys.argv[3])
    bad = [k for k in a if any(not torch.equal(x, y) for x, y in zip(a[k], b[k]))]
    print(f"{len(bad)} of {len(a)} cases differ", bad[:6])
else:
    torch.save(res, sys.argv[1]); print(len(res), "cases")
