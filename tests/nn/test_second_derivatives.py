"""Second derivatives (create_graph=True: gradient penalties, Hessian-vector products) through whole models.

The fast ops' backwards (native kernels, fused attention, the norm Functions) return gradients without a graph;
under create_graph they return torch's formula's gradients on what they saved, which have one.  Checked against
finite differences of first-order gradients in float64, and float32 (the native kernels' paths) against float64.
"""

from __future__ import annotations

import pytest
import torch

from difftx import ModelConfig, build_model
from difftx.nn import ffn, fused, linear, native

from .test_native import needs_native

CASES = [("softmax", "S1"), ("diff", "S1"), ("diff2", "S1"), ("diff", "dnt")]
N = 520  # 2 x 520 tokens of 64: over fused.SMALL_NORM values, so the residual + norm Function runs too


def _setup(attention, norms, dtype):
    torch.manual_seed(0)
    cfg = ModelConfig(attention=attention, norms=norms, d_model=64, n_layers=2, n_heads=2, vocab_size=50,
                      max_seq_len=N)
    model = build_model(cfg).to(dtype)
    x = torch.randint(0, 50, (2, N))
    vec = [torch.randn(p.shape, dtype=torch.float64) for p in model.parameters()]
    return model, x, vec


def _grads(model, x, create_graph=False):
    params = list(model.parameters())
    loss = model(x[:, :-1], targets=x[:, 1:]).loss
    grads = torch.autograd.grad(loss, params, create_graph=create_graph, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


def _hvp(model, x, vec):
    """The Hessian of the loss times vec, by double backward."""
    g = _grads(model, x, create_graph=True)
    dot = sum((gi * vi.to(gi.dtype)).sum() for gi, vi in zip(g, vec))
    return torch.cat([h.reshape(-1).double() for h in _grads_of(dot, model)])


def _grads_of(out, model):
    params = list(model.parameters())
    got = torch.autograd.grad(out, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(got, params)]


def _fd_hvp(model, x, vec, eps=1e-6):
    """The same by central differences of first-order gradients."""
    params = list(model.parameters())

    def shifted(sign):
        with torch.no_grad():
            for p, v in zip(params, vec):
                p.add_(v, alpha=sign * eps)
        g = torch.cat([gi.reshape(-1) for gi in _grads(model, x)])
        with torch.no_grad():
            for p, v in zip(params, vec):
                p.sub_(v, alpha=sign * eps)
        return g

    return (shifted(1) - shifted(-1)) / (2 * eps)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("attention, norms", CASES)
def test_hessian_vector_product_float64_matches_finite_differences(attention, norms):
    model, x, vec = _setup(attention, norms, torch.float64)
    assert _rel(_hvp(model, x, vec), _fd_hvp(model, x, vec)) < 1e-6


@needs_native
@pytest.mark.parametrize("attention, norms", CASES)
def test_hessian_vector_product_through_the_native_kernels(attention, norms, monkeypatch):
    """float32 takes the native kernels (counted: their torch formulas run under create_graph) and agrees with
    the float64 model's Hessian-vector product; the first-order gradients still come from the kernels."""
    calls = []
    for mod, name in ((ffn, "_swiglu_grads"), (fused, "_rms_norm_grads"), (fused, "_attention_torch")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    model, x, vec = _setup(attention, norms, torch.float32)
    got = _hvp(model, x, vec)
    assert {"_swiglu_grads", "_rms_norm_grads", "_attention_torch"} <= set(calls)
    want = _hvp(model.double(), x, vec)
    assert _rel(got, want) < 1e-3
    calls.clear()
    _grads(model.float(), x)
    assert not calls


def test_fused_ops_second_derivatives_match_torch():
    """Op by op in float32, against the same expressions in plain torch ops."""
    torch.manual_seed(1)
    g, u = torch.randn(4, 40, requires_grad=True), torch.randn(4, 40, requires_grad=True)
    cases = [(lambda a, b: ffn.swiglu(a, b), lambda a, b: torch.nn.functional.silu(a) * b)]
    w = torch.randn(40, requires_grad=True)
    cases.append((lambda a, b: fused.rms_norm(a * b, w, 1e-6, gain=0.7),
                  lambda a, b: torch.nn.functional.rms_norm(a * b, (40,), w * 0.7, 1e-6)))
    for ours, ref in cases:
        for f in (ours, ref):
            (ga, gb) = torch.autograd.grad(f(g, u).pow(2).sum(), (g, u), create_graph=True)
            f.hh = torch.autograd.grad((ga * gb).sum(), (g, u, w), allow_unused=True)
        for a, b in zip(ours.hh, ref.hh):
            if b is None:
                assert a is None or not a.any()
            else:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_chunked_loss_refuses_a_second_derivative_in_one_line():
    from difftx.nn.loss import linear_cross_entropy

    h, w = torch.randn(6, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.randint(0, 11, (6,)), chunk=4)
    with pytest.raises(RuntimeError, match="loss_chunk=0"):
        torch.autograd.grad(loss, h, create_graph=True)


def test_rope_refuses_an_odd_width():
    from difftx.nn.rope import apply_rope

    x = torch.randn(1, 1, 3, 5)
    with pytest.raises(RuntimeError):
        apply_rope(x, torch.ones(1, 1, 3, 2), torch.zeros(1, 1, 3, 2), "half")


@pytest.mark.parametrize("op", ["swiglu", "rope"])
def test_torch_func_transforms_take_the_torch_path(op):
    """vmap and torch.func.grad see plain torch ops (the kernels' raw pointers and Functions without
    setup_context cannot run under them), with the eager results."""
    from difftx.nn.rope import apply_rope

    torch.manual_seed(2)
    if op == "swiglu":
        fn, shape = ffn.swiglu, (3, 4, 16)
    else:
        ang = torch.randn(1, 1, 6, 8)
        fn, shape = (lambda a, b: apply_rope(a + b, ang.cos(), ang.sin(), "half")), (3, 1, 2, 6, 16)
    a, b = torch.randn(shape), torch.randn(shape)
    torch.testing.assert_close(torch.func.vmap(fn)(a, b), torch.stack([fn(x, y) for x, y in zip(a, b)]))
    got = torch.func.grad(lambda x: fn(x, b).pow(2).sum())(a)
    ra = a.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(fn(ra, b).pow(2).sum(), ra)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("attention, norms", CASES)
def test_torch_func_over_a_whole_model(attention, norms):
    """torch.func.grad of a whole model's loss (functional_call) equals autograd's gradients, and vmap of it gives
    per-sample gradients: the norms and the fused attention take torch ops under torch.func (their autograd
    Functions have no setup_context, which it needs)."""
    from torch.func import functional_call, grad, vmap

    model, x, _ = _setup(attention, norms, torch.float32)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, ids):
        return functional_call(model, p, (ids[..., :-1],), {"targets": ids[..., 1:]}).loss

    got = grad(loss)(params, x)
    want = dict(zip(params, _grads(model, x)))
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4 * float(want[k].abs().max()), msg=k)
    short = x[:, :40]
    per_sample = vmap(grad(lambda p, ids: loss(p, ids[None])), in_dims=(None, 0))(params, short)
    for i in range(2):
        one = dict(zip(params, _grads(model, short[i:i + 1])))
        for k in params:
            torch.testing.assert_close(per_sample[k][i], one[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_func_leaves_no_wrapped_tensor_on_a_diff2_module(transform):
    """DIFF V2 records the mean lambda of its last forward (model.lambdas()); a forward inside torch.func must not
    leave the transform's wrapper tensor there, which broke deepcopy / torch.save(model) after torch.func.grad and
    model.lambdas() after vmap. The recorded value stays the last one from outside the transform."""
    import copy
    import pickle

    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = build_model(ModelConfig(attention="diff2", d_model=64, n_layers=2, n_heads=2, vocab_size=50))
    x = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        model(x)
    before = model.lambdas()
    if transform == "grad":
        params = {k: v.detach() for k, v in model.named_parameters()}
        grad(lambda p: functional_call(model, p, (x,), {"targets": x}).loss)(params)
    else:
        vmap(lambda ids: model(ids[None]).logits[0])(x)
    assert model.lambdas() == before
    copy.deepcopy(model)
    pickle.dumps(model)


@needs_native
@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
@pytest.mark.parametrize("grad_mode", [True, False])
def test_forward_mode_ad_through_a_whole_model(attention, grad_mode):
    """torch.autograd.forward_ad (dual tensors, not torch.func) through a model: the tangent of the logits equals
    torch.func.jvp's. The fast paths step aside inside a dual level: under no_grad the native kernels (raw
    pointers) used to drop the tangents silently (a wrong jvp), with grad on the autograd Functions raised
    NotImplementedError (no jvp)."""
    import torch.autograd.forward_ad as fwad

    torch.manual_seed(0)
    cfg = ModelConfig(attention=attention, norms="dnt", d_model=128, n_layers=2, n_heads=2, vocab_size=50)
    model = build_model(cfg)
    x = torch.randint(0, 50, (2, 300))  # over fused.SMALL_NORM values: the norms' native passes too
    emb = model.embed.weight.detach()
    tangent = torch.randn_like(emb)

    def logits(w):
        return torch.func.functional_call(model, {"embed.weight": w}, (x,)).logits

    _, want = torch.func.jvp(logits, (emb,), (tangent,))
    with torch.set_grad_enabled(grad_mode), fwad.dual_level():
        got = fwad.unpack_dual(logits(fwad.make_dual(emb, tangent))).tangent
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.detach().abs().max()))
