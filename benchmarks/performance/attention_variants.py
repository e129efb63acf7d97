"""The candidate formulations of differential attention, timed side by side at one layer's shapes.

    python benchmarks/performance/attention_variants.py [--preset small] [--batch 4] [--seq-len 512]
        [--dtypes auto|fp32,bf16] [--repeats 10] [--threads N] [--timer wall|cpu] [--flex] [--out FILE.json]
        [--device cpu|cuda] [--inner K] [--rows PREFIX,...]

Every row is one DIFF layer's attention (the preset's DIFF twin: h heads, Q1/Q2/K1/K2 of d, V of 2d)
against the Transformer twin's attention (2h heads of d through SDPA) as the reference ("x" = its
time / the row's time: above 1 is faster than the Transformer's attention).  Rows:

* ``transformer sdpa``: the yardstick, one SDPA call (CPU: flash);
* ``2call``: two SDPA calls with the 2d-wide value (CPU flash needs equal widths: math kernel);
* ``4call``: four SDPA calls of width d (2x the attention FLOPs);
* ``stacked``: Q1/Q2 stacked as 2h heads in one SDPA call per value half (2 calls, 2x FLOPs);
* ``fused cN``: difftx.nn.fused with query blocks of N rows (N=auto: the library's choice);
* ``eager``: the float32 reference that materialises both maps;
* ``flex 2call`` (--flex): compiled FlexAttention, forward only on the CPU (no CPU backward),
  compiled once per shape (tens of seconds);
* on CUDA also the pairs of calls pinned to one SDPA kernel (``2call efficient``, ``2call cudnn``,
  ``4call flash``, ``stacked flash``, ...): which kernels take a 2d-wide value, and how fast.  A row
  whose kernel refuses the shapes is reported as not run.

On CUDA every timed sample runs the formulation ``--inner`` times (default 10) between two
synchronisations, so launch and sync latency are amortised.

Also the relative error of each formulation in bf16 against float64 (output and gradients).
Repeats are interleaved; medians.  Prints a markdown table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from difftx import ModelConfig  # noqa: E402
from difftx.nn import backends  # noqa: E402
from difftx.nn.fused import chunk_size, fused_attention  # noqa: E402
from difftx.nn.mask import AttnMask  # noqa: E402


def formulations(h, hk, d, scale, mask, flex: bool, device: torch.device = torch.device("cpu")):
    def sdpa_t(q, k, v, lam):  # the Transformer: 2h heads of d
        b, _, _, n, _ = q.shape
        return F.scaled_dot_product_attention(q.reshape(b, 2 * h, n, d), k.reshape(b, 2 * hk, n, d),
                                              v.reshape(b, hk, n, 2, d).permute(0, 3, 1, 2, 4).reshape(b, 2 * hk, n, d),
                                              is_causal=True, scale=scale)

    def pair(variant):
        def f(q, k, v, lam):
            o1, o2 = backends.diff_sdpa(q[:, 0], q[:, 1], k[:, 0], k[:, 1], v, mask, scale, variant=variant)
            return o1.float() - lam * o2.float()
        return f

    def stacked(q, k, v, lam):
        b, _, _, n, _ = q.shape
        qs, ks = q.reshape(b, 2 * h, n, d), k.reshape(b, 2 * hk, n, d)
        va, vb = v[..., :d], v[..., d:]
        o = [F.scaled_dot_product_attention(qs, ks, torch.cat((x, x), 1), is_causal=True, scale=scale)
             for x in (va, vb)]
        o = torch.cat(o, -1)
        return o[:, :h].float() - lam * o[:, h:].float()

    def fused(chunk):
        return lambda q, k, v, lam: fused_attention(q, k, v, mask, scale, lam, chunk=chunk)

    def eager(q, k, v, lam):
        return backends.eager_diff_attention(q[:, 0], q[:, 1], k[:, 0], k[:, 1], v, lam, mask, scale)

    rows = {"transformer sdpa": sdpa_t, "2call": pair("2call"), "4call": pair("4call"), "stacked": stacked}
    for c in (64, 128, None):
        rows[f"fused c{c or 'auto'}"] = fused(c)
    rows["eager"] = eager
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        bm = create_block_mask(lambda b, hh, qi, ki: ki <= qi, None, None, mask.n_q, mask.n_k, device=device)
        fx = torch.compile(flex_attention, dynamic=False)

        def flex2(q, k, v, lam):
            o1 = fx(q[:, 0], k[:, 0], v, block_mask=bm, scale=scale)
            o2 = fx(q[:, 1], k[:, 1], v, block_mask=bm, scale=scale)
            return o1.float() - lam * o2.float()
        rows["flex 2call"] = flex2
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def pinned(f, backend):
            def g(*a):
                with sdpa_kernel([backend]):
                    return f(*a)
            return g

        kernels = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "cudnn": SDPBackend.CUDNN_ATTENTION}
        for kname, backend in kernels.items():
            rows[f"transformer {kname}"] = pinned(sdpa_t, backend)
            rows[f"2call {kname}"] = pinned(pair("2call"), backend)
            rows[f"4call {kname}"] = pinned(pair("4call"), backend)
            rows[f"stacked {kname}"] = pinned(stacked, backend)
    return rows


def measure(args, dtype_name: str) -> list[dict]:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    cfg = ModelConfig.from_preset(args.preset, attention="diff")
    b, n, h, hk, d = args.batch, args.seq_len, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    scale = d ** -0.5
    mask = AttnMask(causal=True, n_q=n, n_k=n)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(*s, generator=g, dtype=torch.float64).to(device) for s in
            ((b, 2, h, n, d), (b, 2, hk, n, d), (b, hk, n, 2 * d))]
    lam = torch.tensor(0.5, requires_grad=True, device=device)
    inputs = [t.to(dtype).requires_grad_() for t in base]
    grad_out = torch.randn(b, h, n, 2 * d, generator=g).to(device)
    rows = formulations(h, hk, d, scale, mask, args.flex, device)
    if args.rows:  # the yardstick and the precision reference always stay
        keep = tuple(x.strip() for x in args.rows.split(",") if x.strip())
        rows = {k: f for k, f in rows.items() if k in ("transformer sdpa", "fused cauto") or k.startswith(keep)}
    inner = args.inner or (1 if device.type == "cpu" else 10)
    if args.timer == "cpu":
        timer = time.process_time
    elif device.type == "cuda":
        def timer():
            torch.cuda.synchronize(device)
            return time.perf_counter()
    else:
        timer = time.perf_counter

    def fwd(f):
        with torch.no_grad():
            f(*inputs, lam)

    def fwd_bwd(f):
        out = f(*inputs, lam)
        if out.dim() == 4 and out.shape[1] == n:  # fused returns (B, N, H, dv)
            out = out.transpose(1, 2)
        if out.shape[1] != h:  # the Transformer row: (B, 2h, N, d) -> same element count
            out = out.reshape(grad_out.shape)
        out.float().backward(grad_out)

    results = []
    for mode, run in (("forward", fwd), ("forward+backward", fwd_bwd)):
        names = [k for k in rows if not (mode != "forward" and k.startswith("flex") and device.type == "cpu")]
        for k in list(names):
            try:
                run(rows[k])
            except Exception as e:  # a kernel pinned by name that refuses these shapes or dtype
                results.append({"dtype": dtype_name, "mode": mode, "formulation": k, "error": _first_line(e)})
                names.remove(k)
        times = {k: [] for k in names}
        for r in range(args.repeats):
            for k in names[r % len(names):] + names[: r % len(names)]:
                t0 = timer()
                for _ in range(inner):
                    run(rows[k])
                times[k].append((timer() - t0) / inner)
        ref = statistics.median(times["transformer sdpa"])
        for k in names:
            med = statistics.median(times[k])
            results.append({"dtype": dtype_name, "mode": mode, "formulation": k, "seconds": med,
                            "speed_vs_transformer": ref / med})
        for t in inputs:
            t.grad = None
    if dtype != torch.float64:
        results += precision(rows, base, lam, grad_out, dtype_name, h, n)
    return results


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def precision(rows, base, lam, grad_out, dtype_name, h, n) -> list[dict]:
    """Relative L2 error of output and input gradients against float64 fused (exact in float64)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]

    def run(f, dt):
        ins = [t.to(dt).detach().requires_grad_() for t in base]
        lm = lam.detach().to(torch.float64 if dt == torch.float64 else torch.float32).requires_grad_()
        out = f(*ins, lm)
        if out.dim() == 4 and out.shape[1] == n:
            out = out.transpose(1, 2)
        out.backward(grad_out.to(out.dtype))
        return [out.double()] + [t.grad.double() for t in ins]

    ref = run(rows["fused cauto"], torch.float64)
    out = []
    for k, f in rows.items():
        if k.startswith("transformer") or k.startswith("flex"):
            continue
        try:
            got = run(f, dtype)
        except Exception:  # a pinned kernel that refuses the shapes: reported with the timings
            continue
        errs = [float((a - b).norm() / b.norm()) for a, b in zip(got, ref)]
        out.append({"dtype": dtype_name, "mode": "relative error vs float64", "formulation": k,
                    "output": errs[0], "dq": errs[1], "dk": errs[2], "dv": errs[3]})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--dtypes", default="auto", help="comma list of fp32, bf16 or auto (default: fp32, and bf16 "
                                                     "where the CPU has bf16 matmul hardware)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int)
    p.add_argument("--timer", choices=["wall", "cpu"], default="wall")
    p.add_argument("--flex", action="store_true", help="also compiled FlexAttention (forward only on CPU)")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("--rows", help="comma list of formulation-name prefixes to time (default: all; the "
                                   "'transformer sdpa' yardstick and 'fused cauto' always run)")
    p.add_argument("--inner", type=int, help="calls per timed sample (default: 1 on the CPU, 10 on CUDA)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_preset(args.preset, attention="diff")
    auto = chunk_size(args.batch, 2, cfg.n_heads, args.seq_len, args.seq_len)
    rows = []
    from difftx.benchmarking import resolve_dtypes

    device = torch.device(args.device)
    for dt in resolve_dtypes(args.dtypes.split(","), device):
        rows += measure(args, dt)
    where = (torch.cuda.get_device_name(device) + f", torch {torch.__version__}" if device.type == "cuda"
             else f"{torch.get_num_threads()} threads")
    print(f"# DIFF attention formulations: preset {args.preset} DIFF twin, batch {args.batch} x {args.seq_len}, "
          f"{where}, {args.timer} time, median of {args.repeats} (fused cauto = c{auto})\n")
    print("| dtype | mode | formulation | ms | x Transformer attention |\n|---|---|---|---:|---:|")
    for r in rows:
        if "seconds" in r:
            print(f"| {r['dtype']} | {r['mode']} | {r['formulation']} | {1000 * r['seconds']:.1f} | "
                  f"{r['speed_vs_transformer']:.2f} |")
        elif "error" in r:
            print(f"| {r['dtype']} | {r['mode']} | {r['formulation']} | not run | {r['error']} |")
    print("\n| dtype | formulation | output | dQ | dK | dV |  (relative L2 error vs float64)\n"
          "|---|---|---:|---:|---:|---:|")
    for r in rows:
        if "output" in r:
            print(f"| {r['dtype']} | {r['formulation']} | {r['output']:.1e} | {r['dq']:.1e} | {r['dk']:.1e} | "
                  f"{r['dv']:.1e} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "device": where, "rows": rows},
                                             indent=2))


if __name__ == "__main__":
    main()
