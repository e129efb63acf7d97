"""Function-preserving re-layouts of a difftx state dict: head pairing and RoPE channel order.

Checkpoint families disagree on two conventions that change *where* numbers sit,
not what the model computes (SPEC, "conventions real checkpoints disagree on"):

* ``pairing`` (DIFF only): ``adjacent`` stores the components of differential
  head i as rows 2i, 2i+1 of q_proj/k_proj (the value of K/V group g as 2d
  contiguous rows); ``halves`` stores them at i and i + h (values at g, g + h_kv).
* ``rope_style``: ``half`` rotates channel j with j + d/2, ``interleaved`` rotates
  2j with 2j + 1.  The same rotation is obtained by permuting the channels of
  every d-wide q/k head (and of the QK-norm gain, which acts before RoPE).

:func:`relayout` moves a state dict from one convention to another; the model
built from the returned config computes the same function (tested to fp32
rounding).  :func:`diff_components` / :func:`pack_diff` expose the logical
pieces (Q1, Q2, K1, K2, V halves) so converters never hard-code a row layout.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import ModelConfig


def rope_channel_index(d: int, src: str, dst: str) -> torch.Tensor:
    """Index ``idx`` with ``w_dst = w_src[idx]`` for the d channels of one head."""
    if src == dst:
        return torch.arange(d)
    half = torch.arange(d).view(2, d // 2)  # half layout: row 0 = first halves, row 1 = partners
    if src == "half" and dst == "interleaved":
        return half.t().reshape(d)  # dst channel 2j <- src j, 2j+1 <- src j + d/2
    if src == "interleaved" and dst == "half":
        return torch.arange(d).view(d // 2, 2).t().reshape(d)  # dst j <- src 2j, j + d/2 <- src 2j+1
    raise ValueError(f"unknown rope styles {src!r} -> {dst!r}")


def _permute_head_rows(w: torch.Tensor, n_heads: int, d: int, idx: torch.Tensor) -> torch.Tensor:
    """Permute the d rows (or entries, for a bias) inside each of ``n_heads`` blocks."""
    rest = w.shape[1:]
    return w.reshape(n_heads, d, *rest)[:, idx].reshape(n_heads * d, *rest)


def _swap_pairing(w: torch.Tensor, n: int, d: int, src: str, dst: str) -> torch.Tensor:
    """Rows of 2n blocks of d: adjacent (n, 2, d) <-> halves (2, n, d)."""
    if src == dst:
        return w
    rest = w.shape[1:]
    shape = (n, 2, d) if src == "adjacent" else (2, n, d)
    return w.reshape(*shape, *rest).transpose(0, 1).reshape(2 * n * d, *rest).contiguous()


def relayout(state: dict, cfg: ModelConfig, pairing: Optional[str] = None,
             rope_style: Optional[str] = None) -> tuple[ModelConfig, dict]:
    """Return ``(cfg', state')`` using ``pairing`` / ``rope_style``; the function is unchanged."""
    pairing = pairing or cfg.pairing
    rope_style = rope_style or cfg.rope_style
    if cfg.attention != "diff":
        pairing = cfg.pairing  # only DIFF V1 has a pairing; diff2 is always adjacent
    out = dict(state)
    d, h, hk = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    n_q, n_k = cfg.n_q_components, cfg.n_kv_components
    rope_idx = None
    if cfg.positions == "rope" and rope_style != cfg.rope_style:
        rope_idx = rope_channel_index(d, cfg.rope_style, rope_style)
    for i in range(cfg.n_layers):
        p = f"layers.{i}.attn."
        for suffix in ("weight", "bias"):
            q, k, v = (p + f"{name}.{suffix}" for name in ("q_proj", "k_proj", "v_proj"))
            if q not in out:
                continue
            if rope_idx is not None:
                out[q] = _permute_head_rows(out[q], n_q, d, rope_idx)
                out[k] = _permute_head_rows(out[k], n_k, d, rope_idx)
            if cfg.attention == "diff":
                out[q] = _swap_pairing(out[q], h, d, cfg.pairing, pairing)
                out[k] = _swap_pairing(out[k], hk, d, cfg.pairing, pairing)
                out[v] = _swap_pairing(out[v], hk, d, cfg.pairing, pairing)
        if rope_idx is not None:
            for norm in ("q_norm", "k_norm"):
                for suffix in ("weight", "bias"):
                    key = p + f"{norm}.{suffix}"
                    if key in out:
                        out[key] = out[key][rope_idx].contiguous()
    return cfg.replace(pairing=pairing, rope_style=rope_style), out


# ---------------------------------------------------------------------- logical DIFF components
def diff_components(state: dict, cfg: ModelConfig, layer: int) -> dict:
    """The pieces of DIFF layer ``layer`` (0-based), independent of the row layout.

    Returns q1, q2 (h, d, D); k1, k2 (h_kv, d, D); va, vb (h_kv, d, D): the first
    and second d channels of each group's 2d-wide value; out (D, h, 2, d).
    """
    _, sd = relayout({k: v for k, v in state.items() if k.startswith(f"layers.{layer}.attn.")}, cfg,
                     pairing="halves")
    p = f"layers.{layer}.attn."
    d, h, hk = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    q = sd[p + "q_proj.weight"].reshape(2, h, d, -1)
    k = sd[p + "k_proj.weight"].reshape(2, hk, d, -1)
    v = sd[p + "v_proj.weight"].reshape(2, hk, d, -1)
    out = sd[p + "out_proj.weight"].reshape(-1, h, 2, d)
    return dict(q1=q[0], q2=q[1], k1=k[0], k2=k[1], va=v[0], vb=v[1], out=out)


def pack_diff(parts: dict, pairing: str) -> dict:
    """Inverse of :func:`diff_components`: q/k/v/out weights in ``pairing`` layout (no layer prefix)."""
    h, d = parts["q1"].shape[:2]
    hk = parts["k1"].shape[0]
    D = parts["q1"].shape[-1]
    q = torch.stack((parts["q1"], parts["q2"])).reshape(2 * h * d, D)
    k = torch.stack((parts["k1"], parts["k2"])).reshape(2 * hk * d, D)
    v = torch.stack((parts["va"], parts["vb"])).reshape(2 * hk * d, D)
    out = parts["out"].reshape(parts["out"].shape[0], 2 * h * d)
    return {
        "q_proj.weight": _swap_pairing(q, h, d, "halves", pairing),
        "k_proj.weight": _swap_pairing(k, hk, d, "halves", pairing),
        "v_proj.weight": _swap_pairing(v, hk, d, "halves", pairing),
        "out_proj.weight": out.contiguous(),
    }
