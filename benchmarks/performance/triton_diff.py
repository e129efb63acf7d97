"""Differential attention on a GPU: the Triton kernels (difftx.nn.triton_diff) against the two-SDPA-call path and
the Transformer twin's one SDPA call, per layer, forward + backward and forward alone (needs CUDA and Triton).

    python benchmarks/performance/triton_diff.py [--shapes 4x512,16x2048] [--heads 4] [--head-dim 64]
        [--configs 64,32,4,2;64,64,4,2] [--dq pass,atomic] [--out FILE.json]

Rows, per shape and dtype (inputs as a DIFF layer of the small preset hands them over: q (B, 2, h, N, d),
k (B, 2, h, N, d), v (B, h, N, 2d), the four lambda vectors and the head norm's weight, all requiring gradients):

* ``2call``: what the layer ran before: lambda from its vectors (host ops), two SDPA calls with the 2d-wide value,
  the combine, the per-head RMSNorm times (1 - lambda_init);
* ``triton BM,BN,W,S dq=pass|atomic``: the kernels with those blocks (BLOCK_M, BLOCK_N, warps, stages), dQ from
  its own pass or added by the K/V pass with atomics (``DIFFTX_TRITON_DQ``);
* ``transformer``: one SDPA call over 2h heads of d (the twin's attention, no lambda, no norm).

Times are medians of CUDA-synchronised wall clock over ``--repeats`` runs of ``--inner`` calls each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from difftx.nn import triton_diff  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, repeats: int, inner: int) -> float:
    for _ in range(3):
        fn()
    _sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync()
        out.append((time.perf_counter() - t0) / inner)
    return sorted(out)[len(out) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4x512,16x2048")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--configs", default="default;64,64,4,2;128,32,8,2;64,32,8,3")
    ap.add_argument("--masks", default="plain", help="comma list of plain (causal), docs (causal within documents of "
                    "N/8 tokens), window (causal over the last N/8 keys), decode (one query after N-1 cached keys, "
                    "forward only); the non-plain ones time 2call (SDPA with the dense mask) and the kernels' "
                    "default blocks only")
    ap.add_argument("--dq", default="pass,atomic", help="comma list of the backward's dQ forms to time (pass: its "
                    "own pass, the default; atomic: added by the K/V pass)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cuda; cpu: a dry run of the script under TRITON_INTERPRET=1")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    h, d = a.heads, a.head_dim
    default_blocks = triton_diff._blocks
    rows = []
    for shape in a.shapes.split(","):
        b, n = (int(x) for x in shape.split("x"))
        for dt_name in a.dtypes.split(","):
            dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt_name]
            g = torch.Generator(device="cpu").manual_seed(0)
            mk = lambda *s: torch.randn(*s, generator=g).to(dev, dt).requires_grad_()  # noqa: E731
            q, k, v = mk(b, 2, h, n, d), mk(b, 2, h, n, d), mk(b, h, n, 2 * d)
            lam = [(torch.randn(d, generator=g) * 0.1).to(dev).requires_grad_() for _ in range(4)]
            w = torch.ones(2 * d, device=dev, requires_grad=True)
            dy = torch.randn(b, n, h, 2 * d, generator=g).to(dev, dt)
            args = (q, k, v, lam, 0.3, d ** -0.5, w)
            kw = {"norm": True, "eps": 1e-5, "gain": 0.7, "out_dtype": dt}
            tq = torch.randn(b, 2 * h, n, d, generator=g).to(dev, dt).requires_grad_()
            tk, tv = torch.randn_like(tq).requires_grad_(), torch.randn_like(tq).requires_grad_()
            tdy = torch.randn_like(tq)

            def fb(fn):
                def run():
                    y = fn()
                    y.backward(dy if y.shape == dy.shape else tdy)
                return run

            def fwd(fn):
                def run():
                    with torch.no_grad():
                        fn()
                return run

            if "decode" in a.masks.split(","):  # a decoding step: the last position's query over all N keys
                q1 = q[:, :, :, n - 1:].detach()
                dargs = (q1, k.detach(), v.detach(), [t.detach() for t in lam], 0.3, d ** -0.5, w.detach())
                for name, fn in (("decode 2call", lambda: triton_diff.reference(*dargs, **kw)),
                                 ("decode triton", lambda: triton_diff.diff_attention(*dargs, **kw))):
                    triton_diff._FAILED.clear()
                    row = {"shape": shape, "dtype": dt_name, "arm": name, "fwd_bwd_ms": float("nan"),
                           "fwd_ms": _time(fwd(fn), a.repeats, a.inner) * 1e3}
                    if triton_diff._FAILED:
                        row = {"shape": shape, "dtype": dt_name, "arm": name, "error": triton_diff._FAILED[0]}
                    rows.append(row)
                    print(row, flush=True)
            for case in [c for c in a.masks.split(",") if c not in ("plain", "decode")]:  # masked: 2call vs the kernels
                mkw = dict(kw, **({"doc_ids": (torch.arange(n, device=dev) // max(1, n // 8))[None]}
                                  if case == "docs" else {"window": max(1, n // 8)}))
                for name, fn in (("2call", lambda: triton_diff.reference(*args, **mkw)),
                                 ("triton", lambda: triton_diff.diff_attention(*args, **mkw))):
                    triton_diff._FAILED.clear()
                    row = {"shape": shape, "dtype": dt_name, "arm": f"{case} {name}",
                           "fwd_bwd_ms": _time(fb(fn), a.repeats, a.inner) * 1e3,
                           "fwd_ms": _time(fwd(fn), a.repeats, a.inner) * 1e3}
                    if triton_diff._FAILED:  # the kernels fell back to torch's ops: not their time
                        row = {"shape": shape, "dtype": dt_name, "arm": f"{case} {name}",
                               "error": triton_diff._FAILED[0]}
                    rows.append(row)
                    print(row, flush=True)
            if "plain" not in a.masks.split(","):
                continue
            arms = {"2call": lambda: triton_diff.reference(*args, **kw),
                    "transformer": lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)}
            for name, fn in arms.items():
                rows.append({"shape": shape, "dtype": dt_name, "arm": name,
                             "fwd_bwd_ms": _time(fb(fn), a.repeats, a.inner) * 1e3,
                             "fwd_ms": _time(fwd(fn), a.repeats, a.inner) * 1e3})
                print(rows[-1], flush=True)
            ref = triton_diff.reference(*args, **kw).float()
            for cfg, dq in [(c, q_) for c in a.configs.split(";") for q_ in a.dq.split(",")]:
                os.environ[triton_diff.DQ_ENV] = dq
                if cfg == "default":
                    triton_diff._blocks = default_blocks
                    label = "triton default " + ",".join(map(str, default_blocks(dt, d))) + f" dq={dq}"
                else:
                    blocks = tuple(int(x) for x in cfg.split(","))
                    triton_diff._blocks = lambda dtype, dd, blocks=blocks: blocks
                    label = f"triton {cfg} dq={dq}"
                fn = lambda: triton_diff.diff_attention(*args, **kw)  # noqa: E731
                triton_diff._FAILED.clear()
                with torch.no_grad():
                    err = float((fn().float() - ref).norm() / ref.norm())
                row = {"shape": shape, "dtype": dt_name, "arm": label, "rel_err_vs_2call": err,
                       "fwd_bwd_ms": _time(fb(fn), a.repeats, a.inner) * 1e3,
                       "fwd_ms": _time(fwd(fn), a.repeats, a.inner) * 1e3}
                if triton_diff._FAILED:  # a block shape this GPU cannot hold: the kernels fell back to torch's ops
                    row = {"shape": shape, "dtype": dt_name, "arm": label, "error": triton_diff._FAILED[0]}
                rows.append(row)
                print(row, flush=True)
            triton_diff._blocks = default_blocks
            os.environ.pop(triton_diff.DQ_ENV, None)
    print("\n| shape | dtype | arm | fwd+bwd ms | fwd ms |\n|---|---|---|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['dtype']} | {r['arm']} | {r['error'][:60]} | |")
        else:
            print(f"| {r['shape']} | {r['dtype']} | {r['arm']} | {r['fwd_bwd_ms']:.3f} | {r['fwd_ms']:.3f} |")
    if a.out:
        name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
        Path(a.out).write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
