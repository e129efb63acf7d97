"""The native CPU kernels against their pure-torch paths, kernel by kernel, in one process.

    python benchmarks/performance/native_kernels.py [--threads 1] [--dtypes fp32,bf16] [--repeats 15]

Each row times one call (forward, or forward + backward) at the ``small`` preset's shapes with
``difftx.nn.native.ENABLED`` on and off, interleaved, and prints the medians and their ratio as a
markdown table.  Timer: process CPU time with one thread (steadier on a shared machine), wall clock
otherwise.  ``keep_freed_memory`` is on, as in ``difftx bench`` (fresh outputs pay no page faults).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from difftx.nn import fused, native
from difftx.nn.ffn import swiglu
from difftx.nn.mask import AttnMask
from difftx.nn.rope import RotaryEmbedding, apply_rope
from difftx.runtime import keep_freed_memory

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _cases(dt: torch.dtype):
    """(name, callable) pairs at the small preset's shapes: batch 4 x 512 tokens, d_model 512."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, grad=True):
        return torch.randn(*shape, generator=g).to(dt).requires_grad_(grad)

    gate, up, dh = rnd(4, 512, 1408), rnd(4, 512, 1408), rnd(4, 512, 1408, grad=False)
    yield "SwiGLU forward (4, 512, 1408)", lambda: swiglu(gate.detach(), up.detach())
    yield "SwiGLU forward + backward", lambda: torch.autograd.grad(swiglu(gate, up), (gate, up), dh)
    x, dy = rnd(4, 512, 512), rnd(4, 512, 512, grad=False)
    w = torch.rand(512, generator=g).requires_grad_()
    yield "RMSNorm forward (4, 512, 512)", lambda: fused.rms_norm(x.detach(), w.detach(), 1e-5, 1.0, dt)
    yield "RMSNorm forward + backward", lambda: torch.autograd.grad(fused.rms_norm(x, w, 1e-5, 1.0, dt), (x, w), dy)
    cos, sin = RotaryEmbedding(64).cos_sin(torch.arange(512)[None])
    q, dq = rnd(4, 8, 512, 64), rnd(4, 8, 512, 64, grad=False)
    yield "RoPE forward + backward (4, 8, 512, 64)", lambda: torch.autograd.grad(apply_rope(q, cos, sin, "half"), (q,), dq)
    mask = AttnMask(True, 512, 512)
    for maps, heads, what in ((1, 8, "Transformer: 8 heads of 64"), (2, 4, "DIFF: 4 heads, 2 maps")):
        qq, kk = rnd(4, maps, heads, 512, 64), rnd(4, maps, heads, 512, 64)
        vv, do = rnd(4, heads, 512, 64 * maps), rnd(4, 512, heads, 64 * maps, grad=False)
        lam = torch.tensor(0.5, requires_grad=True) if maps == 2 else None
        ins = [t for t in (qq, kk, vv, lam) if t is not None]

        def fwd(qq=qq, kk=kk, vv=vv, lam=lam):
            with torch.no_grad():
                return fused.fused_attention(qq, kk, vv, mask, 0.125, lam)

        def fwd_bwd(qq=qq, kk=kk, vv=vv, lam=lam, ins=ins, do=do):
            return torch.autograd.grad(fused.fused_attention(qq, kk, vv, mask, 0.125, lam), ins, do)

        yield f"fused attention forward ({what})", fwd
        yield f"fused attention forward + backward ({what})", fwd_bwd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtypes", default="fp32", help="comma list of fp32, bf16")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    timer = time.process_time if args.threads == 1 else time.perf_counter
    print(f"# Native CPU kernels vs the torch path\n\n{_cpu()}, {args.threads} thread(s), torch {torch.__version__}, "
          f"`{'cpu' if args.threads == 1 else 'wall'}` time, medians of {args.repeats} interleaved pairs.  "
          f"Native kernels: {native.status()}.\n")
    print("| dtype | kernel | native ms | torch ms | torch / native |\n|---|---|---:|---:|---:|")
    for name in args.dtypes.split(","):
        for label, fn in _cases(DTYPES[name.strip()]):
            times = {True: [], False: []}
            for use in (True, False):  # warm both paths
                native.ENABLED = use
                fn()
            for _ in range(args.repeats):
                for use in (True, False):
                    native.ENABLED = use
                    t0 = timer()
                    fn()
                    times[use].append(timer() - t0)
            native.ENABLED = True
            a, b = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
            print(f"| {name} | {label} | {a:.2f} | {b:.2f} | {b / a:.2f} |", flush=True)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


if __name__ == "__main__":
    main()
