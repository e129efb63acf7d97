"""A/B of Transformer decoding steps: the native one-map kernel (variant auto) against the previous path
(variant sdpa in fp32 = CPU flash; bf16: the fused torch path), interleaved in one process.

usage: python decode_ab.py {transformer,dnt} {fp32,bf16}
(2 threads, small preset, 4 x 480 prompt + 32 greedy steps, 5 interleaved pairs; prints the median ratio)"""
import sys, time, torch, statistics
from difftx.config import ModelConfig
from difftx.models import build_model
from difftx.benchmarking.speed import ARMS
from difftx.nn import attention as A
torch.set_num_threads(2)
arm, dt = sys.argv[1], sys.argv[2]
cfg = ModelConfig.from_preset("small", max_seq_len=512, **ARMS[arm])
torch.manual_seed(0); m = build_model(cfg).eval()
b, n, new = 4, 480, 32
prompt = torch.randint(0, cfg.vocab_size, (b, n))
orig = A.SoftmaxAttention._native_decode
def run(native):
    A.SoftmaxAttention._native_decode = orig if native else (lambda *a, **k: False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dt == "bf16"):
        cache = m.new_cache(b, n + new)
        logits = m(prompt, cache=cache).logits
        t0 = time.perf_counter()
        for _ in range(new):
            logits = m(logits[:, -1:].argmax(-1), cache=cache).logits
        return time.perf_counter() - t0
run(True); run(False)
r = []
for i in range(5):
    a, c = (run(True), run(False)) if i % 2 == 0 else tuple(reversed((run(False), run(True))))
    r.append(c / a)
print(f"{arm} {dt}: native / previous decode tokens/s = {statistics.median(r):.3f} (range {min(r):.3f}-{max(r):.3f})")
