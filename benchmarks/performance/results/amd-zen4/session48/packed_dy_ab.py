"""The bf16 Linear backward with the weight gradients' operands packed inside the forward and dx products
(this session) against the start commit's (a transpose of dY and a pack of x, each a pass of its own), in one
process, the two alternated step by step (order alternating): the bench's training step, small preset.

    python packed_dy_ab.py ARM THREADS STEPS [wall|cpu]

The start commit's _DotLinear is taken from git (``git show 85e51d7:src/difftx/nn/linear.py``) and runs on
this tree's kernels (its calls, dot_mm without pack_a, pack_rows and transpose_rows_bf16, are unchanged).
"""
import subprocess, sys, time
import torch
from difftx.nn import linear as L
from difftx.benchmarking.speed import BenchConfig, _train_step, build_arms
from difftx.runtime import keep_freed_memory

arm_name, threads, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
clock = time.process_time if (sys.argv[4:] or ["wall"])[0] == "cpu" else time.perf_counter
src = subprocess.run(["git", "show", "85e51d7:src/difftx/nn/linear.py"], capture_output=True, text=True, check=True).stdout
ns = dict(vars(L))
exec(src[src.index("class _DotLinear"):src.index("def _rows_bf16")], ns)
OLD, NEW = ns["_DotLinear"], L._DotLinear
torch.set_num_threads(threads); keep_freed_memory()
bc = BenchConfig(arms=[arm_name], peers=False, batch_size=4)
dev = torch.device("cpu"); g = torch.Generator().manual_seed(0)
arm = build_arms(bc, dev)[0]
x = torch.randint(0, arm.cfg.vocab_size, (4, 512), generator=g); y = torch.randint(0, arm.cfg.vocab_size, (4, 512), generator=g)
res = {"old": [], "new": []}
for name, fn in (("old", OLD), ("new", NEW)):
    L._DotLinear = fn
    for _ in range(2): _train_step(arm, x, y, "bf16", dev)
for i in range(steps):
    for name in (("old", "new") if i % 2 == 0 else ("new", "old")):
        L._DotLinear = OLD if name == "old" else NEW
        t = clock(); _train_step(arm, x, y, "bf16", dev); res[name].append(clock() - t)
L._DotLinear = NEW
med = lambda v: sorted(v)[len(v) // 2]
pairs = sorted(a / b for a, b in zip(res["old"], res["new"]))
print(f"{arm_name} bf16, {threads} thread(s), {steps} pairs ({clock.__name__}): old {med(res['old']) * 1e3:.1f} ms, "
      f"new {med(res['new']) * 1e3:.1f} ms; old / new paired median {pairs[len(pairs) // 2]:.3f} "
      f"(range {pairs[0]:.3f}-{pairs[-1]:.3f})")
