"""The chunked linear cross-entropy against torch's cross-entropy of the full logits (float64, then the model)."""

import pytest
import torch
import torch.nn.functional as F

from difftx import ModelConfig, build_model
from difftx.nn.loss import linear_cross_entropy


def _reference(hidden, weight, targets):
    return F.cross_entropy(hidden @ weight.t(), targets, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("chunk", [1, 7, 30, 64])
def test_value_and_gradients_equal_the_full_logits_loss(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(30, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (30,), generator=g)
    targets[[3, 11, 12, 29]] = -100  # ignored positions: no loss, no gradient
    ref = _reference(hidden, weight, targets)
    gh, gw = torch.autograd.grad(ref * 1.7, (hidden, weight))
    got = linear_cross_entropy(hidden, weight, targets, chunk)
    assert got.dtype == torch.float64 and torch.allclose(got, ref, rtol=1e-12, atol=1e-12)
    ch, cw = torch.autograd.grad(got * 1.7, (hidden, weight))  # the upstream gradient scales both
    assert torch.allclose(ch, gh, rtol=1e-10, atol=1e-12) and torch.allclose(cw, gw, rtol=1e-10, atol=1e-12)
    assert ch[[3, 11, 12, 29]].abs().max() == 0
    only_h = linear_cross_entropy(hidden, weight.detach(), targets, chunk)  # one input needs no gradient
    assert torch.allclose(torch.autograd.grad(only_h, hidden)[0], gh / 1.7, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        assert torch.allclose(linear_cross_entropy(hidden, weight, targets, chunk), ref, rtol=1e-12)
    with pytest.raises(ValueError, match="positive"):
        linear_cross_entropy(hidden, weight, targets, 0)


def test_every_target_ignored_is_zero_with_zero_gradients():
    hidden = torch.randn(5, 4, requires_grad=True)
    weight = torch.randn(9, 4, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.full((5,), -100), 2)
    loss.backward()
    assert float(loss.detach()) == 0.0 and hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


@pytest.mark.parametrize("attention, tie", [("softmax", True), ("diff", False), ("diff2", True)])
def test_model_loss_and_gradients_do_not_change(attention, tie):
    """forward(loss_chunk=k) is the same loss and the same gradients as the full logits, tied or untied head."""
    cfg = ModelConfig(attention=attention, d_model=32, n_layers=2, n_heads=2, vocab_size=97, max_seq_len=32,
                      tie_embeddings=tie)
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randint(0, 97, (3, 20))
    y = torch.randint(0, 97, (3, 20))
    y[0, :5] = -100
    grads = []
    for chunk in (0, 13):
        model.zero_grad(set_to_none=True)
        out = model(x, targets=y, loss_chunk=chunk)
        out.loss.backward()
        assert (out.logits is None) == (chunk > 0) and int(out.n_targets) == 55
        grads.append((float(out.loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = grads
    assert abs(l0 - l1) < 1e-5
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=1e-4, atol=1e-6), n


def test_under_bf16_autocast_it_stays_close_to_the_full_logits():
    cfg = ModelConfig(attention="diff", d_model=32, n_layers=2, n_heads=2, vocab_size=97, max_seq_len=32)
    torch.manual_seed(0)
    model = build_model(cfg)
    x, y = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = model(x, targets=y).loss
        chunked = model(x, targets=y, loss_chunk=8).loss
    assert chunked.dtype == torch.float32 and abs(full.item() - chunked.item()) < 2e-2
    chunked.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
               for p in model.parameters() if p.requires_grad)


def test_a_hooked_or_swapped_lm_head_is_called_under_loss_chunk():
    """loss_chunk reads the LM head's weight itself; a hooked head or a swapped-in one (a LoRA-style wrapper) is
    called as a module instead, as model.head does: the same loss as loss_chunk=0 (it used to be the plain weight's
    loss, the hook and the wrapper's extra term silently ignored)."""
    from torch import nn

    cfg = ModelConfig(attention="diff", d_model=32, n_layers=2, n_heads=2, vocab_size=97, max_seq_len=32,
                      tie_embeddings=False)
    torch.manual_seed(0)
    model = build_model(cfg)
    x, y = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    plain = float(model(x, targets=y, loss_chunk=8).loss)
    handle = model.lm_head.register_forward_hook(lambda m, i, o: o * 20.0)
    hooked = model(x, targets=y, loss_chunk=8)
    handle.remove()
    assert hooked.logits is None
    scaled = model.lm_head.weight.detach() * 20.0
    with torch.no_grad():
        want = float(nn.functional.cross_entropy((model.features(x) @ scaled.T).reshape(-1, 97), y.reshape(-1),
                                                 reduction="mean"))
    assert abs(float(hooked.loss) - want) < 1e-4 and abs(plain - want) > 1e-3

    class Wrapped(nn.Module):  # a LoRA-style wrapper: the base layer plus a term of its own
        def __init__(self, base):
            super().__init__()
            self.base, self.extra = base, nn.Linear(32, 97, bias=False)

        def forward(self, h):
            return self.base(h) + self.extra(h)

    model.lm_head = Wrapped(model.lm_head)
    chunked = model(x, targets=y, loss_chunk=8)
    chunked.loss.backward()
    assert abs(float(chunked.loss) - float(model(x, targets=y).loss)) < 1e-5
    assert model.lm_head.extra.weight.grad is not None


@pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
                    reason="this torch has no oneDNN linear op")
@pytest.mark.parametrize("chunk", [7, 64])
def test_float32_chunks_on_onednn_match_float64(chunk, monkeypatch):
    """Where float32 products run on oneDNN the chunks' three products do (the weight's gradient summed
    transposed): loss and both gradients within float32 rounding of float64's full-logits loss, the weight's
    gradient contiguous; one input without a gradient, and no chunk at all, too."""
    from difftx.nn import linear as L

    monkeypatch.setattr(L, "ONEDNN_FP32", True)
    calls = []
    real = L._onednn
    monkeypatch.setattr(L, "_onednn", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(30, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (30,), generator=g)
    targets[[3, 11]] = -100
    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    ref = _reference(h64, w64, targets)
    gh, gw = torch.autograd.grad(ref, (h64, w64))
    got = linear_cross_entropy(hidden, weight, targets, chunk)
    ch, cw = torch.autograd.grad(got, (hidden, weight))
    assert len(calls) == 3 * -(-30 // chunk)
    assert abs(got.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert cw.is_contiguous() and cw.dtype == torch.float32
    torch.testing.assert_close(ch.double(), gh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cw.double(), gw, rtol=1e-5, atol=1e-5)
    only_w = linear_cross_entropy(hidden.detach(), weight, targets, chunk)
    torch.testing.assert_close(torch.autograd.grad(only_w, weight)[0].double(), gw, rtol=1e-5, atol=1e-5)
    empty = linear_cross_entropy(hidden[:0], weight, targets[:0], chunk)
    assert empty.item() == 0 and torch.equal(torch.autograd.grad(empty, weight)[0], torch.zeros_like(weight))
