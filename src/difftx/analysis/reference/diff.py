"""A DIFF Transformer block, forward and backward by hand (SPEC section 1).

    Xn = RMSNorm(X)                                          pre-norm
    [Q1; Q2] = Xn W^Q, [K1; K2] = Xn W^K, V = Xn W^V          per differential head (d, d, 2d wide)
    Q*, K* <- RoPE(Q*, K*)                                   optional
    A_j = softmax(Q_j K_j^T / sqrt(d) + mask),  j = 1, 2
    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init   one scalar per layer
    O_i = (A1 - lambda A2) V                                  per head, 2d wide
    Y = X + Concat_i((1 - lambda_init) RMSNorm(O_i)) W^O       the per-head norm's 2d gain is shared by heads
    Z = Y + SwiGLU(RMSNorm(Y))

Parameters are a dict of float64 arrays with per-head stacks (h, d_model, d) /
(h, d_model, 2d) / (h, 2d, d_model), the paper's Appendix E notation.  The
lambda gradient collects every head's ``-<dM, A2>`` and flows into the four
vectors through the two exponentials.

:func:`appendix_e_diff_grads` and :func:`appendix_e_softmax_grads` are the
paper's eqs. 7 and 9 written out literally (one head, no GroupNorm), so a test
can hold the appendix's formulas against autograd too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import ops

ATTN_KEYS = ("WQ1", "WQ2", "WK1", "WK2", "WV")
LAMBDA_KEYS = ("lq1", "lk1", "lq2", "lk2")


@dataclass(frozen=True)
class DiffBlockConfig:
    d_model: int = 16
    n_heads: int = 2  # differential heads
    head_dim: int = 4  # d: the width of Q1, Q2, K1, K2; V is 2d
    ffn_dim: int = 24
    lambda_init: float = 0.8 - 0.6 * np.exp(-0.3)  # layer 2 of the schedule
    eps: float = 1e-5  # the two pre-norms
    head_eps: float = 1e-5  # the per-head norm
    head_norm: bool = True
    causal: bool = True
    rope_style: Optional[str] = "half"  # None: no rotary positions


def init_params(cfg: DiffBlockConfig, rng: np.random.Generator, std: float = 0.3) -> dict[str, np.ndarray]:
    D, h, d, f = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.ffn_dim
    n = lambda *shape: rng.normal(0.0, std, shape)  # noqa: E731
    p = {k: n(h, D, d) for k in ("WQ1", "WQ2", "WK1", "WK2")}
    p.update(WV=n(h, D, 2 * d), WO=n(h, 2 * d, D), attn_norm=1.0 + n(D), ffn_norm=1.0 + n(D),
             Wg=n(D, f), Wu=n(D, f), Wd=n(f, D))
    p.update({k: rng.normal(0.0, 0.1, d) for k in LAMBDA_KEYS})
    if cfg.head_norm:
        p["head_norm"] = 1.0 + n(2 * d)
    return p


def lambda_full(p: dict, cfg: DiffBlockConfig) -> tuple[float, float, float]:
    """(lambda, exp(lq1 . lk1), exp(lq2 . lk2))."""
    e1 = float(np.exp(p["lq1"] @ p["lk1"]))
    e2 = float(np.exp(p["lq2"] @ p["lk2"]))
    return e1 - e2 + cfg.lambda_init, e1, e2


def forward(p: dict, cfg: DiffBlockConfig, X: np.ndarray, cos=None, sin=None):
    """Z (B, N, d_model) and the cache for :func:`backward`.  cos/sin (N, d/2) when ``rope_style``."""
    Xn, c_an = ops.rmsnorm(X, p["attn_norm"], cfg.eps)
    proj = {k: np.einsum("btd,hdk->bhtk", Xn, p[k]) for k in ATTN_KEYS}
    rot = dict(proj)
    if cfg.rope_style is not None:
        for k in ("WQ1", "WQ2", "WK1", "WK2"):
            rot[k] = ops.rope(proj[k], cos, sin, cfg.rope_style)
    scale = cfg.head_dim ** -0.5
    A1 = ops.attention_probs(rot["WQ1"], rot["WK1"], scale, cfg.causal)
    A2 = ops.attention_probs(rot["WQ2"], rot["WK2"], scale, cfg.causal)
    lam, e1, e2 = lambda_full(p, cfg)
    M = A1 - lam * A2
    O = M @ proj["WV"]
    if cfg.head_norm:
        Nh, c_hn = ops.rmsnorm(O, p.get("head_norm"), cfg.head_eps)
        Ob = (1.0 - cfg.lambda_init) * Nh
    else:
        c_hn, Ob = None, O
    Y = X + np.einsum("bhtv,hvd->btd", Ob, p["WO"])
    Yn, c_fn = ops.rmsnorm(Y, p["ffn_norm"], cfg.eps)
    Fo, c_sw = ops.swiglu(Yn, p["Wg"], p["Wu"], p["Wd"])
    cache = dict(c_an=c_an, Xn=Xn, proj=proj, rot=rot, A1=A1, A2=A2, lam=(lam, e1, e2), M=M, c_hn=c_hn, Ob=Ob,
                 c_fn=c_fn, c_sw=c_sw, cos=cos, sin=sin)
    return Y + Fo, cache


def backward(p: dict, cfg: DiffBlockConfig, dZ: np.ndarray, cache) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(dL/dX, dL/dtheta) given dL/dZ."""
    c = cache
    g: dict[str, np.ndarray] = {}
    # FFN sublayer: Z = Y + SwiGLU(RMSNorm(Y))
    dYn, g["Wg"], g["Wu"], g["Wd"] = ops.swiglu_backward(dZ, c["c_sw"], p["Wg"], p["Wu"], p["Wd"])
    dY_norm, g["ffn_norm"] = ops.rmsnorm_backward(dYn, c["c_fn"], p["ffn_norm"])
    dY = dZ + dY_norm
    # attention output: Y = X + sum_i Ob_i WO_i
    g["WO"] = np.einsum("bhtv,btd->hvd", c["Ob"], dY)
    dOb = np.einsum("btd,hvd->bhtv", dY, p["WO"])
    if cfg.head_norm:
        dO, dhn = ops.rmsnorm_backward((1.0 - cfg.lambda_init) * dOb, c["c_hn"], p.get("head_norm"))
        if dhn is not None:
            g["head_norm"] = dhn
    else:
        dO = dOb
    # O = (A1 - lambda A2) V
    V, M, A1, A2 = c["proj"]["WV"], c["M"], c["A1"], c["A2"]
    lam, e1, e2 = c["lam"]
    dM = dO @ np.swapaxes(V, -1, -2)
    dproj = {"WV": np.swapaxes(M, -1, -2) @ dO}
    dlam = -float(np.sum(dM * A2))
    g["lq1"], g["lk1"] = dlam * e1 * p["lk1"], dlam * e1 * p["lq1"]
    g["lq2"], g["lk2"] = -dlam * e2 * p["lk2"], -dlam * e2 * p["lq2"]
    scale = cfg.head_dim ** -0.5
    rot = c["rot"]
    dproj["WQ1"], dproj["WK1"] = ops.attention_probs_backward(dM, A1, rot["WQ1"], rot["WK1"], scale)
    dproj["WQ2"], dproj["WK2"] = ops.attention_probs_backward(-lam * dM, A2, rot["WQ2"], rot["WK2"], scale)
    if cfg.rope_style is not None:
        for k in ("WQ1", "WQ2", "WK1", "WK2"):
            dproj[k] = ops.rope_backward(dproj[k], c["cos"], c["sin"], cfg.rope_style)
    dXn = np.zeros_like(c["Xn"])
    for k in ATTN_KEYS:
        g[k] = np.einsum("btd,bhtk->hdk", c["Xn"], dproj[k])
        dXn += np.einsum("bhtk,hdk->btd", dproj[k], p[k])
    dX_norm, g["attn_norm"] = ops.rmsnorm_backward(dXn, c["c_an"], p["attn_norm"])
    return dY + dX_norm, g


# ----------------------------------------------------------------------------- Appendix E, literally


def _bracket(A: np.ndarray, G: np.ndarray) -> np.ndarray:
    """A ⊙ (G - (A ⊙ G) J), J the all-ones matrix."""
    return A * (G - (A * G) @ np.ones((A.shape[-1], A.shape[-1])))


def appendix_e_diff_grads(X, WQ1, WQ2, WK1, WK2, WV, WO, lam: float, dO) -> dict[str, np.ndarray]:
    """Eq. 7 for O = ((A1 - lambda A2) V) W^O (one head, unmasked, GroupNorm left out)."""
    d = WQ1.shape[1]
    Q1, Q2, K1, K2, V = X @ WQ1, X @ WQ2, X @ WK1, X @ WK2, X @ WV
    A1, A2 = ops.softmax(Q1 @ K1.T / np.sqrt(d)), ops.softmax(Q2 @ K2.T / np.sqrt(d))
    G = dO @ WO.T @ V.T
    B1, B2 = _bracket(A1, G), _bracket(A2, G)
    return {
        "WO": ((A1 - lam * A2) @ V).T @ dO,
        "WV": X.T @ (A1 - lam * A2).T @ dO @ WO.T,
        "WQ1": X.T @ B1 @ K1 / np.sqrt(d),
        "WQ2": -lam * X.T @ B2 @ K2 / np.sqrt(d),
        "WK1": X.T @ B1.T @ Q1 / np.sqrt(d),
        "WK2": -lam * X.T @ B2.T @ Q2 / np.sqrt(d),
    }


def appendix_e_softmax_grads(X, WQ1, WQ2, WK1, WK2, WV, WO, dO) -> dict[str, np.ndarray]:
    """Eq. 9 for O = (A V) W^O, A = softmax((Q1 K1^T + Q2 K2^T) / sqrt(2d)) (one 2d-wide softmax head)."""
    d2 = 2 * WQ1.shape[1]
    Q1, Q2, K1, K2, V = X @ WQ1, X @ WQ2, X @ WK1, X @ WK2, X @ WV
    A = ops.softmax((Q1 @ K1.T + Q2 @ K2.T) / np.sqrt(d2))
    B = _bracket(A, dO @ WO.T @ V.T)
    return {
        "WO": (A @ V).T @ dO,
        "WV": X.T @ A.T @ dO @ WO.T,
        "WQ1": X.T @ B @ K1 / np.sqrt(d2),
        "WQ2": X.T @ B @ K2 / np.sqrt(d2),
        "WK1": X.T @ B.T @ Q1 / np.sqrt(d2),
        "WK2": X.T @ B.T @ Q2 / np.sqrt(d2),
    }
