"""Every fast path equals the eager reference: outputs and gradients, causal and padded, GQA,
both pairings, DIFF V1/V2 and softmax; float64 exact, fp32 tight, bf16 loose.  Also the fused
kernel's long-context property (memory linear in N), its decoding path over a cache's whole
buffers, the fused RMSNorm, and the lambda cache used while decoding."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

from difftx import ModelConfig, build_model
from difftx.nn import backends, fused, native
from difftx.nn.attention import make_attention
from difftx.nn.cache import KVCache
from difftx.nn.mask import AttnMask
from difftx.nn.rope import RotaryEmbedding

TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 6e-2}


def _ref_maps(q, k, v, lam, mask: AttnMask, scale: float):
    """(sum_m sign softmax(Q_m K_m^T s)) V in float64 with explicit head repetition (independent of fused)."""
    b, m, h, n, d = q.shape
    rep = h // k.shape[2]
    kk = k.double().repeat_interleave(rep, dim=2)
    vv = v.double().repeat_interleave(rep, dim=1)
    s = q.double() @ kk.transpose(-1, -2) * scale
    dense = mask.dense(q.device)
    if dense is not None:
        s = s.masked_fill(~dense[:, None], float("-inf"))
    p = torch.softmax(s, -1)
    if m == 2:
        lam = lam.double()
        p = p[:, 0] - (lam if lam.dim() == 0 else lam) * p[:, 1]
    else:
        p = p[:, 0]
    return (p @ vv).transpose(1, 2)  # (B, N, H, dv)


def _kernel_case(m, lam_kind, h, hk, padded, q_start, dtype, n=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, d, dv = 2, 8, 16
    nk = n + q_start

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()

    q, k, v = t(b, m, h, n, d), t(b, m, hk, nk, d), t(b, hk, nk, dv)
    lam = None
    if lam_kind == "scalar":
        lam = torch.tensor(0.37, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                           requires_grad=True)
    elif lam_kind == "rows":
        lam = torch.rand(b, h, n, 1, generator=g, dtype=torch.float64).to(
            torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    valid = None
    if padded:  # row 0 left-padded, row 1 right-padded
        valid = torch.ones(b, nk, dtype=torch.bool)
        valid[0, :5] = False
        valid[1, -3:] = False
    return q, k, v, lam, AttnMask(causal=True, n_q=n, n_k=nk, q_start=q_start, key_valid=valid)


def _check(out, ref, inputs, tol, keep=None):
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    if keep is not None:
        out, ref, w = out[keep], ref[keep], w[keep]
    scale = ref.abs().max().clamp_min(1.0)
    assert (out.double() - ref).abs().max() <= tol * scale, (out.double() - ref).abs().max()
    ins = [t for t in inputs if t is not None]
    g1 = torch.autograd.grad((out.double() * w).sum(), ins)
    g2 = torch.autograd.grad((ref * w).sum(), ins)
    for a, b in zip(g1, g2):
        s = b.abs().max().clamp_min(1.0)
        assert (a.double() - b).abs().max() <= tol * s, (a.double() - b).abs().max()


KERNEL_CASES = [  # maps, lambda, heads, kv heads, padded, q_start (keys already cached)
    (1, None, 4, 4, False, 0), (1, None, 4, 2, True, 5), (1, None, 4, 1, False, 5),
    (2, "scalar", 4, 4, False, 0), (2, "scalar", 4, 2, True, 0), (2, "scalar", 4, 1, True, 5),
    (2, "scalar", 4, 2, False, 5),
    (2, "rows", 4, 4, True, 0), (2, "rows", 4, 2, False, 0), (2, "rows", 4, 1, True, 5),
]


@pytest.mark.parametrize("m,lam_kind,h,hk,padded,q_start", KERNEL_CASES)
def test_fused_kernel_matches_reference_float64(m, lam_kind, h, hk, padded, q_start):
    q, k, v, lam, mask = _kernel_case(m, lam_kind, h, hk, padded, q_start, torch.float64)
    for chunk in (8, 64):  # several blocks (causal skipping, reverse-order sums) and a single block
        out = fused.fused_attention(q, k, v, mask, 0.3, lam, chunk=chunk)
        _check(out, _ref_maps(q, k, v, lam, mask, 0.3), (q, k, v, lam), TOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,lam_kind,h,hk,padded", [(2, "scalar", 4, 2, True), (1, None, 4, 4, False),
                                                     (2, "rows", 4, 1, False)])
@pytest.mark.parametrize("use_native", [True, False])  # the native row kernels (when built) and pure torch
def test_fused_kernel_low_precision(dtype, m, lam_kind, h, hk, padded, use_native, monkeypatch):
    monkeypatch.setattr(native, "ENABLED", use_native)
    q, k, v, lam, mask = _kernel_case(m, lam_kind, h, hk, padded, 0, dtype, n=45)
    out = fused.fused_attention(q, k, v, mask, 0.35, lam, chunk=16)
    assert out.dtype == dtype
    _check(out, _ref_maps(q, k, v, lam, mask, 0.35), (q, k, v, lam), TOL[dtype])


def test_fused_kernel_bf16_fp32_maps_switch():
    q, k, v, lam, mask = _kernel_case(2, "scalar", 4, 2, False, 0, torch.bfloat16, n=40)
    ref = _ref_maps(q, k, v, lam, mask, 0.35)
    old = fused.FP32_MAPS_FOR_BF16
    try:
        fused.FP32_MAPS_FOR_BF16 = True
        _check(fused.fused_attention(q, k, v, mask, 0.35, lam, chunk=16), ref, (q, k, v, lam), TOL[torch.bfloat16])
    finally:
        fused.FP32_MAPS_FOR_BF16 = old


@pytest.mark.parametrize("m,lam_kind,h,hk", [(1, None, 4, 2), (2, "scalar", 4, 4), (2, "rows", 4, 2)])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_few_queries_path_matches_blocks(m, lam_kind, h, hk, padded, n):
    """Decoding (no grad, a handful of queries) takes a separate path; it computes the same thing."""
    q, k, v, lam, mask = _kernel_case(m, lam_kind, h, hk, padded, 9, torch.float64, n=n)
    with torch.no_grad():
        out = fused.fused_attention(q, k, v, mask, 0.3, lam)
    torch.testing.assert_close(out, _ref_maps(q, k, v, lam, mask, 0.3), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,mk", [(1, 1), (2, 2), (2, 1)])
@pytest.mark.parametrize("n,grad", [(3, False), (70, False), (70, True)])
def test_fused_attention_of_an_empty_batch_is_empty(dtype, m, mk, n, grad):
    """A batch of 0 sequences (as SDPA takes it) gives an empty output and empty gradients: it was a
    ZeroDivisionError from the kernels' per-head geometry (K rows // (batch x K/V heads))."""
    q = torch.randn(0, m, 4, n, 32, dtype=dtype, requires_grad=grad)
    k = torch.randn(0, mk, 2, n + 5, 32, dtype=dtype, requires_grad=grad)  # a cache's longer buffers too
    v = torch.randn(0, 2, n + 5, 64, dtype=dtype, requires_grad=grad)
    lam = torch.tensor(0.3, requires_grad=grad) if m == 2 else None
    out = fused.fused_attention(q, k, v, AttnMask(True, n, n), 0.3, lam)
    assert out.shape == (0, n, 4, 64) and out.dtype == dtype
    if grad:
        out.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
        assert lam is None or float(lam.grad) == 0.0


def test_whole_cache_buffer_is_masked_past_the_written_length():
    """K/V longer than mask.n_k (a static cache's buffers): whatever finite values lie past n_k
    (a KVCache starts zeroed; a reused one holds old keys) have no effect, in any dtype."""
    for dtype in (torch.float64, torch.bfloat16):
        q, k, v, lam, mask = _kernel_case(2, "scalar", 4, 2, False, 20, dtype, n=1)
        k_buf = torch.cat((k.detach(), torch.full_like(k.detach()[:, :, :, :6], 1e4)), dim=3)
        v_buf = torch.cat((v.detach(), torch.full_like(v.detach()[:, :, :6], -3e4)), dim=2)
        with torch.no_grad():
            out = fused.fused_attention(q.detach(), k_buf, v_buf, mask, 0.3, lam.detach())
            ref = fused.fused_attention(q.detach(), k.detach(), v.detach(), mask, 0.3, lam.detach())
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref.double(), atol=1e-12 if dtype == torch.float64 else 2e-2,
                                   rtol=0)


# ----------------------------------------------------------------------------- modules
B, N = 2, 11


def _module_inputs(cfg, padded, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, cfg.d_model, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    valid = None
    positions = torch.arange(N)[None].expand(B, N)
    if padded:
        valid = torch.ones(B, N, dtype=torch.bool)
        valid[0, :3] = False
        valid[1, -2:] = False
        positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_style).cos_sin(positions, dtype)
    return x, rope, AttnMask(causal=True, n_q=N, n_k=N, key_valid=valid), valid


def _module(cfg, dtype, layer=3):
    torch.manual_seed(1)
    m = make_attention(cfg, layer).to(dtype)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.startswith("lambda_") and p.dim() == 1:
                p.normal_(0, 0.4)
    return m


def _run(m, x, rope, mask, backend, variant):
    m.backend, m.diff_variant = backend, variant
    return m(x, rope, mask)


def _compare_modules(m, x, rope, mask, valid, fast, tol):
    out = _run(m, x, rope, mask, *fast)
    ref = _run(m, x, rope, mask, "eager", "auto")
    keep = torch.ones(B, N, dtype=torch.bool) if valid is None else valid
    scale = ref[keep].abs().max().clamp_min(1.0)
    assert (out[keep].double() - ref[keep].double()).abs().max() <= tol * scale
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype) * keep[..., None]
    params = [x] + list(m.parameters())
    g1 = torch.autograd.grad((out * w).float().sum(), params, allow_unused=True)
    g2 = torch.autograd.grad((ref * w).float().sum(), params, allow_unused=True)
    for (name, _), a, b in zip([("x", None)] + list(m.named_parameters()), g1, g2):
        if a is None and b is None:
            continue
        s = b.abs().max().clamp_min(1.0)
        assert (a.double() - b.double()).abs().max() <= tol * s, f"grad {name}"


DIFF_CASES = [  # pairing, rope style, heads, kv heads, padded, qk_norm (DNT)
    ("adjacent", "half", 2, 2, False, False),
    ("adjacent", "interleaved", 4, 2, True, True),
    ("halves", "half", 4, 1, True, False),
    ("halves", "interleaved", 2, 2, False, True),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("pairing,rope_style,h,hk,padded,qk_norm", DIFF_CASES)
def test_diff_module_fused_equals_eager(dtype, pairing, rope_style, h, hk, padded, qk_norm):
    cfg = ModelConfig(attention="diff", d_model=48, n_heads=h, n_kv_heads=hk, head_dim=6, n_layers=4,
                      pairing=pairing, rope_style=rope_style, qk_norm=qk_norm)
    m = _module(cfg, dtype)
    x, rope, mask, valid = _module_inputs(cfg, padded, dtype)
    for fast in (("sdpa", "fused"), ("sdpa", "auto")):
        _compare_modules(m, x, rope, mask, valid, fast, TOL[dtype])


@pytest.mark.parametrize("pairing", ["adjacent", "halves"])
def test_diff_module_fused_bf16_autocast(pairing):
    cfg = ModelConfig(attention="diff", d_model=64, n_heads=2, n_kv_heads=1, head_dim=16, n_layers=2,
                      pairing=pairing)
    m = _module(cfg, torch.float32)
    x, rope, mask, valid = _module_inputs(cfg, True, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _run(m, x, rope, mask, "sdpa", "fused")
        ref = _run(m, x, rope, mask, "eager", "auto")
    keep = valid
    assert (out[keep].float() - ref[keep].float()).abs().max() <= 0.05 * ref[keep].abs().max()
    g1 = torch.autograd.grad(out.float()[keep].sum(), [x] + list(m.parameters()))
    g2 = torch.autograd.grad(ref.float()[keep].sum(), [x] + list(m.parameters()))
    for a, b in zip(g1, g2):
        assert (a - b).norm() <= 0.05 * b.norm().clamp_min(1e-3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("h,hk,padded", [(2, 2, False), (4, 2, True), (4, 1, True)])
def test_diff2_module_fused_equals_eager(dtype, h, hk, padded):
    cfg = ModelConfig(attention="diff2", d_model=32, n_heads=h, n_kv_heads=hk, head_dim=6, n_layers=2)
    m = _module(cfg, dtype)
    x, rope, mask, valid = _module_inputs(cfg, padded, dtype)
    for fast in (("sdpa", "fused"), ("sdpa", "sdpa")):
        _compare_modules(m, x, rope, mask, valid, fast, TOL[dtype])


@pytest.mark.parametrize("amx", [True, False])
def test_variant_choice(amx, monkeypatch):
    monkeypatch.setattr(backends, "CPU_HAS_AMX", amx)
    cpu = torch.device("cpu")
    q = torch.zeros(1, 1, 4, 2, requires_grad=True)
    for resolve in (backends.resolve_v2_variant, backends.resolve_softmax_variant):
        assert resolve("auto", q) == "fused"  # training on the CPU
        assert resolve("auto", q, dropout_p=0.1) == "sdpa"
        with torch.no_grad():
            assert resolve("auto", q) == "sdpa"  # a decoding step (2 queries): the flash forward
            prompt = torch.zeros(1, 1, 8, 2)
            assert resolve("auto", prompt) == "fused"  # an fp32 prompt: fused
            # bf16: CPU flash's kernel on AMX; without AMX the fused path, decoding steps too
            assert resolve("auto", prompt.bfloat16()) == ("sdpa" if amx else "fused")
            assert resolve("auto", q.detach().bfloat16()) == ("sdpa" if amx else "fused")
            assert resolve("auto", prompt, dropout_p=0.1) == "sdpa"
            # a sliding window: the fused path, which multiplies only the window's keys (SDPA: a dense mask)
            for x in (q.detach(), prompt.bfloat16(), q.detach().bfloat16()):
                assert resolve("auto", x, windowed=True) == "fused"
            assert resolve("auto", prompt, dropout_p=0.1, windowed=True) == "sdpa"
        assert resolve("fused", q.detach()) == "fused"
        with pytest.raises(ValueError):
            resolve("bogus", q)
    assert backends.resolve_diff_variant("auto", cpu) == "fused"
    assert backends.resolve_diff_variant("auto", cpu, dropout_p=0.1) == "2call"
    assert backends.resolve_diff_variant("sdpa", cpu) == "2call"
    for variant in ("fused", "4call"):  # no dropout of their own: 2call, not a silently undropped forward
        assert backends.resolve_diff_variant(variant, cpu) == variant
        assert backends.resolve_diff_variant(variant, cpu, dropout_p=0.1) == "2call"
    for resolve in (backends.resolve_v2_variant, backends.resolve_softmax_variant):
        assert resolve("fused", q, dropout_p=0.1) == "sdpa"


@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
@pytest.mark.parametrize("variant", ["auto", "fused", "sdpa", "2call", "4call"])
def test_attention_dropout_is_applied_by_every_variant(attention, variant):
    torch.manual_seed(0)
    cfg = ModelConfig(attention=attention, d_model=32, n_layers=1, n_heads=2, dropout=0.5, attn_backend="sdpa")
    m = make_attention(cfg, 1)
    m.diff_variant = variant
    x = torch.randn(2, 6, 32, requires_grad=True)
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_style).cos_sin(torch.arange(6))
    mask = AttnMask(causal=True, n_q=6, n_k=6)
    torch.manual_seed(1)
    a = m(x, rope, mask)
    torch.manual_seed(2)
    assert not torch.allclose(a, m(x, rope, mask))  # was: fused and 4call dropped nothing
    torch.manual_seed(1)
    assert torch.equal(a, m(x, rope, mask))
    m.eval()
    with torch.no_grad():
        ref = m(x, rope, mask)
        m.diff_variant = "2call" if attention == "diff" else "sdpa"
        torch.testing.assert_close(m(x, rope, mask), ref)


@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
def test_a_cache_without_a_slot_for_the_layer_is_refused(attention):
    cfg = ModelConfig(attention=attention, d_model=32, n_layers=3, n_heads=2)
    m = make_attention(cfg, 3)
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_style).cos_sin(torch.arange(4))
    with pytest.raises(ValueError, match="made for 2 layers has no slot for layer 3"):  # was: an IndexError
        m(torch.randn(1, 4, 32), rope, AttnMask(causal=True, n_q=4, n_k=4), KVCache(2, 1, 8))


@pytest.mark.parametrize("attention", ["diff", "diff2"])
def test_a_decoding_step_in_training_mode_applies_attention_dropout(attention):
    torch.manual_seed(0)
    cfg = ModelConfig(attention=attention, d_model=32, n_layers=1, n_heads=2, dropout=0.5)
    m = make_attention(cfg, 1)
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_style)
    x = torch.randn(1, 5, 32)
    outs = []
    for seed in (1, 2):
        cache = KVCache(1, 1, 8)
        with torch.no_grad():
            m(x[:, :4], rope.cos_sin(torch.arange(4)), AttnMask(causal=True, n_q=4, n_k=4), cache)
            cache.advance(4)
            torch.manual_seed(seed)
            outs.append(m(x[:, 4:], rope.cos_sin(torch.arange(4, 5)), AttnMask(causal=True, n_q=1, n_k=5, q_start=4),
                          cache))
    assert not torch.allclose(*outs)  # was: DIFF V2's native decoding step dropped nothing


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("h,hk,padded", [(4, 4, False), (4, 2, True)])
def test_softmax_module_fused_equals_eager(dtype, h, hk, padded):
    cfg = ModelConfig(attention="softmax", d_model=24, n_heads=h, n_kv_heads=hk, head_dim=6, n_layers=2)
    m = _module(cfg, dtype)
    x, rope, mask, valid = _module_inputs(cfg, padded, dtype)
    for fast in (("sdpa", "fused"), ("sdpa", "auto"), ("sdpa", "sdpa")):
        _compare_modules(m, x, rope, mask, valid, fast, TOL[dtype])


# ----------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("attention", ["diff", "diff2"])
def test_cached_decoding_bf16_matches_full_recompute(attention):
    """The decoding path (whole cache buffers, few queries) against a full forward each step."""
    cfg = ModelConfig(attention=attention, d_model=64, n_heads=2, head_dim=16, n_layers=2, vocab_size=50,
                      max_seq_len=64)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = model.new_cache(2, 14)
        step_logits = [model(ids, cache=cache).logits[:, -1]]
        seq = ids
        for _ in range(4):
            nxt = step_logits[-1].argmax(-1, keepdim=True)
            seq = torch.cat((seq, nxt), 1)
            step_logits.append(model(nxt, cache=cache).logits[:, -1])
        for i, lg in enumerate(step_logits):
            full = model(seq[:, : 9 + i]).logits[:, -1]
            assert (lg.float() - full.float()).abs().max() <= 0.05 * full.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,hk,padded", [(4, 4, False), (4, 2, True), (4, 1, True)])
def test_paired_decode_matches_reference(dtype, h, hk, padded):
    """One decoding query over a paired-layout cache ([K1 | K2] per head), one GQA SDPA call."""
    q, k, v, lam, mask = _kernel_case(2, "scalar", h, hk, padded, 30, dtype, n=1)
    b, _, _, nk, d = k.shape
    kk = k.detach().permute(0, 2, 3, 1, 4).reshape(b, hk, nk, 2 * d)  # what _cache_keys writes
    with torch.no_grad():
        out = backends.diff_decode_paired(q.detach(), kk, v.detach(), mask, 0.3, lam.detach())
    ref = _ref_maps(q, k, v, lam, mask, 0.3)
    assert out.shape == ref.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - ref).abs().max() <= tol * ref.abs().max().clamp_min(1.0)


def _padded_decoding(model, ids, valid, dtype):
    """Prefill ids[:, :8] into a fresh cache, then decode ids 8..10 one step at a time (``valid``: left padding),
    under bf16 autocast for ``dtype`` bf16: the logits at positions 7..10 as float32, and the cache."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        cache = model.new_cache(ids.shape[0], 16)
        out = [model(ids[:, :8], cache=cache, attention_mask=valid[:, :8]).logits[:, -1:]]
        for i in range(8, 11):
            out.append(model(ids[:, i:i + 1], cache=cache, attention_mask=valid[:, i:i + 1]).logits)
    return torch.cat(out, 1).float(), cache


@pytest.mark.parametrize("n_kv_heads", [None, 1])
def test_bf16_diff_cache_is_paired_and_decodes_like_fp32(n_kv_heads):
    """A bf16 KVCache holds DIFF keys paired (h_kv heads of 2d: the Transformer twin's bytes) and
    left-padded cached decoding lands within bf16 error of the fp32 full forward; fp32 keeps 2 h_kv heads of d."""
    cfg = ModelConfig(attention="diff", d_model=64, n_heads=4, head_dim=8, n_layers=2, vocab_size=50,
                      max_seq_len=64, n_kv_heads=n_kv_heads)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    hk = cfg.n_kv_heads
    ids = torch.randint(0, 50, (2, 12))
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[0, :3] = False
    with torch.no_grad():
        ref = model(ids, attention_mask=valid).logits[:, 7:11].float()  # prefill predicts at 7, steps at 8..10
        for dtype in (torch.bfloat16, torch.float32):
            got, cache = _padded_decoding(model, ids, valid, dtype)
            paired = (2, hk, 16, 2 * cfg.head_dim)
            assert tuple(cache.k[0].shape) == (paired if dtype == torch.bfloat16 else (2, 2 * hk, 16, cfg.head_dim))
            tol = 0.03 if dtype == torch.bfloat16 else 1e-5
            assert (got - ref).abs().max() <= tol * ref.abs().max(), (dtype, (got - ref).abs().max())


@pytest.mark.skipif(native.library() is None, reason="the native kernels are not built here")
@pytest.mark.parametrize("n_kv_heads,head_dim", [(None, 16), (1, 16), (2, 12)])  # 12: the kernel's scalar path
def test_diff2_decoding_kernel_matches_the_full_forward(n_kv_heads, head_dim, monkeypatch):
    """DIFF V2's cached decoding steps go through the native decoding kernel (both maps over the one set of
    cached keys, lambda per sequence and head) and land on the full forward's logits, left padding, GQA and
    bf16 autocast included."""
    cfg = ModelConfig(attention="diff2", d_model=64, n_heads=4, head_dim=head_dim, n_layers=2, vocab_size=50,
                      max_seq_len=64, n_kv_heads=n_kv_heads)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids = torch.randint(0, 50, (2, 12))
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[0, :3] = False
    calls = []
    run = native.diff_decode
    monkeypatch.setattr(native, "diff_decode", lambda *a: calls.append(a[4]) or run(*a))
    with torch.no_grad():
        ref = model(ids, attention_mask=valid).logits[:, 7:11].float()  # prefill predicts at 7, steps at 8..10
        for dtype in (torch.float32, torch.bfloat16):
            calls.clear()
            got, _ = _padded_decoding(model, ids, valid, dtype)
            assert len(calls) == 3 * 2 and all(tuple(lam.shape) == (2, 4) for lam in calls)  # steps x layers
            tol = 0.03 if dtype == torch.bfloat16 else 1e-5
            assert (got - ref).abs().max() <= tol * ref.abs().max(), (dtype, (got - ref).abs().max())


def test_lambda_is_fresh_outside_a_generation():
    cfg = ModelConfig(attention="diff", d_model=32, n_heads=2, n_layers=1, vocab_size=20)
    attn = build_model(cfg).layers[0].attn
    with torch.no_grad():
        a = float(attn._lambda())
        attn.lambda_q1.data.add_(0.5)  # like torch's fused optimisers: in place, no version bump
        b = float(attn._lambda())
        assert b != a and b == pytest.approx(float(attn.lambda_full()), abs=1e-7)
    with torch.enable_grad():
        assert attn._lambda().requires_grad  # training never sees a memoised value


def test_decoding_after_a_prefill_with_gradients_into_a_reset_cache_sees_the_new_lambda():
    """The lambda memoised for a cache's earlier generation is not reused by its next one: a prefill into the reset
    cache with autograd on (lambda computed afresh, not memoised) used to leave the old memo in place, so the
    following no-grad decoding steps read the lambda of the weights before their change."""
    torch.manual_seed(0)
    cfg = ModelConfig(attention="diff", d_model=32, n_heads=2, n_layers=2, vocab_size=20)
    model = build_model(cfg).eval()
    ids = torch.randint(0, 20, (1, 8))
    cache = model.new_cache(1, 8)
    with torch.no_grad():
        model(ids[:, :6], cache=cache)
        model(ids[:, 6:7], cache=cache)  # decoding: lambda memoised for this cache
        for layer in model.layers:
            layer.attn.lambda_q1.add_(0.5)
        ref = model(ids).logits[:, -1]
    cache.reset()
    model(ids[:, :7], cache=cache)  # a prefill with autograd on
    with torch.no_grad():
        step = model(ids[:, 7:], cache=cache).logits[:, -1]
    assert (step - ref).abs().max() < 1e-5


@pytest.mark.parametrize("change", ["in_place", "new_parameter", "lambda_init"])
def test_a_lambda_changed_between_decoding_steps_is_read_again(change):
    """Regression: the decoding memo was keyed on the cache alone, so a lambda changed between two decoding steps
    of one cache (an ablation mid-generation, in place or as a new Parameter, or a new lambda_init) was ignored
    by the later steps, which kept the lambda of the first step, while every weight matrix's change was seen."""
    torch.manual_seed(0)
    cfg = ModelConfig(attention="diff", d_model=32, n_heads=2, n_layers=2, vocab_size=20)
    model = build_model(cfg).eval()
    ids = torch.randint(0, 20, (1, 8))

    def change_lambda(attn):
        if change == "in_place":
            attn.lambda_q1.mul_(-3.0)
        elif change == "new_parameter":
            attn.lambda_q1 = torch.nn.Parameter(attn.lambda_q1.detach() * -3.0)
        else:
            attn.lambda_init = 0.5 * attn.lambda_init

    steps = []
    for memo in (True, False):
        cache = model.new_cache(1, 8)
        m = copy.deepcopy(model)
        with torch.no_grad():
            m(ids[:, :6], cache=cache)
            m(ids[:, 6:7], cache=cache)  # decoding: lambda memoised for this cache
            for layer in m.layers:
                change_lambda(layer.attn)
                if not memo:
                    layer.attn._lambda_memo = None  # the reference: lambda computed afresh
            steps.append(m(ids[:, 7:], cache=cache).logits[:, -1])
    assert torch.equal(steps[0], steps[1])


def test_evaluation_after_a_fused_adamw_step_sees_the_new_lambda():
    """Regression: a version-keyed lambda cache went stale under fused AdamW (no version bumps)."""
    torch.manual_seed(0)
    cfg = ModelConfig(attention="diff", d_model=32, n_heads=2, n_layers=2, vocab_size=20, max_seq_len=16)
    model = build_model(cfg)
    x = torch.randint(0, 20, (2, 12))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model.eval()
    with torch.no_grad():
        model(x, cache=model.new_cache(2, 12))  # a generation's prefill memoises lambda
    model.train()
    model(x).logits.float().pow(2).mean().backward()
    opt.step()
    model.eval()
    fresh = build_model(cfg).eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        for use_cache in (False, True):
            kw = {"cache": model.new_cache(2, 12)} if use_cache else {}
            kwf = {"cache": fresh.new_cache(2, 12)} if use_cache else {}
            torch.testing.assert_close(model(x, **kw).logits, fresh(x, **kwf).logits, rtol=0, atol=0)


def test_lambda_is_computed_once_per_generation(monkeypatch):
    cfg = ModelConfig(attention="diff", d_model=32, n_heads=2, n_layers=2, vocab_size=20, max_seq_len=16)
    model = build_model(cfg).eval()
    calls = []
    real = type(model.layers[0].attn).lambda_full
    monkeypatch.setattr(type(model.layers[0].attn), "lambda_full", lambda self: calls.append(1) or real(self))
    with torch.no_grad():
        for _ in range(2):  # two generations: each computes lambda once per layer, at its prefill
            cache = model.new_cache(1, 10)
            model(torch.randint(0, 20, (1, 4)), cache=cache)
            for _ in range(5):
                model(torch.randint(0, 20, (1, 1)), cache=cache)
    assert len(calls) == 2 * cfg.n_layers


# ----------------------------------------------------------------------------- memory, norm
def test_fused_attention_memory_grows_linearly():
    """Scaled-down long context: 4x the tokens costs ~4x the memory (eager: ~16x)."""
    from difftx.benchmarking.memory import peak_live_bytes

    def peak(n, fn):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, 2, n, 16, generator=g, requires_grad=True)
        k = torch.randn(1, 2, 2, n, 16, generator=g, requires_grad=True)
        v = torch.randn(1, 2, n, 32, generator=g, requires_grad=True)
        lam = torch.tensor(0.5, requires_grad=True)
        mask = AttnMask(causal=True, n_q=n, n_k=n)
        return peak_live_bytes(lambda: fn(q, k, v, lam, mask).sum().backward())[0]

    def fused_fn(q, k, v, lam, mask):
        return fused.fused_attention(q, k, v, mask, 0.25, lam, chunk=16)

    def eager_fn(q, k, v, lam, mask):
        return backends.eager_diff_attention(q[:, 0], q[:, 1], k[:, 0], k[:, 1], v, lam, mask, 0.25)

    f1, f4 = peak(128, fused_fn), peak(512, fused_fn)
    e1, e4 = peak(128, eager_fn), peak(512, eager_fn)
    assert f4 / f1 < 5.0, (f1, f4)
    assert e4 / e1 > 10.0, (e1, e4)
    assert f4 < e4 / 4


def test_block_rows_stay_bounded_for_inference_blocks(monkeypatch):
    """bf16 inference drops the per-head slice limit but keeps the whole-block cap (memory linear in N)."""
    seen = []
    run = fused._FusedAttention.apply
    monkeypatch.setattr(fused._FusedAttention, "apply", lambda *a: seen.append(a[-2]) or run(*a))
    b, m, h, n = 4, 2, 4, 512
    assert fused.chunk_size(b, m, h, n, n, 2, slices=False) == n  # the small preset's prefill: one block
    assert fused.chunk_size(b, m, h, n, n, 2) == fused.SLICE_BYTES // (n * 2)  # training: slices
    for n_long in (16384, 65536):  # a whole block never exceeds BLOCK_BYTES beyond MIN_CHUNK rows
        c = fused.chunk_size(1, m, h, n_long, n_long, 2, slices=False)
        assert c < n_long and (c * m * h * n_long * 2 <= fused.BLOCK_BYTES or c == fused.MIN_CHUNK)
    q, k, v, lam, mask = _kernel_case(2, "scalar", 4, 2, False, 0, torch.bfloat16, n=300)
    with torch.no_grad():
        fused.fused_attention(q, k, v, mask, 0.3, lam)
    fused.fused_attention(q, k, v, mask, 0.3, lam)
    assert seen == [300, 192]  # one block; slices of SLICE_BYTES (131072 / 600 bytes, in 64-row steps)


def test_float32_kernel_blocks_are_whole_micro_tiles(monkeypatch):
    """Without an explicit chunk, the float32 kernel gets blocks of a multiple of 48 rows (8 tiles of its
    6-row micro-kernel), 3/4 of the block path's: 48 at the small preset's 512 tokens."""
    seen = []
    run = fused._FusedAttention.apply
    monkeypatch.setattr(fused._FusedAttention, "apply", lambda *a: seen.append(a[-2:]) or run(*a))
    q, k, v, lam, mask = _kernel_case(2, "scalar", 4, 2, False, 0, torch.float32, n=512)
    fused.fused_attention(q, k, v, mask, 0.3, lam)
    assert seen == [(64, 48)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight,gain", [(True, 1.0), (True, 0.8), (False, 0.8)])
@pytest.mark.parametrize("rows", [15, 3000])  # the small no-grad path applies below SMALL_NORM elements
def test_fused_rms_norm(dtype, weight, gain, rows):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, rows // 3, 24, generator=g, dtype=torch.float64) * 3).to(dtype).requires_grad_()
    wdtype = torch.float64 if dtype == torch.float64 else torch.float32
    w = torch.rand(24, generator=g, dtype=torch.float64).to(wdtype).requires_grad_() if weight else None
    out = fused.rms_norm(x, w, 1e-5, gain)
    xr = x.double()
    ref = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5) * gain
    if w is not None:
        ref = ref * w.double()
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(out.double(), ref, atol=tol * 3, rtol=tol)
    gy = torch.randn(out.shape, generator=g, dtype=torch.float64)
    ins = [x] + ([w] if w is not None else [])
    g1 = torch.autograd.grad((out.double() * gy).sum(), ins)
    g2 = torch.autograd.grad((ref * gy).sum(), ins)
    for a, b in zip(g1, g2):
        b = b.double()
        torch.testing.assert_close(a.double(), b, atol=tol * 10 * b.abs().max().item(), rtol=tol * 10)
    with torch.no_grad():  # the small-input no-grad path (decoding) agrees
        torch.testing.assert_close(fused.rms_norm(x, w, 1e-5, gain), out.detach())


def test_fused_rms_norm_matches_functional_float64():
    x = torch.randn(4, 7, 16, dtype=torch.float64, requires_grad=True)
    w = torch.rand(16, dtype=torch.float64, requires_grad=True)
    a = fused.rms_norm(x, w, 1e-6)
    b = F.rms_norm(x, (16,), w, 1e-6)
    torch.testing.assert_close(a, b, atol=1e-14, rtol=1e-12)


@pytest.mark.skipif(not any(__import__("shutil").which(c) for c in ("g++", "c++", "clang++")),
                    reason="inductor builds its CPU kernels with a C++ compiler")
@pytest.mark.parametrize("attention,dtype", [("softmax", "fp32"), ("diff", "fp32"), ("diff2", "bf16")])
def test_cached_decoding_compiles_with_inductor(attention, dtype):
    """torch.compile (inductor) of a model decoding over a KV cache, the default attention variant: its steps
    give the eager steps' logits.  The decoding step took the native kernel (a ctypes call) or the fused kernel
    (a compiler-disabled island) inside the graph, and after that break inductor failed on the cache's dynamic
    length ("name 's29' is not defined"); compiled steps now run on SDPA."""
    torch.manual_seed(0)
    m = build_model(ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, head_dim=32, attention=attention))
    m.eval()
    ids = torch.randint(0, 64, (2, 8))
    torch._dynamo.reset()
    compiled = torch.compile(m)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        cache = m.new_cache(2, 16)
        m(ids, cache=cache)
        want = [m(ids[:, i:i + 1], cache=cache).logits.float() for i in range(4)]
        cache = m.new_cache(2, 16)
        compiled(ids, cache=cache)
        got = [compiled(ids[:, i:i + 1], cache=cache).logits.float() for i in range(4)]  # dynamic from the 2nd
    tol = 2e-2 if dtype == "bf16" else 1e-5
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=tol * w.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("attention", ["softmax", "diff"])
def test_models_trace_under_torch_compile(attention):
    """Dynamo traces the model around the fused CPU kernel (an eager island), forward and backward,
    with the eager model's numbers (the ``eager`` backend: tracing only, no code generation)."""
    torch._dynamo.reset()
    cfg = ModelConfig(attention=attention, d_model=32, n_heads=2, n_layers=2, vocab_size=40, max_seq_len=32)
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = torch.randint(0, 40, (2, 16))
    compiled = torch.compile(model, backend="eager", fullgraph=False)
    loss_c = compiled(ids, targets=ids).loss
    loss_c.backward()
    grads_c = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss_e = model(ids, targets=ids).loss
    loss_e.backward()
    assert torch.allclose(loss_c, loss_e, atol=1e-6)
    for a, p in zip(grads_c, model.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(native.library() is None, reason="the native kernels are not built here")
@pytest.mark.parametrize("a_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                               (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("uses", ["both", "norm", "sum"])
def test_add_rms_norm_is_bitwise_the_two_ops(a_dtype, out_dtype, weight, uses):
    """fused.add_rms_norm against x + a and rms_norm: the same bits in every output and gradient, whichever of
    its two outputs the loss reads."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 300, 96, generator=g) * 2
    a0 = torch.randn(3, 300, 96, generator=g).to(a_dtype)
    w0 = torch.rand(96, generator=g) + 0.5 if weight else None
    gs = (torch.randn(x0.shape, generator=g), torch.randn(x0.shape, generator=g).to(out_dtype))
    results = []
    for fuse in (True, False):
        x, a = x0.clone().requires_grad_(), a0.clone().requires_grad_()
        w = None if w0 is None else w0.clone().requires_grad_()
        if fuse:
            x1, h = fused.add_rms_norm(x, a, w, 1e-5, out_dtype)
        else:
            x1 = x + a
            h = fused.rms_norm(x1, w, 1e-5, out_dtype=out_dtype)
        assert h.dtype == out_dtype
        outs = {"both": [x1, h], "norm": [h], "sum": [x1]}[uses]
        grads = {"both": list(gs), "norm": [gs[1]], "sum": [gs[0]]}[uses]
        torch.autograd.backward(outs, grads)
        results.append([x1, h, x.grad, a.grad] + ([w.grad] if w is not None and uses != "sum" else []))
    for p, q in zip(*results):
        assert p.dtype == q.dtype and torch.equal(p, q)


def test_rope_frequencies_kept_per_dtype_are_the_fresh_ones():
    """The inverse frequencies RotaryEmbedding keeps between calls: float64 angles for float64 models, float32
    otherwise, each exactly the values computed afresh (in float64, theta^(-2i/d) to the last bit)."""
    r = RotaryEmbedding(16, theta=500.0)
    pos = torch.tensor([[0, 3, 1000]])
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.float32):
        cos, sin = r.cos_sin(pos, dtype)
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        inv = 1.0 / (500.0 ** (torch.arange(0, 16, 2).to(compute) / 16))
        angles = pos.to(compute)[..., None] * inv
        assert cos.dtype == compute and torch.equal(cos[:, 0], angles.cos()) and torch.equal(sin[:, 0], angles.sin())
    assert len(r._inv_freq_memo) == 2 and "_inv_freq_memo" not in dict(r.state_dict())


@pytest.mark.skipif(native.library() is None, reason="the native kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_calls_run_the_kernels_without_autograd_nodes(dtype, monkeypatch):
    """Decoding-sized calls with no gradient wanted (RMSNorm, the residual-adding norm, RoPE, SwiGLU) call the
    native kernel directly, with no autograd.Function, and give the bits the autograd path gives."""
    from difftx.nn import ffn, rope

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 1, 96, generator=g)
    a = torch.randn(4, 1, 96, generator=g).to(dtype)
    w = torch.rand(96, generator=g) + 0.5
    qp = torch.randn(4, 1, 2 * 3 * 32, generator=g).to(dtype)  # a projection's output; (B, 2, 3, 1, 32) heads
    heads = qp.view(4, 1, 2, 3, 32).permute(0, 2, 3, 1, 4)
    cos, sin = RotaryEmbedding(32).cos_sin(torch.tensor([7]))
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    gu = torch.randn(2, 4, 1, 80, generator=g).to(dtype)

    def calls():
        return [fused.rms_norm(x.to(dtype), w, 1e-5, 0.8), *fused.add_rms_norm(x, a, w, 1e-5, dtype),
                rope.apply_rope(heads, cos, sin, "half"), rope.apply_rope(heads, cos, sin, "interleaved"),
                ffn.swiglu(gu[0], gu[1])]

    with torch.enable_grad():  # the autograd path: inputs that want gradients
        for t in (x, a, w, qp, gu):
            t.requires_grad_()
        heads = qp.view(4, 1, 2, 3, 32).permute(0, 2, 3, 1, 4)
        reference = [t.detach() for t in calls()]
    nodes = []
    for fn in (fused._RMSNorm, fused._AddRMSNorm, rope._NativeRope, ffn._NativeSwiGLU):
        monkeypatch.setattr(fn, "apply", lambda *args, fn=fn: nodes.append(fn))
    kernels = []
    for name in ("rms_norm", "add_rms_norm", "rope", "swiglu"):
        run = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *args, run=run, name=name, **kw: kernels.append(name) or run(*args, **kw))
    with torch.no_grad():
        out = calls()
    assert nodes == [] and kernels == ["rms_norm", "add_rms_norm", "rope", "rope", "swiglu"]
    for p, q in zip(out, reference):
        assert p.dtype == q.dtype and p.shape == q.shape and torch.equal(p, q)


@pytest.mark.skipif(native.library() is None, reason="the native kernels are not built here")
@pytest.mark.parametrize("attention", ["softmax", "diff"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_blocks_fused_residual_norms_change_no_bit(attention, dtype, monkeypatch):
    """A training step's loss and every gradient with the residual additions fused into the next norms (within a
    block, between blocks, into the final norm) equal block-by-block autograd's bit for bit; hooks on a block
    or a norm put the model back on the block-by-block path (the hook runs)."""
    from difftx.nn.block import Block

    cfg = ModelConfig(attention=attention, d_model=128, n_heads=2, n_layers=2, vocab_size=40, max_seq_len=300)
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = torch.randint(0, 40, (2, 300))  # 2 x 300 x 128 values: over fused.SMALL_NORM, so the kernel runs
    calls = []
    apply = fused._AddRMSNorm.apply
    monkeypatch.setattr(fused._AddRMSNorm, "apply", lambda *a: calls.append(1) or apply(*a))

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = model(ids, targets=ids).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    fused_step = step()
    assert len(calls) == 4  # block 1's FFN PreNorm, block 2's two PreNorms, the final norm
    monkeypatch.setattr(Block, "chains", lambda self, x, first: False)
    monkeypatch.setattr(Block, "_fuse_residual_norm", lambda self, x, p: False)
    plain_step = step()
    assert len(calls) == 4
    assert all(torch.equal(p, q) for p, q in zip(fused_step, plain_step))
    monkeypatch.undo()

    seen = []
    model.layers[1].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model.layers[0].ffn_norm.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    calls.clear()
    monkeypatch.setattr(fused._AddRMSNorm, "apply", lambda *a: calls.append(1) or apply(*a))
    assert all(torch.equal(p, q) for p, q in zip(step(), plain_step))
    norm_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32  # a PreNorm emits autocast's dtype
    assert seen == [norm_dtype, torch.float32] and len(calls) == 1  # only block 2's FFN PreNorm fused


@pytest.mark.skipif(native.library() is None, reason="the native kernels are not built here")
@pytest.mark.parametrize("attention", ["softmax", "diff"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cached_decoding_chains_the_residual_norms_without_changing_a_bit(attention, dtype, monkeypatch):
    """Without autograd, decoding-sized steps also chain the blocks (each residual addition in the next norm's
    native pass): every step's logits are block-by-block's bit for bit."""
    from difftx.nn.block import Block

    cfg = ModelConfig(attention=attention, d_model=64, n_heads=2, n_layers=3, vocab_size=40, max_seq_len=64)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids = torch.randint(0, 40, (2, 9))
    calls = []
    run = native.add_rms_norm
    monkeypatch.setattr(native, "add_rms_norm", lambda *a: calls.append(1) or run(*a))

    def decode():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            cache = model.new_cache(2, 16)
            out = [model(ids, cache=cache).logits]
            for _ in range(4):
                out.append(model(out[-1][:, -1:].argmax(-1), cache=cache).logits)
        return out

    chained = decode()
    assert len(calls) == 5 * 6  # per forward: 3 FFN PreNorms, 2 attention PreNorms, the final norm
    monkeypatch.setattr(Block, "chains", lambda self, x, first: False)
    calls.clear()
    plain = decode()
    assert len(calls) == 5 * 3  # the FFN PreNorms only
    assert all(torch.equal(p, q) for p, q in zip(chained, plain))


@pytest.mark.skipif(native.library() is None, reason="the native kernels are not built here")
@pytest.mark.parametrize("attention", ["softmax", "diff"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_dnt_blocks_chain_through_their_mid_norms_without_changing_a_bit(attention, dtype, monkeypatch):
    """DNT blocks (InputNorm, PreNorm, QK-norm, MidNorms, no FFN PreNorm) chain too: x + MidNorm(FFN) is added
    in the next attention PreNorm's pass and the last one in the final norm's.  A training step's loss and
    gradients, and cached decoding's logits, equal block-by-block's bit for bit."""
    from difftx.nn.block import Block

    cfg = ModelConfig(attention=attention, norms="dnt", d_model=128, n_heads=2, n_layers=3, vocab_size=40,
                      max_seq_len=300)
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = torch.randint(0, 40, (2, 300))  # over fused.SMALL_NORM: the training kernels run
    calls = []
    run = native.add_rms_norm  # the fused kernel, with autograd (training) or without (decoding)
    monkeypatch.setattr(native, "add_rms_norm", lambda *a: calls.append(1) or run(*a))
    autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")

    def step():
        model.train()
        model.zero_grad(set_to_none=True)
        with autocast():
            loss = model(ids, targets=ids).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    def decode():
        model.eval()
        with torch.no_grad(), autocast():
            cache = model.new_cache(2, 16)
            out = [model(ids[:, :9], cache=cache).logits]
            for _ in range(3):
                out.append(model(out[-1][:, -1:].argmax(-1), cache=cache).logits)
        return out

    chained = step(), decode()
    assert len(calls) == 3 + 4 * 3  # blocks 2 and 3's attention PreNorms and the final norm, per forward
    monkeypatch.setattr(Block, "chains", lambda self, x, first: False)
    calls.clear()
    plain = step(), decode()
    assert calls == []  # no FFN PreNorm in DNT: nothing else fuses
    for got, want in zip(chained, plain):
        assert all(torch.equal(p, q) for p, q in zip(got, want))


def test_qk_norm_on_the_projection_rows_is_the_head_views_norm():
    """QK-norm runs on a projection's output (B, N, n*d) as rows of d, not on its head view (B, n, N, d) (which
    costs the norm a copy each way): the same output and input gradient bit for bit, fp32 and bf16; the
    weight's gradient sums the rows in another order, as close to float64 either way."""
    from difftx.nn.attention import AttentionBase, _heads
    from difftx.nn.norms import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 300, 4 * 16).to(dtype)  # over fused.SMALL_NORM: the training kernel runs
        w = torch.randn(2, 4, 300, 16).to(dtype)
        outs = []
        for rows in (True, False):
            p = x.clone().requires_grad_()
            y = _heads(AttentionBase._qk_norm(p, norm, 16), 4, 16) if rows else norm(_heads(p, 4, 16))
            grads = torch.autograd.grad((y.float() * w.float()).sum(), (p, norm.weight))
            outs.append([y.detach(), *grads])
        (y1, dx1, dw1), (y2, dx2, dw2) = outs
        assert y1.dtype == y2.dtype == dtype and torch.equal(y1, y2) and torch.equal(dx1, dx2)
        xd = x.double().view(2, 300, 4, 16)
        xn = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + norm.eps)
        dw_ref = (xn * w.double().transpose(1, 2)).sum((0, 1, 2))
        for dw in (dw1, dw2):
            assert (dw.double() - dw_ref).abs().max() <= 1e-5 * dw_ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_combine_matches_autograd_of_the_expression(dtype):
    """backends.combine (the SDPA / flex paths' o1 - lambda o2, saving only o2) gives autograd's output and
    gradients of ``upcast(o1) - lam * upcast(o2)``; float64 also by gradcheck."""
    g = torch.Generator().manual_seed(0)
    o1, o2 = (torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(2))
    lam = torch.tensor(0.37, dtype=torch.float64 if dtype == torch.float64 else torch.float32, requires_grad=True)
    w = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64)
    got = backends.combine(o1, o2, lam)
    ref = o1.to(lam.dtype) - lam * o2.to(lam.dtype)
    assert got.dtype == ref.dtype and torch.equal(got, ref)
    ga = torch.autograd.grad((got * w.to(got.dtype)).sum(), (o1, o2, lam))
    gb = torch.autograd.grad((ref * w.to(ref.dtype)).sum(), (o1, o2, lam))
    for a, b in zip(ga, gb):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6 if dtype != torch.bfloat16 else 1e-2, atol=1e-6)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(backends.combine, (o1, o2, lam))


def test_combine_under_torch_func_and_double_backward():
    """combine under torch.func.grad (the plain expression) and with create_graph=True (through _Combine)."""
    o1, o2 = torch.randn(2, 3, 4, 8, dtype=torch.float64), torch.randn(2, 3, 4, 8, dtype=torch.float64)
    lam = torch.tensor(0.4, dtype=torch.float64)
    g = torch.func.grad(lambda l: backends.combine(o1, o2, l).pow(2).sum())(lam)
    assert torch.allclose(g, (-2 * (o1 - lam * o2) * o2).sum())
    lam = lam.clone().requires_grad_()
    (dl,) = torch.autograd.grad(backends.combine(o1, o2, lam).pow(2).sum(), lam, create_graph=True)
    (d2,) = torch.autograd.grad(dl, lam)
    assert torch.allclose(d2, 2 * (o2 * o2).sum())


@pytest.mark.parametrize("attention, variant", [("softmax", "sdpa"), ("diff", "2call"), ("diff2", "sdpa")])
def test_a_compiled_model_is_one_graph_where_attention_is_torchs(attention, variant):
    """Under torch.compile the native norm and RoPE passes step aside for torch ops (as the Linear and Block fast
    paths do): a model whose attention is SDPA traces as one graph.  The norm's native pass broke the graph at
    every RMSNorm (and past dynamo's recompile limit on a small preset), RoPE's at the kernels' lock."""
    torch.manual_seed(0)
    m = build_model(ModelConfig(attention=attention, d_model=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=16))
    m.set_attention_backend("sdpa", variant)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(m)(torch.randint(0, 64, (2, 16)))
    assert explained.graph_break_count == 0, [b.reason.splitlines()[0] for b in explained.break_reasons]


@pytest.mark.parametrize("grad", [True, False])
def test_a_block_forward_patched_on_the_instance_or_overridden_is_called(grad):
    """The LM's chained loop calls Block.forward_parts itself; a forward patched on a block instance (accelerate's
    hooks, activation checkpointing wrapped around it) or a subclass's own forward takes the block-by-block path,
    so that it runs (it used to be skipped silently for training-sized inputs and all inference)."""
    from torch.utils.checkpoint import checkpoint

    from difftx.nn.block import Block

    cfg = ModelConfig(attention="diff", d_model=128, n_heads=2, n_layers=2, vocab_size=40, max_seq_len=300)
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = torch.randint(0, 40, (2, 300))  # over fused.SMALL_NORM: the chained path when nothing is patched
    with torch.set_grad_enabled(grad):
        want = model(ids).logits
    calls = []
    orig = model.layers[0].forward

    def patched(*args, **kwargs):
        calls.append(1)
        return checkpoint(orig, *args, use_reentrant=False, **kwargs) if grad else orig(*args, **kwargs)

    model.layers[0].forward = patched
    with torch.set_grad_enabled(grad):
        got = model(ids).logits
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    del model.layers[0].forward

    class Counted(Block):
        def forward(self, x, rope, mask, cache=None):
            calls.append(2)
            return super().forward(x, rope, mask, cache)

    model.layers[1].__class__ = Counted
    with torch.set_grad_enabled(grad):
        model(ids)
    assert calls == [1, 2]


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_fused_attention_gradients_of_float32_keys_under_a_low_precision_query_are_not_scratch(q_dtype):
    """Regression: under a bf16/fp16 query the blockwise backward sums dK and dV in float32 per-thread scratch
    buffers and returned their casts; with float32 K and V the cast was the scratch buffer itself, so the next
    backward overwrote the k.grad and v.grad that the first one had returned."""
    b, m, h, n, d = 1, 2, 2, 40, 16

    def grads(seed):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(b, m, h, n, d, generator=g).to(q_dtype).requires_grad_()
        k = torch.randn(b, m, h, n, d, generator=g).requires_grad_()
        v = torch.randn(b, h, n, 2 * d, generator=g).requires_grad_()
        lam = torch.tensor(0.3, requires_grad=True)
        fused.fused_attention(q, k, v, AttnMask(True, n, n), d ** -0.5, lam).float().pow(2).sum().backward()
        return q.grad, k.grad, v.grad

    first = grads(1)
    kept = [t.clone() for t in first]
    grads(2)
    assert all(torch.equal(a, b) for a, b in zip(first, kept))
