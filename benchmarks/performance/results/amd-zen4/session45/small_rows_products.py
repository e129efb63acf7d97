"""A 4-row bf16 product at the small preset's widths (2 threads, wall, median of 60 alternated): autocast's
F.linear on a weight cast to bf16 beforehand against dot_mm on a weight packed beforehand (what a KV cache's store
holds).  python small_rows_products.py"""
import time, statistics, torch
import torch.nn.functional as F
from difftx.nn import native
from difftx.runtime import keep_freed_memory
keep_freed_memory()
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
for M, K, N in [(4, 512, 1408), (4, 1408, 512), (4, 512, 1536), (4, 512, 256)]:
    w = torch.randn(N, K, generator=g); x = torch.randn(M, K, generator=g).bfloat16()
    wb = w.bfloat16(); bp = native.pack_wt(w)
    def a(): return F.linear(x, wb)
    def b():
        y = torch.empty(M, N, dtype=torch.bfloat16); native.dot_mm(x, bp, N, y); return y
    res = {"torch": [], "dot": []}
    for r in range(60):
        for name, f in (("torch", a), ("dot", b)) if r % 2 == 0 else (("dot", b), ("torch", a)):
            t = time.perf_counter(); f(); res[name].append(time.perf_counter() - t)
    tt, td = statistics.median(res["torch"]), statistics.median(res["dot"])
    print(f"M={M} K={K} N={N}: bf16 F.linear (weight cast beforehand) {1e3*tt:.3f} ms, dot_mm (packed beforehand) {1e3*td:.3f} ms, ratio {tt/td:.2f}")
