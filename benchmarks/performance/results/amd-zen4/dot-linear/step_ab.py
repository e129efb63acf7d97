# bf16 training step with the dot-product Linear path on ("dot") and off ("torch": oneDNN GEMMs), and fp32,
# alternated in one process (native._STATE toggled per step):  python step_ab.py REPEATS THREADS [ARMS]
import time, torch, sys, statistics
from difftx.benchmarking.speed import BenchConfig, _train_step, build_arms
from difftx.runtime import keep_freed_memory
from difftx.nn import native
th = int(sys.argv[2]) if len(sys.argv) > 2 else 2
torch.set_num_threads(th); keep_freed_memory()
clock = time.perf_counter if th > 1 else time.process_time
native.library()
arms = build_arms(BenchConfig(arms=sys.argv[3].split(",") if len(sys.argv) > 3 else ["transformer", "diff"], peers=False, batch_size=4), torch.device("cpu"))
reps = int(sys.argv[1])
g = torch.Generator().manual_seed(0)
for arm in arms:
    x = torch.randint(0, arm.cfg.vocab_size, (4, 512), generator=g); y = torch.randint(0, arm.cfg.vocab_size, (4, 512), generator=g)
    t = {"torch": [], "dot": [], "fp32": []}
    def run(v):
        native._STATE["dot_linear"] = v == "dot"
        s = clock(); _train_step(arm, x, y, "fp32" if v == "fp32" else "bf16", torch.device("cpu")); return clock() - s
    for v in t: run(v)
    for i in range(reps):
        for v in (list(t) if i % 2 == 0 else list(t)[::-1]): t[v].append(run(v))
    med = {v: statistics.median(t[v]) for v in t}
    print(arm.name, th, " ".join(f"{v} {med[v]:.3f}" for v in t), " dot/torch %.3f  fp32/dot %.2f fp32/torch %.2f" % (
        statistics.median([a/b for a, b in zip(t["dot"], t["torch"])]),
        statistics.median([a/b for a, b in zip(t["fp32"], t["dot"])]), statistics.median([a/b for a, b in zip(t["fp32"], t["torch"])])), flush=True)
