"""difftx's dot kernels (bf16 Linear on AVX512-BF16 without AMX) shape by shape at the small preset (2048 tokens):
forward, dX and dW products in GFLOP/s, and the packing and transposes around them in ms; medians of 30 calls.

    python dot_shapes.py THREADS
"""
import time, torch, sys
from difftx.nn import native
torch.set_num_threads(int(sys.argv[1]))
T = 2048
def tm(f, reps=30):
    for _ in range(3): f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    ts.sort(); return ts[len(ts)//2]
rows = []
for (k, n) in [(512, 512), (512, 1408), (1408, 512), (512, 256)]:
    w = torch.randn(n, k) * 0.02
    x = torch.randn(T, k).bfloat16(); dy = torch.randn(T, n).bfloat16()
    bp = native.pack_wt(w); y = torch.empty(T, n, dtype=torch.bfloat16)
    t_f = tm(lambda: native.dot_mm(x, bp, n, y))
    t_pw = tm(lambda: native.pack_wt(w))
    wr = native.pack_rows(w, n); dx = torch.empty(T, k, dtype=torch.float32)
    t_dx = tm(lambda: native.dot_mm(dy, wr, k, dx))
    t_pr = tm(lambda: native.pack_rows(w, n))
    xp = native.pack_rows(x, T); dyt = native.transpose_rows_bf16(dy); dw = torch.empty(n, k)
    t_dw = tm(lambda: native.dot_mm(dyt, xp, k, dw))
    t_px = tm(lambda: native.pack_rows(x, T)); t_tr = tm(lambda: native.transpose_rows_bf16(dy))
    fl = 2 * T * k * n / 1e9
    print(f"k={k:5d} n={n:5d}  fwd {fl/t_f:6.1f}  dx {fl/t_dx:6.1f}  dw {fl/t_dw:6.1f} GFLOP/s | "
          f"ms: fwd {t_f*1e3:.2f} packwt {t_pw*1e3:.2f} dx {t_dx*1e3:.2f} packrows(w) {t_pr*1e3:.2f} "
          f"dw {t_dw*1e3:.2f} packrows(x) {t_px*1e3:.2f} transp(dy) {t_tr*1e3:.2f}")
