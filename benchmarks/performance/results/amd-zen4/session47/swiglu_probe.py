"""The SwiGLU backward inside whole training steps, timed around its kernel call and around the autograd node's whole
backward (monkeypatched), against what torch.profiler books for that node (cpu_step_profile.py).

    python swiglu_probe.py transformer|diff fp32|bf16 STEPS
"""
import sys, time, torch
from difftx.benchmarking.speed import BenchConfig, _train_step, build_arms
from difftx.runtime import keep_freed_memory
from difftx.nn import native, ffn
arm_name, dtype, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(2); keep_freed_memory()
orig_k = native.swiglu_backward; orig_b = ffn._NativeSwiGLU.backward
rk, rb, info = [], [], []
def wk(g, u, dh):
    t0 = time.perf_counter(); r = orig_k(g, u, dh); rk.append(time.perf_counter() - t0); return r
def wb(ctx, dh):
    info.append((dh.dtype, dh.is_contiguous(), tuple(dh.stride())))
    t0 = time.perf_counter(); r = orig_b(ctx, dh); rb.append(time.perf_counter() - t0); return r
native.swiglu_backward = wk; ffn._NativeSwiGLU.backward = staticmethod(wb)
bc = BenchConfig(arms=[arm_name], peers=False)
dev = torch.device("cpu"); g = torch.Generator().manual_seed(0)
arm = build_arms(bc, dev)[0]
x = torch.randint(0, arm.cfg.vocab_size, (4, 512), generator=g)
y = torch.randint(0, arm.cfg.vocab_size, (4, 512), generator=g)
for _ in range(2): _train_step(arm, x, y, dtype, dev)
rk.clear(); rb.clear()
for _ in range(steps): _train_step(arm, x, y, dtype, dev)
print(arm_name, dtype, "kernel ms/step %.1f, whole backward ms/step %.1f"
      % (sum(rk) * 1e3 / steps, sum(rb) * 1e3 / steps), info[-1])
