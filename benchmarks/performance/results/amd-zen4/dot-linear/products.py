# One bf16 Linear layer's products alone, native dot kernels (with packing) against torch (oneDNN):
#   python products.py THREADS
import torch, time, sys
from difftx.nn import native
torch.set_num_threads(int(sys.argv[1]))
def t(f, r=7):
    f(); best = 1e9
    for _ in range(r):
        s = time.perf_counter(); f(); best = min(best, time.perf_counter() - s)
    return best * 1e3
for (m, k, n) in [(2048, 512, 1408), (2048, 1408, 512), (2048, 512, 512)]:
    x = torch.randn(m, k).bfloat16(); w = torch.randn(n, k); dy = torch.randn(m, n).bfloat16()
    bp = native.pack_wt(w); y = torch.empty(m, n, dtype=torch.bfloat16)
    fl = 2 * m * k * n / 1e6
    pw = t(lambda: native.pack_wt(w)); fw = t(lambda: native.dot_mm(x, bp, n, y))
    bw = native.pack_rows(w, n); dxf = torch.empty(m, k)
    pr = t(lambda: native.pack_rows(w, n)); dxm = t(lambda: native.dot_mm(dy, bw, k, dxf)); cv = t(lambda: dxf.to(torch.bfloat16))
    xp = native.pack_rows(x, m); dyt = native.transpose_rows_bf16(dy); dw = torch.empty(n, k)
    px = t(lambda: native.pack_rows(x, m)); tr = t(lambda: native.transpose_rows_bf16(dy)); dwm = t(lambda: native.dot_mm(dyt, xp, k, dw))
    tt = t(lambda: x @ w.bfloat16().t()); tdx = t(lambda: dy @ w.bfloat16()); tdw = t(lambda: (dy.t() @ x).float())
    print((m, k, n), f"fwd pack {pw:.2f} mm {fw:.2f} ({fl/fw:.0f} GF) | dx pack {pr:.2f} mm {dxm:.2f} ({fl/dxm:.0f}) cvt {cv:.2f} | dW packx {px:.2f} tr {tr:.2f} mm {dwm:.2f} ({fl/dwm:.0f}) || torch fwd {tt:.2f} dx {tdx:.2f} dW {tdw:.2f}")
