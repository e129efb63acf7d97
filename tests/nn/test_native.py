"""The native CPU kernels (difftx.nn.native): they build where a C compiler exists, compute what the
pure-torch path and float64 references compute (attention softmax/combine and its backward, RMSNorm,
SwiGLU, RoPE, DIFF decoding; fp32 tight, bf16 to its rounding), are the path actually taken, and fail
over to pure torch when disabled or unbuildable."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from difftx.nn import fused, native
from difftx.nn.mask import AttnMask

from .test_fast_paths import _kernel_case

HAVE_CC = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
needs_native = pytest.mark.skipif(not (HAVE_CC and native._enabled_by_env()),
                                  reason="no C compiler, or DIFFTX_NATIVE off: no native kernels here")


@needs_native
def test_kernels_build_where_a_compiler_exists():
    assert native.library() is not None, native.status()
    assert native.status().startswith("on")


def test_enabled_false_turns_off_the_bf16_product_kernels_too(monkeypatch):
    """``native.ENABLED = False`` (what the tests compare the native path against) is the pure-torch path
    everywhere: the AMX / AVX512-BF16 switches (bf16 linear layers, packed decoding weights, bf16 attention) said
    yes from the loaded library's flags alone, so bf16 linear layers kept running on the dot-product kernels."""
    monkeypatch.setattr(native, "library", lambda: object())  # a loaded library on a CPU with every bf16 kernel
    monkeypatch.setattr(native, "_STATE", {"amx": True, "bf16_attention": True, "dot_linear": True})
    monkeypatch.setattr(native, "ENABLED", True)
    assert native.amx() and native.bf16_attention() and native.dot_linear()
    monkeypatch.setattr(native, "ENABLED", False)
    assert not native.amx() and not native.bf16_attention() and not native.dot_linear()


@needs_native
def test_enabled_false_calls_no_kernel_in_bf16_training_and_decoding(monkeypatch):
    from difftx import ModelConfig, build_model

    calls = []
    for name in ("dot_mm", "dot_mm_sum", "dot_mm_t", "pack_wt", "pack_rows", "few_rows_linear", "diff_decode"):
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    monkeypatch.setattr(native, "ENABLED", False)
    model = build_model(ModelConfig(d_model=32, n_layers=1, n_heads=2, vocab_size=32))
    ids = torch.randint(0, 32, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, targets=ids).loss.backward()
        with torch.no_grad():
            cache = model.new_cache(2, 9)
            model(ids, cache=cache)
            model(ids[:, :1], cache=cache)
    assert calls == []


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,causal,diag0", [(2, True, 0), (2, True, 21), (1, True, 5), (2, False, -1), (1, False, -1)])
def test_softmax_combine_and_backward_match_torch(dtype, m, causal, diag0):
    """Rows of 53 keys (not a multiple of the vector width), logits over a wide range, -inf entries."""
    g = torch.Generator().manual_seed(0)
    b, rows, c, ke = 2, 3 * 8, 8, 53
    s = (torch.randn(b, m, rows, ke, generator=g, dtype=torch.float64) * 20).to(dtype)
    if not causal:
        s[..., 7] = float("-inf")  # a masked key
    lam_rows = torch.rand(b, rows, generator=g)
    p = torch.empty_like(s)
    comb = torch.empty(b, rows, ke, dtype=dtype)
    native.softmax_combine(s, p, comb, m, rows, c, diag0 if causal else -1, 0.0, lam_rows if m == 2 else None)
    sf = s.double()
    if causal:
        q = diag0 + torch.arange(rows) % c
        sf = sf.masked_fill(torch.arange(ke)[None] > q[:, None], float("-inf"))
    ref = torch.softmax(sf, -1)
    ref_comb = ref[:, 0] - lam_rows.double()[..., None] * ref[:, 1] if m == 2 else ref[:, 0]
    tol = 2e-7 if dtype == torch.float32 else 4e-3  # fp32: a few ulp of probabilities <= 1
    assert (p.double() - ref).abs().max() <= tol
    assert (comb.double() - ref_comb).abs().max() <= tol * 2
    if causal:  # keys past a row's query are exact zeros
        assert (p.double()[..., -1][..., :] == 0).sum() > 0
    dp = torch.randn(b, rows, ke, generator=g, dtype=torch.float64).to(dtype)
    ds = torch.empty_like(s)
    rs = torch.empty(b, m, rows)
    native.softmax_backward(p, dp, ds, rs, m, rows, c, diag0 if causal else -1)
    pd = p.double()
    rs_ref = (pd * dp.double()[:, None]).sum(-1)
    ds_ref = pd * (dp.double()[:, None] - rs_ref[..., None])
    assert (rs.double() - rs_ref).abs().max() <= 1e-5
    assert (ds.double() - ds_ref).abs().max() <= (2e-6 if dtype == torch.float32 else 3e-2)


def _attention_case(dtype, m, hk, padded, q_start, lam_kind, n=70, seed=1):
    """test_fast_paths' kernel inputs (4 heads, d = 8): ((q, k, v, lam), mask)."""
    q, k, v, lam, mask = _kernel_case(m, lam_kind, 4, hk, padded, q_start, dtype, n=n, seed=seed)
    return (q, k, v, lam), mask


def _run(inputs, mask, use_native, monkeypatch, chunk=16):
    monkeypatch.setattr(native, "ENABLED", use_native)
    q, k, v, lam = inputs
    out = fused.fused_attention(q, k, v, mask, 0.3, lam, chunk=chunk)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    ins = [t for t in inputs if t is not None]
    return [out.detach()] + list(torch.autograd.grad((out * w).sum(), ins))


@needs_native
@pytest.mark.parametrize("m,hk,padded,q_start,lam_kind", [(2, 2, False, 0, "scalar"), (2, 1, True, 7, "scalar"),
                                                         (2, 4, False, 3, "rows"), (1, 2, True, 0, None),
                                                         (1, 4, False, 9, None)])
def test_fused_attention_native_equals_torch_path_fp32(m, hk, padded, q_start, lam_kind, monkeypatch):
    """Outputs and every gradient (q, k, v, lambda) of the native path equal the float64 result to a few
    fp32 ulp, as the torch path's do.

    Both are checked against float64 rather than against each other: a scalar lambda's gradient is a long
    fp32 sum with cancellation whose torch-path rounding depends on the CPU's vector width (2.2e-6 of its
    scale on an AVX2 CPU, where the native kernel's is 5e-8)."""
    inputs, mask = _attention_case(torch.float32, m, hk, padded, q_start, lam_kind)
    # the block path's row kernels (with 4-lane vectors, d = 8 would take the float32 attention kernel)
    monkeypatch.setattr(native, "attention_ok", lambda *a, **kw: False)
    calls = []
    real = native.softmax_combine
    monkeypatch.setattr(native, "softmax_combine", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = _run(inputs, mask, True, monkeypatch)
    assert calls, "the native kernel was not used"
    n_calls = len(calls)
    want = _run(inputs, mask, False, monkeypatch)
    assert len(calls) == n_calls  # the torch path does not call it
    exact = _run(tuple(None if t is None else t.detach().double().requires_grad_() for t in inputs), mask, False,
                 monkeypatch)
    for a, b, r in zip(got, want, exact):
        scale = r.abs().max().clamp_min(1.0)
        assert (a.double() - r).abs().max() <= 2e-6 * scale
        assert (b.double() - r).abs().max() <= 5e-6 * scale  # the torch path, for comparison


def _wide_case(m, h, hk, n, q_start, lam_kind, causal, seed=2):
    """Inputs whose head widths take the native float32 attention kernel (d = 32, dv = 64: multiples of
    its 8-, 16- or 32-float column block), in float64; ((q, k, v, lam), mask)."""
    g = torch.Generator().manual_seed(seed)
    b, d, dv, nk = 2, 32, 64 if m == 2 else 32, n + q_start

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    lam = None
    if lam_kind == "scalar":
        lam = torch.tensor(0.37, dtype=torch.float64, requires_grad=True)
    elif lam_kind == "rows":
        lam = torch.rand(b, h, n, 1, generator=g, dtype=torch.float64).requires_grad_()
    mask = AttnMask(causal=causal, n_q=n, n_k=nk, q_start=q_start)
    return (t(b, m, h, n, d), t(b, m, hk, nk, d), t(b, hk, nk, dv), lam), mask


def _wide_run(inputs, mask, dtype, use_native, monkeypatch, chunk):
    return _run(tuple(None if x is None else x.detach().to(dtype).requires_grad_() for x in inputs), mask,
                use_native, monkeypatch, chunk)


@needs_native
@pytest.mark.parametrize("m,h,hk,n,q_start,lam_kind,causal,chunk", [
    (1, 4, 4, 70, 0, None, True, 16),  # a last block of 6 rows; keys not a multiple of the column block
    (2, 4, 2, 70, 0, "scalar", True, 32),  # GQA
    (2, 2, 2, 45, 9, "rows", True, 16),  # DIFF V2's per-token lambda, queries after a cached prefix
    (1, 4, 2, 33, 0, None, False, 64),  # no causal mask (vision), one block
    (2, 2, 1, 129, 0, "scalar", True, 64),  # several 64-row blocks, every key visible to the last
])
def test_native_float32_attention_matches_float64(m, h, hk, n, q_start, lam_kind, causal, chunk, monkeypatch):
    """The float32 attention kernel (difftx_attn_forward / _backward: register-blocked products, causal
    tiles skipped, maps rebuilt from the saved log-sum-exp) gives the output and every gradient (q, k, v,
    lambda) of the float64 reference to a few fp32 ulp, and is the path taken."""
    inputs, mask = _wide_case(m, h, hk, n, q_start, lam_kind, causal)
    calls = []
    fwd, bwd = native.attention_forward, native.attention_backward
    monkeypatch.setattr(native, "attention_forward", lambda *a, **kw: calls.append("f") or fwd(*a, **kw))
    monkeypatch.setattr(native, "attention_backward", lambda *a, **kw: calls.append("b") or bwd(*a, **kw))
    got = _wide_run(inputs, mask, torch.float32, True, monkeypatch, chunk)
    assert calls == ["f", "b"], calls
    exact = _wide_run(inputs, mask, torch.float64, False, monkeypatch, chunk)
    assert len(got) == len(exact) == 4 + (lam_kind is not None)
    for i, (a, r) in enumerate(zip(got, exact)):
        assert a.dtype == torch.float32 and a.shape == r.shape
        scale = r.abs().max().clamp_min(1.0)
        assert (a.double() - r).abs().max() <= 2e-6 * scale, (i, (a.double() - r).abs().max() / scale)


@needs_native
def test_native_float32_attention_reads_values_in_place_and_returns_their_gradient_in_their_layout(monkeypatch):
    """V as the head view of a value projection's output (B, N, Hk*dv) -> (B, Hk, N, dv), strided: the kernel
    reads it without a copy, and dV comes back in that layout (so the projection's gradient needs no copy
    either), matching float64."""
    (q, k, v, lam), mask = _wide_case(2, 4, 2, 70, 0, "scalar", True)
    b, hk, nk, dv = v.shape
    proj = v.detach().transpose(1, 2).reshape(b, nk, hk * dv)  # what v_proj would have produced

    def run(dtype, use_native):
        qq, kk, pp = (t.detach().to(dtype).requires_grad_() for t in (q, k, proj))
        ll = lam.detach().to(dtype).requires_grad_()
        vv = pp.view(b, nk, hk, dv).transpose(1, 2)
        strides = []
        vv.register_hook(lambda g: strides.append(g.stride()))
        monkeypatch.setattr(native, "ENABLED", use_native)
        out = fused.fused_attention(qq, kk, vv, mask, 0.3, ll, chunk=32)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
        return [out.detach()] + list(torch.autograd.grad((out * w).sum(), [qq, kk, pp, ll])), strides, vv.stride()

    calls = []
    fwd = native.attention_forward
    monkeypatch.setattr(native, "attention_forward", lambda *a, **kw: calls.append(a[2].stride()) or fwd(*a, **kw))
    got, strides, v_stride = run(torch.float32, True)
    assert calls == [v_stride]  # the kernel ran on V itself (a copy would be contiguous)
    assert strides == [v_stride]  # and dV came back in V's own strides
    exact, _, _ = run(torch.float64, False)
    for i, (a, r) in enumerate(zip(got, exact)):
        scale = r.abs().max().clamp_min(1.0)
        assert (a.double() - r).abs().max() <= 2e-6 * scale, i


@needs_native
def test_native_float32_attention_is_causal_and_thread_count_invariant(monkeypatch):
    """Changing the last query's inputs changes no earlier output; the results are bitwise the same with
    1 and 2 threads (every sum has one order: one task per K/V head in the backward)."""
    inputs, mask = _wide_case(2, 4, 2, 100, 0, "scalar", True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _wide_run(inputs, mask, torch.float32, True, monkeypatch, 32)
        torch.set_num_threads(2)
        two = _wide_run(inputs, mask, torch.float32, True, monkeypatch, 32)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    q, k, v, lam = (None if x is None else x.detach().float() for x in inputs)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[:, :, :, -1] += 1.0
    k2[:, :, :, -1] += 1.0
    v2[:, :, -1] += 1.0
    with torch.no_grad():
        o1 = fused.fused_attention(q, k, v, mask, 0.3, lam, chunk=32)
        o2 = fused.fused_attention(q2, k2, v2, mask, 0.3, lam, chunk=32)
    assert torch.equal(o1[:, :-1], o2[:, :-1]) and not torch.equal(o1[:, -1], o2[:, -1])


def test_native_float32_attention_declines_what_it_cannot_take():
    """Heads not a multiple of the column block (d = 12), bf16 without AMX or AVX512-BF16 (or with heads not a
    multiple of 32),
    padded keys and a partial K keep the block-by-block path."""
    q, k, v = torch.zeros(1, 1, 2, 8, 12), torch.zeros(2, 8, 12), torch.zeros(1, 2, 8, 12)
    assert not native.attention_ok(q, k, v, 8, False)
    assert not native.attention_ok(q.bfloat16(), k.bfloat16(), v.bfloat16(), 8, False)
    q, k, v = torch.zeros(1, 1, 2, 8, 64), torch.zeros(2, 8, 64), torch.zeros(1, 2, 8, 64)
    assert not native.attention_ok(q, k, v, 8, True)
    assert native.attention_ok(q.bfloat16(), k.bfloat16(), v.bfloat16(), 8, False) == native.bf16_attention()
    assert not native.attention_ok(q.bfloat16(), k, v, 8, False)  # mixed dtypes
    assert not native.attention_ok(q, k[:, :5], v[:, :, :5], 8, False)
    assert not native.attention_ok(q, k, torch.zeros(1, 2, 64, 8).transpose(-1, -2), 8, False)  # V rows strided
    if native.library() is not None:
        assert native.attention_ok(q, k, v, 8, False)
        assert native.attention_ok(q, k, torch.zeros(1, 8, 2, 64).transpose(1, 2), 8, False)  # a head view


def test_native_float32_blocks_grow_with_the_keys_within_their_scratch_bound():
    """The float32 kernel's query blocks: 48 rows at the small preset (4 x 512, as tuned) and up to 1K-2K keys,
    NATIVE_LONG_ROWS from NATIVE_LONG_KEYS keys on, never taller than the C block buffer bound allows or the
    queries need, and never under the rows of before."""
    def rows(chunk, n_q, n_k, maps, threads=2):
        return fused.native_rows(chunk, n_q, n_k, maps, threads)

    assert rows(fused.chunk_size(4, 2, 4, 512, 512, 4), 512, 512, 2) == 48
    assert rows(fused.chunk_size(4, 1, 8, 512, 512, 4), 512, 512, 1) == 48
    assert rows(fused.chunk_size(1, 2, 4, 256, 256, 4), 256, 256, 2) == 96  # short keys: the block path's 128 x 3/4
    lengths = (1024, 2047, 2048, 16384, 32768, 1 << 17)
    got = {nk: rows(fused.chunk_size(1, 2, 4, nk, nk, 4), nk, nk, 2) for nk in lengths}
    assert got[1024] == got[2047] == fused.NATIVE_CHUNK
    assert got[2048] == got[16384] == fused.NATIVE_LONG_ROWS > fused.NATIVE_CHUNK
    for nk, r in got.items():
        assert r % fused.NATIVE_CHUNK == 0 and fused.NATIVE_CHUNK <= r <= fused.NATIVE_LONG_ROWS
        assert r == fused.NATIVE_CHUNK or 2 * 3 * r * nk * 4 <= fused.NATIVE_SCRATCH, (nk, r)  # both threads' buffers
    assert fused.NATIVE_CHUNK < got[32768] < fused.NATIVE_LONG_ROWS and got[1 << 17] == fused.NATIVE_CHUNK
    assert rows(64, 4096, 4096, 2, threads=16) == 144 and rows(64, 16384, 16384, 2, threads=16) == 48  # many threads
    assert rows(64, 20, 4096, 2) == 48  # few queries after a long prefix: the rows as before
    assert rows(64, 100, 4096, 2) == 102  # no taller than the queries (in whole 6-row tiles)


@needs_native
def test_native_float32_attention_with_tall_blocks_at_long_keys_matches_float64(monkeypatch):
    """At 2.1K keys fused_attention gives the kernel taller blocks (NATIVE_LONG_KEYS), which it runs exactly:
    output and every gradient (DIFF V2's per-row lambda included) within fp32 ulps of float64."""
    inputs, mask = _wide_case(2, 2, 1, 2100, 0, "rows", True)
    chunks = []
    fwd = native.attention_forward
    monkeypatch.setattr(native, "attention_forward", lambda *a, **kw: chunks.append(a[5]) or fwd(*a, **kw))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the block buffer bound is for all threads together
        got = _wide_run(inputs, mask, torch.float32, True, monkeypatch, None)
    finally:
        torch.set_num_threads(threads)
    assert chunks == [fused.NATIVE_LONG_ROWS]  # where the rule before gave 48
    exact = _wide_run(inputs, mask, torch.float64, False, monkeypatch, None)
    for i, (a, r) in enumerate(zip(got, exact)):
        scale = r.abs().max().clamp_min(1.0)
        assert (a.double() - r).abs().max() <= 2e-6 * scale, (i, (a.double() - r).abs().max() / scale)


needs_amx = pytest.mark.skipif(not (HAVE_CC and native.amx()), reason="the bf16 products need an AMX CPU")
needs_bf16_linear = pytest.mark.skipif(not (HAVE_CC and (native.amx() or native.dot_linear())),
                                       reason="the bf16 Linear training path needs a CPU with AMX or AVX512-BF16")
needs_bf16_attention = pytest.mark.skipif(not (HAVE_CC and native.bf16_attention()),
                                          reason="the bf16 attention kernel needs a CPU with AMX or AVX512-BF16")


@needs_bf16_attention
@pytest.mark.parametrize("m,h,hk,n,q_start,lam_kind,causal,chunk", [
    (1, 4, 4, 70, 0, None, True, 32),  # a last block of 6 rows; keys not a multiple of 32
    (2, 4, 2, 70, 0, "scalar", True, 32),  # GQA
    (2, 2, 2, 45, 9, "rows", True, 32),  # DIFF V2's per-token lambda, queries after a cached prefix
    (1, 4, 2, 33, 0, None, False, 64),  # no causal mask (vision), one block
    (2, 2, 1, 129, 0, "scalar", True, 64),  # several blocks, every key visible to the last
    (2, 4, 2, 70, 0, "scalar", True, None),  # the default chunk: all 70 queries, one block (kept bf16 off the kernel)
    (2, 2, 2, 100, 4, "rows", True, None),
])
def test_bf16_attention_matches_float64_as_closely_as_the_torch_path(m, h, hk, n, q_start, lam_kind, causal, chunk,
                                                                     monkeypatch):
    """The bf16 kernel (difftx_attn_forward_bf16 / _backward_bf16: AMX tiles or AVX512-BF16) is the path taken, and
    its output and gradients (q, k, v, lambda) are as close to float64 on the same bf16 inputs as the torch
    block path's: products bf16 x bf16 -> float32, maps and statistics in float32, one rounding of each map."""
    inputs, mask = _wide_case(m, h, hk, n, q_start, lam_kind, causal)
    inputs = tuple(None if x is None else (x.detach().to(torch.bfloat16) if x.dim() > 0 and x.shape[-1] > 1 else x)
                   for x in inputs)  # q, k, v rounded to bf16 (lambda stays as it is: float64 -> fp32 below)
    calls = []
    fwd, bwd = native.attention_forward, native.attention_backward
    monkeypatch.setattr(native, "attention_forward", lambda *a, **kw: calls.append("f") or fwd(*a, **kw))
    monkeypatch.setattr(native, "attention_backward", lambda *a, **kw: calls.append("b") or bwd(*a, **kw))
    lam16 = lambda x, t: x.detach().to(t).requires_grad_()  # noqa: E731
    as_dtype = lambda t, lt: tuple(None if x is None else lam16(x, t if x.dtype == torch.bfloat16 else lt)  # noqa: E731
                                   for x in inputs)
    got = _run(as_dtype(torch.bfloat16, torch.float32), mask, True, monkeypatch, chunk)
    assert calls == ["f", "b"], calls
    tor = _run(as_dtype(torch.bfloat16, torch.float32), mask, False, monkeypatch, chunk)
    exact = _run(as_dtype(torch.float64, torch.float64), mask, False, monkeypatch, chunk)
    assert len(got) == len(exact) == 4 + (lam_kind is not None)
    for i, (a, b, r) in enumerate(zip(got, tor, exact)):
        assert a.dtype == b.dtype and a.shape == r.shape
        scale = r.abs().max().clamp_min(1.0)
        err, err_torch = (a.double() - r).abs().max() / scale, (b.double() - r).abs().max() / scale
        assert err <= 1.5 * err_torch + 2e-3, (i, err, err_torch)
        if i < 4:
            assert err <= 2e-2, (i, err)


@pytest.mark.skipif(not (HAVE_CC and native.bf16_attention() and not native.amx()),
                    reason="the untransposed dK / dV products run on AVX512-BF16 without AMX")
@pytest.mark.parametrize("m,mk,h,hk,n,q_start,causal,chunk", [
    (1, 1, 4, 4, 70, 0, True, 32),  # a last block of 6 rows; keys not a multiple of 32
    (2, 2, 4, 2, 129, 0, True, 64),  # GQA, several blocks: the causal start of each 8 keys' contraction
    (2, 1, 4, 2, 45, 9, True, 32),  # one K both maps read (DIFF V2), queries after a cached prefix
    (1, 1, 2, 2, 100, 0, False, 32),  # no causal mask: every key's whole contraction
])
def test_bf16_attention_backward_forms_give_the_same_bits(m, mk, h, hk, n, q_start, causal, chunk):
    """Without AMX the backward multiplies the packed maps as they are (dK = dS^T Q, dV = G^T dO: no transposed
    operand, each block of keys starting its sum at the first query that sees it); form 0 runs AMX's transposed
    products (Q^T dS, dO^T G) on the same dot products.  The same products summed in the same order: equal bits."""
    g = torch.Generator().manual_seed(3)
    b, d, dv, nk = 2, 32, 64, n + q_start
    t = lambda *shape: torch.randn(*shape, generator=g).bfloat16()  # noqa: E731
    q, k, v, dout = t(b, m, h, n, d), t(b * mk * hk, nk, d), t(b, hk, nk, dv), t(b, n, h, dv)
    lam = 0.37 if m == 2 else 0.0
    _, lse = native.attention_forward(q, k, v, causal, q_start, chunk, 0.3, lam, None, True)
    before = native.attention_backward_form()
    try:
        assert native.attention_backward_form(0) == 0
        old = native.attention_backward(q, k, v, dout, lse, causal, q_start, chunk, 0.3, lam, None)
        assert native.attention_backward_form(1) == 1
        new = native.attention_backward(q, k, v, dout, lse, causal, q_start, chunk, 0.3, lam, None)
    finally:
        native.attention_backward_form(before)
    for a, c in zip(old, new):
        assert (a is None) == (c is None)
        if a is not None:
            assert torch.equal(a, c) and a.abs().sum() > 0


@needs_bf16_attention
def test_bf16_attention_is_causal_thread_count_invariant_and_reads_values_in_place(monkeypatch):
    """Bitwise the same with 1 and 2 threads; the last query's inputs change no earlier output; V as a strided
    head view of a projection is read in place and its gradient comes back in that layout."""
    (q, k, v, lam), mask = _wide_case(2, 4, 2, 100, 0, "scalar", True)
    b, hk, nk, dv = v.shape
    proj = v.detach().transpose(1, 2).reshape(b, nk, hk * dv).bfloat16()

    def run():
        qq, kk, pp = (t.detach().bfloat16().requires_grad_() for t in (q, k, proj))
        ll = lam.detach().float().requires_grad_()
        vv = pp.view(b, nk, hk, dv).transpose(1, 2)
        strides = []
        vv.register_hook(lambda g: strides.append(g.stride()))
        out = fused.fused_attention(qq, kk, vv, mask, 0.3, ll, chunk=32)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).bfloat16()
        return [out.detach()] + list(torch.autograd.grad((out * w).sum(), [qq, kk, pp, ll])), strides, vv.stride()

    calls = []
    fwd = native.attention_forward
    monkeypatch.setattr(native, "attention_forward", lambda *a, **kw: calls.append(a[2].stride()) or fwd(*a, **kw))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, strides, v_stride = run()
        torch.set_num_threads(2)
        two, _, _ = run()
    finally:
        torch.set_num_threads(threads)
    assert calls[0] == v_stride and strides == [v_stride]
    for a, c in zip(one, two):
        assert torch.equal(a, c)
    q16, k16, v16 = (t.detach().bfloat16() for t in (q, k, v))
    q2, k2, v2 = q16.clone(), k16.clone(), v16.clone()
    q2[:, :, :, -1] += 1.0
    k2[:, :, :, -1] += 1.0
    v2[:, :, -1] += 1.0
    with torch.no_grad():
        o1 = fused.fused_attention(q16, k16, v16, mask, 0.3, lam.detach().float(), chunk=32)
        o2 = fused.fused_attention(q2, k2, v2, mask, 0.3, lam.detach().float(), chunk=32)
    assert torch.equal(o1[:, :-1], o2[:, :-1]) and not torch.equal(o1[:, -1], o2[:, -1])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,hk,n,q_start,lam_kind,chunk", [
    (4, 2, 70, 0, "rows", 32),  # DIFF V2: per-token lambda, two query heads per K/V group
    (2, 2, 45, 9, "rows", 32),  # queries after a cached prefix
    (2, 1, 129, 0, "scalar", 64),  # several blocks
])
def test_a_key_both_maps_read_is_packed_once_and_gets_both_maps_gradient(dtype, h, hk, n, q_start, lam_kind, chunk,
                                                                         monkeypatch):
    """k (B, 1, Hk, Nk, d), one K that both maps read (DIFF V2): the native kernel takes it as it is (one K slice
    per K/V head, not an expanded copy) and returns dK summed over the maps.  Its output and gradients equal the
    float64 reference computed on the *expanded* K, whose gradient autograd sums; as closely as the float32
    kernel's 2e-6 (float32), or as the torch block path on the same inputs (bf16).  1 and 2 threads agree
    bitwise, and the torch block path takes the shared K too."""
    if not (HAVE_CC and (dtype == torch.float32 or native.bf16_attention())):
        pytest.skip("the native attention kernel for this dtype is not available here")
    (q, k, v, lam), mask = _wide_case(2, h, hk, n, q_start, lam_kind, True)
    k = k.detach()[:, :1].clone()  # (B, 1, Hk, Nk, d)
    b = q.shape[0]
    cast = lambda x, t: x.detach().to(t if x.dim() > 0 and x.shape[-1] > 1 else  # noqa: E731
                                      (torch.float64 if t == torch.float64 else torch.float32)).requires_grad_()

    def run(t, use_native, expand=False):
        monkeypatch.setattr(native, "ENABLED", use_native)
        qq, kk, vv, ll = (None if x is None else cast(x, t) for x in (q, k, v, lam))
        keys = kk.expand(b, 2, *kk.shape[2:]) if expand else kk
        out = fused.fused_attention(qq, keys, vv, mask, 0.3, ll, chunk=chunk)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
        return [out.detach()] + list(torch.autograd.grad((out * w).sum(), [qq, kk, vv, ll]))

    seen = []
    fwd, bwd = native.attention_forward, native.attention_backward
    monkeypatch.setattr(native, "attention_forward", lambda *a, **kw: seen.append(a[1].shape) or fwd(*a, **kw))
    monkeypatch.setattr(native, "attention_backward", lambda *a, **kw: seen.append(a[1].shape) or bwd(*a, **kw))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        got = run(dtype, True)
        torch.set_num_threads(2)
        got2 = run(dtype, True)
    finally:
        torch.set_num_threads(threads)
    assert seen and all(s[0] == b * hk for s in seen), seen  # one K slice per (batch, K/V head), both calls
    for a, c in zip(got, got2):
        assert torch.equal(a, c)
    exact = run(torch.float64, False, expand=True)
    shared64 = run(torch.float64, False)  # the torch block path given the shared K
    tor = run(dtype, False, expand=True)
    for i, (a, r, s64, c) in enumerate(zip(got, exact, shared64, tor)):
        assert a.shape == r.shape and a.dtype == c.dtype
        scale = r.abs().max().clamp_min(1.0)
        assert (s64 - r).abs().max() <= 1e-12 * scale, i
        err = (a.double() - r).abs().max() / scale
        if dtype == torch.float32:
            assert err <= 2e-6, (i, err)
        else:
            err_torch = (c.double() - r).abs().max() / scale
            assert err <= 1.5 * err_torch + 2e-3, (i, err, err_torch)


@needs_native
@pytest.mark.parametrize("m,lam_kind", [(2, "scalar"), (2, "rows"), (1, None)])
def test_fused_attention_native_bf16_is_closer_to_fp32_than_torch_path(m, lam_kind, monkeypatch):
    """bf16: the native forward rounds the combined map once from fp32 probabilities, so its error
    against the fp32 result is no larger than the torch path's (which rounds each map first)."""
    (q, k, v, lam), mask = _attention_case(torch.float32, m, 2, False, 0, lam_kind, n=96)
    inputs16 = tuple(t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v)) + (lam,)  # lambda stays fp32
    exact = tuple(t.detach().float().requires_grad_() for t in inputs16[:3]) + (lam,)  # the same values in fp32
    ref = _run(exact, mask, True, monkeypatch)
    nat = _run(inputs16, mask, True, monkeypatch)
    tor = _run(inputs16, mask, False, monkeypatch)
    for i, (a, b, r) in enumerate(zip(nat, tor, ref)):
        scale = r.abs().max().clamp_min(1.0)
        err_nat = (a.double() - r.double()).abs().max() / scale
        err_tor = (b.double() - r.double()).abs().max() / scale
        assert err_nat <= 1.5 * err_tor + 2e-3, (i, err_nat, err_tor)
        if i < 4:  # out, dq, dk, dv (a scalar lambda's gradient is a long sum with cancellation: ~8% both ways)
            assert err_nat <= 2e-2, (i, err_nat)


@needs_native
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("weight,gain", [(True, 0.8), (False, 0.7)])
def test_rms_norm_native_equals_torch_path(dtype, out_dtype, weight, gain, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 300, 37, generator=g) * 3).to(dtype).requires_grad_()  # > SMALL_NORM elements
    w = torch.rand(37, generator=g).requires_grad_() if weight else None
    gy = torch.randn(5, 300, 37, generator=g)
    res = {}
    for use in (True, False):
        monkeypatch.setattr(native, "ENABLED", use)
        y = fused.rms_norm(x, w, 1e-5, gain, out_dtype)
        assert y.dtype == out_dtype
        res[use] = [y.detach()] + list(torch.autograd.grad((y.float() * gy).sum(), [x] + ([w] if w is not None else [])))
    tol = 2e-6 if (dtype, out_dtype) == (torch.float32, torch.float32) else 1e-2
    for a, b in zip(res[True], res[False]):
        assert (a.double() - b.double()).abs().max() <= tol * b.abs().max().clamp_min(1.0)


@needs_native
@pytest.mark.parametrize("bits", [0xFFFFFFFF, 0x7FFFFFFF, 0x7FFF8000, 0x7F800001, 0xFF800001, 0x7FC00000])
def test_float32_nan_payloads_stay_nan_in_bfloat16(bits):
    """The kernels' float32 -> bfloat16 rounding gives a NaN for every NaN, as torch's does.  Rounded as a
    number, an all-ones NaN (0xFFFFFFFF) carried into +0 and a row normalised through it came out as zeros,
    a divergence hidden; a signalling low payload (0x7F800001) became infinity.  Checked in a row of 19
    (whole vectors and the scalar tail) next to finite rows."""
    x = torch.randn(3, 19, generator=torch.Generator().manual_seed(0))
    x.view(torch.int32)[1, 0] = torch.tensor(bits, dtype=torch.int64).to(torch.int32)  # the vector part
    x.view(torch.int32)[2, 18] = torch.tensor(bits, dtype=torch.int64).to(torch.int32)  # the tail
    assert x[1, 0].isnan() and x[2, 18].isnan()
    y = native.rms_norm(x, None, 1.0, 1e-6, torch.bfloat16)
    assert y[1:].isnan().all(), y
    want = (x[:1] * torch.rsqrt(x[:1].pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert (y[0].float() - want.float()).abs().max() <= 2 ** -8 * want.float().abs().max()


def test_disabled_by_env_gives_the_torch_path(monkeypatch):
    monkeypatch.setenv("DIFFTX_NATIVE", "0")
    native.reset()
    try:
        assert native.library() is None and native.status().startswith("off")
        assert not native.supports(torch.float32, torch.device("cpu"))
        inputs, mask = _attention_case(torch.float32, 2, 2, False, 0, "scalar")
        out = fused.fused_attention(*inputs[:3], mask, 0.3, inputs[3])
        assert torch.isfinite(out).all()
    finally:
        monkeypatch.delenv("DIFFTX_NATIVE")
        native.reset()


def test_a_failing_build_falls_back_to_torch(monkeypatch, tmp_path):
    """A compiler that fails (here `false`) leaves the torch path, with the reason in the status."""
    monkeypatch.delenv("DIFFTX_NATIVE", raising=False)  # a build is attempted whatever the caller's setting
    if not shutil.which("false"):
        pytest.skip("no `false` binary")
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_compiler", lambda: ["false"])
    native.reset()
    try:
        assert native.library() is None
        assert native.status().startswith("build failed")
        assert list(tmp_path.iterdir()) == []  # nothing half-written left behind
        x = torch.randn(4, 300, 64)
        y = fused.rms_norm(x, None, 1e-5)
        torch.testing.assert_close(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    finally:
        native.reset()


@pytest.mark.parametrize("value", ["garbage", "of", "disable"])
def test_an_unrecognised_DIFFTX_NATIVE_value_gives_the_torch_path_and_names_it(value, monkeypatch):
    """Only 1/true/yes/on (or unset) builds the kernels; anything else is off, and the status says what was read
    (a typo must not leave them on unnoticed)."""
    monkeypatch.setenv("DIFFTX_NATIVE", value)
    native.reset()
    try:
        assert native.library() is None
        assert native.status().startswith("off") and repr(value) in native.status(), native.status()
    finally:
        monkeypatch.delenv("DIFFTX_NATIVE")
        native.reset()


@pytest.mark.parametrize("value", ["OFF", " no ", "false"])
def test_the_off_status_names_the_value_given(value, monkeypatch):
    monkeypatch.setenv("DIFFTX_NATIVE", value)
    native.reset()
    try:
        assert native.status() == f"off (DIFFTX_NATIVE={value.strip()})"
    finally:
        monkeypatch.delenv("DIFFTX_NATIVE")
        native.reset()


def test_the_cache_dir_expands_a_home_tilde(monkeypatch, tmp_path):
    """DIFFTX_CACHE_DIR="~/x" (quoted in a shell, or from an env file) is the home's x, not ./~/x in the current
    directory (as DIFFTX_CACHE, the token shards' cache, already does)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DIFFTX_CACHE_DIR", "~/kernels")
    assert native._cache_dir() == tmp_path / "kernels"


def test_either_cache_variable_moves_the_whole_cache(monkeypatch, tmp_path):
    """The kernels read DIFFTX_CACHE_DIR and the token shards DIFFTX_CACHE: setting one moved half the cache."""
    from difftx.data.shards import default_cache_dir

    for var, other in (("DIFFTX_CACHE", "DIFFTX_CACHE_DIR"), ("DIFFTX_CACHE_DIR", "DIFFTX_CACHE")):
        monkeypatch.delenv(other, raising=False)
        monkeypatch.setenv(var, str(tmp_path / var))
        assert native._cache_dir() == default_cache_dir() == tmp_path / var
        monkeypatch.delenv(var)


def test_an_unwritable_cache_dir_falls_back_to_torch_and_says_what_to_set(monkeypatch, tmp_path):
    """A cache path that cannot be a directory (here a file; a read-only home is the same) leaves the torch
    path with a status that names the directory and DIFFTX_CACHE_DIR."""
    monkeypatch.delenv("DIFFTX_NATIVE", raising=False)  # a build is attempted whatever the caller's setting
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(blocker))
    monkeypatch.setattr(native, "_compiler", lambda: [shutil.which("false") or "false"])
    native.reset()
    try:
        assert native.library() is None
        status = native.status()
        assert status.startswith("build failed") and str(blocker) in status and "DIFFTX_CACHE_DIR" in status, status
    finally:
        native.reset()


def _decode_reference(q, kk, v, valid, lam, scale, wg, eps):
    """float64: (softmax(q1 K1^T s) - lam softmax(q2 K2^T s)) V per head, then RMSNorm * wg."""
    b, _, h, _, d = q.shape
    rep = h // kk.shape[1]
    k = kk.double().repeat_interleave(rep, 1)
    vv = v.double().repeat_interleave(rep, 1)
    q1, q2 = q[:, 0, :, 0].double(), q[:, 1, :, 0].double()  # (B, H, d)
    l1 = torch.einsum("bhd,bhtd->bht", q1, k[..., :d]) * scale
    l2 = torch.einsum("bhd,bhtd->bht", q2, k[..., d:]) * scale
    if valid is not None:
        l1 = l1.masked_fill(~valid[:, None], float("-inf"))
        l2 = l2.masked_fill(~valid[:, None], float("-inf"))
    p = torch.softmax(l1, -1) - lam * torch.softmax(l2, -1)
    o = torch.einsum("bht,bhtc->bhc", p, vv)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * wg.double()
    return o[:, None]  # (B, 1, H, 2d)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,hk,padded", [(4, 4, False), (4, 2, True), (4, 1, False)])
@pytest.mark.parametrize("paired", [True, False])
@pytest.mark.parametrize("d", [8, 32])  # the scalar loop; whole 16-lane vectors
def test_diff_decode_kernel_matches_reference(dtype, h, hk, padded, paired, d):
    """The decoding kernel over a cache's strided prefix views (29 of 40 slots written), keys in
    either cache layout: paired [K1 | K2] per head, or K1 heads then K2 heads."""
    from difftx.nn.attention import _cached_keys

    g = torch.Generator().manual_seed(2)
    b, t, cap = 3, 29, 40
    q = torch.randn(b, 2, h, 1, d, generator=g).to(dtype)
    kk = torch.randn(b, hk, cap, 2 * d, generator=g).to(dtype)[:, :, :t]
    v = torch.randn(b, hk, cap, 2 * d, generator=g).to(dtype)[:, :, :t]
    if paired:
        k = _cached_keys(kk, b, hk, d)
    else:  # the same keys stored as (B, 2 Hk, cap, d)
        buf = torch.randn(b, 2 * hk, cap, d, generator=g).to(dtype)
        buf[:, :hk, :t], buf[:, hk:, :t] = kk[..., :d], kk[..., d:]
        k = _cached_keys(buf[:, :, :t], b, hk, d)
    assert k.shape == (b, 2, hk, t, d) and not k.is_contiguous()
    valid = None
    if padded:
        valid = torch.ones(b, t, dtype=torch.bool)
        valid[0, :4] = False
        valid[2, 10:13] = False
    wg = torch.rand(2 * d, generator=g) + 0.5
    out = native.diff_decode(q, k, v, valid, 0.37, 0.3, True, wg, 1.0, 1e-5, torch.float32)
    ref = _decode_reference(q, kk, v, valid, 0.37, 0.3, wg, 1e-5)
    tol = 2e-5 if dtype == torch.float32 else 1e-4  # bf16 inputs, fp32 math and output
    torch.testing.assert_close(out.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,hk,padded", [(4, 4, False), (4, 2, True), (4, 1, True)])
@pytest.mark.parametrize("d", [8, 32])  # the scalar loop; whole 16-lane vectors
def test_softmax_decode_kernel_matches_float64(dtype, h, hk, padded, d):
    """The one-map case of the decoding kernel (softmax attention, M = 1) over a cache's strided prefix views
    (29 of 40 slots written), GQA groups and padded keys, against softmax(q K^T s) V in float64."""
    g = torch.Generator().manual_seed(3)
    b, t, cap, scale = 3, 29, 40, 0.37
    q = torch.randn(b, 1, h, 1, d, generator=g).to(dtype)
    k = torch.randn(b, hk, cap, d, generator=g).to(dtype)[:, :, :t]
    v = torch.randn(b, hk, cap, d, generator=g).to(dtype)[:, :, :t]
    assert not k.is_contiguous()
    valid = None
    if padded:
        valid = torch.ones(b, t, dtype=torch.bool)
        valid[0, :4] = False
        valid[2, 10:13] = False
    for out_dtype in (torch.float32, torch.bfloat16):
        out = native.diff_decode(q, k[:, None], v, valid, 123.0, scale, False, None, 1.0, 0.0, out_dtype)
        assert out.shape == (b, 1, h, d) and out.dtype == out_dtype
        rep = h // hk
        kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
        logits = torch.einsum("bhd,bhtd->bht", q[:, 0, :, 0].double(), kk) * scale
        if valid is not None:
            logits = logits.masked_fill(~valid[:, None], float("-inf"))
        ref = torch.einsum("bht,bhtd->bhd", torch.softmax(logits, -1), vv)[:, None]
        tol = (2e-5 if dtype == torch.float32 else 1e-4) if out_dtype == torch.float32 else 8e-3
        torch.testing.assert_close(out.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [8, 32])  # the scalar loop; whole 16-lane vectors
def test_decode_kernel_reads_queries_through_their_strides(dtype, d):
    """DIFF V2's queries reach the decoding kernel as a view of one projection (heads 2i, 2i + 1 -> maps 1, 2),
    not copied: the same bits as the contiguous copy, and the maps not swapped (lambda weighs map 2)."""
    g = torch.Generator().manual_seed(4)
    b, h, hk, t = 3, 4, 2, 21
    q = torch.randn(b, 2 * h, 1, d, generator=g).to(dtype)
    qs = q.view(b, h, 2, 1, d).transpose(1, 2)  # as DiffV2Attention hands it over
    assert not qs.is_contiguous()
    k = torch.randn(b, hk, t, d, generator=g).to(dtype)[:, None].expand(b, 2, hk, t, d)
    v = torch.randn(b, hk, t, d, generator=g).to(dtype)
    lam = torch.rand(b, h, generator=g)
    out = native.diff_decode(qs, k, v, None, lam, 0.3, False, None, 1.0, 0.0, torch.float32)
    assert torch.equal(out, native.diff_decode(qs.contiguous(), k, v, None, lam, 0.3, False, None, 1.0, 0.0,
                                               torch.float32))
    swapped = native.diff_decode(qs.flip(1).contiguous(), k, v, None, lam, 0.3, False, None, 1.0, 0.0,
                                 torch.float32)
    assert not torch.allclose(out, swapped)


@needs_native
@pytest.mark.parametrize("attention,qk_norm", [("diff", False), ("softmax", False), ("softmax", True)])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("bf16", [True, False])
def test_model_decoding_takes_the_native_step_and_matches_the_torch_step(attention, qk_norm, padded, bf16,
                                                                         monkeypatch):
    """Decoding with the native step, one call a layer and step, gives the torch step's logits (bf16: to bf16
    rounding; fp32: to float32 rounding).  DIFF: the paired bf16 cache, the (B, 2 h_kv, T, d) fp32 one; softmax
    attention (the Transformer's, and DNT's QK-normed): the kernel's one-map case.  Asking for the sdpa variant
    keeps the torch step."""
    from difftx import ModelConfig, build_model

    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, attention=attention,
                      qk_norm=qk_norm)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    prompt = torch.randint(0, 64, (2, 9))
    valid = torch.ones(2, 9, dtype=torch.bool)
    if padded:
        valid[1, :3] = False  # left padding, remembered by the cache
    calls = []
    real = native.diff_decode
    monkeypatch.setattr(native, "diff_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def decode(use_native, variant="auto"):
        monkeypatch.setattr(native, "ENABLED", use_native)
        for block in model.layers:
            block.attn.diff_variant = variant
        cache = model.new_cache(2, 12)
        outs = []
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(prompt, cache=cache, attention_mask=valid)
            tok = prompt[:, -1:]
            for _ in range(3):
                outs.append(model(tok, cache=cache).logits.float())
        return torch.cat(outs, 1)

    a = decode(True)
    assert len(calls) == 3 * cfg.n_layers
    b = decode(False)
    c = decode(True, "sdpa")
    assert len(calls) == 3 * cfg.n_layers
    tol = 0.05 if bf16 else 1e-5
    torch.testing.assert_close(a, b, atol=tol * b.abs().max().item(), rtol=tol)
    torch.testing.assert_close(a, c, atol=tol * c.abs().max().item(), rtol=tol)


@needs_native
@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
def test_a_decoding_step_with_autograd_on_keeps_its_gradients(attention, monkeypatch):
    """The native decoding step has no backward: a step taken with autograd on (a prefill without gradients, then
    one step whose logits are differentiated) runs the torch step, and its parameter gradients are the pure-torch
    ones (the query projection's included, which only the attention's output reaches)."""
    from difftx import ModelConfig, build_model

    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                      attention=attention)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    prompt = torch.randint(0, 64, (2, 9))

    def step_grads(use_native):
        monkeypatch.setattr(native, "ENABLED", use_native)
        model.zero_grad(set_to_none=True)
        cache = model.new_cache(2, 12)
        with torch.no_grad():
            model(prompt, cache=cache)
        logits = model(prompt[:, -1:], cache=cache).logits
        (logits.double() ** 2).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = step_grads(False)
    got = step_grads(True)
    q_proj = next(n for n in ref if "attn" in n and ("q_proj" in n or "qkv" in n))
    assert set(got) == set(ref), sorted(set(ref) ^ set(got))
    for n in ref:  # float32 rounding: DIFF's lambda gradients (a difference of two near terms) sit 1-4e-5 of their
        # largest entry from float64's on either path (torch's GEMM or oneDNN for the projections)
        torch.testing.assert_close(got[n], ref[n], atol=1e-4 * ref[n].abs().max().item(), rtol=1e-5, msg=n)
    assert ref[q_proj].abs().max() > 0


@needs_native
@pytest.mark.parametrize("attention", ["diff", "diff2", "softmax"])
def test_native_decoding_applies_a_one_row_key_valid_to_every_sequence(attention, monkeypatch):
    """AttnMask takes key_valid with one row for the whole batch; the native decoding step masks every
    sequence with it, as the torch step does (it used to read rows 1.. past the end of the mask)."""
    from difftx import ModelConfig
    from difftx.nn.attention import make_attention
    from difftx.nn.cache import KVCache
    from difftx.nn.rope import RotaryEmbedding

    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                      attention=attention)
    torch.manual_seed(0)
    layer = make_attention(cfg, 1).eval()
    b, n = 3, 9
    x = torch.randn(b, n + 1, 64)
    valid = torch.ones(1, n + 1, dtype=torch.bool)
    valid[0, :4] = False  # one left-padded row for every sequence
    rope = RotaryEmbedding(16)
    calls = []
    real = native.diff_decode
    monkeypatch.setattr(native, "diff_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def step(use_native):
        monkeypatch.setattr(native, "ENABLED", use_native)
        cache = KVCache(1, b, 16)
        with torch.no_grad():
            layer(x[:, :n], rope.cos_sin(torch.arange(n)), AttnMask(True, n, n, 0, valid[:, :n]), cache)
            cache.advance(n)
            return layer(x[:, n:], rope.cos_sin(torch.arange(n, n + 1)), AttnMask(True, 1, n + 1, n, valid), cache)

    got = step(True)
    assert calls
    want = step(False)
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_swiglu_blocks_and_tails_match_float64(threads, dtype, monkeypatch):
    """Several of the kernel's 4096-element blocks with a partial vector at the end: the whole-vector loop
    of each dtype and the tail path agree with float64, whatever the thread count, and compute bitwise
    the same values (every element again through the tail path, 3 at a time)."""
    monkeypatch.setattr(native, "ENABLED", True)
    gen = torch.Generator().manual_seed(1)
    g = (torch.randn(3, 4099, generator=gen, dtype=torch.float64) * 4).to(dtype)
    u, dh = (torch.randn(3, 4099, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        h = native.swiglu(g, u)
        dg, du = native.swiglu_backward(g, u, dh)
    finally:
        torch.set_num_threads(before)
    gd, ud, hd = g.double(), u.double(), dh.double()
    s = torch.sigmoid(gd)
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # bfloat16: the output's rounding, 2^-8 relative
    for a, b in ((h, gd * s * ud), (dg, hd * ud * s * (1 + gd * (1 - s))), (du, hd * gd * s)):
        assert a.dtype == dtype
        assert ((a.double() - b).abs() <= tol * b.abs() + 1e-6 * b.abs().max()).all()
    fg, fu, fh = g.flatten(), u.flatten(), dh.flatten()
    tails = [(native.swiglu(fg[i:i + 3].clone(), fu[i:i + 3].clone()),
              *native.swiglu_backward(fg[i:i + 3].clone(), fu[i:i + 3].clone(), fh[i:i + 3].clone()))
             for i in range(0, 600, 3)]
    for whole, tail in zip((h, dg, du), zip(*tails)):
        assert torch.equal(whole.flatten()[:600], torch.cat(tail))


@needs_native
def test_rms_norm_backward_is_deterministic():
    """The weight gradient sums per-thread partials in thread order: bitwise equal run to run."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g).requires_grad_()
    w = torch.rand(64, generator=g).requires_grad_()
    gy = torch.randn(4096, 64, generator=g)
    runs = [torch.autograd.grad((fused.rms_norm(x, w, 1e-5, 0.9) * gy).sum(), [x, w]) for _ in range(4)]
    for dx, dw in runs[1:]:
        assert torch.equal(dx, runs[0][0]) and torch.equal(dw, runs[0][1])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_float64_reference(dtype, monkeypatch):
    """silu(g) * u and both gradients; 3 x 7 x 37 elements (a partial last vector), extreme gates."""
    from difftx.nn.ffn import swiglu

    monkeypatch.setattr(native, "ENABLED", True)
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3, 7, 37, generator=gen, dtype=torch.float64) * 4
    g[0, 0, :6] = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 30.0, 100.0])
    u = torch.randn(3, 7, 37, generator=gen, dtype=torch.float64)
    dh = torch.randn(3, 7, 37, generator=gen, dtype=torch.float64)
    gd, ud = g.to(dtype).requires_grad_(), u.to(dtype).requires_grad_()
    calls = []
    real = native.swiglu
    monkeypatch.setattr(native, "swiglu", lambda *a: calls.append(1) or real(*a))
    h = swiglu(gd, ud)
    assert calls and h.dtype == dtype
    dg, du = torch.autograd.grad(h, [gd, ud], dh.to(dtype))
    gr, ur = gd.detach().double().requires_grad_(), ud.detach().double().requires_grad_()
    hr = torch.nn.functional.silu(gr) * ur
    dgr, dur = torch.autograd.grad(hr, [gr, ur], dh.to(dtype).double())
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    for a, b in ((h, hr), (dg, dgr), (du, dur)):
        assert (a.double() - b).abs().max() <= tol * b.abs().max()


@needs_native
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_batch,five_d", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("d", [16, 64])
def test_rope_native_matches_float64_rotation(style, dtype, per_batch, five_d, d, monkeypatch):
    """The rotation and its gradient (the inverse rotation) against float64, strided input included; in bf16,
    d = 64 takes the whole-vector path of the half style (d / 2 a multiple of the vector width), d = 16 the row
    buffers."""
    from difftx.nn.rope import RotaryEmbedding, apply_rope

    monkeypatch.setattr(native, "ENABLED", True)
    gen = torch.Generator().manual_seed(0)
    b, n = 2, 11
    pos = torch.arange(n) + torch.tensor([[0], [5]]) if per_batch else torch.arange(n)
    cos, sin = RotaryEmbedding(d, style=style).cos_sin(pos)  # (B|1, 1, N, d/2)
    shape = (b, 3, 2, n, d) if five_d else (b, 3, n, d)
    base = torch.randn(*shape[:-2], d, n, generator=gen, dtype=torch.float64)  # transposed storage: strided x
    x = base.transpose(-1, -2).to(dtype).requires_grad_()
    c, s = (cos.unsqueeze(1), sin.unsqueeze(1)) if five_d else (cos, sin)
    calls = []
    real = native.rope
    monkeypatch.setattr(native, "rope", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    y = apply_rope(x, c, s, style)
    assert calls and y.dtype == dtype
    gy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype)
    (gx,) = torch.autograd.grad(y, [x], gy)
    monkeypatch.setattr(native, "ENABLED", False)
    xr = x.detach().double().requires_grad_()
    yr = apply_rope(xr, c.double(), s.double(), style)
    (gxr,) = torch.autograd.grad(yr, [xr], gy.double())
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert (y.double() - yr).abs().max() <= tol * yr.abs().max()
    assert (gx.double() - gxr).abs().max() <= tol * gxr.abs().max()


def _special_bf16_values() -> torch.Tensor:
    """bfloat16 values that round-trip through float32: subnormals, the smallest normal, ones next to ties, the
    largest finite, infinities, a quiet NaN (0x7FC0) and signed zeros."""
    bits = [0x0001, 0x8001, 0x0040, 0x007F, 0x807F, 0x0080, 0x3F80, 0x3F81, 0xBF81, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80,
            0x7FC0, 0x0000, 0x8000]
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


@needs_native
def test_bf16_stores_round_subnormals_as_torch_does():
    """The vector bf16 stores' rounding (vcvtneps2bf16 where a vector holds no subnormal or NaN, else the integer
    path) is torch's cast, bit for bit, NaN to a NaN: the SwiGLU gradient at g = 0 with dh = 1 is dg = u / 2,
    exact in float32, so the kernel's bf16 dg is the cast of u / 2, for specials alone, one subnormal among
    normals, infinities among normals, and normals alone (vcvtneps2bf16 alone would flush the subnormals)."""
    special = _special_bf16_values()
    normal = torch.randn(16, generator=torch.Generator().manual_seed(0)).bfloat16()
    one_subnormal, infinities = normal.clone(), normal.clone()
    one_subnormal[5] = special[0]
    infinities[[2, 9]] = special[[11, 12]]
    u = torch.stack([special, one_subnormal, infinities, normal]).reshape(-1)  # 4 vectors of 16
    dg, du = native.swiglu_backward(torch.zeros_like(u), u, torch.ones_like(u))
    want = (u.float() * 0.5).bfloat16()
    nan = want.isnan()
    assert nan.sum() == 1 and torch.equal(dg.isnan(), nan) and not du.any()
    assert torch.equal(dg[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert (want[:16].float().abs() < 1.2e-38).sum() >= 5  # subnormal results really are among them


@needs_native
@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_rope_reads_a_projection_view_in_place_and_writes_its_gradient_in_that_layout(style, monkeypatch):
    """DIFF's stacked heads: x = proj.view(b, n, h, 2, d).permute(0, 3, 2, 1, 4), a strided view of the
    projection's output.  The kernel reads it without a copy; the gradient comes back in x's own strides
    (so its way back to the projection is views only); both match float64."""
    from difftx.nn.rope import RotaryEmbedding, apply_rope

    monkeypatch.setattr(native, "ENABLED", True)
    gen = torch.Generator().manual_seed(3)
    b, n, h, d = 2, 9, 3, 16
    cos, sin = RotaryEmbedding(d, style=style).cos_sin(torch.arange(n))
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    proj = torch.randn(b, n, h * 2 * d, generator=gen, dtype=torch.float64)

    def run(dtype, use_native):
        monkeypatch.setattr(native, "ENABLED", use_native)
        pp = proj.to(dtype).requires_grad_()
        x = pp.view(b, n, h, 2, d).permute(0, 3, 2, 1, 4)
        strides = []
        x.register_hook(lambda g: strides.append(g.stride()))
        y = apply_rope(x, c.to(torch.float64) if dtype == torch.float64 else c,
                       s.to(torch.float64) if dtype == torch.float64 else s, style)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(dtype)
        (gp,) = torch.autograd.grad(y, [pp], gy)
        return y, gp, strides, x.stride()

    seen = []
    real = native.rope
    monkeypatch.setattr(native, "rope", lambda x, *a, **kw: seen.append(x.stride()) or real(x, *a, **kw))
    y, gp, strides, x_stride = run(torch.float32, True)
    assert seen[0] == x_stride  # read in place (a copy would be contiguous)
    assert strides == [x_stride]  # the gradient in x's layout
    yr, gpr, _, _ = run(torch.float64, False)
    assert (y.double() - yr).abs().max() <= 1e-6 * yr.abs().max()
    assert (gp.double() - gpr).abs().max() <= 1e-6 * gpr.abs().max()


@needs_native
def test_rope_native_takes_more_than_three_leading_dims(monkeypatch):
    """(B, a, b, c, N, d): the leading head dims are flattened; rotation and gradient match float64."""
    from difftx.nn.rope import RotaryEmbedding, apply_rope

    monkeypatch.setattr(native, "ENABLED", True)
    gen = torch.Generator().manual_seed(6)
    cos, sin = RotaryEmbedding(8).cos_sin(torch.arange(5))
    c, s = cos[:, None, None], sin[:, None, None]  # (1, 1, 1, 1, N, d/2)
    x = torch.randn(2, 3, 2, 2, 5, 8, generator=gen, dtype=torch.float64)
    gy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    calls = []
    real = native.rope
    monkeypatch.setattr(native, "rope", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    xf = x.float().requires_grad_()
    y = apply_rope(xf, c, s, "half")
    (g,) = torch.autograd.grad(y, [xf], gy.float())
    assert calls  # the native rotation, forward and backward
    monkeypatch.setattr(native, "ENABLED", False)
    xr = x.clone().requires_grad_()
    yr = apply_rope(xr, c.double(), s.double(), "half")
    (gr,) = torch.autograd.grad(yr, [xr], gy)
    assert (y.double() - yr).abs().max() <= 1e-6 * yr.abs().max()
    assert (g.double() - gr).abs().max() <= 1e-6 * gr.abs().max()


@needs_native
@pytest.mark.parametrize("shape", [(0, 2, 5, 8), (2, 0, 5, 8), "no positions, strided"])
def test_rope_of_an_empty_tensor_and_its_gradient(shape, monkeypatch):
    """No rows (an empty batch or head dim), strided or not: an empty rotation and an empty gradient, as the
    torch rotation gives (the kernel's strided-row reader took no empty tensor)."""
    from difftx.nn.rope import RotaryEmbedding, apply_rope

    monkeypatch.setattr(native, "ENABLED", True)
    cos, sin = RotaryEmbedding(8).cos_sin(torch.arange(5))
    if isinstance(shape, str):  # (B, H, 0, d) stored transposed: its last dim's stride is not 1
        x = torch.zeros(2, 2, 8, 0).transpose(-1, -2).requires_grad_()
        cos, sin = RotaryEmbedding(8).cos_sin(torch.arange(0))
    else:
        x = torch.zeros(shape).requires_grad_()
    y = apply_rope(x, cos, sin, "half")
    assert y.shape == x.shape
    (gx,) = torch.autograd.grad(y.sum(), [x])
    assert gx.shape == x.shape


@needs_native
@pytest.mark.parametrize("x_grad", [False, True])
def test_rope_angles_that_require_grad_get_their_gradient(x_grad, monkeypatch):
    """Angles computed from differentiable positions (a learned scaling, say) get the gradient the torch
    rotation gives, whether or not x wants one; the native rotation (which returns none for the angles) is
    not used for them."""
    from difftx.nn.rope import RotaryEmbedding, apply_rope

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64)
    inv = RotaryEmbedding(8)._inv_freq(torch.float32, torch.device("cpu"))

    def grads(use_native):
        monkeypatch.setattr(native, "ENABLED", use_native)
        pos = torch.arange(5, dtype=torch.float32).requires_grad_()
        ang = pos[:, None] * inv
        xi = x.float().requires_grad_(x_grad)
        y = apply_rope(xi, ang.cos()[None, None], ang.sin()[None, None], "half")
        return torch.autograd.grad((y.double() * w).sum(), [pos] + ([xi] if x_grad else []))

    got, want = grads(True), grads(False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_native_rotates_in_place(dtype, interleaved):
    """``out`` may be x itself (float32 rows are read and written in place, bfloat16 ones through
    scratch): the same values as into a new tensor, for a strided x (a head view of a projection)."""
    from difftx.nn.rope import RotaryEmbedding

    gen = torch.Generator().manual_seed(8)
    b, n, h, d = 2, 7, 3, 16
    cos, sin = RotaryEmbedding(d).cos_sin(torch.arange(n))
    c3, s3 = cos.reshape(1, n, d // 2).contiguous(), sin.reshape(1, n, d // 2).contiguous()
    proj = torch.randn(b, n, 2 * h * d, generator=gen).to(dtype)
    x = proj[..., : h * d].view(b, n, h, d).transpose(1, 2)  # strided, position-major
    expect = native.rope(x, c3, s3, interleaved)
    assert expect.is_contiguous() and not torch.equal(expect, x)
    untouched = proj[..., h * d:].clone()
    assert native.rope(x, c3, s3, interleaved, out=x) is x
    assert torch.equal(x, expect)
    assert torch.equal(proj[..., h * d:], untouched)  # only x's own elements were written


@needs_native
@pytest.mark.parametrize("k,n", [(64, 48), (37, 5), (512, 130), (100, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_linear_against_float64_and_row_by_row(k, n, bias):
    """native.few_rows_linear is x W^T + b (float64 reference, float32 rounding) for 1-13 rows, K and N that
    are not multiples of the vector width or of the tile; each row's bits are the same whatever the other rows
    (the row computed alone) and whatever the thread count."""
    g = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(13, k, generator=g)
    threads = torch.get_num_threads()
    try:
        for rows in (1, 2, 3, 4, 5, 8, 13):
            xs = x[:rows].contiguous()
            y = native.few_rows_linear(xs, w, b)
            ref = xs.double() @ w.double().t() + (0 if b is None else b.double())
            torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
            assert torch.equal(y, native.few_rows_linear(x, w, b)[:rows])  # the same bits with 13 rows
            torch.set_num_threads(1 if threads > 1 else 2)
            assert torch.equal(y, native.few_rows_linear(xs, w, b))
            torch.set_num_threads(threads)
        x3 = x[:6].view(2, 3, k)  # leading dims are rows
        assert torch.equal(native.few_rows_linear(x3, w, b), native.few_rows_linear(x[:6], w, b).view(2, 3, n))
    finally:
        torch.set_num_threads(threads)


WIDTH_FLAGS = {"8 lanes (AVX2 without AVX-512)": "-mno-avx512f", "4 lanes (SSE)": "-mno-avx"}


@needs_native
@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="x86 vector-width flags")
@pytest.mark.parametrize("flags", list(WIDTH_FLAGS.values()), ids=list(WIDTH_FLAGS))
def test_every_vector_width_computes_the_same(flags, tmp_path):
    """The kernels' vector width follows the ISA (16, 8 or 4 floats): build the narrower ones here with
    DIFFTX_NATIVE_CFLAGS and run the kernel-level tests against them, whatever this CPU is."""
    import re

    env = dict(os.environ, DIFFTX_NATIVE_CFLAGS=flags, DIFFTX_CACHE_DIR=str(tmp_path))
    probe = "from difftx.nn import native; print(native.status())"
    status = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert status.stdout.startswith("on (") and str(tmp_path) in status.stdout, status.stdout + status.stderr
    tests = ("softmax_combine_and_backward or rms_norm_native or native_equals_torch_path_fp32 "
             "or swiglu or rope or decode or native_float32_attention or few_rows or nan_payloads")
    r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-p", "no:cacheprovider", __file__, "-k", tests],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) >= 40 and "failed" not in r.stdout, r.stdout[-500:]


def _clang_with_openmp(tmp_path) -> bool:
    """Whether clang is on PATH and builds an OpenMP program (libomp's headers installed)."""
    clang = shutil.which("clang")
    if clang is None:
        return False
    src = tmp_path / "omp.c"
    src.write_text("#include <omp.h>\nint f(void) { return omp_get_max_threads(); }\n")
    r = subprocess.run([clang, "-fopenmp", "-fPIC", "-shared", str(src), "-o", str(tmp_path / "omp.so")],
                       capture_output=True, timeout=120)
    return r.returncode == 0


@needs_native
def test_the_kernels_build_and_compute_the_same_with_clang(tmp_path):
    """The kernels are GCC/Clang vector-extension C: with CC=clang (where it and libomp are installed) they build at
    this CPU's width and pass the kernel-level tests (float32 and bf16 attention, a shared K, SwiGLU, RoPE,
    norms, decoding, the bf16 Linear products).  Clang has no __builtin_shuffle (GCC's only before 12): the
    SHUF1 / SHUF2 macros pick __builtin_shufflevector there."""
    import re

    if not _clang_with_openmp(tmp_path):
        pytest.skip("clang with OpenMP (libomp) is not installed here")
    env = dict(os.environ, CC="clang", DIFFTX_CACHE_DIR=str(tmp_path / "cache"))
    probe = "from difftx.nn import native; print(native.status())"
    status = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert status.stdout.startswith("on (") and str(tmp_path) in status.stdout, status.stdout + status.stderr
    # libomp's threads, beside torch's libgomp pool, do not spin after a parallel region (unless the user says so)
    blocktime = "from difftx.nn import native; native.library(); import os; print(os.environ.get('KMP_BLOCKTIME'))"
    for cc, user, want in (("clang", None, "0"), ("clang", "50", "50"), ("gcc", None, "None")):
        e = {k: v for k, v in env.items() if k != "KMP_BLOCKTIME"}
        e.update(CC=cc, **({"KMP_BLOCKTIME": user} if user else {}))
        got = subprocess.run([sys.executable, "-c", blocktime], env=e, capture_output=True, text=True, timeout=300)
        assert got.stdout.strip() == want, (cc, user, got.stdout, got.stderr)
    tests = ("softmax_combine_and_backward or rms_norm_native or native_equals_torch_path_fp32 or swiglu or rope "
             "or decode or native_float32_attention or few_rows or nan_payloads or bf16_attention or key_both_maps "
             "or bf16_stores or float32_packing or dot_kernels or dot_path")
    here = Path(__file__).parent
    r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-p", "no:cacheprovider", "-o", "addopts=", "-m",
                        "not slow", __file__, str(here / "test_linear.py"), "-k", tests],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) >= 60 and "failed" not in r.stdout, r.stdout[-500:]


def test_the_build_asks_for_the_machines_own_instruction_set(monkeypatch):
    """The instruction-set flags follow the machine: x86 gets -march=native (and whole 512-bit vectors), Arm
    -mcpu=native and none of x86's options (GCC and Clang on AArch64 reject -mprefer-vector-width: with x86's
    flags every build there failed, and every kernel fell back to torch), other machines the compiler's own
    default."""
    monkeypatch.delenv("DIFFTX_NATIVE_CFLAGS", raising=False)
    for machine, want, unwanted in (("x86_64", {"-march=native", "-mprefer-vector-width=512"}, {"-mcpu=native"}),
                                    ("AMD64", {"-march=native"}, {"-mcpu=native"}),
                                    ("aarch64", {"-mcpu=native"}, {"-march=native", "-mprefer-vector-width=512"}),
                                    ("arm64", {"-mcpu=native"}, {"-march=native", "-mprefer-vector-width=512"}),
                                    ("riscv64", set(), {"-march=native", "-mcpu=native", "-mprefer-vector-width=512"})):
        monkeypatch.setattr(native.platform, "machine", lambda m=machine: m)
        flags = native._flags()
        assert want <= set(flags) and not unwanted & set(flags), (machine, flags)
        assert {"-O3", "-fopenmp", "-fPIC", "-shared"} <= set(flags), (machine, flags)


def test_the_source_builds_for_aarch64_with_the_arm_flags(tmp_path, monkeypatch):
    """Where an AArch64 cross toolchain is installed (Debian: gcc-aarch64-linux-gnu libc6-dev-arm64-cross;
    .ci/run installs it), the kernels' source builds for AArch64 with exactly the flags an Arm machine takes, a
    named core standing in for -mcpu=native (a cross compiler has no host to ask): x86-only code outside its
    guards, or an x86-only flag, fails here.  benchmarks/performance/arm64_emulation.sh runs the kernel tests on
    that build under emulation."""
    monkeypatch.delenv("DIFFTX_NATIVE_CFLAGS", raising=False)
    monkeypatch.setattr(native.platform, "machine", lambda: "aarch64")
    arm_flags = native._flags()
    cross = shutil.which("aarch64-linux-gnu-gcc")
    probe = tmp_path / "probe.c"  # the toolchain whole: headers and OpenMP
    probe.write_text("#include <math.h>\n#include <omp.h>\n"
                     "float f(float x) { return expf(x) + omp_get_max_threads(); }\n")
    if cross is None or subprocess.run([cross, "-fopenmp", "-fPIC", "-shared", str(probe), "-o", str(tmp_path / "p.so"),
                                        "-lm"], capture_output=True, timeout=120).returncode != 0:
        pytest.skip("no whole AArch64 cross toolchain here (Debian: gcc-aarch64-linux-gnu libc6-dev-arm64-cross)")
    out = tmp_path / "kernels-aarch64.so"
    flags = ["-mcpu=neoverse-n1" if f == "-mcpu=native" else f for f in arm_flags]
    r = subprocess.run([cross, *flags, str(native._SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    head = out.read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183  # EM_AARCH64
    # x86's flag, which Arm builds were given before, stops the build
    r = subprocess.run([cross, *flags, "-mprefer-vector-width=512", str(native._SOURCE), "-o", str(out), "-lm"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "prefer-vector-width" in r.stderr


@needs_native
def test_a_failed_scratch_allocation_raises_memory_error():
    """A kernel whose per-thread scratch cannot be allocated raises MemoryError (it used to write through a NULL
    pointer).  A query block of 6 x 2^40 rows asks the float32 attention kernels for ~400 TB of scratch."""
    torch.manual_seed(0)
    b, m, h, n, d = 1, 2, 2, 12, 16
    q = torch.randn(b, m, h, n, d)
    k3, v = torch.randn(b * m * h, n, d), torch.randn(b, h, n, 2 * d)
    huge = 6 << 40
    with pytest.raises(MemoryError, match="difftx_attn_forward"):
        native.attention_forward(q, k3, v, True, 0, huge, 0.25, 0.5, None, True)
    out, lse = native.attention_forward(q, k3, v, True, 0, 6, 0.25, 0.5, None, True)
    with pytest.raises(MemoryError, match="difftx_attn_backward"):
        native.attention_backward(q, k3, v, torch.randn_like(out), lse, True, 0, huge, 0.25, 0.5, None)


def test_cc_with_arguments_and_a_missing_cc(monkeypatch):
    """$CC is a command (``ccache gcc``, ``gcc -m64``), split like a shell; a $CC that is not on PATH is named in
    the status (and `difftx train`'s warning) rather than swapped for another compiler unannounced."""
    monkeypatch.delenv("DIFFTX_NATIVE", raising=False)  # a build is attempted whatever the caller's setting
    cc = next(c for c in ("cc", "gcc", "clang") if shutil.which(c)) if HAVE_CC else "cc"
    monkeypatch.setenv("CC", f"{cc} -O2")
    assert native._compiler() == [cc, "-O2"]
    monkeypatch.setenv("CC", "no-such-cc-here --flag")
    native.reset()
    try:
        assert native.library() is None
        assert native.problem() is not None and "CC='no-such-cc-here --flag'" in native.status()
    finally:
        native.reset()


@needs_native
def test_a_damaged_cached_library_is_built_again(monkeypatch, tmp_path):
    """A cached .so that cannot be loaded (truncated to nothing: disk trouble) is removed and built again, not
    reported as a failed build on every run; the build is readable by others (a cache shared between users)."""
    native.reset()
    built = Path(native.status().split("(", 1)[1].split(";", 1)[0])  # "on (PATH; ...)"
    damaged = tmp_path / built.name
    damaged.write_bytes(b"")
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path))
    native.reset()
    try:
        assert native.library() is not None, native.status()
        assert damaged.stat().st_size > 0 and damaged.stat().st_mode & 0o055 == 0o055
    finally:
        native.reset()


@needs_native
def test_a_truncated_cached_library_is_built_again_not_loaded(tmp_path):
    """A cached .so cut short (a full disk, an interrupted copy of the cache) still opens, and running it killed
    the process with SIGBUS, past every handler.  Its recorded SHA-256 no longer matches, so it is built again;
    checked in a child process, which a bus error would kill."""
    native.reset()
    built = Path(native.status().split("(", 1)[1].split(";", 1)[0])
    native.reset()
    whole = built.read_bytes()
    (tmp_path / built.name).write_bytes(whole[: len(whole) // 2])
    (tmp_path / built.name).with_suffix(".sha256").write_text(hashlib.sha256(whole).hexdigest() + "\n")
    code = ("import torch; from difftx.nn import native; assert native.library() is not None, native.status(); "
            "x = torch.randn(3, 8); print(float((native.rms_norm(x, None, 1.0, 1e-6, torch.float32)"
            " - x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).abs().max()))")
    env = dict(os.environ, DIFFTX_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert float(proc.stdout) < 1e-5
    assert (tmp_path / built.name).read_bytes() != whole[: len(whole) // 2]
