"""Sliding-window attention (``ModelConfig.sliding_window``, ``AttnMask.window``): every backend and attention
kind against SPEC's equations under an explicitly built mask, decoding with a cache against the full forward."""

from __future__ import annotations

import pytest
import torch

from difftx import ModelConfig, build_model
from difftx.errors import ConfigError
from difftx.nn import backends, native
from difftx.nn.backends import flex_available
from difftx.nn.mask import AttnMask

from .test_document_masking import BACKENDS, _module, _reference, _rope, assert_matches

N = 23


def allowed_window(n_k: int, window: int, causal: bool = True, q_start: int = 0, valid=None,
                   doc=None) -> torch.Tensor:
    """(B, n_q, n_k) by an explicit loop: query t sees key s when s <= t (causal), |t - s| < window, s is real and
    in t's document; and always itself."""
    b = 1 if valid is None and doc is None else (valid if valid is not None else doc).shape[0]
    n_q = n_k - q_start
    out = torch.zeros(b, n_q, n_k, dtype=torch.bool)
    for bi in range(b):
        for i in range(n_q):
            t = q_start + i
            for s in range(n_k):
                ok = (s <= t or not causal) and abs(t - s) < window
                if valid is not None:
                    ok = ok and bool(valid[bi, s])
                if doc is not None:
                    ok = ok and int(doc[bi, s]) == int(doc[bi, t])
                out[bi, i, s] = ok or s == t
    return out


def test_mask_forms_match_an_explicit_loop():
    from difftx.nn import fused

    valid = torch.ones(2, N, dtype=torch.bool)
    valid[0, :4] = False
    doc = torch.tensor([[0] * 9 + [1] * 14, [0] * 23])
    cpu = torch.device("cpu")
    for causal in (True, False):
        for kv, dc in ((None, None), (valid, None), (None, doc)):
            m = AttnMask(causal=causal, n_q=N, n_k=N, key_valid=kv, doc_ids=dc, window=5)
            assert m.windowed and not m.is_plain_causal and not m.is_empty and m.segments() is None
            ref = allowed_window(N, 5, causal, valid=kv, doc=dc).expand(2, N, N)
            assert torch.equal(m.dense(cpu)[:, 0].expand(2, N, N), ref)
            for i0, i1 in ((0, 8), (8, N)):
                ke = min(N, i1) if causal else N
                blk = fused._block_mask(m, i0, i1, ke, cpu)[:, 0, 0, 0].expand(2, i1 - i0, ke)
                assert torch.equal(blk, ref[:, i0:i1, :ke])
    m = AttnMask(causal=True, n_q=3, n_k=N, q_start=N - 3, window=4)  # queries after a cache
    assert torch.equal(m.dense(cpu)[:, 0], allowed_window(N, 4, q_start=N - 3))
    # a window as long as the keys hides nothing: the plain causal mask
    assert AttnMask(causal=True, n_q=N, n_k=N, window=N).is_plain_causal


def test_bad_windows_are_refused():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window must be a positive integer"):
            AttnMask(causal=True, n_q=4, n_k=4, window=bad)
        with pytest.raises(ConfigError, match="sliding_window: must be a positive integer"):
            ModelConfig(sliding_window=bad)
    with pytest.raises(ConfigError, match="sliding_window: is a causal language model's local attention"):
        ModelConfig(domain="vision", sliding_window=8)


@pytest.mark.parametrize("kind,h,h_kv", [("softmax", 4, 2), ("diff", 2, 2), ("diff", 4, 1), ("diff2", 2, 1)])
@pytest.mark.parametrize("backend,variant", BACKENDS)
def test_windowed_attention_matches_the_equations(kind, h, h_kv, backend, variant):
    """float64 outputs and gradients against SPEC's equations under an explicitly built window mask."""
    cfg, m = _module(kind, h, h_kv)
    m.backend, m.diff_variant = backend, variant
    positions = torch.arange(N)[None].expand(2, N)
    x = torch.randn(2, N, cfg.d_model, dtype=torch.float64, requires_grad=True)
    out = m(x, _rope(cfg, positions, torch.float64), AttnMask(causal=True, n_q=N, n_k=N, window=6))
    assert_matches(out, _reference(kind, cfg, m, x, positions, allowed_window(N, 6)), [x, *m.parameters()])


@pytest.mark.skipif(not flex_available(), reason="FlexAttention is not available in this torch")
@pytest.mark.parametrize("kind", ["softmax", "diff", "diff2"])
def test_flex_block_mask_keeps_the_window(kind):
    cfg, m = _module(kind, 2, 2)
    x = torch.randn(2, N, cfg.d_model, dtype=torch.float64)
    rope = _rope(cfg, torch.arange(N)[None], torch.float64)
    with torch.no_grad():
        m.backend = "flex"
        out = m(x, rope, AttnMask(causal=True, n_q=N, n_k=N, window=6))
        m.backend = "eager"
        ref = m(x, rope, AttnMask(causal=True, n_q=N, n_k=N, window=6))
    assert torch.allclose(out, ref, atol=1e-10)


@pytest.mark.parametrize("kind", ["softmax", "diff", "diff2"])
def test_one_layer_sees_only_its_window(kind):
    """A one-layer model's logits at position t depend on tokens t - window + 1 .. t only."""
    cfg = ModelConfig(attention=kind, d_model=64, n_heads=2, n_layers=1, vocab_size=50, max_seq_len=64,
                      sliding_window=5)
    torch.manual_seed(0)
    model = build_model(cfg).double()
    x = torch.randint(0, 50, (2, 30))
    y = x.clone()
    y[:, :16] = (y[:, :16] + 1) % 50  # tokens 0..15 changed
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    assert torch.equal(a[:, 20:], b[:, 20:])  # position 20 sees 16..20
    assert not torch.allclose(a[:, 19], b[:, 19])  # position 19 sees 15


@pytest.mark.parametrize("kind", ["softmax", "diff", "diff2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_with_a_cache_keeps_the_window(kind, dtype, monkeypatch):
    """Prefill then one-token steps over a KV cache (the native decoding kernel where built) give the full
    forward's logits; the window then hides the cache's older keys."""
    taken = []
    real = backends.native_diff_decode
    monkeypatch.setattr(backends, "native_diff_decode", lambda *a, **k: taken.append(1) or real(*a, **k))
    cfg = ModelConfig(attention=kind, d_model=64, n_heads=2, n_layers=2, vocab_size=50, max_seq_len=64,
                      sliding_window=6)
    torch.manual_seed(0)
    model = build_model(cfg).to(dtype).eval()
    x = torch.randint(0, 50, (2, 20))
    with torch.no_grad():
        full = model(x).logits.float()
        cache = model.new_cache(2, 32, dtype=dtype)
        steps = [model(x[:, :12], cache=cache).logits[:, -1]]
        for t in range(12, 20):
            steps.append(model(x[:, t:t + 1], cache=cache).logits[:, -1])
        plain = build_model(cfg.replace(sliding_window=None)).to(dtype).eval()
        plain.load_state_dict(model.state_dict())
        unwindowed = plain(x).logits.float()
    got = torch.stack(steps[1:], dim=1).float()
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    assert torch.allclose(got, full[:, 12:20], atol=tol), (got - full[:, 12:20]).abs().max()
    assert not torch.allclose(unwindowed[:, 12:20], full[:, 12:20], atol=tol)
    assert bool(taken) == native.supports(dtype, torch.device("cpu"))


def test_logit_quantization_scales_come_from_the_window():
    from difftx.evals.quant import scale_entries

    m = AttnMask(causal=True, n_q=N, n_k=N, window=5)
    assert torch.equal(scale_entries(m, N, N, torch.device("cpu"))[:, 0], allowed_window(N, 5))
