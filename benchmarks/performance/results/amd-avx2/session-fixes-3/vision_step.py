"""One vit-tiny training step (forward, backward, AdamW) timed with whichever difftx is on the path.

    PYTHONPATH=OLD/src python vision_step.py; PYTHONPATH=NEW/src python vision_step.py   # alternating

Batch 64 of 8x8 images (the built-in digits' shape), fp32 and bf16 autocast, 1 thread, CPU time; median of 15
steps after 3 warm-up steps.  Prints one JSON line (ms a step, and the first step's loss as a check).
"""

import json
import statistics
import time

import torch

import difftx

torch.set_num_threads(1)
out = {"version": difftx.__file__}
for dtype in ("fp32", "bf16"):
    torch.manual_seed(0)
    model = difftx.build_model(difftx.ModelConfig.from_preset("vit-tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 1, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g)
    times, first = [], None
    for i in range(18):
        t = time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(x).logits.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 3:
            times.append(time.process_time() - t)
        first = first if first is not None else round(loss.item(), 6)
    out[f"{dtype}_ms"] = round(statistics.median(times) * 1e3, 2)
    out[f"{dtype}_first_loss"] = first
print(json.dumps(out))
