"""bf16 training step of the small preset (4 x 512, 2 threads): the native vdpbf16ps linear layers (_DotLinear)
against torch's oneDNN products (_Linear), interleaved in one process.

usage: python dot_ab.py {transformer,diff}   (7 interleaved pairs after 2 warm-up pairs; prints the median ratio)"""
import sys, time, statistics, torch
import torch.nn.functional as F
from difftx.config import ModelConfig
from difftx.models import build_model
from difftx.benchmarking.speed import ARMS
from difftx.nn import native
from difftx.optim import build_optimizer
torch.set_num_threads(2)
arm = sys.argv[1] if len(sys.argv) > 1 else "transformer"
cfg = ModelConfig.from_preset("small", max_seq_len=512, **ARMS[arm])
torch.manual_seed(0); m = build_model(cfg)
opt = build_optimizer(m, "adamw", lr=1e-4, weight_decay=0.1)
ids = torch.randint(0, cfg.vocab_size, (4, 513))
x, y = ids[:, :-1], ids[:, 1:]
real = native.dot_linear
def step(dot):
    native.dot_linear = real if dot else (lambda: False)
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = m(x).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0
for _ in range(2): step(True); step(False)
r = []
for i in range(7):
    if i % 2: b = step(False); a = step(True)
    else: a = step(True); b = step(False)
    r.append(b / a)
print(f"{arm}: native dot / oneDNN bf16 training tokens/s = {statistics.median(r):.3f} (range {min(r):.3f}-{max(r):.3f})")
