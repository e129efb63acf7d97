"""DIFF V2 training steps (bench's diff2 arm, small preset, 4 x 512) with the K both maps read passed shared
((B, 1, Hk, N, d), this session's path) or expanded over the maps ((B, 2, Hk, N, d): the path before), steps
alternated in one process, wall time, medians:

    python v2_step_shared_k.py DTYPE THREADS REPS
"""
import statistics, sys, time
import torch
from difftx.benchmarking.speed import BenchConfig, _train_step, build_arms
from difftx.nn import backends
from difftx.runtime import keep_freed_memory

dtype, threads, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
keep_freed_memory()
arm = build_arms(BenchConfig(arms=["diff2"], peers=False), torch.device("cpu"))[0]
g = torch.Generator().manual_seed(0)
x = torch.randint(0, 256, (4, 512), generator=g)
y = torch.randint(0, 256, (4, 512), generator=g)
shared = backends.fused_attention
state = {"expand": False}


def fused(q, k, v, mask, scale, lam=None):
    if state["expand"] and k.shape[1] == 1 and q.shape[1] == 2:
        k = k.expand(k.shape[0], 2, *k.shape[2:])
    return shared(q, k, v, mask, scale, lam)


backends.fused_attention = fused
times = {False: [], True: []}
for e in (False, True):
    state["expand"] = e
    _train_step(arm, x, y, dtype, torch.device("cpu"))
for r in range(reps):
    for e in ((False, True) if r % 2 == 0 else (True, False)):
        state["expand"] = e
        t = time.perf_counter()
        _train_step(arm, x, y, dtype, torch.device("cpu"))
        times[e].append(time.perf_counter() - t)
s, x_ = statistics.median(times[False]), statistics.median(times[True])
pairs = statistics.median([a / b for a, b in zip(times[False], times[True])])
print(f"{dtype} {threads} thread(s): shared K {s:.3f} s, expanded K {x_:.3f} s a step; shared / expanded time "
      f"{pairs:.3f} (median of pairs)")
