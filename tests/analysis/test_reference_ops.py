"""Each hand-written primitive backward against torch autograd, float64, relative 1e-8.

The loss in every test is L = sum(R * f(inputs)) with a random R, so dL/df = R
exercises every output entry.  Torch computes f with its own ops (F.layer_norm,
torch.softmax, F.cross_entropy, ...): an independent implementation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from difftx.analysis.reference import ops
from .grads_helpers import assert_rel, leaf, rel_err

pytestmark = pytest.mark.reference


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def _autograd(fn, *arrays):
    ts = [leaf(a) for a in arrays]
    out = fn(*ts)
    R = torch.tensor(np.random.default_rng(7).normal(size=tuple(out.shape)))
    (out * R).sum().backward()
    return out.detach().numpy(), R.numpy(), [t.grad.numpy() for t in ts]


def test_reference_linear(rng):
    x, W, b = rng.normal(size=(2, 5, 6)), rng.normal(size=(6, 4)), rng.normal(size=4)
    out, R, (dx, dW, db) = _autograd(lambda x, W, b: x @ W + b, x, W, b)
    assert_rel(ops.linear(x, W, b), out, "forward")
    ours = ops.linear_backward(R, x, W, bias=True)
    for name, a, t in zip(("dx", "dW", "db"), ours, (dx, dW, db)):
        assert_rel(a, t, name)


def test_reference_embedding_scatter_add(rng):
    E, ids = rng.normal(size=(9, 4)), np.array([[1, 3, 1, 8], [3, 3, 0, 1]])  # repeated ids accumulate (eq. 51)
    out, R, (dE,) = _autograd(lambda E: E[torch.tensor(ids)], E)
    assert_rel(ops.embedding(E, ids), out, "forward")
    ours = ops.embedding_backward(R, ids, 9)
    assert_rel(ours, dE, "dE")
    assert np.all(ours[[2, 4, 5, 6, 7]] == 0)


def test_reference_softmax(rng):
    S = rng.normal(size=(3, 4, 7)) * 3
    out, R, (dS,) = _autograd(lambda s: torch.softmax(s, -1), S)
    A = ops.softmax(S)
    assert_rel(A, out, "forward")
    assert_rel(ops.softmax_backward(R, A), dS, "dS (eq. 19)")


def test_reference_cross_entropy(rng):
    z, y = rng.normal(size=(2, 6, 11)) * 2, rng.integers(0, 11, size=(2, 6))
    tz = leaf(z)
    loss = F.cross_entropy(tz.reshape(-1, 11), torch.tensor(y).reshape(-1))
    loss.backward()
    ours, y_hat = ops.cross_entropy(z, y)
    assert abs(ours - loss.item()) <= 1e-12 * abs(loss.item())
    assert_rel(ops.cross_entropy_backward(y_hat, y), tz.grad.numpy(), "dz (eq. 4)")


@pytest.mark.parametrize("eps", [1e-5, 0.3])
def test_reference_layernorm(rng, eps):
    x, g, b = rng.normal(size=(2, 3, 8)) * 2 + 1, 1 + rng.normal(size=8) * 0.5, rng.normal(size=8)
    out, R, (dx, dg, db) = _autograd(lambda x, g, b: F.layer_norm(x, (8,), g, b, eps), x, g, b)
    y, cache = ops.layernorm(x, g, b, eps)
    assert_rel(y, out, "forward")
    ours = ops.layernorm_backward(R, cache, g)
    for name, a, t in zip(("dx (eq. 34 corrected)", "dgamma (eq. 31)", "dbeta (eq. 32)"), ours, (dx, dg, db)):
        assert_rel(a, t, name)


def test_reference_eq34_as_printed_disagrees_with_autograd(rng):
    """SPEC section 3: the seed's eq. 34 drops a 1/D on its last term; autograd decides."""
    D = 8
    x, g, b = rng.normal(size=(4, D)), 1 + rng.normal(size=D) * 0.5, rng.normal(size=D)
    _, R, (dx, _, _) = _autograd(lambda x, g, b: F.layer_norm(x, (D,), g, b, 1e-5), x, g, b)
    _, cache = ops.layernorm(x, g, b, 1e-5)
    printed = ops.layernorm_backward_printed(R, cache, g)
    assert rel_err(printed, dx) > 0.1, "the printed eq. 34 should be visibly wrong"
    assert_rel(ops.layernorm_backward(R, cache, g)[0], dx, "corrected eq. 34")
    # and the whole disagreement is the missing 1/D: printed - correct = -(D - 1) x_hat mean(g x_hat) / sigma
    x_hat, inv_sigma = cache
    gg = R * g
    missing = -(D - 1) * inv_sigma * x_hat * (gg * x_hat).mean(-1, keepdims=True)
    assert_rel(printed - dx, missing, "printed minus correct")


@pytest.mark.parametrize("with_weight", [True, False])
def test_reference_rmsnorm(rng, with_weight):
    x, w = rng.normal(size=(2, 3, 8)) + 0.5, 1 + rng.normal(size=8) * 0.5
    if with_weight:
        out, R, (dx, dw) = _autograd(lambda x, w: F.rms_norm(x, (8,), w, 1e-5), x, w)
    else:
        out, R, (dx,) = _autograd(lambda x: F.rms_norm(x, (8,), None, 1e-5), x)
    y, cache = ops.rmsnorm(x, w if with_weight else None, 1e-5)
    assert_rel(y, out, "forward")
    ours_dx, ours_dw = ops.rmsnorm_backward(R, cache, w if with_weight else None)
    assert_rel(ours_dx, dx, "dx")
    if with_weight:
        assert_rel(ours_dw, dw, "dw")
    else:
        assert ours_dw is None


def test_reference_relu(rng):
    x = rng.normal(size=(5, 7))
    out, R, (dx,) = _autograd(F.relu, x)
    assert_rel(ops.relu(x), out, "forward")
    assert_rel(ops.relu_backward(R, x), dx, "dF (eq. 45)")


def test_reference_silu(rng):
    x = rng.normal(size=(5, 7)) * 4
    out, R, (dx,) = _autograd(F.silu, x)
    assert_rel(ops.silu(x), out, "forward")
    assert_rel(ops.silu_backward(R, x), dx, "dx")


def test_reference_swiglu(rng):
    x, Wg, Wu, Wd = rng.normal(size=(2, 4, 6)), rng.normal(size=(6, 10)), rng.normal(size=(6, 10)), \
        rng.normal(size=(10, 6))
    out, R, grads = _autograd(lambda x, a, b, c: (F.silu(x @ a) * (x @ b)) @ c, x, Wg, Wu, Wd)
    y, cache = ops.swiglu(x, Wg, Wu, Wd)
    assert_rel(y, out, "forward")
    for name, a, t in zip(("dx", "dWg", "dWu", "dWd"), ops.swiglu_backward(R, cache, Wg, Wu, Wd), grads):
        assert_rel(a, t, name)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_attention_probs(rng, causal):
    q, k = rng.normal(size=(2, 3, 6, 4)), rng.normal(size=(2, 3, 6, 4))
    mask = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)

    def fn(q, k):
        s = q @ k.transpose(-1, -2) * 0.5
        return torch.softmax(s.masked_fill(mask, float("-inf")) if causal else s, -1)

    out, R, (dq, dk) = _autograd(fn, q, k)
    A = ops.attention_probs(q, k, 0.5, causal)
    assert_rel(A, out, "forward")
    ours_dq, ours_dk = ops.attention_probs_backward(R, A, q, k, 0.5)
    assert_rel(ours_dq, dq, "dQ (eq. 20)")
    assert_rel(ours_dk, dk, "dK (eq. 21)")


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_reference_rope_matches_difftx_and_autograd(rng, style):
    from difftx.nn.rope import RotaryEmbedding, apply_rope

    x = rng.normal(size=(2, 3, 5, 8))
    cos, sin = RotaryEmbedding(8, 10000.0, style).cos_sin(torch.arange(5), torch.float64)
    out, R, (dx,) = _autograd(lambda x: apply_rope(x, cos.double(), sin.double(), style), x)
    c, s = cos.double().numpy()[0, 0], sin.double().numpy()[0, 0]
    assert_rel(ops.rope(x, c, s, style), out, "forward")
    assert_rel(ops.rope_backward(R, c, s, style), dx, "dx")
