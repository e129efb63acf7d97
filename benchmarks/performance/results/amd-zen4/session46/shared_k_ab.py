"""DIFF V2's fused attention, forward + backward, at the bench's diff2 arm's shapes (small preset, B 4, N 512):
the K both maps read passed as it is ((B, 1, Hk, N, d): packed once, dK summed in the kernel) against the same K
expanded over the maps ((B, 2, Hk, N, d): copied to a K per map, dK per map summed by autograd, as before
session 46).  One process, calls alternated, process CPU time (all threads), medians.

    python shared_k_ab.py THREADS REPS
"""
import statistics, sys, time
import torch
from difftx.benchmarking.speed import BenchConfig, build_arms
from difftx.nn import fused
from difftx.nn.mask import AttnMask

threads, reps = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
arm = build_arms(BenchConfig(arms=["diff2"], peers=False), torch.device("cpu"))[0]
cfg = arm.cfg
h, hk, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
b, n = 4, 512
g = torch.Generator().manual_seed(0)
mask = AttnMask(causal=True, n_q=n, n_k=n)
for dt in (torch.float32, torch.bfloat16):
    q = torch.randn(b, 2, h, n, d, generator=g).to(dt)
    k = torch.randn(b, 1, hk, n, d, generator=g).to(dt)
    v = torch.randn(b, hk, n, d, generator=g).to(dt)
    lam = torch.rand(b, h, n, 1, generator=g)
    w = torch.randn(b, n, h, d, generator=g).to(dt)

    def step(expand):
        qq, kk, vv, ll = (t.clone().requires_grad_() for t in (q, k, v, lam))
        keys = kk.expand(b, 2, hk, n, d) if expand else kk
        t0 = time.process_time()
        out = fused.fused_attention(qq, keys, vv, mask, d ** -0.5, ll)
        (out * w).sum().backward()
        return time.process_time() - t0, [out.detach(), qq.grad, kk.grad, vv.grad, ll.grad]

    step(True), step(False)
    times = {True: [], False: []}
    for r in range(reps):
        for e in ((True, False) if r % 2 == 0 else (False, True)):
            times[e].append(step(e)[0])
    _, a = step(True)
    _, c = step(False)
    diff = max(((x.double() - y.double()).abs().max() / y.double().abs().max()).item() for x, y in zip(a, c))
    te, ts = statistics.median(times[True]), statistics.median(times[False])
    print(f"{str(dt)[6:]:8s} {threads} thread(s): expanded K {te * 1e3:7.1f} ms, shared K {ts * 1e3:7.1f} ms, "
          f"shared / expanded time {ts / te:.3f}; largest relative difference {diff:.1e}")
