"""The seed Transformer's hand-derived backward against autograd, the SGD update, and difftx itself.

Three independent computations of the same gradients: the NumPy reference
(:mod:`difftx.analysis.reference.seed`), a plain-torch mirror of the seed's
equations differentiated by autograd, and difftx's ``DecoderLM`` in the seed's
layout (post-LayerNorm, ReLU MLP with biases) in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from difftx.analysis.reference import bridge, seed
from .grads_helpers import assert_rel, grads_of, leaves

pytestmark = pytest.mark.reference


def torch_seed_loss(t: dict, cfg: seed.SeedConfig, ids, targets, P_fixed=None) -> torch.Tensor:
    """The seed's forward in plain torch ops (autograd does the backward)."""
    ids_t = torch.tensor(ids)
    T = ids.shape[1]
    P = t["P"] if cfg.positions == "learned" else torch.tensor(P_fixed)
    X = t["E"][ids_t] + P[:T]
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    for layer in range(cfg.n_layers):
        p = {k: t[f"{layer}.{k}"] for k in seed.BLOCK_KEYS}
        Q = torch.einsum("btd,hdk->bhtk", X, p["WQ"])
        K = torch.einsum("btd,hdk->bhtk", X, p["WK"])
        V = torch.einsum("btd,hdk->bhtk", X, p["WV"])
        S = Q @ K.transpose(-1, -2) / cfg.head_dim ** 0.5
        A = torch.softmax(S.masked_fill(mask, float("-inf")) if cfg.causal else S, -1)
        H = torch.einsum("bhtv,hvd->btd", A @ V, p["WO"])
        X1 = F.layer_norm(X + H, (cfg.d_model,), p["ln1_g"], p["ln1_b"], cfg.eps)
        G = F.relu(X1 @ p["W1"] + p["b1"]) @ p["W2"] + p["b2"]
        X = F.layer_norm(X1 + G, (cfg.d_model,), p["ln2_g"], p["ln2_b"], cfg.eps)
    z = X @ t["Wout"]
    return F.cross_entropy(z.reshape(-1, cfg.vocab_size), torch.tensor(targets).reshape(-1))


def _problem(positions: str, causal: bool = True, seed_: int = 0):
    cfg = seed.SeedConfig(positions=positions, causal=causal)
    rng = np.random.default_rng(seed_)
    p = seed.init_params(cfg, rng)
    ids = rng.integers(0, cfg.vocab_size, size=(2, 7))
    targets = rng.integers(0, cfg.vocab_size, size=(2, 7))
    P_fixed = rng.normal(size=(cfg.max_len, cfg.d_model)) if positions == "fixed" else None
    return cfg, p, ids, targets, P_fixed


@pytest.mark.parametrize("positions,causal", [("learned", True), ("fixed", True), ("learned", False)])
def test_reference_seed_gradients_match_autograd(positions, causal):
    cfg, p, ids, targets, P_fixed = _problem(positions, causal)
    loss, grads = seed.loss_and_grads(p, cfg, ids, targets, P_fixed)
    t = leaves(p)
    tl = torch_seed_loss(t, cfg, ids, targets, P_fixed)
    tl.backward()
    assert abs(loss - tl.item()) <= 1e-12 * abs(tl.item())
    auto = grads_of(t)
    assert set(grads) == set(auto) == set(p)
    assert ("P" in grads) == (positions == "learned")  # fixed encodings get no gradient (section 3.3)
    for k in sorted(p):
        assert_rel(grads[k], auto[k], k)


def test_reference_seed_sgd_update_matches_torch_sgd():
    cfg, p, ids, targets, _ = _problem("learned", seed_=1)
    lr = 0.05
    _, grads = seed.loss_and_grads(p, cfg, ids, targets)
    new = seed.sgd_update(p, grads, lr)
    t = leaves(p)
    opt = torch.optim.SGD(list(t.values()), lr=lr)
    torch_seed_loss(t, cfg, ids, targets).backward()
    opt.step()
    for k in sorted(p):
        assert_rel(new[k] - p[k], t[k].detach().numpy() - p[k], f"update of {k}")
    # eq. 53: only the embedding rows that were looked up move
    untouched = sorted(set(range(cfg.vocab_size)) - set(ids.reshape(-1).tolist()))
    assert untouched and np.array_equal(new["E"][untouched], p["E"][untouched])
    # a second step from the updated parameters lowers the loss (a sanity check of the sign)
    assert seed.forward(new, cfg, ids, targets)[0] < seed.forward(p, cfg, ids, targets)[0]


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_reference_seed_matches_difftx_post_norm_model(positions):
    """difftx's DecoderLM with norms='post', LayerNorm, ReLU MLP and biases is the seed's model."""
    import difftx

    cfg = difftx.ModelConfig(d_model=12, n_layers=2, n_heads=3, head_dim=4, ffn_dim=20, vocab_size=17,
                             max_seq_len=16, norms="post", norm="layer", ffn="relu", bias=True,
                             positions=positions, attn_backend="eager")
    torch.manual_seed(3)
    model = difftx.build_model(cfg).double()
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias", "out_proj.bias")):
                prm.zero_()  # the seed's attention has no biases
            elif name.endswith("norm.weight") or name.endswith("norm.bias") or name.endswith("w_up.bias") \
                    or name.endswith("w_down.bias"):
                prm.normal_(0.0, 0.3).add_(1.0 if name.endswith("weight") else 0.0)
    rng = np.random.default_rng(5)
    ids, targets = rng.integers(0, 17, size=(2, 9)), rng.integers(0, 17, size=(2, 9))
    out = model(torch.tensor(ids), targets=torch.tensor(targets))
    out.loss.backward()

    rcfg = bridge.seed_config(model)
    P_fixed = None if positions == "learned" else model.pos_table.double().numpy()
    loss, grads = seed.loss_and_grads(bridge.seed_arrays(model), rcfg, ids, targets, P_fixed)
    assert abs(loss - out.loss.item()) <= 1e-10 * loss
    lib = bridge.seed_arrays(model, grad=True)
    assert set(lib) == set(grads)
    for k in sorted(grads):
        assert_rel(grads[k], lib[k], k)


def test_the_seed_bridge_refuses_dropout():
    """The seed reference has no dropout: a model with dropout compared in training mode held masks the reference
    lacks, so the bridge refuses it as it refuses other layouts."""
    import difftx

    cfg = difftx.ModelConfig.from_preset("nano", d_model=16, n_layers=1, n_heads=2, vocab_size=17, max_seq_len=16,
                                         norms="post", norm="layer", ffn="relu", bias=True, positions="learned",
                                         tie_embeddings=False, final_norm=False)
    assert bridge.seed_config(difftx.build_model(cfg)).d_model == 16
    with pytest.raises(ValueError, match="no dropout"):
        bridge.seed_config(difftx.build_model(cfg.replace(dropout=0.1)))


def test_the_seed_bridge_refuses_a_sliding_window_and_missing_qkv_biases():
    """The seed reference attends over the whole causal context and has biases on every projection: a windowed
    model, or one with bias=True but qkv_bias=False, would be compared against another function."""
    import difftx

    cfg = difftx.ModelConfig.from_preset("nano", d_model=16, n_layers=1, n_heads=2, vocab_size=17, max_seq_len=16,
                                         norms="post", norm="layer", ffn="relu", bias=True, positions="learned",
                                         tie_embeddings=False, final_norm=False)
    for change in (dict(sliding_window=4), dict(qkv_bias=False)):
        with pytest.raises(ValueError, match=r"qkv_bias too\).* no sliding window"):
            bridge.seed_config(difftx.build_model(cfg.replace(**change)))
