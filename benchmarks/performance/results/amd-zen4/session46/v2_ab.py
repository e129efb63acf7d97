"""DIFF V2 / Transformer training speed (small preset, 4 x 512, 2 threads, wall) in bf16 or fp32: steps
alternated in one process.  Session 45's script with a dtype argument.  Run it alternately with two checkouts'
src on PYTHONPATH:

    for r in 1 2 3; do for side in old new; do PYTHONPATH=$src/src python v2_ab.py 6 bf16; done; done
"""
import sys, time, os, statistics, torch
from difftx.benchmarking.speed import BenchConfig, _train_step, build_arms
from difftx.runtime import keep_freed_memory
torch.set_num_threads(2)
keep_freed_memory()
reps = int(sys.argv[1]); DT = sys.argv[2] if len(sys.argv) > 2 else "bf16"
built = build_arms(BenchConfig(arms=["transformer", "diff2"], peers=False), torch.device("cpu"))
g = torch.Generator().manual_seed(0)
x = torch.randint(0, 256, (4, 512), generator=g); y = torch.randint(0, 256, (4, 512), generator=g)
res = {}
for a in built: _train_step(a, x, y, DT, torch.device("cpu"))
for r in range(reps):
    for a in (built if r % 2 == 0 else built[::-1]):
        t = time.perf_counter(); _train_step(a, x, y, DT, torch.device("cpu")); res.setdefault(a.name, []).append(time.perf_counter() - t)
t, d = res["transformer"], res["diff2"]
print(f"{DT} 2 threads: transformer {statistics.median(t):.3f} s, diff2 {statistics.median(d):.3f} s, diff2/transformer tokens/s {statistics.median([p / q for p, q in zip(t, d)]):.3f}")
