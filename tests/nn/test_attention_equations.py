"""Differential attention equals an independent implementation of SPEC eq. 1-3 (float64).

Outputs and gradients, for causal and padded batches, GQA, both pairing
conventions, both RoPE styles and every backend.  Also DIFF V2 and softmax
attention against their own references, and lambda exactly as SPEC.
"""

from __future__ import annotations

import math

import pytest
import torch

from difftx import ModelConfig, lambda_init_for_layer
from difftx.nn.attention import make_attention
from difftx.nn.backends import flex_available
from difftx.nn.mask import AttnMask
from difftx.nn.rope import RotaryEmbedding

from .reference_attention import (allowed_mask, ref_diff2_attention, ref_diff_attention,
                                  ref_softmax_attention)

B, N = 2, 7


def _inputs(cfg, padded: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, cfg.d_model, generator=g, dtype=torch.float64, requires_grad=True)
    valid = None
    positions = torch.arange(N)[None].expand(B, N)
    if padded:  # row 0 left-padded by 3, row 1 right-padded by 2
        valid = torch.ones(B, N, dtype=torch.bool)
        valid[0, :3] = False
        valid[1, -2:] = False
        positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
    return x, valid, positions


def _module(cfg, layer=3):
    torch.manual_seed(1)
    m = make_attention(cfg, layer).double()
    with torch.no_grad():  # make lambda far from its init so a wrong formula shows
        for name, p in m.named_parameters():
            if name.startswith("lambda_") and p.dim() == 1:
                p.normal_(0, 0.4)
            if name.endswith("head_norm.weight"):
                p.uniform_(0.5, 1.5)
    return m


def _run_module(m, cfg, x, valid, positions, backend, variant="auto"):
    m.backend = backend
    m.diff_variant = variant
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_style).cos_sin(positions, torch.float64)
    mask = AttnMask(causal=True, n_q=N, n_k=N, key_valid=valid)
    return m(x, rope, mask)


def _params(m) -> dict:
    p = {k.replace(".weight", ""): v for k, v in m.named_parameters()}
    return p


def _compare(out, ref, x, m, valid, tol=1e-10):
    """Outputs equal at real query positions; gradients of a random projection of them equal."""
    keep = torch.ones(B, N, dtype=torch.bool) if valid is None else valid
    assert torch.allclose(out[keep], ref[keep], atol=tol, rtol=tol), (out[keep] - ref[keep]).abs().max()
    w = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    w = w * keep[..., None]
    params = [x] + [p for p in m.parameters()]
    g_out = torch.autograd.grad((out * w).sum(), params, allow_unused=True)
    g_ref = torch.autograd.grad((ref * w).sum(), params, allow_unused=True)
    names = ["x"] + [n for n, _ in m.named_parameters()]
    for name, a, b in zip(names, g_out, g_ref):
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        assert torch.allclose(a, b, atol=tol, rtol=tol), f"grad {name}: {(a - b).abs().max():.3e}"


DIFF_CASES = [
    # pairing, rope_style, n_heads, n_kv_heads, padded
    ("adjacent", "interleaved", 2, 2, False),
    ("adjacent", "half", 4, 2, True),   # GQA: each of a head's two maps must use its own keys
    ("halves", "half", 2, 2, True),
    ("halves", "interleaved", 4, 1, False),
    ("adjacent", "half", 4, 1, True),
]


@pytest.mark.parametrize("pairing,rope_style,h,h_kv,padded", DIFF_CASES)
@pytest.mark.parametrize("backend,variant", [("eager", "auto"), ("sdpa", "2call"), ("sdpa", "4call"),
                                             ("sdpa", "auto")])
def test_diff_attention_matches_spec(pairing, rope_style, h, h_kv, padded, backend, variant):
    cfg = ModelConfig(attention="diff", d_model=48, n_heads=h, n_kv_heads=h_kv, head_dim=6, pairing=pairing,
                      rope_style=rope_style, n_layers=4)
    m = _module(cfg, layer=3)
    x, valid, positions = _inputs(cfg, padded)
    out = _run_module(m, cfg, x, valid, positions, backend, variant)
    p = _params(m)
    ref = ref_diff_attention(x, p, h=h, h_kv=h_kv, d=6, pairing=pairing, lambda_init=lambda_init_for_layer(3),
                             positions=positions, theta=cfg.rope_theta, rope_style=rope_style,
                             allowed=allowed_mask(N, valid))
    _compare(out, ref, x, m, valid)


@pytest.mark.parametrize("pairing,rope_style,h,h_kv,padded", DIFF_CASES[:3])
def test_diff_attention_flex_forward(pairing, rope_style, h, h_kv, padded):
    cfg = ModelConfig(attention="diff", d_model=48, n_heads=h, n_kv_heads=h_kv, head_dim=6, pairing=pairing,
                      rope_style=rope_style, n_layers=4)
    m = _module(cfg, layer=2)
    x, valid, positions = _inputs(cfg, padded)
    with torch.no_grad():
        out = _run_module(m, cfg, x, valid, positions, "flex")
        m.backend = "eager"
        ref = _run_module(m, cfg, x, valid, positions, "eager")
    keep = torch.ones(B, N, dtype=torch.bool) if valid is None else valid
    assert torch.allclose(out[keep], ref[keep], atol=1e-10)


@pytest.mark.skipif(not flex_available(), reason="FlexAttention is not available in this torch")
@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
@pytest.mark.parametrize("causal", [True, False])
def test_flex_takes_one_key_valid_row_for_the_whole_batch(attention, causal):
    """AttnMask accepts key_valid with one row for every sequence (as the dense mask broadcasts it); flex's block
    mask indexed that row by the batch index (IndexError for batch > 1)."""
    cfg = ModelConfig(attention=attention, d_model=24, n_heads=2, n_kv_heads=1, head_dim=6, n_layers=2,
                      positions="none")
    m = _module(cfg, layer=2)
    x = torch.randn(3, 5, cfg.d_model, dtype=torch.float64)
    mask = AttnMask(causal=causal, n_q=5, n_k=5, key_valid=torch.tensor([[False, True, True, False, True]]))
    _flex_matches_eager(m, x, mask)


def _flex_matches_eager(m, x, mask) -> None:
    """Module ``m`` on the flex backend gives its eager output on ``x`` (float64: to 1e-10)."""
    with torch.no_grad():
        m.backend = "eager"
        ref = m(x, None, mask)
        m.backend = "flex"
        out = m(x, None, mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not flex_available(), reason="FlexAttention is not available in this torch")
@pytest.mark.parametrize("attention", ["softmax", "diff"])
def test_compiled_flex_serves_float64_on_the_cpu(attention, monkeypatch):
    """Inductor's CPU FlexAttention takes float32, float16 and bfloat16 only: a float64 model on the flex backend
    (compiled, the default) raised a LoweringException at its first forward."""
    from torch.nn.attention.flex_attention import flex_attention

    from difftx.nn import backends

    monkeypatch.setattr(backends, "_FLEX", torch.compile(flex_attention, dynamic=False))  # DIFFTX_FLEX_COMPILE=1
    cfg = ModelConfig(attention=attention, d_model=24, n_heads=2, n_kv_heads=1, head_dim=6, n_layers=2,
                      positions="none")
    m = _module(cfg, layer=2)
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64)
    mask = AttnMask(causal=True, n_q=5, n_k=5, key_valid=torch.tensor([[False, True, True, True, True]] * 2))
    _flex_matches_eager(m, x, mask)


@pytest.mark.parametrize("head_norm,weight", [(False, False), (True, False)])
def test_diff_attention_norm_ablations(head_norm, weight):
    """Without the per-head norm (paper's 'without GroupNorm'), and without its learnable weight (DiffLlama)."""
    cfg = ModelConfig(attention="diff", d_model=24, n_heads=2, head_dim=6, head_norm=head_norm,
                      head_norm_weight=weight, n_layers=2)
    m = _module(cfg, layer=1)
    assert (m.head_norm is None) == (not head_norm)
    if head_norm:
        assert m.head_norm.weight is None
    x, valid, positions = _inputs(cfg, True)
    out = _run_module(m, cfg, x, valid, positions, "sdpa")
    ref = ref_diff_attention(x, _params(m), h=2, h_kv=2, d=6, pairing="adjacent", lambda_init=0.2,
                             positions=positions, theta=cfg.rope_theta, rope_style="half",
                             allowed=allowed_mask(N, valid), head_norm=head_norm)
    _compare(out, ref, x, m, valid)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("h,h_kv,padded", [(2, 2, False), (4, 2, True), (4, 1, True)])
def test_diff2_attention_matches_reference(backend, h, h_kv, padded):
    cfg = ModelConfig(attention="diff2", d_model=32, n_heads=h, n_kv_heads=h_kv, head_dim=6, n_layers=2,
                      rope_style="interleaved")
    m = _module(cfg)
    x, valid, positions = _inputs(cfg, padded)
    out = _run_module(m, cfg, x, valid, positions, backend)
    ref = ref_diff2_attention(x, _params(m), h=h, h_kv=h_kv, d=6, positions=positions, theta=cfg.rope_theta,
                              rope_style="interleaved", allowed=allowed_mask(N, valid))
    _compare(out, ref, x, m, valid)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("h,h_kv,padded", [(4, 4, False), (4, 2, True)])
def test_softmax_attention_matches_reference(backend, h, h_kv, padded):
    cfg = ModelConfig(attention="softmax", d_model=24, n_heads=h, n_kv_heads=h_kv, head_dim=6, n_layers=2)
    m = _module(cfg)
    x, valid, positions = _inputs(cfg, padded)
    out = _run_module(m, cfg, x, valid, positions, backend)
    ref = ref_softmax_attention(x, _params(m), h=h, h_kv=h_kv, d=6, positions=positions, theta=cfg.rope_theta,
                                rope_style="half", allowed=allowed_mask(N, valid))
    _compare(out, ref, x, m, valid)


def test_lambda_init_schedule_exact():
    # SPEC: lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1)), l 1-based: layer 1 gets 0.2
    assert lambda_init_for_layer(1) == pytest.approx(0.2, abs=1e-15)
    for layer in range(1, 30):
        assert lambda_init_for_layer(layer) == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * (layer - 1)), abs=1e-15)
    assert lambda_init_for_layer(5, 0.5) == 0.5
    with pytest.raises(ValueError):
        lambda_init_for_layer(0)
    cfg = ModelConfig(attention="diff", d_model=32, n_heads=2, n_layers=6)
    from difftx import build_model

    model = build_model(cfg)
    inits = [layer.attn.lambda_init for layer in model.layers]
    assert inits == [lambda_init_for_layer(i) for i in range(1, 7)]
    const = build_model(cfg.replace(lambda_init=0.8))
    assert all(layer.attn.lambda_init == 0.8 for layer in const.layers)


def test_lambda_reparameterisation_and_readout():
    cfg = ModelConfig(attention="diff", d_model=32, n_heads=2, n_layers=3, lambda_std=0.1)
    from difftx import build_model

    model = build_model(cfg)
    values = model.lambdas()
    assert len(values) == 3
    for i, layer in enumerate(model.layers):
        a = layer.attn
        expected = (math.exp(float((a.lambda_q1.double() * a.lambda_k1.double()).sum().detach()))
                    - math.exp(float((a.lambda_q2.double() * a.lambda_k2.double()).sum().detach()))
                    + lambda_init_for_layer(i + 1))
        assert values[i] == pytest.approx(expected, rel=1e-6)
        assert a.lambda_full().dtype == torch.float32
        assert a.lambda_q1.shape == (cfg.head_dim,)  # one set of vectors per layer, shared by its heads
        # lambda stays fp32 even when the model is cast
    half = build_model(cfg).to(torch.bfloat16)
    assert half.layers[0].attn.lambda_full().dtype == torch.float32
    # lambda vectors initialised N(0, lambda_std)
    torch.manual_seed(1234)
    big = build_model(ModelConfig(attention="diff", d_model=512, n_heads=2, n_layers=2, lambda_std=0.1))
    sample = torch.cat([big.layers[0].attn.lambda_q1, big.layers[1].attn.lambda_k2])
    assert 0.08 < float(sample.detach().std()) < 0.12


@pytest.mark.parametrize("backend,variant", [("eager", "auto"), ("sdpa", "fused"), ("sdpa", "2call")])
def test_lambda_with_large_equal_exponents_is_finite(backend, variant):
    """lq1 . lk1 = lq2 . lk2 = 100: each exp overflows float32 (past 88.7), but lambda = lambda_init exactly.
    Computed in float32 it was inf - inf = NaN, and so was every output and input gradient of the layer."""
    cfg = ModelConfig(attention="diff", d_model=32, n_heads=2, n_layers=3, qk_norm=False)
    a = make_attention(cfg, 3)
    with torch.no_grad():
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            getattr(a, name).fill_(math.sqrt(100.0 / cfg.head_dim))
    lam = a.lambda_full().detach()
    assert lam.dtype == torch.float32 and float(lam) == pytest.approx(lambda_init_for_layer(3), abs=1e-6)
    ref = make_attention(cfg, 3).double()
    ref.load_state_dict(a.state_dict())
    ref.backend = "eager"
    a.backend, a.diff_variant = backend, variant
    x, _, positions = _inputs(cfg, padded=False)
    rope = RotaryEmbedding(cfg.head_dim).cos_sin(positions)
    mask = AttnMask(causal=True, n_q=N, n_k=N)
    xf = x.detach().float().requires_grad_(True)
    y = a(xf, rope, mask)
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(xf.grad).all()
    with torch.no_grad():
        expected = ref(x.detach(), tuple(t.double() for t in rope), mask)
    torch.testing.assert_close(y.double(), expected, rtol=1e-4, atol=1e-5)
