"""The DIFF block's hand-derived backward against autograd and against difftx's own Block.

Also the DIFF paper's Appendix E gradient formulas (eqs. 7 and 9), written out
literally, against autograd.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from difftx.analysis.reference import bridge, diff
from .grads_helpers import assert_rel, grads_of, leaf, leaves

pytestmark = pytest.mark.reference


def _rms(x, w, eps):
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def _rope(x, cos, sin, style):
    if style == "half":
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


def torch_diff_block(t: dict, cfg: diff.DiffBlockConfig, X, cos=None, sin=None) -> torch.Tensor:
    """SPEC section 1 in plain torch ops."""
    T = X.shape[1]
    Xn = _rms(X, t["attn_norm"], cfg.eps)
    pr = {k: torch.einsum("btd,hdk->bhtk", Xn, t[k]) for k in diff.ATTN_KEYS}
    if cfg.rope_style is not None:
        c, s = torch.tensor(cos), torch.tensor(sin)
        for k in ("WQ1", "WQ2", "WK1", "WK2"):
            pr[k] = _rope(pr[k], c, s, cfg.rope_style)
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)

    def probs(q, k):
        s = q @ k.transpose(-1, -2) / cfg.head_dim ** 0.5
        return torch.softmax(s.masked_fill(mask, float("-inf")) if cfg.causal else s, -1)

    lam = torch.exp((t["lq1"] * t["lk1"]).sum()) - torch.exp((t["lq2"] * t["lk2"]).sum()) + cfg.lambda_init
    O = (probs(pr["WQ1"], pr["WK1"]) - lam * probs(pr["WQ2"], pr["WK2"])) @ pr["WV"]
    if cfg.head_norm:
        O = (1 - cfg.lambda_init) * _rms(O, t.get("head_norm"), cfg.head_eps)
    Y = X + torch.einsum("bhtv,hvd->btd", O, t["WO"])
    Yn = _rms(Y, t["ffn_norm"], cfg.eps)
    return Y + (torch.nn.functional.silu(Yn @ t["Wg"]) * (Yn @ t["Wu"])) @ t["Wd"]


def _rope_tables(n, d, style):
    from difftx.nn.rope import RotaryEmbedding

    cos, sin = RotaryEmbedding(d, 10000.0, style).cos_sin(torch.arange(n), torch.float64)
    return cos.double().numpy()[0, 0], sin.double().numpy()[0, 0]


@pytest.mark.parametrize("rope_style,head_norm,causal", [
    ("half", True, True), ("interleaved", True, True), (None, True, False), (None, False, True),
])
def test_reference_diff_block_matches_autograd(rope_style, head_norm, causal):
    cfg = diff.DiffBlockConfig(rope_style=rope_style, head_norm=head_norm, causal=causal)
    rng = np.random.default_rng(11)
    p = diff.init_params(cfg, rng)
    X = rng.normal(size=(2, 6, cfg.d_model))
    cos, sin = _rope_tables(6, cfg.head_dim, rope_style) if rope_style else (None, None)
    Z, cache = diff.forward(p, cfg, X, cos, sin)
    R = rng.normal(size=Z.shape)
    dX, grads = diff.backward(p, cfg, R, cache)

    t, tX = leaves(p), leaf(X)
    tZ = torch_diff_block(t, cfg, tX, cos, sin)
    (tZ * torch.tensor(R)).sum().backward()
    assert_rel(Z, tZ.detach().numpy(), "forward")
    assert_rel(dX, tX.grad.numpy(), "dX")
    auto = grads_of(t)
    assert set(grads) == set(auto)
    for k in sorted(p):
        assert_rel(grads[k], auto[k], k)


def test_reference_diff_lambda_vectors_match_finite_differences():
    """The lambda re-parameterisation's gradient, checked a third way: central differences of the loss."""
    cfg = diff.DiffBlockConfig(rope_style=None)
    rng = np.random.default_rng(2)
    p = diff.init_params(cfg, rng)
    X, R = rng.normal(size=(1, 5, cfg.d_model)), rng.normal(size=(1, 5, cfg.d_model))
    loss = lambda q: float(np.sum(R * diff.forward(q, cfg, X)[0]))  # noqa: E731
    _, g = diff.backward(p, cfg, R, diff.forward(p, cfg, X)[1])
    h = 1e-5
    for key in diff.LAMBDA_KEYS:
        for i in range(cfg.head_dim):
            up, down = {**p, key: p[key].copy()}, {**p, key: p[key].copy()}
            up[key][i] += h
            down[key][i] -= h
            fd = (loss(up) - loss(down)) / (2 * h)
            assert abs(fd - g[key][i]) <= 1e-6 * max(1.0, abs(fd)), (key, i, fd, g[key][i])


@pytest.mark.parametrize("pairing,rope_style,backend", [
    ("adjacent", "half", "eager"), ("adjacent", "interleaved", "sdpa"), ("halves", "half", "sdpa"),
    ("halves", "interleaved", "eager"),
])
def test_reference_diff_block_matches_difftx_block(pairing, rope_style, backend):
    """difftx's Block(attention='diff') in float64 against the reference: outputs and every gradient."""
    import difftx
    from difftx.nn.block import Block
    from difftx.nn.mask import AttnMask
    from difftx.nn.rope import RotaryEmbedding

    cfg = difftx.ModelConfig(attention="diff", d_model=16, n_layers=3, n_heads=2, head_dim=4, ffn_dim=24,
                             pairing=pairing, rope_style=rope_style, attn_backend=backend)
    torch.manual_seed(7)
    block = Block(cfg, layer=2).double()
    with torch.no_grad():
        for name, prm in block.named_parameters():
            prm.normal_(0.0, 0.3 if "lambda" not in name else 0.1).add_(1.0 if "norm" in name else 0.0)
    N = 6
    cos, sin = RotaryEmbedding(4, cfg.rope_theta, rope_style).cos_sin(torch.arange(N), torch.float64)
    x = torch.randn(2, N, 16, dtype=torch.float64, requires_grad=True)
    z = block(x, (cos, sin), AttnMask(causal=True, n_q=N, n_k=N))
    R = torch.randn_like(z)
    (z * R).sum().backward()

    rcfg = bridge.diff_block_config(block)
    assert rcfg.lambda_init == pytest.approx(difftx.lambda_init_for_layer(2))
    c, s = cos.double().numpy()[0, 0], sin.double().numpy()[0, 0]
    Z, cache = diff.forward(bridge.diff_block_arrays(block), rcfg, x.detach().numpy(), c, s)
    assert_rel(Z, z.detach().numpy(), "forward")
    assert diff.lambda_full(bridge.diff_block_arrays(block), rcfg)[0] == pytest.approx(
        float(block.attn.lambda_full().detach()), rel=1e-12)
    dX, grads = diff.backward(bridge.diff_block_arrays(block), rcfg, R.numpy(), cache)
    assert_rel(dX, x.grad.numpy(), "dX")
    lib = bridge.diff_block_arrays(block, grad=True)
    assert set(lib) == set(grads)
    for k in sorted(grads):
        assert_rel(grads[k], lib[k], k)


@pytest.mark.parametrize("field,value", [("bias", True), ("norm", "layer"), ("ffn", "gelu")])
def test_reference_diff_bridge_refuses_blocks_it_cannot_represent(field, value):
    """Biases, LayerNorm or another FFN would be dropped silently by the reference: refused, naming the field."""
    import difftx
    from difftx.nn.block import Block

    cfg = difftx.ModelConfig(attention="diff", d_model=16, n_layers=1, n_heads=2, head_dim=4, ffn_dim=24,
                             **{field: value})
    block = Block(cfg, layer=1)
    with pytest.raises(ValueError, match=f"{field}="):
        bridge.diff_block_config(block)


@pytest.mark.parametrize("flags", [dict(mid_norm_ffn=True), dict(post_norm=True), dict(dropout=0.1)])
def test_reference_diff_bridge_refuses_norms_beyond_the_pre_norm_layout(flags):
    """A MidNorm after the FFN or PostNorms (norms='S1' with a flag on) have no place in the reference block: it
    computed the block without them, another block than the library's; refused, naming the flag."""
    import difftx
    from difftx.nn.block import Block

    cfg = difftx.ModelConfig(attention="diff", d_model=16, n_layers=1, n_heads=2, head_dim=4, ffn_dim=24, **flags)
    with pytest.raises(ValueError, match=f"{next(iter(flags))}="):
        bridge.diff_block_config(Block(cfg, layer=1))


def _appendix_problem(rng, n=5, D=6, d=3):
    W = {k: rng.normal(size=(D, d)) for k in ("WQ1", "WQ2", "WK1", "WK2")}
    W["WV"], W["WO"] = rng.normal(size=(D, 2 * d)), rng.normal(size=(2 * d, D))
    return rng.normal(size=(n, D)), W, rng.normal(size=(n, D)), d


def test_reference_appendix_e_eq7_differential_attention():
    rng = np.random.default_rng(3)
    X, W, dO, d = _appendix_problem(rng)
    lam = 0.37
    t = leaves(W)
    Xt = torch.tensor(X)
    sm = lambda q, k: torch.softmax(q @ k.T / d ** 0.5, -1)  # noqa: E731
    A1, A2 = sm(Xt @ t["WQ1"], Xt @ t["WK1"]), sm(Xt @ t["WQ2"], Xt @ t["WK2"])
    O = ((A1 - lam * A2) @ (Xt @ t["WV"])) @ t["WO"]
    (O * torch.tensor(dO)).sum().backward()
    ours = diff.appendix_e_diff_grads(X, *(W[k] for k in ("WQ1", "WQ2", "WK1", "WK2", "WV", "WO")), lam, dO)
    for k, v in ours.items():
        assert_rel(v, t[k].grad.numpy(), f"eq. 7 {k}")


def test_reference_appendix_e_eq9_softmax_attention():
    rng = np.random.default_rng(4)
    X, W, dO, d = _appendix_problem(rng)
    t = leaves(W)
    Xt = torch.tensor(X)
    S = (Xt @ t["WQ1"] @ (Xt @ t["WK1"]).T + Xt @ t["WQ2"] @ (Xt @ t["WK2"]).T) / (2 * d) ** 0.5
    O = (torch.softmax(S, -1) @ (Xt @ t["WV"])) @ t["WO"]
    (O * torch.tensor(dO)).sum().backward()
    ours = diff.appendix_e_softmax_grads(X, *(W[k] for k in ("WQ1", "WQ2", "WK1", "WK2", "WV", "WO")), dO)
    for k, v in ours.items():
        assert_rel(v, t[k].grad.numpy(), f"eq. 9 {k}")
