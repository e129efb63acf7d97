"""Two versions of the native kernels' source (cpu_kernels.c) timed in one process, interleaved round by round
(A B, B A, ...): each built with the project's own flags into a library of its own, and swapped in as
``difftx.nn.native``'s library between calls.  Medians, A/B, and the middle half of the pairs' ratios.

    git worktree add /tmp/wt_start <start commit>
    python benchmarks/performance/results/amd-zen5/session61/ab_kernels.py \
        /tmp/wt_start/src/difftx/nn/cpu_kernels.c src/difftx/nn/cpu_kernels.c WORKLOADS [ROUNDS]   (2 threads)

WORKLOADS, comma-separated: fwd:ARM:B:N (bf16 attention layer, no grad), fwdg:ARM:B:N (its forward with grad),
bwd:ARM:B:N (forward + backward), ARM diff or transformer (2 maps x 4 heads of 64, or 8 heads of 64, causal);
prefill:ARM:B:N (a bench arm's bf16 prefill of B x N tokens); step:ARM (its bf16 training step at 4 x 512).
"""
import ctypes, subprocess, sys, time, statistics, torch
from difftx.nn import native
from difftx.runtime import keep_freed_memory
torch.set_num_threads(2); keep_freed_memory()
native.library()
libs = []
for i, src in enumerate(sys.argv[1:3]):
    out = f"/tmp/ab_{i}.so"
    subprocess.run(["cc", *native._flags(), src, "-o", out, "-lm"], check=True)
    lib = ctypes.CDLL(out); native._declare(lib); libs.append(lib)
wl = sys.argv[3]; rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 15
from difftx.nn.fused import fused_attention
from difftx.nn.mask import AttnMask
def attn(kind, B, N, bwd):
    m, h, D = (2, 4, 64) if kind == "diff" else (1, 8, 64)
    dv = 2 * D if m == 2 else D
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, m, h, N, D, generator=g).bfloat16().requires_grad_()
    k = torch.randn(B, m, h, N, D, generator=g).bfloat16().requires_grad_()
    v = torch.randn(B, h, N, dv, generator=g).bfloat16().requires_grad_()
    lam = torch.tensor(0.5, requires_grad=True) if m == 2 else None
    mask = AttnMask(True, N, N); ins = [t for t in (q, k, v, lam) if t is not None]
    go = torch.randn_like(fused_attention(q, k, v, mask, 0.125, lam))
    if bwd == "g":
        return lambda: fused_attention(q, k, v, mask, 0.125, lam)
    if bwd:
        return lambda: torch.autograd.grad(fused_attention(q, k, v, mask, 0.125, lam), ins, go)
    def f():
        with torch.no_grad(): fused_attention(q, k, v, mask, 0.125, lam)
    return f
def step(name):
    from difftx.benchmarking.speed import BenchConfig, _train_step, build_arms
    arm = build_arms(BenchConfig(arms=[name], peers=False), torch.device("cpu"), log=lambda s: None)[0]
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (4, 512), generator=g) for _ in range(2))
    return lambda: _train_step(arm, x, y, "bf16", torch.device("cpu"))
def prefill(name, B, N):
    from difftx.benchmarking.speed import BenchConfig, _prefill, build_arms
    arm = build_arms(BenchConfig(arms=[name], peers=False, seq_len=N, batch_size=B), torch.device("cpu"), log=lambda s: None)[0]
    x = torch.randint(0, 256, (B, N), generator=torch.Generator().manual_seed(0))
    return lambda: _prefill(arm, x, "bf16", torch.device("cpu"))
fns = {}
for w in wl.split(","):
    p = w.split(":")
    if p[0] == "prefill":
        fns[w] = prefill(p[1], int(p[2]), int(p[3])); continue
    fns[w] = step(p[1]) if p[0] == "step" else attn(p[1], int(p[2]), int(p[3]), "g" if p[0] == "fwdg" else p[0] == "bwd")
inner = 1
for w, f in fns.items():
    res = {0: [], 1: []}
    for lib in libs:
        native._STATE["lib"] = lib; f(); f()
    t0 = time.perf_counter(); f(); one = time.perf_counter() - t0
    inner = max(1, int(0.15 / one))
    for r in range(rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            native._STATE["lib"] = libs[i]
            t = time.perf_counter()
            for _ in range(inner): f()
            res[i].append((time.perf_counter() - t) / inner)
    a, b = statistics.median(res[0]), statistics.median(res[1])
    ratios = sorted(x / y for x, y in zip(res[0], res[1]))
    print(f"{w:22s} A {a*1e3:8.2f} ms  B {b*1e3:8.2f} ms  A/B {a/b:.3f} (pairs {ratios[len(ratios)//4]:.3f}-{ratios[3*len(ratios)//4]:.3f})")
