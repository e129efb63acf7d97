import time, torch, sys, statistics
from difftx.benchmarking.speed import BenchConfig, _train_step, build_arms
from difftx.runtime import keep_freed_memory
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1); keep_freed_memory()
arm_name, dt = sys.argv[1], sys.argv[2]
bc = BenchConfig(arms=[arm_name], peers=False, batch_size=4)
g = torch.Generator().manual_seed(0)
arm = build_arms(bc, torch.device("cpu"))[0] if arm_name == "transformer" else [a for a in build_arms(BenchConfig(arms=["transformer", arm_name], peers=False), torch.device("cpu")) if a.name == arm_name][0]
x = torch.randint(0, arm.cfg.vocab_size, (4, 512), generator=g); y = torch.randint(0, arm.cfg.vocab_size, (4, 512), generator=g)
_train_step(arm, x, y, dt, torch.device("cpu"))
ts=[]
for i in range(5):
    t=(time.perf_counter() if len(sys.argv) > 3 and sys.argv[3] != "1" else time.process_time()); _train_step(arm, x, y, dt, torch.device("cpu")); ts.append((time.perf_counter() if len(sys.argv) > 3 and sys.argv[3] != "1" else time.process_time())-t)
print(statistics.median(ts))
