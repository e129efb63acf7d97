"""generate() and sample_next: an older generation.py (argv[1]) against this tree's, alternating, 1 thread.

    python generate_ab.py OLD_TREE/src/difftx/models/generation.py
"""
import time, torch, statistics, importlib.util, sys
import difftx
from difftx.models import generation as new
oldsrc = open(sys.argv[1]).read().replace("from ..", "from difftx.")
oldmod = type(sys)("oldgen"); exec(compile(oldsrc, "oldgen", "exec"), oldmod.__dict__)
torch.set_num_threads(1)
torch.manual_seed(0)
model = difftx.build_model(difftx.ModelConfig.from_preset("nano", attention="diff")).eval()
x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
res = {"old": [], "new": []}
for r in range(12):  # the order alternates too: old first in even rounds, new first in odd ones
    for name, mod in (("old", oldmod), ("new", new))[::1 if r % 2 == 0 else -1]:
        t = time.process_time(); mod.generate(model, x, 64, top_p=0.9, generator=torch.Generator().manual_seed(1))
        res[name].append(time.process_time() - t)
o, n = statistics.median(res["old"]), statistics.median(res["new"])
print(f"generate 4x64 top_p=0.9: old {256/o:.0f} tok/s, new {256/n:.0f} tok/s, new/old {o/n:.3f}")
lg = torch.randn(4, 256)
for name, mod in (("old", oldmod), ("new", new)):
    t = time.perf_counter()
    for _ in range(2000): mod.sample_next(lg, 1.0, None, 0.9)
    print(name, "sample_next", round((time.perf_counter() - t) / 2000 * 1e6, 1), "us")
