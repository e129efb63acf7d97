"""Sliding-window attention (``ModelConfig.sliding_window``, ``AttnMask.window``): every backend and attention
kind against SPEC's equations under an explicitly built mask, decoding with a cache against the full forward."""

from __future__ import annotations

import copy
import json

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
            assert m.windowed and not m.is_plain_causal and not m.is_empty
            assert (m.segments() is not None) == (dc is not None)  # documents keep the window: a call each
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


# ----------------------------------------------------------------------------- the native kernels' own windows
def _native_case(m, h, hk, n, q_start, lam_kind, causal, window, mk=None, seed=2):
    """float64 inputs whose head widths take the native attention kernels (d = 32, dv = 32 or 64); ``mk`` 1: one K
    both maps read (DIFF V2).  ((q, k, v, lam), mask)."""
    g = torch.Generator().manual_seed(seed)
    b, d, dv, nk = 2, 32, 64 if m == 2 else 32, n + q_start

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    lam = None
    if lam_kind == "scalar":
        lam = torch.tensor(0.37, dtype=torch.float64)
    elif lam_kind == "rows":
        lam = torch.rand(b, h, n, 1, generator=g, dtype=torch.float64)
    mask = AttnMask(causal=causal, n_q=n, n_k=nk, q_start=q_start, window=window)
    return (t(b, m, h, n, d), t(b, mk or m, hk, nk, d), t(b, hk, nk, dv), lam), mask


def _fused_run(inputs, mask, dtype, use_native, monkeypatch, chunk):
    """Output and gradients (q, k, v, lambda) of fused_attention on ``inputs`` in ``dtype`` (lambda in float32 under
    bf16), with the native kernels on or off; and whether the native attention kernel ran."""
    from difftx.nn import fused

    monkeypatch.setattr(native, "ENABLED", use_native)
    calls = []
    fwd, bwd = native.attention_forward, native.attention_backward
    monkeypatch.setattr(native, "attention_forward", lambda *a, **kw: calls.append("f") or fwd(*a, **kw))
    monkeypatch.setattr(native, "attention_backward", lambda *a, **kw: calls.append("b") or bwd(*a, **kw))
    lam_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    ins = [None if x is None else x.to(lam_dtype if x is inputs[3] else dtype).requires_grad_() for x in inputs]
    out = fused.fused_attention(*ins[:3], mask, 0.3, ins[3], chunk=chunk)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    grads = torch.autograd.grad((out * w).sum(), [x for x in ins if x is not None])
    return [out.detach(), *grads], calls


WINDOW_CASES = [  # m, h, hk, n, q_start, lambda, causal, window, mk, (fp32 chunk, bf16 chunk)
    (1, 4, 4, 200, 0, None, True, 40, None, (48, 32)),  # blocks whose keys start past 0, 64, 96, ...
    (2, 4, 2, 200, 0, "scalar", True, 70, None, (96, 64)),  # GQA, taller blocks
    (2, 2, 2, 150, 37, "rows", True, 33, None, (48, 32)),  # DIFF V2's per-token lambda, queries after a cache
    (2, 4, 2, 150, 0, "scalar", True, 45, 1, (48, 32)),  # one K both maps read
    (2, 4, 2, 130, 0, "scalar", False, 45, None, (48, 32)),  # bidirectional: keys on both sides
    (1, 4, 4, 100, 0, None, True, 1, None, (48, 32)),  # every query sees itself only
    (2, 4, 2, 300, 0, "scalar", True, 64, None, (None, None)),  # the default (window) blocks
]


@pytest.mark.skipif(not native.supports(torch.float32, torch.device("cpu")), reason="no native kernels here")
@pytest.mark.parametrize("m,h,hk,n,q_start,lam_kind,causal,window,mk,chunks", WINDOW_CASES)
def test_native_float32_attention_under_a_window_matches_float64(m, h, hk, n, q_start, lam_kind, causal, window, mk,
                                                                  chunks, monkeypatch):
    """The float32 attention kernels take a sliding window themselves (each block multiplies only the keys from its
    first query's window on, each row masks the rest): the output and every gradient of the float64 masked
    reference, to a few fp32 ulp (a scalar lambda's gradient, one fp32 sum over every row with cancellation, to
    5e-5 of its size: the torch path's is as far off)."""
    inputs, mask = _native_case(m, h, hk, n, q_start, lam_kind, causal, window, mk)
    got, calls = _fused_run(inputs, mask, torch.float32, True, monkeypatch, chunks[0])
    assert calls == ["f", "b"], calls
    exact, _ = _fused_run(inputs, mask, torch.float64, False, monkeypatch, chunks[0])
    for i, (a, r) in enumerate(zip(got, exact)):
        assert a.dtype == torch.float32 and a.shape == r.shape
        scale = r.abs().max().clamp_min(1.0)
        tol = 5e-5 if r.dim() == 0 else 2e-6
        assert (a.double() - r).abs().max() <= tol * scale, (i, (a.double() - r).abs().max() / scale)


@pytest.mark.skipif(not native.bf16_attention(), reason="the bf16 attention kernel needs AMX or AVX512-BF16")
@pytest.mark.parametrize("m,h,hk,n,q_start,lam_kind,causal,window,mk,chunks", WINDOW_CASES)
def test_native_bf16_attention_under_a_window_is_as_close_to_float64_as_the_torch_path(
        m, h, hk, n, q_start, lam_kind, causal, window, mk, chunks, monkeypatch):
    inputs, mask = _native_case(m, h, hk, n, q_start, lam_kind, causal, window, mk)
    inputs = tuple(None if x is None or x is inputs[3] else x.bfloat16().double() for x in inputs[:3]) + (inputs[3],)
    got, calls = _fused_run(inputs, mask, torch.bfloat16, True, monkeypatch, chunks[1])
    assert calls == ["f", "b"], calls
    tor, calls = _fused_run(inputs, mask, torch.bfloat16, False, monkeypatch, chunks[1])
    assert not calls
    exact, _ = _fused_run(inputs, mask, torch.float64, False, monkeypatch, chunks[1])
    for i, (a, b, r) in enumerate(zip(got, tor, exact)):
        scale = r.abs().max().clamp_min(1.0)
        err, err_torch = (a.double() - r).abs().max() / scale, (b.double() - r).abs().max() / scale
        assert err <= 1.5 * err_torch + 2e-3, (i, err, err_torch)
        if i < 4:
            assert err <= 2e-2, (i, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch blocks"])
def test_attention_never_reads_the_keys_left_of_a_blocks_window(dtype, use_native, monkeypatch):
    """NaN in the first 32 keys and values: the queries of every block whose first query's window starts past them
    get the same outputs as with finite keys there (a masked product would give 0 x NaN = NaN: neither the native
    kernels nor the torch blocks multiply or read those keys), the earlier queries NaN."""
    ok = native.supports(dtype, torch.device("cpu")) and (dtype == torch.float32 or native.bf16_attention())
    if use_native and not ok:
        pytest.skip("no native attention kernel for this dtype here")
    (q, k, v, lam), mask = _native_case(2, 4, 2, 200, 0, "scalar", True, 40)
    chunk = 48 if dtype == torch.float32 else 32
    clean, calls = _fused_run((q, k, v, lam), mask, dtype, use_native, monkeypatch, chunk)
    assert calls == (["f", "b"] if use_native else [])
    k, v = k.clone(), v.clone()
    k[:, :, :, :32] = float("nan")
    v[:, :, :32] = float("nan")
    dirty, _ = _fused_run((q, k, v, lam), mask, dtype, use_native, monkeypatch, chunk)
    first = next(i0 for i0 in range(0, 200, chunk) if i0 - 40 + 1 >= 32)  # 96 (fp32) or 96 (bf16)
    assert torch.equal(dirty[0][:, first:], clean[0][:, first:])
    assert dirty[0][:, :32].isnan().all()


@pytest.mark.skipif(not (native.bf16_attention() and not native.amx()),
                    reason="the untransposed dK / dV products run on AVX512-BF16 without AMX")
@pytest.mark.parametrize("causal", [True, False])
def test_bf16_backward_forms_give_the_same_bits_under_a_window(causal):
    """AMX's transposed dK / dV products (form 0, run here on dot products) and the untransposed ones (form 1) over
    each block's window of keys: equal bits."""
    g = torch.Generator().manual_seed(3)
    b, m, h, hk, n, d, dv = 2, 2, 4, 2, 150, 32, 64
    t = lambda *shape: torch.randn(*shape, generator=g).bfloat16()  # noqa: E731
    q, k, v, dout = t(b, m, h, n, d), t(b * m * hk, n, d), t(b, hk, n, dv), t(b, n, h, dv)
    _, lse = native.attention_forward(q, k, v, causal, 0, 32, 0.3, 0.37, None, True, 40)
    before = native.attention_backward_form()
    try:
        native.attention_backward_form(0)
        old = native.attention_backward(q, k, v, dout, lse, causal, 0, 32, 0.3, 0.37, None, 40)
        native.attention_backward_form(1)
        new = native.attention_backward(q, k, v, dout, lse, causal, 0, 32, 0.3, 0.37, None, 40)
    finally:
        native.attention_backward_form(before)
    for a, c in zip(old, new):
        assert torch.equal(a, c) and a.abs().sum() > 0


@pytest.mark.parametrize("causal", [True, False])
def test_packed_documents_under_a_window_run_a_call_each_and_match_the_mask(causal, monkeypatch):
    """Documents and a sliding window together: each document its own call under the window (not the masked blocks
    over the whole sequence), the values of the float64 masked reference."""
    from difftx.nn import fused

    doc = torch.tensor([[0] * 70 + [1] * 50 + [2] * 80, [0] * 130 + [1] * 70])
    (q, k, v, lam), _ = _native_case(2, 4, 2, 200, 0, "scalar", causal, 40)
    mask = AttnMask(causal=causal, n_q=200, n_k=200, doc_ids=doc, window=40)
    seen = []
    real = fused._by_document
    monkeypatch.setattr(fused, "_by_document", lambda *a, **kw: seen.append(a[4]) or real(*a, **kw))
    got, _ = _fused_run((q, k, v, lam), mask, torch.float32, True, monkeypatch, None)
    assert len(seen) == 1 and seen[0].window == 40
    monkeypatch.setattr(fused, "_by_document", real)
    ref = backends.eager_diff_attention(q[:, 0], q[:, 1], k[:, 0], k[:, 1], v, lam, mask, 0.3).transpose(1, 2)
    assert (got[0].double() - ref).abs().max() <= 2e-6 * ref.abs().max()


@pytest.mark.skipif(not native.supports(torch.float32, torch.device("cpu")), reason="no native kernels here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_a_native_decoding_step_reads_only_the_windows_keys(dtype, padded, monkeypatch):
    """One DIFF decoding step over a 50-key cache under a window of 9: the kernel gets the window's 9 keys only (as
    views of the cache), and gives the masked float32 reference's output, with NaN in every key and value before
    the window; with left padding reaching into the window, its padding keys stay hidden."""
    if not native.supports(dtype, torch.device("cpu")):
        pytest.skip("no native kernel for this dtype here")
    g = torch.Generator().manual_seed(4)
    b, h, hk, t, d, w = 2, 4, 2, 50, 16, 9
    q = torch.randn(b, 2, h, 1, d, generator=g).to(dtype)
    k = torch.randn(b, 2, hk, t, d, generator=g).to(dtype)
    v = torch.randn(b, hk, t, 2 * d, generator=g).to(dtype)
    lam = torch.tensor(0.4)
    valid = None
    if padded:
        valid = torch.ones(b, t, dtype=torch.bool)
        valid[1, :44] = False  # the window's first 3 keys of row 1 are padding
    mask = AttnMask(causal=True, n_q=1, n_k=t, q_start=t - 1, key_valid=valid, window=w)
    ref = backends.eager_diff_attention(q[:, 0], q[:, 1], k[:, 0], k[:, 1], v, lam, mask, 0.25).transpose(1, 2)
    k[:, :, :, : t - w] = float("nan")
    v[:, :, : t - w] = float("nan")
    keys = []
    real = native.diff_decode
    monkeypatch.setattr(native, "diff_decode", lambda q, k, *a: keys.append(k.shape[3]) or real(q, k, *a))
    got = backends.native_diff_decode(q, k, v, mask, 0.25, lam, False, None, 1.0, 1e-5, torch.float32)
    assert keys == [w]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == ref.shape and (got - ref).abs().max() <= tol, (got - ref).abs().max()


# ----------------------------------------------------------------------------- decoding past the cache's length
def _windowed_model(kind, dtype=torch.float32, positions="rope", max_seq_len=64):
    cfg = ModelConfig(attention=kind, d_model=64, n_heads=2, n_layers=2, vocab_size=50, max_seq_len=max_seq_len,
                      sliding_window=6, positions=positions)
    torch.manual_seed(0)
    return build_model(cfg).to(dtype).eval()


@pytest.mark.parametrize("kind", ["softmax", "diff", "diff2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_windowed_model_decodes_past_its_caches_length(kind, dtype):
    """A cache of 10 positions under a window of 6: a prompt of 8 (one row left-padded by 3), then 52 one-token
    steps and calls of 3 tokens: every call's logits are the full forward's (the model drops the keys no later
    token sees whenever the cache fills), and the cache never grows."""
    model = _windowed_model(kind, dtype)
    x = torch.randint(0, 50, (2, 60), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 60, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        full = model(x, attention_mask=mask).logits.float()
        cache = model.new_cache(2, 10)
        got = [model(x[:, :8], attention_mask=mask[:, :8], cache=cache).logits]
        t = 8
        while t < 60:
            step = 1 if t < 40 else 3  # 3 tokens: the 5 positions the first sees, + 3 <= 10
            got.append(model(x[:, t:t + step], cache=cache).logits)
            t += step
    got = torch.cat(got, 1).float()
    tol = 1e-5 if dtype == torch.float32 else 6e-2
    real = mask.bool()
    assert (got - full)[real].abs().max() <= tol, (got - full)[real].abs().max()
    assert cache.max_len == 10 and cache.length <= 10 and cache.dropped + cache.length == 60
    assert all(t.shape[2] == 10 for t in cache.k + cache.v)


def test_a_call_that_cannot_fit_under_the_window_is_refused_and_the_cache_kept():
    model = _windowed_model("diff")
    x = torch.randint(0, 50, (1, 20))
    with torch.no_grad():
        cache = model.new_cache(1, 7)
        model(x[:, :7], cache=cache)
        k0 = cache.k[0].clone()
        with pytest.raises(ValueError, match=r"needs room for 8 positions, the cache has 7; make the cache with "
                                             r"max_len >= 8"):
            model(x[:, 7:10], cache=cache)  # keeps 5 + 3
        assert cache.length == 7 and cache.dropped == 0 and torch.equal(cache.k[0], k0)
        model(x[:, 7:9], cache=cache)  # 5 + 2 fit
        assert cache.length == 7 and cache.dropped == 2
    plain = build_model(model.config.replace(sliding_window=None)).eval()
    with torch.no_grad(), pytest.raises(ValueError, match="KV cache full: 8 positions needed, room for 7"):
        c = plain.new_cache(1, 7)
        plain(x[:, :7], cache=c)
        plain(x[:, 7:8], cache=c)


def test_learned_positions_still_end_at_max_seq_len_and_the_cache_is_kept():
    from difftx.errors import DifftxError

    model = _windowed_model("softmax", positions="learned", max_seq_len=12)
    x = torch.randint(0, 50, (1, 13))
    with torch.no_grad():
        cache = model.new_cache(1, 8)
        model(x[:, :8], cache=cache)
        for t in range(8, 12):  # past the cache's 8, within max_seq_len's 12
            model(x[:, t:t + 1], cache=cache)
        assert cache.dropped + cache.length == 12
        before = (cache.length, cache.dropped)
        with pytest.raises(DifftxError, match="sequence of 13 tokens is longer than max_seq_len=12"):
            model(x[:, 12:13], cache=cache)
        assert (cache.length, cache.dropped) == before


def test_generate_under_a_window_holds_two_windows_and_matches_decoding_without_a_cache(monkeypatch):
    model = _windowed_model("diff")
    sizes = []
    real = model.new_cache
    monkeypatch.setattr(model, "new_cache", lambda b, n, **kw: sizes.append(n) or real(b, n, **kw))
    x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(2))
    got = model.generate(x, max_new_tokens=40, temperature=0)
    assert sizes == [12]  # max(prompt 9, 2 x window 6), not 9 + 40
    assert torch.equal(got, model.generate(x, max_new_tokens=40, temperature=0, use_cache=False))


def test_drop_oldest_moves_the_rest_to_the_front_and_reset_forgets_it():
    from difftx.nn import KVCache

    c = KVCache(1, 2, 6)
    k = torch.arange(2 * 1 * 5 * 2, dtype=torch.float32).view(2, 1, 5, 2)
    c.update(0, k, k + 100)
    c.advance(5, torch.tensor([[False, True, True, True, True], [True] * 5]))
    assert c.padded
    c.drop_oldest(2)
    assert c.length == 3 and c.dropped == 2 and not c.padded  # the padding position went
    assert torch.equal(c.k[0][:, :, :3], k[:, :, 2:]) and torch.equal(c.v[0][:, :, :3], k[:, :, 2:] + 100)
    assert c.next_position.tolist() == [4, 5]  # the numbering goes on
    with pytest.raises(ValueError, match="can drop 0..3 positions; got 4"):
        c.drop_oldest(4)
    c.reset()
    assert c.length == 0 and c.dropped == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_few_queries_after_a_cache_read_only_their_windows_keys(dtype):
    """Three queries after 47 cached keys under a window of 9 (fused_attention's few-query path, no autograd): the
    masked float64 reference's output, with NaN in every key and value left of the first query's window."""
    from difftx.nn import fused

    (q, k, v, lam), mask = _native_case(2, 4, 2, 3, 47, "scalar", True, 9)
    with torch.no_grad():
        ref = fused._attention_torch(q, k, v, lam, mask, 0.3)
        k, v = k.clone(), v.clone()
        first = 47 - 9 + 1
        k[:, :, :, :first] = float("nan")
        v[:, :, :first] = float("nan")
        got = fused.fused_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask, 0.3, lam.float())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got.double() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("kind", ["softmax", "diff2"])
def test_windowed_inference_takes_the_fused_path_where_sdpa_would_be_chosen(kind, monkeypatch):
    """bf16 inference on an AMX CPU takes SDPA (CPU flash) without a window; under a window the fused path, which
    multiplies only the window's keys, where SDPA would mask a dense N x N map."""
    monkeypatch.setattr(backends, "CPU_HAS_AMX", True)
    calls = []
    real = backends.fused_attention
    monkeypatch.setattr(backends, "fused_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = torch.randint(0, 50, (2, 20))
    for window, want in ((None, False), (6, True)):
        cfg = ModelConfig(attention=kind, d_model=64, n_heads=2, n_layers=1, vocab_size=50, max_seq_len=64,
                          sliding_window=window)
        torch.manual_seed(0)
        model = build_model(cfg).bfloat16().eval()
        calls.clear()
        with torch.no_grad():
            model(x)
        assert bool(calls) == want, (window, calls)


# ---------------------------------------------------------------------- local and global layers


def _mixed_model(kind, dtype=torch.float32, n_layers=3, full=(2,), window=4):
    cfg = ModelConfig(attention=kind, d_model=64, n_heads=2, n_layers=n_layers, vocab_size=50, max_seq_len=64,
                      sliding_window=window, full_attention_layers=full)
    torch.manual_seed(0)
    return build_model(cfg).to(dtype).eval()


def _by_hand(model, x):
    """The model's forward written out, each block given a mask built here: the window on the layers outside
    full_attention_layers, none on theirs."""
    cfg, n = model.config, x.shape[1]
    h = model.embed(x)
    rope = model.rope.cos_sin(torch.arange(n)[None].expand(x.shape[0], n), h.dtype)
    for i, block in enumerate(model.layers, start=1):
        window = None if i in cfg.full_attention_layers else cfg.sliding_window
        h = block(h, rope, AttnMask(causal=True, n_q=n, n_k=n, window=window))
    return model.head(model.final_norm(h))


def test_full_attention_layers_are_checked():
    for bad, needle in (("2", "must be a list of 1-based layer numbers"), ([1.0], "must be a list"),
                        ([True], "must be a list"), ([2, 2], "lists a layer twice"),
                        ([0], "layer numbers run from 1 to n_layers = 3"), ([4], "layer numbers run from 1 to n_layers = 3"),
                        ([1, 2, 3], "lists all 3 layers, so no layer uses the sliding window")):
        with pytest.raises(ConfigError, match=f"full_attention_layers: {needle}"):
            ModelConfig(n_layers=3, sliding_window=4, full_attention_layers=bad)
    with pytest.raises(ConfigError, match="full_attention_layers: names the layers .* sliding_window is null"):
        ModelConfig(n_layers=3, full_attention_layers=[1])
    cfg = ModelConfig(n_layers=3, sliding_window=4, full_attention_layers=[3, 1])
    assert cfg.full_attention_layers == (1, 3) and [cfg.layer_window(i) for i in (1, 2, 3)] == [None, 4, None]
    assert cfg.uniform_window is None and cfg.replace(full_attention_layers=[]).uniform_window == 4
    assert cfg.replace(sliding_window=None).full_attention_layers is None  # no window: no exception to it
    assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg


@pytest.mark.parametrize("kind", ["softmax", "diff", "diff2"])
@pytest.mark.parametrize("backend,variant", [("auto", None), ("eager", None), ("sdpa", "fused"), ("sdpa", "sdpa")])
def test_local_and_global_layers_match_the_forward_written_out(kind, backend, variant):
    """Logits and gradients of a 3-layer model whose layer 2 attends over the whole context (layers 1 and 3: a
    window of 4 over 20 tokens) against the same blocks run one by one with masks built by hand (float64, eager)."""
    model = _mixed_model(kind)
    x = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(1))
    ref_model = copy.deepcopy(model).double()
    ref_model.set_attention_backend("eager")
    ref = _by_hand(ref_model, x)
    ref.square().mean().backward()
    model.set_attention_backend(backend, variant)
    got = model(x).logits
    got.square().mean().backward()
    assert (got.double() - ref).abs().max() < 1e-5
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert (p.grad.double() - q.grad).abs().max() < 1e-5 * max(1.0, q.grad.abs().max().item()), name
    with torch.no_grad():  # the window on layer 2 too, or on no layer: other logits
        for change in (dict(full_attention_layers=None), dict(sliding_window=None)):
            other = build_model(model.config.replace(**change)).eval()
            other.load_state_dict(model.state_dict())
            assert (other(x).logits - got).abs().max() > 1e-3, change


@pytest.mark.parametrize("kind", ["softmax", "diff", "diff2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_and_global_layers_decode_with_a_cache_as_the_full_forward(kind, dtype):
    """Prefill then one-token steps: the global layer reads every cached key, the local ones their window; a
    cache that fills is refused (the global layer needs every key) and generate sizes it for the whole text."""
    model = _mixed_model(kind, dtype)
    x = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x).logits.float()
        cache = model.new_cache(2, 20, dtype=dtype)
        steps = [model(x[:, :10], cache=cache).logits[:, -1]]
        for t in range(10, 20):
            steps.append(model(x[:, t:t + 1], cache=cache).logits[:, -1])
        with pytest.raises(ValueError, match="KV cache full"):
            model(x[:, :1], cache=cache)
    got = torch.stack(steps, dim=1).float()
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    assert (got - full[:, 9:]).abs().max() <= tol
    assert cache.dropped == 0
    if dtype == torch.float32:
        y = model.generate(x[:, :5], max_new_tokens=30, temperature=0)
        assert torch.equal(y, model.generate(x[:, :5], max_new_tokens=30, temperature=0, use_cache=False))
