"""Each DNT norm setting S1..S5 (and ``dnt``), written out from SPEC section 4 as a whole float64 language model.

An independent forward in plain torch, from the model's parameters only: embedding -> [InputNorm] -> per layer
x + [MidNorm](Attn([PreNorm](x))), x + [MidNorm](SwiGLU([PreNorm](x))) -> final norm -> LM head, with QK-norm
(DNT eq. 10: gamma * sqrt(d_h) * q / ||q||, i.e. RMSNorm over each d-wide head) on every query and key head
before RoPE, and DIFF's attention from SPEC section 1 (V2 as the notes describe the official code).  Logits (the
chained inference path and the block-by-block training path) and gradients are compared, so a norm in the wrong
place, a missing one, or one skipped by a fused path shows.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from difftx import ModelConfig, build_model

from ..nn.reference_attention import allowed_mask, rope_complex, softmax_rows

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny float64 models: one thread is fastest

B, N, V, D = 2, 6, 37, 32

# which placements each setting has (SPEC section 4): InputNorm, PreNorm-attn, QKNorm, MidNorm-attn, PreNorm-FFN,
# MidNorm-FFN
SETTINGS = {
    "S1": dict(inp=False, pre_a=True, qk=False, mid_a=False, pre_f=True, mid_f=False),
    "S2": dict(inp=False, pre_a=True, qk=True, mid_a=False, pre_f=True, mid_f=False),
    "S3": dict(inp=True, pre_a=True, qk=True, mid_a=False, pre_f=True, mid_f=False),
    "S4": dict(inp=True, pre_a=True, qk=True, mid_a=True, pre_f=True, mid_f=True),
    "S5": dict(inp=True, pre_a=True, qk=True, mid_a=True, pre_f=False, mid_f=True),
    "dnt": dict(inp=True, pre_a=True, qk=True, mid_a=True, pre_f=False, mid_f=True),
}


def rms(x, w, eps):
    x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return x if w is None else x * w


def ref_attention(x, p, pre, cfg, layer, qk, positions, allowed):
    """One layer's attention on the already-normed x (B, N, D): softmax, DIFF (adjacent pairing) or DIFF V2."""
    d = cfg.head_dim
    q_all, k_all, v_all = x @ p[pre + "q_proj.weight"].T, x @ p[pre + "k_proj.weight"].T, x @ p[pre + "v_proj.weight"].T

    def qkn(t, which):
        if qk:
            t = rms(t, p[pre + which + "_norm.weight"], cfg.norm_eps)
        return rope_complex(t, positions, cfg.rope_theta, cfg.rope_style)

    def attn(q, k):
        return softmax_rows(qkn(q, "q") @ qkn(k, "k").transpose(-1, -2) / math.sqrt(d), allowed)

    heads = []
    if cfg.attention == "softmax":
        for i in range(cfg.n_heads):
            sl = slice(i * d, (i + 1) * d)
            heads.append(attn(q_all[..., sl], k_all[..., sl]) @ v_all[..., sl])
    elif cfg.attention == "diff2":  # 2h query heads; heads 2i, 2i+1 share K/V; lambda = sigmoid(W_lambda x)
        lam = torch.sigmoid(x @ p[pre + "lambda_proj.weight"].T)
        for i in range(cfg.n_heads):
            kv = slice(i * d, (i + 1) * d)
            a1 = attn(q_all[..., 2 * i * d:(2 * i + 1) * d], k_all[..., kv])
            a2 = attn(q_all[..., (2 * i + 1) * d:(2 * i + 2) * d], k_all[..., kv])
            heads.append(a1 @ v_all[..., kv] - lam[..., i:i + 1] * (a2 @ v_all[..., kv]))
    else:
        lam_init = 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))
        lam = (torch.exp((p[pre + "lambda_q1"] * p[pre + "lambda_k1"]).sum())
               - torch.exp((p[pre + "lambda_q2"] * p[pre + "lambda_k2"]).sum()) + lam_init)
        for i in range(cfg.n_heads):
            q1, q2 = q_all[..., 2 * i * d:(2 * i + 1) * d], q_all[..., (2 * i + 1) * d:(2 * i + 2) * d]
            k1, k2 = k_all[..., 2 * i * d:(2 * i + 1) * d], k_all[..., (2 * i + 1) * d:(2 * i + 2) * d]
            v = v_all[..., 2 * i * d:(2 * i + 2) * d]
            o = (attn(q1, k1) - lam * attn(q2, k2)) @ v
            heads.append((1 - lam_init) * rms(o, p[pre + "head_norm.weight"], cfg.head_norm_eps))
    return torch.cat(heads, dim=-1) @ p[pre + "out_proj.weight"].T


def ref_logits(model, ids):
    cfg, s = model.config, SETTINGS[model.config.norms]
    p = dict(model.named_parameters())
    eps = cfg.norm_eps
    positions = torch.arange(N)[None].expand(B, N)
    allowed = allowed_mask(N, None)
    x = F.embedding(ids, p["embed.weight"])
    if s["inp"]:
        x = rms(x, p["input_norm.weight"], eps)
    for li in range(cfg.n_layers):
        pre = f"layers.{li}."
        h = rms(x, p[pre + "attn_norm.weight"], eps) if s["pre_a"] else x
        a = ref_attention(h, p, pre + "attn.", cfg, li + 1, s["qk"], positions, allowed)
        x = x + (rms(a, p[pre + "attn_mid_norm.weight"], eps) if s["mid_a"] else a)
        h = rms(x, p[pre + "ffn_norm.weight"], eps) if s["pre_f"] else x
        f = (F.silu(h @ p[pre + "ffn.w_gate.weight"].T) * (h @ p[pre + "ffn.w_up.weight"].T)) \
            @ p[pre + "ffn.w_down.weight"].T
        x = x + (rms(f, p[pre + "ffn_mid_norm.weight"], eps) if s["mid_f"] else f)
    x = rms(x, p["final_norm.weight"], eps)
    return x @ p["lm_head.weight"].T


def _model(attention, norms):
    heads = {"softmax": 4, "diff": 2, "diff2": 2}[attention]
    cfg = ModelConfig(attention=attention, norms=norms, d_model=D, n_heads=heads, head_dim=4, n_layers=3,
                      vocab_size=V, max_seq_len=16, positions="rope", rope_style="half", ffn="swiglu",
                      pairing="adjacent", tie_embeddings=False, bias=False, norm="rms")
    torch.manual_seed(0)
    model = build_model(cfg).double()
    with torch.no_grad():  # every gain away from 1 and lambda away from its init, so a misplaced norm shows
        for name, prm in model.named_parameters():
            if prm.dim() == 1 and "lambda_" in name:
                prm.normal_(0, 0.3)
            elif prm.dim() == 1:
                prm.uniform_(0.5, 1.5)
            else:
                prm.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("norms", list(SETTINGS))
@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
def test_norm_setting_forward_and_grads_match_the_equations(attention, norms):
    model = _model(attention, norms)
    ids = torch.randint(0, V, (B, N), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fast = model(ids).logits  # the chained path (residual additions fused into the next norm)
    out = model(ids).logits
    ref = ref_logits(model, ids)
    assert out.dtype == torch.float64
    torch.testing.assert_close(fast, ref.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    w = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    names, params = zip(*model.named_parameters())
    got = torch.autograd.grad((out * w).sum(), params)
    want = torch.autograd.grad((ref * w).sum(), params)
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m: f"grad {name}: {m}")
