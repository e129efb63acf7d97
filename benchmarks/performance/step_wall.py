"""Where a CPU training step's wall time goes, without a profiler: every call into the native kernels is timed
around its ctypes call (the kernel's whole parallel region, its OpenMP threads included), and the rest of the
step is "outside" (torch's own operators: float32 GEMMs on MKL, AdamW, the loss; Python and autograd).

    python benchmarks/performance/step_wall.py [--arms transformer,diff] [--dtypes fp32,bf16] [--steps 6]

The bench's training step (``difftx bench``: small preset, 4 x 512 tokens, fused AdamW) after two warm-up
steps per dtype; with several dtypes the steps alternate (fp32, bf16, bf16, fp32, ...) so that the dtypes
share the machine's state.  Unlike ``cpu_step_profile.py`` (torch.profiler), nothing is booked to the wrong
operator and the timers cost a few microseconds a call.
"""

from __future__ import annotations

import argparse
import collections
import re
import time

import torch

from difftx.benchmarking.speed import BenchConfig, _train_step, build_arms
from difftx.nn import native
from difftx.runtime import keep_freed_memory


class _Timed:
    """A ctypes function with its wall time summed into ``acc[key][name]`` (key: the dtype being timed)."""

    def __init__(self, name, fn, state):
        self.name, self.fn, self.state = name, fn, state

    def __call__(self, *args):
        t = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            if self.state["key"] is not None:
                self.state["acc"][self.state["key"]][self.name] += time.perf_counter() - t
                self.state["calls"][self.state["key"]][self.name] += 1


def _instrument(state) -> None:
    lib = native.library()
    if lib is None:
        raise SystemExit(f"step_wall.py: the native kernels are off here ({native.status()})")
    names = sorted(set(re.findall(r"\b(difftx_\w+)\(", open(native.__file__).read())))
    for name in names:
        fn = getattr(lib, name, None)
        if callable(fn) and not isinstance(fn, _Timed):
            setattr(lib, name, _Timed(name, fn, state))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="transformer,diff")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per arm and dtype (default: 6)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    dtypes = args.dtypes.split(",")
    state = {"key": None, "acc": collections.defaultdict(lambda: collections.defaultdict(float)),
             "calls": collections.defaultdict(collections.Counter)}
    _instrument(state)
    bc = BenchConfig(arms=args.arms.split(","), peers=False, batch_size=args.batch_size)
    device = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    print(f"{args.threads} threads, {bc.batch_size} x {bc.seq_len} tokens, {args.steps} steps per dtype, "
          f"torch {torch.__version__}; {native.status()}")
    for arm in build_arms(bc, device):
        x = torch.randint(0, arm.cfg.vocab_size, (bc.batch_size, bc.seq_len), generator=g)
        y = torch.randint(0, arm.cfg.vocab_size, (bc.batch_size, bc.seq_len), generator=g)
        for dt in dtypes:
            for _ in range(2):
                _train_step(arm, x, y, dt, device)
        state["acc"].clear()
        state["calls"].clear()
        steps = collections.defaultdict(list)
        for i in range(args.steps):
            for dt in (dtypes if i % 2 == 0 else dtypes[::-1]):
                state["key"] = dt
                t = time.perf_counter()
                _train_step(arm, x, y, dt, device)
                steps[dt].append(time.perf_counter() - t)
                state["key"] = None
        cols = " | ".join(f"{dt} ms | calls" for dt in dtypes)
        print(f"\n## {arm.name}\n\n| | {cols} |\n|---|" + "---:|---:|" * len(dtypes))
        n = args.steps
        total = {dt: sum(steps[dt]) / n * 1e3 for dt in dtypes}
        inside = {dt: sum(state["acc"][dt].values()) / n * 1e3 for dt in dtypes}
        print("| whole step (mean) | " + " | ".join(f"{total[dt]:.1f} | " for dt in dtypes) + "|")
        print("| outside the native kernels | " + " | ".join(f"{total[dt] - inside[dt]:.1f} | " for dt in dtypes) + "|")
        names = sorted({k for dt in dtypes for k in state["acc"][dt]},
                       key=lambda k: -max(state["acc"][dt][k] for dt in dtypes))
        for k in names:
            print(f"| {k} | " + " | ".join(f"{state['acc'][dt][k] / n * 1e3:.1f} | {state['calls'][dt][k] // n}"
                                           for dt in dtypes) + " |")
        if len(dtypes) == 2:
            pairs = sorted(a / b for a, b in zip(steps[dtypes[0]], steps[dtypes[1]]))
            print(f"\n{dtypes[0]} / {dtypes[1]} step time, paired: median {pairs[len(pairs) // 2]:.3f} "
                  f"(range {pairs[0]:.3f}-{pairs[-1]:.3f})")


if __name__ == "__main__":
    main()
