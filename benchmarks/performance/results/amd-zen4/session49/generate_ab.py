"""generate() (fp32, small preset, 4 prompts of 64 tokens + 32 greedy tokens, with attention_mask, 2 threads), 15 runs, median:
the code at the session's end against its start (f040a28; written for session48, copied), in alternating processes:
    for i in 1 2 3; do PYTHONPATH=<worktree of f040a28>/src python3 generate_ab.py; python3 generate_ab.py; done
"""
import time, torch, sys
from difftx import ModelConfig, build_model
from difftx.models.generation import generate
torch.manual_seed(0); torch.set_num_threads(2)
res = {}
for att in ("softmax", "diff"):
    m = build_model(ModelConfig.from_preset("small", attention=att)).eval()
    ids = torch.randint(0, 256, (4, 64)); mask = torch.ones_like(ids)
    generate(m, ids, max_new_tokens=4, temperature=0, attention_mask=mask)
    ts = []
    for _ in range(15):
        t = time.perf_counter(); generate(m, ids, max_new_tokens=32, temperature=0, attention_mask=mask); ts.append(time.perf_counter() - t)
    print(att, "generate 4x(64+32) fp32, median s", round(sorted(ts)[7], 3))
