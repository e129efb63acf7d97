"""One DIFF layer's fused attention (forward + backward, small preset, 4 x 512) and the SwiGLU kernels (forward +
backward at 2048 x 1408) with two builds of the native kernels in one process, alternated; 1 thread, CPU time.

    python kernels_ab_libs.py OLD.so REPEATS     # OLD.so: see step_ab_libs.py
"""
import ctypes, sys, time, os, statistics, torch
from difftx.nn import native
from difftx.nn.fused import fused_attention
from difftx.nn.mask import AttnMask
from difftx.runtime import keep_freed_memory
keep_freed_memory()
torch.set_num_threads(1)
new = native.library(); old = ctypes.CDLL(sys.argv[1]); native._declare(old)
libs = {"old": old, "new": new}
B, H, N, d = 4, 4, 512, 64
g = torch.Generator().manual_seed(0)
cases = {}
for dt in (torch.float32, torch.bfloat16):
    q = torch.randn(B, 2, H, N, d, generator=g).to(dt).requires_grad_()
    k = torch.randn(B, 2, H, N, d, generator=g).to(dt).requires_grad_()
    v = torch.randn(B, H, N, 2 * d, generator=g).to(dt).requires_grad_()
    do = torch.randn(B, N, H, 2 * d, generator=g).to(dt)
    mask = AttnMask(causal=True, n_q=N, n_k=N)
    def att(q=q, k=k, v=v, do=do, mask=mask):
        o = fused_attention(q, k, v, mask, 0.125, torch.tensor(0.3))
        torch.autograd.grad(o, [q, k, v], do)
    gg = torch.randn(2048, 1408, generator=g).to(dt); uu = torch.randn(2048, 1408, generator=g).to(dt); dh = torch.randn(2048, 1408, generator=g).to(dt)
    name = "fp32" if dt == torch.float32 else "bf16"
    cases[f"attention fwd+bwd {name}"] = att
    cases[f"swiglu fwd+bwd {name}"] = lambda gg=gg, uu=uu, dh=dh: (native.swiglu(gg, uu), native.swiglu_backward(gg, uu, dh))
res = {}
for l in libs.values():
    native._STATE["lib"] = l
    for f in cases.values(): f()
for r in range(int(sys.argv[2])):
    for name, f in cases.items():
        for l in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
            native._STATE["lib"] = libs[l]
            t = time.process_time(); f(); res.setdefault((name, l), []).append(time.process_time() - t)
for name in cases:
    o, n = res[(name, "old")], res[(name, "new")]
    print(f"{name:26s} old {1e3*statistics.median(o):8.2f} ms new {1e3*statistics.median(n):8.2f} ms new/old {statistics.median([b / a for a, b in zip(o, n)]):.3f}")
