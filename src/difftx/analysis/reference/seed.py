"""The seed Transformer (papers/transformer-gradient-calculation.md), forward and backward by hand.

    X0 = E[I] + P                                    eqs. 49-50 (P fixed or learnable)
    per block:  Q_h, K_h, V_h = X W_Q^h, X W_K^h, X W_V^h          eq. 8
                A_h = softmax(Q_h K_h^T / sqrt(d_k) + mask)        eqs. 9-10
                H = sum_h (A_h V_h) W_O^h                          eqs. 11-13
                X' = LayerNorm(X + H)                              eqs. 26-27 (post-norm)
                Y = LayerNorm(X' + ReLU(X' W1 + b1) W2 + b2)       eqs. 37-41
    z = h W_out;  L = mean cross-entropy                           eqs. 1-5

Parameters are a flat dict of float64 arrays; per-head projections are stacked
(H, d_model, d_k) and (H, d_v, d_model), the seed's W^h.  Each backward line
cites the seed equation it implements.  :func:`sgd_update` is eq. 52.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import ops

BLOCK_KEYS = ("WQ", "WK", "WV", "WO", "ln1_g", "ln1_b", "W1", "b1", "W2", "b2", "ln2_g", "ln2_b")


@dataclass(frozen=True)
class SeedConfig:
    vocab_size: int = 17
    d_model: int = 12
    n_heads: int = 3
    head_dim: int = 4
    ffn_dim: int = 20
    n_layers: int = 2
    max_len: int = 16
    positions: str = "learned"  # "learned" (a parameter) or "fixed" (P given, no gradient)
    causal: bool = True
    eps: float = 1e-5


def init_params(cfg: SeedConfig, rng: np.random.Generator, std: float = 0.3) -> dict[str, np.ndarray]:
    """Random parameters (norm gains and biases perturbed too, so no gradient term hides behind a 1 or a 0)."""
    d, h, k, f = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.ffn_dim
    n = lambda *shape: rng.normal(0.0, std, shape)  # noqa: E731
    p = {"E": n(cfg.vocab_size, d), "Wout": n(d, cfg.vocab_size)}
    if cfg.positions == "learned":
        p["P"] = n(cfg.max_len, d)
    for layer in range(cfg.n_layers):
        blk = {
            "WQ": n(h, d, k), "WK": n(h, d, k), "WV": n(h, d, k), "WO": n(h, k, d),
            "ln1_g": 1.0 + n(d), "ln1_b": n(d), "W1": n(d, f), "b1": n(f), "W2": n(f, d), "b2": n(d),
            "ln2_g": 1.0 + n(d), "ln2_b": n(d),
        }
        p.update({f"{layer}.{key}": v for key, v in blk.items()})
    return p


def _attention(X, p, pre, cfg):
    Q = np.einsum("btd,hdk->bhtk", X, p[pre + "WQ"])
    K = np.einsum("btd,hdk->bhtk", X, p[pre + "WK"])
    V = np.einsum("btd,hdk->bhtk", X, p[pre + "WV"])
    A = ops.attention_probs(Q, K, cfg.head_dim ** -0.5, cfg.causal)
    O = A @ V
    H = np.einsum("bhtv,hvd->btd", O, p[pre + "WO"])
    return H, (X, Q, K, V, A, O)


def _attention_backward(dH, cache, p, pre, cfg, g):
    X, Q, K, V, A, O = cache
    g[pre + "WO"] = np.einsum("bhtv,btd->hvd", O, dH)            # eqs. 14-15 (dL/dH_h = dL/dH)
    dO = np.einsum("btd,hvd->bhtv", dH, p[pre + "WO"])            # eq. 16
    dA = dO @ np.swapaxes(V, -1, -2)                              # eq. 17
    dV = np.swapaxes(A, -1, -2) @ dO                              # eq. 18
    dQ, dK = ops.attention_probs_backward(dA, A, Q, K, cfg.head_dim ** -0.5)  # eqs. 19-21
    dX = np.zeros_like(X)
    for name, dZ in (("WQ", dQ), ("WK", dK), ("WV", dV)):
        g[pre + name] = np.einsum("btd,bhtk->hdk", X, dZ)         # eqs. 22-24
        dX += np.einsum("bhtk,hdk->btd", dZ, p[pre + name])       # eq. 25
    return dX


def forward(p: dict, cfg: SeedConfig, ids: np.ndarray, targets: np.ndarray, P_fixed: np.ndarray | None = None):
    """Loss and the cache for :func:`backward`.  ``ids``, ``targets``: int arrays (B, T)."""
    T = ids.shape[1]
    P = p["P"] if cfg.positions == "learned" else P_fixed
    if P is None:
        raise ValueError("positions='fixed' needs the fixed table P_fixed")
    X = ops.embedding(p["E"], ids) + P[:T]                        # eqs. 49-50
    caches = []
    for layer in range(cfg.n_layers):
        pre = f"{layer}."
        H, att = _attention(X, p, pre, cfg)
        X1, ln1 = ops.layernorm(X + H, p[pre + "ln1_g"], p[pre + "ln1_b"], cfg.eps)       # eqs. 26-27
        F = ops.linear(X1, p[pre + "W1"], p[pre + "b1"])                                 # eq. 37
        A = ops.relu(F)                                                                  # eq. 38
        G = ops.linear(A, p[pre + "W2"], p[pre + "b2"])                                  # eq. 39
        Y, ln2 = ops.layernorm(X1 + G, p[pre + "ln2_g"], p[pre + "ln2_b"], cfg.eps)       # eqs. 40-41
        caches.append((att, ln1, X1, F, A, ln2))
        X = Y
    z = ops.linear(X, p["Wout"])                                                         # eq. 5
    loss, y_hat = ops.cross_entropy(z, targets)                                          # eqs. 1-3
    return loss, (ids, targets, X, y_hat, caches)


def backward(p: dict, cfg: SeedConfig, cache) -> dict[str, np.ndarray]:
    """dL/dtheta for every parameter in ``p`` (same keys)."""
    ids, targets, h, y_hat, caches = cache
    g: dict[str, np.ndarray] = {}
    dz = ops.cross_entropy_backward(y_hat, targets)                                      # eq. 4
    dX, g["Wout"], _ = ops.linear_backward(dz, h, p["Wout"])                             # eqs. 6-7
    for layer in reversed(range(cfg.n_layers)):
        pre = f"{layer}."
        att, ln1, X1, F, A, ln2 = caches[layer]
        dYres, g[pre + "ln2_g"], g[pre + "ln2_b"] = ops.layernorm_backward(dX, ln2, p[pre + "ln2_g"])  # 31-34
        dA, g[pre + "W2"], g[pre + "b2"] = ops.linear_backward(dYres, A, p[pre + "W2"], bias=True)     # 42-44
        dF = ops.relu_backward(dA, F)                                                                   # eq. 45
        dX1, g[pre + "W1"], g[pre + "b1"] = ops.linear_backward(dF, X1, p[pre + "W1"], bias=True)      # 46-47
        dX1 = dX1 + dYres                                                                               # eq. 48
        dXres, g[pre + "ln1_g"], g[pre + "ln1_b"] = ops.layernorm_backward(dX1, ln1, p[pre + "ln1_g"])
        dX = dXres + _attention_backward(dXres, att, p, pre, cfg, g)                   # eqs. 35-36 + 25
    g["E"] = ops.embedding_backward(dX, ids, p["E"].shape[0])                            # eq. 51
    if cfg.positions == "learned":                                                       # section 3.3
        dP = np.zeros_like(p["P"])
        dP[: ids.shape[1]] = dX.sum(axis=0)
        g["P"] = dP
    return g


def loss_and_grads(p: dict, cfg: SeedConfig, ids, targets, P_fixed=None):
    loss, cache = forward(p, cfg, ids, targets, P_fixed)
    return loss, backward(p, cfg, cache)


def sgd_update(p: dict, grads: dict, lr: float) -> dict[str, np.ndarray]:
    """Eq. 52: theta <- theta - eta dL/dtheta (a new dict; the embedding rows not looked up stay put, eq. 53)."""
    return {k: v - lr * grads[k] for k, v in p.items()}
