"""Two builds of the native kernels' SwiGLU, forward and backward, alternating in one process.

    python swiglu_ab.py BASE_COMMIT [--threads 1] [--rounds 30]

Builds ``src/difftx/nn/cpu_kernels.c`` as of BASE_COMMIT ("old") and of the working tree ("new") with the
flags difftx uses, then times each build's ``difftx_swiglu`` / ``difftx_swiglu_backward`` at the ``small``
preset's FFN (4 x 512 x 1408 elements), float32 and bfloat16, old and new alternating; prints medians
(process CPU time with one thread, wall clock otherwise) and old / new.
"""

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from difftx.nn import native

p = argparse.ArgumentParser()
p.add_argument("base")
p.add_argument("--threads", type=int, default=1)
p.add_argument("--rounds", type=int, default=30)
args = p.parse_args()
root = Path(native.__file__).resolve().parents[3]
tmp = Path(tempfile.mkdtemp())
(tmp / "old.c").write_text(subprocess.run(["git", "-C", str(root), "show", f"{args.base}:src/difftx/nn/cpu_kernels.c"],
                                          check=True, capture_output=True, text=True).stdout)
libs = {}
for name, src in (("old", tmp / "old.c"), ("new", native._SOURCE)):
    subprocess.run(["gcc", *native._flags(), str(src), "-o", str(tmp / f"{name}.so"), "-lm"], check=True)
    libs[name] = ctypes.CDLL(str(tmp / f"{name}.so"))
torch.set_num_threads(args.threads)
clock = time.process_time if args.threads == 1 else time.perf_counter
n = 4 * 512 * 1408
print(f"threads {args.threads}, {'CPU time' if args.threads == 1 else 'wall'}, medians of {args.rounds}\n")
print("| dtype | call | old ms | new ms | old / new |\n|---|---|---:|---:|---:|")
for dt in (torch.float32, torch.bfloat16):
    g, u, dh = (torch.randn(n).to(dt) for _ in range(3))
    h, dg, du = (torch.empty_like(g) for _ in range(3))
    ptr = [ctypes.c_void_p(t.data_ptr()) for t in (g, u, h, dh, dg, du)]
    bf, nn_ = int(dt == torch.bfloat16), ctypes.c_int64(n)
    times = {}
    for _ in range(args.rounds):
        for name, lib in libs.items():
            t0 = clock()
            lib.difftx_swiglu(ptr[0], ptr[1], ptr[2], bf, nn_, args.threads)
            t1 = clock()
            lib.difftx_swiglu_backward(ptr[0], ptr[1], ptr[3], ptr[4], ptr[5], bf, nn_, args.threads)
            t2 = clock()
            times.setdefault((name, "forward"), []).append(t1 - t0)
            times.setdefault((name, "backward"), []).append(t2 - t1)
    for call in ("forward", "backward"):
        o, w = (statistics.median(times[(k, call)]) for k in ("old", "new"))
        print(f"| {str(dt).split('.')[-1]} | {call} | {o * 1e3:.3f} | {w * 1e3:.3f} | {o / w:.2f}x |")
