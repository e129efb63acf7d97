"""DIFF attention at long context: time and peak memory from 1K to 16K tokens (``difftx bench --long-context``).

One layer's differential attention (the preset's DIFF twin: h heads, Q1/Q2/K1/K2 of d, V of 2d),
forward and backward, through each formulation:

* ``fused``: :mod:`difftx.nn.fused`, query blocks against the keys they can see; only one block
  of maps exists at a time, so memory grows linearly in N;
* ``4call``: four SDPA (flash) calls of width d: linear memory too, at twice the attention FLOPs;
* ``eager``: the reference, which materialises both N x N maps (run only up to ``eager_max``).

The peak is the high-water mark of tensor bytes the attention allocates on top of its inputs
(:func:`difftx.benchmarking.memory.peak_live_bytes`), including its gradients; "one N x N map"
is what a single fp32 attention map of one head would take, for scale.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from ..config import ModelConfig
from ..nn import backends
from ..nn.fused import fused_attention
from ..nn.mask import AttnMask
from .memory import peak_live_bytes

VARIANTS = ("fused", "4call", "eager")


def _inputs(cfg: ModelConfig, n: int, batch: int, dtype: torch.dtype, seed: int = 0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h, hk, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def t(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_()

    q, k, v = t(batch, 2, h, n, d), t(batch, 2, hk, n, d), t(batch, hk, n, 2 * d)
    lam = torch.tensor(0.5, device=device, requires_grad=True)
    return q, k, v, lam


def _run(variant: str, q, k, v, lam, scale: float, backward: bool) -> None:
    n = q.shape[3]
    mask = AttnMask(causal=True, n_q=n, n_k=n)
    with torch.set_grad_enabled(backward):
        if variant == "fused":
            out = fused_attention(q, k, v, mask, scale, lam)
        elif variant == "eager":
            out = backends.eager_diff_attention(q[:, 0], q[:, 1], k[:, 0], k[:, 1], v, lam, mask, scale)
        else:
            o1, o2 = backends.diff_sdpa(q[:, 0], q[:, 1], k[:, 0], k[:, 1], v, mask, scale, variant=variant)
            out = o1.float() - lam * o2.float()
        if backward:
            out.float().sum().backward()


def check_memory(lengths: list[int], preset: str = "small", batch: int = 1, dtype: str = "bf16",
                 device: str = "cpu") -> None:
    """InsufficientMemory, one line, when the longest length's inputs and their gradients (Q1/Q2/K1/K2/V of the
    preset's DIFF twin, ``batch`` sequences in ``dtype``) cannot fit in the device's free memory (the rule of the
    training check; ``DIFFTX_MEMORY_CHECK=0`` skips it).  --lengths 10**11 crashed with torch's allocator error as
    a traceback, after --out was made."""
    from ..train import memory_check

    cfg = ModelConfig.from_preset(preset, attention="diff")
    n, size = max(lengths), {"fp32": 4, "bf16": 2}[dtype]
    need = 2 * size * batch * n * cfg.head_dim * (2 * cfg.n_heads + 4 * cfg.n_kv_heads)  # inputs and gradients
    memory_check.require_bytes(need, device, f"{batch:,} sequence(s) of {n:,} tokens of one {preset} DIFF attention "
                                             "layer's inputs and gradients",
                               "pass shorter --lengths or a smaller --batch-size")


def attention_scaling(lengths: list[int], preset: str = "small", batch: int = 1, dtype: str = "bf16",
                      variants: tuple = VARIANTS, eager_max: int = 4096, backward: bool = True,
                      log: Callable[[str], None] = print, device: str = "cpu") -> dict:
    """Seconds and peak bytes per (variant, N) on ``device``; see the module docstring."""
    cfg = ModelConfig.from_preset(preset, attention="diff")
    device = torch.device(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    scale = cfg.head_dim ** -0.5
    rows, method = [], None  # method: how the peaks were measured (None when no cell ran)
    for n in lengths:
        for variant in variants:
            if variant == "eager" and n > eager_max:
                continue
            q, k, v, lam = _inputs(cfg, n, batch, torch_dtype, device=device)
            if device.type == "cuda":  # an untimed run first: the cuBLAS / cuDNN workspaces a first call allocates
                _run(variant, q, k, v, lam, scale, backward)  # count in max_memory_allocated, not the attention
                for t in (q, k, v, lam):
                    t.grad = None
            peak, method = peak_live_bytes(lambda: _run(variant, q, k, v, lam, scale, backward), device)
            for t in (q, k, v, lam):
                t.grad = None
            sync()
            t0 = time.perf_counter()
            _run(variant, q, k, v, lam, scale, backward)
            sync()
            seconds = time.perf_counter() - t0
            row = {"n": n, "variant": variant, "seconds": seconds, "peak_bytes": peak,
                   "peak_bytes_per_token": peak / (batch * n), "one_map_fp32_bytes": 4 * n * n}
            rows.append(row)
            log(f"  N={n:6d} {variant:6s} {seconds:8.2f} s  peak {peak / 2**20:9.1f} MiB "
                f"({peak / (batch * n) / 1024:.1f} KiB/token)")
    return {"rows": rows, "preset": preset, "batch": batch, "dtype": dtype, "device": str(device),
            "backward": backward, "heads": cfg.n_heads, "head_dim": cfg.head_dim, "memory_method": method,
            "growth": _growth(rows)}


def _growth(rows: list[dict]) -> dict:
    """Per variant, peak bytes per token at the longest N over that at the shortest (1.0 = linear)."""
    out = {}
    for variant in {r["variant"] for r in rows}:
        rs = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["n"])
        if len(rs) >= 2 and rs[0]["peak_bytes"] > 0:
            out[variant] = {"n_from": rs[0]["n"], "n_to": rs[-1]["n"],
                            "bytes_per_token_ratio": rs[-1]["peak_bytes_per_token"] / rs[0]["peak_bytes_per_token"]}
    return out


def markdown(result: dict, command: Optional[str] = None) -> str:
    lines = [f"# DIFF attention at long context ({result['preset']} DIFF twin: {result['heads']} heads of "
             f"d={result['head_dim']}, batch {result['batch']}, {result['dtype']} on {result.get('device', 'cpu')}, "
             f"{'forward + backward' if result['backward'] else 'forward'})", ""]
    if command:
        lines += [f"`{command}`", ""]
    lines += ["| N | variant | seconds | peak MiB | KiB / token | one N x N fp32 map, MiB |",
              "|---:|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['n']} | {r['variant']} | {r['seconds']:.2f} | {r['peak_bytes'] / 2**20:.1f} | "
                     f"{r['peak_bytes_per_token'] / 1024:.1f} | {r['one_map_fp32_bytes'] / 2**20:.0f} |")
    lines += ["", "Growth of peak bytes per token from the shortest to the longest N (1.0 = memory linear in N):", ""]
    for variant, g in sorted(result["growth"].items()):
        lines.append(f"- {variant}: {g['bytes_per_token_ratio']:.2f}x from N={g['n_from']} to N={g['n_to']}")
    lines += ["", f"Memory: {result['memory_method']}, attention inputs excluded, gradients included.", ""]
    return "\n".join(lines)
