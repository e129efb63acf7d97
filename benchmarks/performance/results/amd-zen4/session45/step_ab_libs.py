"""The training step with two builds of the native kernels in one process (the same Python code): steps
alternate between the builds and the dtypes, their order reversed every repeat.  1 thread and CPU time, or
T=2 for 2 threads and wall time.

    git worktree add /tmp/old 51ba229   # this session's start
    PYTHONPATH=/tmp/old/src python -c "from difftx.nn import native; print(native.status())"   # builds it: its path
    python step_ab_libs.py OLD.so transformer,diff REPEATS [fp32,bf16]
"""
import ctypes, sys, time, os, statistics, torch
from difftx.benchmarking.speed import BenchConfig, _train_step, build_arms
from difftx.runtime import keep_freed_memory
from difftx.nn import native
torch.set_num_threads(int(os.environ.get("T", "1")))
keep_freed_memory()
old_path, arms, reps = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
dts = sys.argv[4].split(",") if len(sys.argv) > 4 else ["fp32", "bf16"]
clock = time.process_time if os.environ.get("T", "1") == "1" else time.perf_counter
new = native.library()
old = ctypes.CDLL(old_path)
native._declare(old)
libs = {"old": old, "new": new}
bc = BenchConfig(arms=arms, peers=False)
g = torch.Generator().manual_seed(0)
built = build_arms(bc, torch.device("cpu"))
x = torch.randint(0, 256, (4, 512), generator=g); y = torch.randint(0, 256, (4, 512), generator=g)
res = {}
for a in built:
    for lib in libs.values():
        native._STATE["lib"] = lib
        for dt in dts: _train_step(a, x, y, dt, torch.device("cpu"))
order = [(l, d) for l in libs for d in dts]
for r in range(reps):
    for a in built:
        for l, dt in (order if r % 2 == 0 else order[::-1]):
            native._STATE["lib"] = libs[l]
            t = clock(); _train_step(a, x, y, dt, torch.device("cpu")); res.setdefault((a.name, l, dt), []).append(clock() - t)
native._STATE["lib"] = new
print(f"{reps} repeats, {torch.get_num_threads()} threads, medians in s; new/old = median of per-repeat ratios")
for a in built:
    for dt in dts:
        o, n = res[(a.name, "old", dt)], res[(a.name, "new", dt)]
        print(f"{a.name:12s} {dt}: old {statistics.median(o):.3f} new {statistics.median(n):.3f} "
              f"new/old {statistics.median([q / p for p, q in zip(o, n)]):.3f}")
    if len(dts) == 2:
        for l in libs:
            f, b = res[(a.name, l, "fp32")], res[(a.name, l, "bf16")]
            print(f"{a.name:12s} {l} bf16/fp32 speed {statistics.median([p / q for p, q in zip(f, b)]):.3f}")
