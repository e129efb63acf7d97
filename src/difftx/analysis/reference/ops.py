"""Forward and hand-written backward of every primitive, in NumPy float64.

Each ``*_backward`` takes the upstream gradient and what its forward returned
and gives the gradients of the inputs, written from the chain rule rather than
from autograd.  Weights follow the seed's convention ``y = x W + b`` with
W of shape (d_in, d_out) (torch's ``nn.Linear`` stores W^T).  Leading axes are
batch axes everywhere.

Notable:

* softmax backward is the seed's eq. 19: ``dS = A * (G - rowsum(A * G))``.
* LayerNorm backward is eq. 34 *corrected* (SPEC section 3): the last term
  carries a 1/D, ``dx = (g - mean(g) - x_hat * mean(g * x_hat)) / sigma``.
  :func:`layernorm_backward_printed` keeps the form printed in the seed
  (``sum`` instead of ``mean``) so a test can show it disagrees with autograd.
* RMSNorm backward: ``dx = (g - x_hat * mean(g * x_hat)) / rms``.
* RoPE is a rotation, so its backward is the rotation by the opposite angle.
"""

from __future__ import annotations

import numpy as np

# ----------------------------------------------------------------------------- linear, embedding


def linear(x: np.ndarray, W: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """x W + b over the last axis of ``x``."""
    y = x @ W
    return y if b is None else y + b


def linear_backward(dy: np.ndarray, x: np.ndarray, W: np.ndarray, bias: bool = False):
    """Seed eqs. 6-7 / 15-16 / 43-44: dW = x^T dy, db = sum dy, dx = dy W^T.  Returns (dx, dW, db|None)."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    dW = x2.T @ dy2
    db = dy2.sum(axis=0) if bias else None
    return dy @ W.T, dW, db


def embedding(E: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Seed eq. 50: X = E[I]."""
    return E[ids]


def embedding_backward(dX: np.ndarray, ids: np.ndarray, n_rows: int) -> np.ndarray:
    """Seed eq. 51: scatter-add dX into the rows of the table that were looked up."""
    dE = np.zeros((n_rows, dX.shape[-1]))
    np.add.at(dE, ids.reshape(-1), dX.reshape(-1, dX.shape[-1]))
    return dE


# ----------------------------------------------------------------------------- softmax, loss


def softmax(S: np.ndarray) -> np.ndarray:
    """Row softmax over the last axis; -inf entries (masked) get probability 0."""
    m = np.max(S, axis=-1, keepdims=True)
    e = np.exp(S - m)
    return e / e.sum(axis=-1, keepdims=True)


def softmax_backward(dA: np.ndarray, A: np.ndarray) -> np.ndarray:
    """Seed eq. 19: dS = A * (G - rowsum(A * G)), G = dL/dA."""
    return A * (dA - np.sum(A * dA, axis=-1, keepdims=True))


def cross_entropy(z: np.ndarray, targets: np.ndarray):
    """Seed eqs. 1-3: mean over the rows of -log softmax(z)[target].  Returns (loss, y_hat)."""
    z2 = z.reshape(-1, z.shape[-1])
    t = targets.reshape(-1)
    m = z2.max(axis=-1, keepdims=True)
    logp = z2 - m - np.log(np.exp(z2 - m).sum(axis=-1, keepdims=True))
    loss = -logp[np.arange(t.size), t].mean()
    return float(loss), np.exp(logp).reshape(z.shape)


def cross_entropy_backward(y_hat: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Seed eq. 4 with the 1/N of the batch mean: dz = (y_hat - onehot(y)) / N."""
    dz = y_hat.reshape(-1, y_hat.shape[-1]).copy()
    t = targets.reshape(-1)
    dz[np.arange(t.size), t] -= 1.0
    return (dz / t.size).reshape(y_hat.shape)


# ----------------------------------------------------------------------------- activations


def relu(F_: np.ndarray) -> np.ndarray:
    return np.maximum(F_, 0.0)


def relu_backward(dA: np.ndarray, F_: np.ndarray) -> np.ndarray:
    """Seed eq. 45: pass the gradient where the pre-activation was positive."""
    return dA * (F_ > 0)


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # overflow-free


def silu(z: np.ndarray) -> np.ndarray:
    return z * sigmoid(z)


def silu_backward(dy: np.ndarray, z: np.ndarray) -> np.ndarray:
    """d/dz z sigma(z) = sigma(z) (1 + z (1 - sigma(z)))."""
    s = sigmoid(z)
    return dy * s * (1.0 + z * (1.0 - s))


def swiglu(x: np.ndarray, Wg: np.ndarray, Wu: np.ndarray, Wd: np.ndarray):
    """(silu(x Wg) * x Wu) Wd.  Returns (y, cache)."""
    a, u = x @ Wg, x @ Wu
    h = silu(a) * u
    return h @ Wd, (x, a, u, h)


def swiglu_backward(dy: np.ndarray, cache, Wg: np.ndarray, Wu: np.ndarray, Wd: np.ndarray):
    """Returns (dx, dWg, dWu, dWd)."""
    x, a, u, h = cache
    dh, dWd, _ = linear_backward(dy, h, Wd)
    da = silu_backward(dh * u, a)
    du = dh * silu(a)
    dx_g, dWg, _ = linear_backward(da, x, Wg)
    dx_u, dWu, _ = linear_backward(du, x, Wu)
    return dx_g + dx_u, dWg, dWu, dWd


# ----------------------------------------------------------------------------- norms


def layernorm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float = 1e-5):
    """Seed eqs. 29-30 and the affine map.  Returns (y, (x_hat, inv_sigma))."""
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    inv_sigma = 1.0 / np.sqrt(var + eps)
    x_hat = (x - mu) * inv_sigma
    return x_hat * gamma + beta, (x_hat, inv_sigma)


def _sum_leading(t: np.ndarray) -> np.ndarray:
    return t.reshape(-1, t.shape[-1]).sum(axis=0)


def layernorm_backward(dy: np.ndarray, cache, gamma: np.ndarray):
    """Seed eqs. 31-34, eq. 34 corrected.  Returns (dx, dgamma, dbeta)."""
    x_hat, inv_sigma = cache
    g = dy * gamma  # eq. 33
    dx = inv_sigma * (g - g.mean(axis=-1, keepdims=True) - x_hat * (g * x_hat).mean(axis=-1, keepdims=True))
    return dx, _sum_leading(dy * x_hat), _sum_leading(dy)


def layernorm_backward_printed(dy: np.ndarray, cache, gamma: np.ndarray) -> np.ndarray:
    """Eq. 34 exactly as printed in the seed (no 1/D on the last term).  Wrong; kept for a test."""
    x_hat, inv_sigma = cache
    g = dy * gamma
    return inv_sigma * (g - g.mean(axis=-1, keepdims=True) - x_hat * (g * x_hat).sum(axis=-1, keepdims=True))


def rmsnorm(x: np.ndarray, w: np.ndarray | None, eps: float = 1e-5):
    """x / sqrt(mean(x^2) + eps) * w.  Returns (y, (x_hat, inv_rms))."""
    inv_rms = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    x_hat = x * inv_rms
    return (x_hat if w is None else x_hat * w), (x_hat, inv_rms)


def rmsnorm_backward(dy: np.ndarray, cache, w: np.ndarray | None):
    """Returns (dx, dw|None): dx = (g - x_hat * mean(g * x_hat)) / rms, g = dy * w."""
    x_hat, inv_rms = cache
    g = dy if w is None else dy * w
    dx = inv_rms * (g - x_hat * (g * x_hat).mean(axis=-1, keepdims=True))
    return dx, (None if w is None else _sum_leading(dy * x_hat))


# ----------------------------------------------------------------------------- attention pieces


def causal_mask(n: int) -> np.ndarray:
    """Additive mask: 0 on and below the diagonal, -inf above."""
    return np.where(np.tril(np.ones((n, n), dtype=bool)), 0.0, -np.inf)


def attention_probs(q: np.ndarray, k: np.ndarray, scale: float, causal: bool = True) -> np.ndarray:
    """Seed eqs. 9-10: A = softmax(q k^T scale + mask) over (..., N, d) inputs."""
    S = (q @ np.swapaxes(k, -1, -2)) * scale
    if causal:
        S = S + causal_mask(q.shape[-2])
    return softmax(S)


def attention_probs_backward(dA: np.ndarray, A: np.ndarray, q: np.ndarray, k: np.ndarray, scale: float):
    """Seed eqs. 19-21: through the softmax, then dq = dS k s, dk = dS^T q s.  Returns (dq, dk)."""
    dS = softmax_backward(dA, A) * scale
    return dS @ k, np.swapaxes(dS, -1, -2) @ q


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str = "half") -> np.ndarray:
    """Rotate channel pairs of ``x`` (..., N, d) by the angles in cos/sin (N, d/2).

    ``half``: pairs (i, i + d/2); ``interleaved``: pairs (2i, 2i + 1).
    """
    if style == "half":
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        return np.concatenate((x1 * cos - x2 * sin, x1 * sin + x2 * cos), axis=-1)
    if style == "interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = x1 * cos - x2 * sin, x1 * sin + x2 * cos
        return out
    raise ValueError(f"unknown rope style {style!r}")


def rope_backward(dy: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str = "half") -> np.ndarray:
    """The transpose of a rotation is the rotation by minus the angle."""
    return rope(dy, cos, -sin, style)
