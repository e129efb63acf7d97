"""Reduced precision on the torch paths: the eager reference and DIFF V2's lambda stay float32 under autocast,
and float16 logits are never rounded to float16 (where they overflow past 65504) in the fused formulation."""

from __future__ import annotations

import pytest
import torch

from difftx import ModelConfig
from difftx.nn import backends, fused
from difftx.nn.attention import make_attention
from difftx.nn.mask import AttnMask
from difftx.nn.rope import RotaryEmbedding


def test_eager_reference_is_float32_under_autocast():
    torch.manual_seed(0)
    q1, q2, k1, k2 = (torch.randn(2, 2, 9, 16).bfloat16() for _ in range(4))
    v = torch.randn(2, 2, 9, 32).bfloat16()
    lam, mask = torch.tensor(0.8123), AttnMask(causal=True, n_q=9, n_k=9)
    want = backends.eager_diff_attention(q1, q2, k1, k2, v, lam, mask, 0.25)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = backends.eager_diff_attention(q1, q2, k1, k2, v, lam, mask, 0.25)
        got1 = backends.eager_attention(q1, k1, v, mask, 0.25)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(got1, backends.eager_attention(q1, k1, v, mask, 0.25))


def test_v2_lambda_is_float32_under_autocast():
    torch.manual_seed(0)
    cfg = ModelConfig(attention="diff2", d_model=32, n_layers=2, n_heads=2, vocab_size=50)
    attn = make_attention(cfg, 1)
    x = torch.randn(2, 6, 32)
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_style).cos_sin(torch.arange(6))
    mask = AttnMask(causal=True, n_q=6, n_k=6)
    attn(x, rope, mask)
    want = attn.last_lambda
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attn(x, rope, mask)
    assert attn.last_lambda.dtype == torch.float32 and torch.equal(attn.last_lambda, want)


@pytest.mark.parametrize("n, grad", [(8, False), (8, True), (1, False)])
@pytest.mark.parametrize("maps", [1, 2])
def test_float16_logits_past_its_range_stay_finite(n, grad, maps):
    """Scaled logits of ~3e5 (float16's largest value is 65504): float32 arithmetic saturates the softmax; the
    fused formulation's products in float16 gave inf - inf = NaN."""
    torch.manual_seed(1)
    b, h, d = 1, 2, 64
    q = (torch.randn(b, maps, h, n, d).sign() * 200).half()
    k = (torch.randn(b, maps, h, 8, d).sign() * 200).half()
    k[..., :n, :] = q  # each query meets its own key: a logit of 200 * 200 * 64 / 8
    v = torch.randn(b, h, 8, d).half()
    lam = torch.tensor(0.5) if maps == 2 else None
    mask = AttnMask(causal=True, n_q=n, n_k=8, q_start=8 - n)
    q.requires_grad_(grad)
    out = fused.fused_attention(q, k, v, mask, d ** -0.5, lam)
    ref = backends.eager_attention(q[:, 0].float(), k[:, 0].float(), v.float(), mask, d ** -0.5)
    if maps == 2:
        ref = ref - 0.5 * backends.eager_attention(q[:, 1].float(), k[:, 1].float(), v.float(), mask, d ** -0.5)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.transpose(1, 2), atol=2e-3, rtol=2e-3)
    if grad:
        out.float().sum().backward()
        assert torch.isfinite(q.grad).all()


def test_float16_blocks_take_their_zero_without_a_copy_of_q(monkeypatch):
    """The float32 products' baddbmm zero comes from the dtype alone: no float32 copy of all of Q per call."""
    seen = []
    real = fused._zero
    monkeypatch.setattr(fused, "_zero", lambda t: seen.append(t.numel()) or real(t))
    q = torch.randn(1, 2, 2, 64, 16).half().requires_grad_()
    k, v = torch.randn(1, 2, 2, 64, 16).half(), torch.randn(1, 2, 64, 32).half()
    out = fused.fused_attention(q, k, v, AttnMask(causal=True, n_q=64, n_k=64), 0.25, torch.tensor(0.5), chunk=16)
    out.float().sum().backward()
    assert seen and max(seen) < q.numel()


@pytest.mark.parametrize("per_token", [False, True])
def test_bf16_torch_backward_keeps_the_softmax_row_sums_float32(monkeypatch, per_token):
    """The pure-torch fused backward (DIFFTX_NATIVE=0, or no native kernels) in bf16: the softmax backward's row
    sums rowsum(P2 * dP) make lambda's gradient.  They were rounded to bf16 before being summed into it (the native
    kernel keeps them float32).  Here every map entry and product is exact in bf16 (uniform maps of 1/256, small
    integer dP), so a float32 row sum gives lambda's gradient exactly."""
    from difftx.nn import native

    monkeypatch.setattr(native, "ENABLED", False)
    torch.manual_seed(0)
    b, h, n, d = 1, 2, 256, 8
    q = torch.zeros(b, 2, h, n, d, dtype=torch.bfloat16, requires_grad=True)  # all logits 0: P = 1/256 exactly
    k = torch.randn(b, 2, h, n, d).bfloat16()
    v = torch.randint(-3, 4, (b, h, n, 2 * d)).bfloat16()
    dout = torch.randint(-3, 4, (b, n, h, 2 * d)).bfloat16()  # dP = dout . v: integers up to 126, exact in bf16
    lam = (torch.full((b, h, n, 1), 0.75) if per_token else torch.tensor(0.75)).requires_grad_()
    mask = AttnMask(causal=False, n_q=n, n_k=n)
    fused.fused_attention(q, k, v, mask, d ** -0.5, lam, chunk=n).backward(dout)
    dp = torch.einsum("bnhe,bhme->bhnm", dout.double(), v.double())  # (B, H, Nq, Nk)
    rows = -(dp / n).sum(-1)  # -rowsum(P2 * dP) per query row: float64, exact
    want = rows[..., None] if per_token else rows.sum()
    assert lam.grad.dtype == torch.float32
    torch.testing.assert_close(lam.grad.double(), want.reshape(lam.grad.shape), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("per_token", [False, True])
def test_bf16_decoding_combines_the_maps_with_a_float32_lambda(per_token):
    """A few-query (decoding) step of the fused kernel in bf16: A1 - lambda A2 with lambda as computed (float32).
    torch.add's alpha on bf16 tensors is rounded to bf16 itself: lambda half-way between two bf16 values was off by
    2^-9 (~1% of (1 - lambda) here, a bias on every key), where the native decoding kernel keeps it float32.
    Uniform maps (all logits 0) of 1/64 and integer values make everything else exact."""
    torch.manual_seed(0)
    b, h, t, d = 2, 2, 64, 16
    q = torch.zeros(b, 2, h, 1, d, dtype=torch.bfloat16)
    k = torch.randn(b, 2, h, t, d).bfloat16()
    v = torch.randint(-8, 9, (b, h, t, 2 * d)).bfloat16()
    lam_value = 0.80078125 + 2 ** -9  # half-way between the bf16 values 0.80078125 and 0.8046875
    lam = torch.full((b, h, 1, 1), lam_value) if per_token else torch.tensor(lam_value)
    mask = AttnMask(causal=True, n_q=1, n_k=t, q_start=t - 1)
    with torch.no_grad():
        out = fused.fused_attention(q, k, v, mask, d ** -0.5, lam)  # (B, 1, H, 2d)
    want = (1 - lam_value) * v.double().mean(2)[:, None]  # (B, 1, H, 2d)
    torch.testing.assert_close(out.double(), want, rtol=2 ** -8, atol=1e-6)
