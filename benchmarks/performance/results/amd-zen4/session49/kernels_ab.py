"""In-process A/B of this session's native-kernel changes against an earlier build of cpu_kernels.c.

    python kernels_ab.py OLD_CPU_KERNELS_C [ROUNDS] [bench,bench,...]

OLD_CPU_KERNELS_C: the source file of the start commit (e.g. ``git show f040a28:src/difftx/nn/cpu_kernels.c >
/tmp/old.c``).  It is built with this machine's flags and loaded beside the current build; each bench calls the
same Python wrapper (``difftx.nn.native``) with one library or the other, alternating which goes first, 3 calls
timed per sample after one untimed call.  Prints each bench's medians and the median of the paired old / new
ratios with its interquartile range.  Shapes: the small preset's (4 x 512 tokens; the Transformer's 8 heads of
64, DIFF's 4 differential heads of 64 / 128), 2 threads.

Two more A/Bs need no old build (both forms are in the current one), under ``form`` and ``project``:
* ``form``: the bf16 attention backward's dK / dV products as AMX runs them (transposed, form 0) against the
  AVX512-BF16 form (packed maps as they are, form 1), :func:`difftx.nn.native.attention_backward_form`;
* ``project``: a bf16 projection group's backward (Q/K/V: 3 x 512 -> 512; gate/up: 2 x 512 -> 1376) with dx as a
  chain of products (``native.DOT_SUM_MAX = 1``) against one summed call (:func:`difftx.nn.native.dot_mm_sum`).
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import sys
import time

import torch

from difftx.nn import native
from difftx.nn.linear import Linear, project
from difftx.nn.rope import RotaryEmbedding, apply_rope
from difftx.runtime import keep_freed_memory


class _Declared:
    """Declares the current wrapper's argtypes on an older library, skipping functions it does not have."""

    def __init__(self, lib):
        self.__dict__["_lib"] = lib

    def __getattr__(self, name):
        try:
            return getattr(self._lib, name)
        except AttributeError:
            return type("Missing", (), {})()


def _paired(name, run_a, run_b, label_a, label_b, rounds):
    t = {label_a: [], label_b: []}
    for r in range(rounds):
        for label, run in ((label_a, run_a), (label_b, run_b)) if r % 2 else ((label_b, run_b), (label_a, run_a)):
            run()
            t0 = time.perf_counter()
            for _ in range(3):
                run()
            t[label].append((time.perf_counter() - t0) / 3)
    ratios = sorted(a / b for a, b in zip(t[label_a], t[label_b]))
    q = len(ratios) // 4
    print(f"| {name} | {statistics.median(t[label_a]) * 1e3:.3f} | {statistics.median(t[label_b]) * 1e3:.3f} | "
          f"{statistics.median(ratios):.3f} ({ratios[q]:.3f}-{ratios[-1 - q]:.3f}) |")


def main() -> None:
    keep_freed_memory()
    torch.set_num_threads(2)
    old_c = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    new = native.library()
    so = "/tmp/difftx_kernels_ab_old.so"
    subprocess.run([*native._compiler(), *native._flags(), old_c, "-o", so, "-lm"], check=True)
    old = ctypes.CDLL(so)
    native._declare(_Declared(old))
    g = torch.Generator().manual_seed(0)
    benches = {}
    cos, sin = RotaryEmbedding(64).cos_sin(torch.arange(512))
    for dt, nm in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        proj = torch.randn(4, 512, 3 * 512, generator=g).to(dt)
        qv = proj[..., :512].view(4, 512, 8, 64).transpose(1, 2)  # a head view of the projection, as the model's
        benches[f"rope {nm}"] = lambda qv=qv: apply_rope(qv, cos, sin, "half")
    for nm, (m, mk, h, d, dv) in {"T": (1, 1, 8, 64, 64), "D": (2, 2, 4, 64, 128)}.items():
        q = torch.randn(4, m, h, 512, d, generator=g).bfloat16()
        k = torch.randn(4 * mk * h, 512, d, generator=g).bfloat16()
        v = torch.randn(4, h, 512, dv, generator=g).bfloat16()
        do = torch.randn(4, 512, h, dv, generator=g).bfloat16()
        lam = 0.3 if m == 2 else 0.0
        _, lse = native.attention_forward(q, k, v, True, 0, 128, 0.125, lam, None, True)
        benches[f"bf16 attention forward {nm}"] = (
            lambda q=q, k=k, v=v, lam=lam: native.attention_forward(q, k, v, True, 0, 128, 0.125, lam, None, True))
        benches[f"bf16 attention backward {nm}"] = (
            lambda q=q, k=k, v=v, do=do, lse=lse, lam=lam: native.attention_backward(q, k, v, do, lse, True, 0, 128,
                                                                                    0.125, lam, None))
    for n, k in ((512, 512), (1376, 512), (512, 1376)):
        w = torch.randn(n, k, generator=g)
        benches[f"pack_wt {n}x{k}"] = lambda w=w: native.pack_wt(w)
    wanted = sys.argv[3].split(",") if len(sys.argv) > 3 else list(benches) + ["form", "project"]

    def use(lib):
        return lambda: native._STATE.__setitem__("lib", lib)

    print(f"{rounds} rounds, 2 threads; old = {old_c}\n")
    print("| bench | old ms | new ms | old / new, paired (IQR) |\n|---|---:|---:|---|")
    for name in wanted:
        if name in benches:
            f = benches[name]
            _paired(name, lambda: (use(old)(), f()), lambda: (use(new)(), f()), "old", "new", rounds)
            use(new)()
    if "form" in wanted:
        for nm in ("T", "D"):
            f = benches[f"bf16 attention backward {nm}"]
            _paired(f"backward form 0 / form 1, {nm}", lambda: (native.attention_backward_form(0), f()),
                    lambda: (native.attention_backward_form(1), f()), "0", "1", rounds)
        native.attention_backward_form(1)
    if "project" in wanted:
        torch.manual_seed(0)
        x0 = torch.randn(2048, 512)
        for nm, outs in (("Q/K/V", [512, 512, 512]), ("gate/up", [1376, 1376])):
            mods = [Linear(512, o, bias=False) for o in outs]
            gys = [torch.randn(2048, o).bfloat16() for o in outs]

            def backward(cap, mods=mods, gys=gys):
                native.DOT_SUM_MAX = cap
                x = x0.clone().requires_grad_()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    ys = project(x, mods)
                torch.autograd.backward(ys, gys)

            _paired(f"{nm} forward + backward, chain / summed dx", lambda: backward(1), lambda: backward(8),
                    "chain", "summed", rounds)
        native.DOT_SUM_MAX = 8


if __name__ == "__main__":
    main()
