"""Median prefill ms of a small-preset arm (4 x 512, no grad): python pfonly.py THREADS ARM CALLS (1 thread: CPU time)."""
import torch, sys, time, statistics
from difftx import ModelConfig
from difftx.benchmarking.speed import ARMS
from difftx.models import build_model
th=int(sys.argv[1]); torch.set_num_threads(th); torch.manual_seed(0)
clock = time.process_time if th==1 else time.perf_counter
a=sys.argv[2]
cfg=ModelConfig.from_preset("small", **ARMS[a]); model=build_model(cfg).eval()
x = torch.randint(0, cfg.vocab_size, (4, 512))
pf=[]
with torch.no_grad():
    model(x)
    for _ in range(int(sys.argv[3])):
        t=clock(); model(x); pf.append(clock()-t)
print(f"{statistics.median(pf)*1e3:.1f}")
