"""Where the bench's bf16 (or fp32) training step of one arm goes: wall time of each native kernel entry point
(difftx.nn.native's functions, wrapped), the optimizer step, and the rest, over 5 steps after 2 of warm-up.

    python benchmarks/performance/results/amd-zen5/session60/step_kernels.py diff bf16   (2 threads)
"""
import collections
import sys
import time
import types

import torch

from difftx.benchmarking.speed import BenchConfig, _train_step, build_arms
from difftx.nn import native
from difftx.runtime import keep_freed_memory

torch.set_num_threads(2)
keep_freed_memory()
acc = collections.defaultdict(lambda: [0, 0.0])
skip = {"library", "dot_linear", "amx", "bf16_attention", "supports", "status", "problem"}
for name, f in list(vars(native).items()):
    if isinstance(f, types.FunctionType) and f.__module__ == native.__name__ and not name.startswith("_") \
            and name not in skip and not name.endswith("_numel") and name not in ("attention_ok", "dense_layout",
                                                                                  "empty_in", "cpuinfo_line",
                                                                                  "cpuinfo_value", "cpu_vendor",
                                                                                  "attention_backward_form"):
        def wrapped(*a, _f=f, _n=name, **k):
            t = time.perf_counter()
            r = _f(*a, **k)
            acc[_n][0] += 1
            acc[_n][1] += time.perf_counter() - t
            return r
        setattr(native, name, wrapped)
arm_name, dtype = (sys.argv[1:3] + ["diff", "bf16"][len(sys.argv[1:3]):])[:2]
arm = build_arms(BenchConfig(arms=[arm_name], peers=False), torch.device("cpu"))[0]
opt = [0.0]
step = arm.optimizer.step


def timed_step(*a, **k):
    t = time.perf_counter()
    r = step(*a, **k)
    opt[0] += time.perf_counter() - t
    return r


arm.optimizer.step = timed_step
g = torch.Generator().manual_seed(0)
x, y = (torch.randint(0, arm.cfg.vocab_size, (4, 512), generator=g) for _ in range(2))
for _ in range(2):
    _train_step(arm, x, y, dtype, torch.device("cpu"))
acc.clear()
opt[0] = 0.0
n = 5
t0 = time.perf_counter()
for _ in range(n):
    _train_step(arm, x, y, dtype, torch.device("cpu"))
total = (time.perf_counter() - t0) / n
print(f"{arm_name} {dtype}: {total * 1e3:.1f} ms a step; optimizer {opt[0] / n * 1e3:.1f} ms")
kernels = 0.0
for name, (calls, secs) in sorted(acc.items(), key=lambda kv: -kv[1][1]):
    print(f"  {name:22s} {calls // n:3d} calls {secs / n * 1e3:7.1f} ms")
    kernels += secs / n
print(f"  native kernels {kernels * 1e3:.1f} ms; the rest {(total - kernels - opt[0] / n) * 1e3:.1f} ms")
