"""Straightforward, independent implementations of the attention equations, for tests.

Written from SPEC eq. 1-3 (and the official V2 code's semantics) with explicit
per-head loops, explicit slicing of the projection rows by pairing convention,
a complex-number RoPE and an explicit boolean mask.  Nothing here imports the
product's attention code.
"""

from __future__ import annotations

import math

import torch


def rope_complex(x: torch.Tensor, positions: torch.Tensor, theta: float, style: str) -> torch.Tensor:
    """Rotate x (B, N, d) at integer positions (B, N): pair (m, m + d/2) ('half') or (2m, 2m+1)."""
    d = x.shape[-1]
    m = torch.arange(d // 2, dtype=torch.float64)
    freq = theta ** (-2.0 * m / d)
    angle = positions.to(torch.float64)[..., None] * freq  # (B, N, d/2)
    rot = torch.polar(torch.ones_like(angle), angle)
    if style == "half":
        z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double()) * rot
        return torch.cat((z.real, z.imag), dim=-1).to(x.dtype)
    z = torch.complex(x[..., 0::2].double(), x[..., 1::2].double()) * rot
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real.to(x.dtype), z.imag.to(x.dtype)
    return out


def allowed_mask(n: int, valid: torch.Tensor | None, causal: bool = True) -> torch.Tensor:
    """(B, N, N) bool: query t may see key s when s <= t (causal), s is a real token, or s == t."""
    b = 1 if valid is None else valid.shape[0]
    out = torch.zeros(b, n, n, dtype=torch.bool)
    for bi in range(b):
        for t in range(n):
            for s in range(n):
                ok = (s <= t) if causal else True
                if valid is not None:
                    ok = ok and bool(valid[bi, s])
                out[bi, t, s] = ok or s == t
    return out


def softmax_rows(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    logits = logits.masked_fill(~allowed, float("-inf"))
    return torch.softmax(logits, dim=-1)


def ref_diff_attention(x, p: dict, *, h: int, h_kv: int, d: int, pairing: str, lambda_init: float,
                       positions, theta: float, rope_style: str | None, allowed, head_norm: bool = True,
                       eps: float = 1e-5) -> torch.Tensor:
    """SPEC eq. 1-3 for one layer; p holds q_proj, k_proj, v_proj, out_proj weights, lambda vectors, norm weight."""
    q_all, k_all, v_all = x @ p["q_proj"].T, x @ p["k_proj"].T, x @ p["v_proj"].T
    lam = (torch.exp((p["lambda_q1"] * p["lambda_k1"]).sum()) - torch.exp((p["lambda_q2"] * p["lambda_k2"]).sum())
           + lambda_init)
    group = h // h_kv
    heads = []
    for i in range(h):
        j = i // group
        if pairing == "adjacent":
            q1, q2 = q_all[..., 2 * i * d:(2 * i + 1) * d], q_all[..., (2 * i + 1) * d:(2 * i + 2) * d]
            k1, k2 = k_all[..., 2 * j * d:(2 * j + 1) * d], k_all[..., (2 * j + 1) * d:(2 * j + 2) * d]
            v = v_all[..., 2 * j * d:(2 * j + 2) * d]
        else:
            q1, q2 = q_all[..., i * d:(i + 1) * d], q_all[..., (h + i) * d:(h + i + 1) * d]
            k1, k2 = k_all[..., j * d:(j + 1) * d], k_all[..., (h_kv + j) * d:(h_kv + j + 1) * d]
            v = torch.cat((v_all[..., j * d:(j + 1) * d], v_all[..., (h_kv + j) * d:(h_kv + j + 1) * d]), dim=-1)
        if rope_style is not None:
            q1, q2, k1, k2 = (rope_complex(t, positions, theta, rope_style) for t in (q1, q2, k1, k2))
        a1 = softmax_rows(q1 @ k1.transpose(-1, -2) / math.sqrt(d), allowed)
        a2 = softmax_rows(q2 @ k2.transpose(-1, -2) / math.sqrt(d), allowed)
        o = (a1 - lam * a2) @ v
        if head_norm:
            o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + eps)
            if p.get("head_norm") is not None:
                o = o * p["head_norm"]
            o = o * (1 - lambda_init)
        heads.append(o)
    return torch.cat(heads, dim=-1) @ p["out_proj"].T


def ref_softmax_attention(x, p: dict, *, h: int, h_kv: int, d: int, positions, theta, rope_style, allowed):
    q_all, k_all, v_all = x @ p["q_proj"].T, x @ p["k_proj"].T, x @ p["v_proj"].T
    heads = []
    for i in range(h):
        j = i // (h // h_kv)
        q, k, v = q_all[..., i * d:(i + 1) * d], k_all[..., j * d:(j + 1) * d], v_all[..., j * d:(j + 1) * d]
        if rope_style is not None:
            q, k = rope_complex(q, positions, theta, rope_style), rope_complex(k, positions, theta, rope_style)
        heads.append(softmax_rows(q @ k.transpose(-1, -2) / math.sqrt(d), allowed) @ v)
    return torch.cat(heads, dim=-1) @ p["out_proj"].T


def ref_diff2_attention(x, p: dict, *, h: int, h_kv: int, d: int, positions, theta, rope_style, allowed):
    """Official V2: 2h query heads, GQA over h_kv heads, out_i = attn_2i - sigmoid(W x)_i attn_2i+1."""
    q_all, k_all, v_all = x @ p["q_proj"].T, x @ p["k_proj"].T, x @ p["v_proj"].T
    lam = torch.sigmoid(x @ p["lambda_proj"].T)  # (B, N, h)
    group = (2 * h) // h_kv
    outs = []
    for c in range(2 * h):
        j = c // group
        q, k, v = q_all[..., c * d:(c + 1) * d], k_all[..., j * d:(j + 1) * d], v_all[..., j * d:(j + 1) * d]
        if rope_style is not None:
            q, k = rope_complex(q, positions, theta, rope_style), rope_complex(k, positions, theta, rope_style)
        outs.append(softmax_rows(q @ k.transpose(-1, -2) / math.sqrt(d), allowed) @ v)
    heads = [outs[2 * i] - lam[..., i:i + 1] * outs[2 * i + 1] for i in range(h)]
    return torch.cat(heads, dim=-1) @ p["out_proj"].T
