"""The Triton kernels of differential attention (difftx.nn.triton_diff) against float64 torch ops.

On a CUDA GPU with Triton they run compiled (and in bfloat16 too).  Without one they run in Triton's interpreter on
the CPU, which must be switched on (``TRITON_INTERPRET=1``) before anything imports triton (triton.language's own
jit functions are built at its import): tests/nn/test_triton_interpreter.py runs this file in a child process with
it set; in a process without it this file skips.  The interpreter's bfloat16 is not numpy's, so it checks float32
and float16.  Skipped where Triton is not installed (torch's CPU wheels ship without it; ``pip install triton``).
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA GPU: these run under Triton's interpreter in a child process "
                "(tests/nn/test_triton_interpreter.py)", allow_module_level=True)
pytest.importorskip("triton")

import difftx  # noqa: E402
from difftx.nn import backends, triton_diff  # noqa: E402
from difftx.nn.mask import AttnMask  # noqa: E402
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _kernels_ran():
    """Every test here is of the kernels themselves: a failure of theirs would fall back to torch's ops silently
    (triton_diff._failed), so none may have happened."""
    triton_diff._FAILED.clear()
    yield
    assert triton_diff._FAILED == [], triton_diff._FAILED


def _inputs(b, h, hk, n, d, dtype, seed=0, weight=True):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s, sd=1.0: (torch.randn(*s, generator=g) * sd).to(DEV, dtype)  # noqa: E731
    q, k, v = mk(b, 2, h, n, d), mk(b, 2, hk, n, d), mk(b, hk, n, 2 * d)
    lam = [(torch.randn(d, generator=g) * 0.1).to(DEV) for _ in range(4)]
    w = (1 + 0.1 * torch.randn(2 * d, generator=g)).to(DEV) if weight else None
    return q, k, v, lam, w


def _rel(got, ref):
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def _run(q, k, v, lam, w, norm, out_dtype=None, lambda_init=0.3, gain=0.7, fn=triton_diff.diff_attention, **masks):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, *lam)] + \
        ([w.detach().clone().requires_grad_()] if w is not None else [])
    y = fn(leaves[0], leaves[1], leaves[2], leaves[3:7], lambda_init, q.shape[-1] ** -0.5,
           leaves[7] if w is not None else None, norm=norm, eps=1e-5, gain=gain, out_dtype=out_dtype, **masks)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9)).to(y.device, y.dtype)
    return y, torch.autograd.grad(y, leaves, dy), dy


def _reference64(q, k, v, lam, w, norm, dy, lambda_init=0.3, gain=0.7, doc_ids=None, window=None):
    c = lambda t: t.detach().double().cpu().requires_grad_()  # noqa: E731
    leaves = [c(t) for t in (q, k, v, *lam)] + ([c(w)] if w is not None else [])
    y = triton_diff.reference(leaves[0], leaves[1], leaves[2], leaves[3:7], lambda_init, q.shape[-1] ** -0.5,
                              leaves[7] if w is not None else None, norm=norm, eps=1e-5, gain=gain,
                              out_dtype=torch.float64, doc_ids=None if doc_ids is None else doc_ids.cpu(),
                              window=window)
    return y, torch.autograd.grad(y, leaves, dy.double().cpu())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,norm,weight", [
    ((2, 2, 2, 40, 16), True, True),      # N past one query block, not a multiple of the blocks
    ((1, 4, 2, 70, 16), True, True),      # grouped-query K/V (two query heads a K/V head)
    ((1, 2, 1, 33, 32), False, False),    # no head norm: the combined output as it is
    ((1, 2, 2, 20, 16), True, False),     # a norm without a weight
    ((1, 1, 1, 192, 16), True, True),     # blocks wholly below the diagonal (3 blocks a side at 64): left unmasked
])
@pytest.mark.parametrize("dq", ["pass", "atomic"])
def test_output_and_every_gradient_match_float64(dtype, shape, norm, weight, dq, monkeypatch):
    monkeypatch.setenv(triton_diff.DQ_ENV, dq)
    q, k, v, lam, w = _inputs(*shape, dtype, weight=weight)
    y, grads, dy = _run(q, k, v, lam, w, norm)
    yr, gr = _reference64(q, k, v, lam, w, norm, dy)
    assert y.shape == yr.shape == (shape[0], shape[3], shape[1], 2 * shape[4]) and y.dtype == dtype
    names = ["y", "q", "k", "v", "lq1", "lk1", "lq2", "lk2", "w"]
    errs = {nm: _rel(a, b) for nm, a, b in zip(names, (y, *grads), (yr, *gr))}
    assert all(e < TOL[dtype] for e in errs.values()), errs


def test_dq_from_the_kv_pass_is_opt_in_and_off_under_deterministic_algorithms(monkeypatch):
    """DIFFTX_TRITON_DQ=atomic adds dQ's shares from the K/V pass (the Q pass then does not run); unset, or under
    torch.use_deterministic_algorithms, dQ has its own pass, whose bits repeat run to run."""
    q, k, v, lam, w = _inputs(1, 2, 1, 100, 16, torch.float32, seed=11)
    runs = []
    real = triton_diff._triton().diff_bwd_q

    class _Count:
        def __getitem__(self, grid):
            runs.append(grid)
            return real[grid]

    monkeypatch.setattr(triton_diff._triton(), "diff_bwd_q", _Count())
    monkeypatch.delenv(triton_diff.DQ_ENV, raising=False)
    _, g_pass, _ = _run(q, k, v, lam, w, True)
    _, g_again, _ = _run(q, k, v, lam, w, True)
    assert len(runs) == 2 and all(torch.equal(a, b) for a, b in zip(g_pass, g_again))
    monkeypatch.setenv(triton_diff.DQ_ENV, "atomic")
    _, g_atomic, _ = _run(q, k, v, lam, w, True)
    assert len(runs) == 2  # no Q pass
    # the same gradients, to float32 rounding (dQ summed in another order; the rest from the same K/V pass, compiled
    # with the atomics beside it)
    assert max(_rel(a, b) for a, b in zip(g_atomic, g_pass)) < 1e-6
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not triton_diff.dq_atomic()
        _run(q, k, v, lam, w, True)
    finally:
        torch.use_deterministic_algorithms(prev)
    assert len(runs) == 3


def test_no_grad_forward_is_the_training_forward_and_out_dtype():
    q, k, v, lam, w = _inputs(2, 2, 1, 45, 16, torch.float32, seed=3)
    y, _, _ = _run(q, k, v, lam, w, True)
    with torch.no_grad():
        y0 = triton_diff.diff_attention(q, k, v, lam, 0.3, 0.25, w, norm=True, eps=1e-5, gain=0.7)
        y16 = triton_diff.diff_attention(q, k, v, lam, 0.3, 0.25, w, norm=True, eps=1e-5, gain=0.7,
                                         out_dtype=torch.float16)
    assert torch.equal(y0, y.detach())
    assert y16.dtype == torch.float16 and _rel(y16, y0) < 1e-3


def test_lambda_of_two_large_equal_terms_is_lambda_init():
    """exp(100) - exp(100) overflows float32 (inf - inf = NaN); the kernels' lambda is lambda_init there."""
    q, k, v, lam, w = _inputs(1, 2, 2, 24, 16, torch.float32, seed=4, weight=False)
    big = torch.full((16,), 2.5, device=DEV)  # 16 * 6.25 = 100 for both terms
    lam = [big, big, big.clone(), big.clone()]
    y, grads, dy = _run(q, k, v, lam, w, False, lambda_init=0.4)
    yr, _ = _reference64(q, k, v, lam, w, False, dy, lambda_init=0.4)
    assert torch.isfinite(y).all() and _rel(y, yr) < 1e-5
    assert all(torch.isfinite(g).all() for g in grads[:3])


def test_second_derivatives_go_through_the_differentiable_recomputation():
    q, k, v, lam, w = _inputs(1, 2, 2, 20, 16, torch.float32, seed=5)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    def grad_norm(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, *lam, w)]
        with sdpa_kernel(SDPBackend.MATH):  # the reference's SDPA calls: CUDA's other kernels have no double backward
            y = fn(leaves[0], leaves[1], leaves[2], leaves[3:7], 0.3, 0.25, leaves[7], norm=True, eps=1e-5, gain=0.7)
        g = torch.autograd.grad((y * y).sum(), leaves, create_graph=True)
        hv = torch.autograd.grad(sum((x * x).sum() for x in g), leaves)
        return g, hv

    g, hv = grad_norm(triton_diff.diff_attention)
    gr, hvr = grad_norm(triton_diff.reference)
    assert max(_rel(a, b) for a, b in zip(g, gr)) < 1e-4
    assert max(_rel(a, b) for a, b in zip(hv, hvr)) < 1e-4


def _model(**kw):
    cfg = difftx.ModelConfig(attention="diff", d_model=64, n_layers=2, n_heads=2, vocab_size=61, max_seq_len=64, **kw)
    torch.manual_seed(0)
    return difftx.build_model(cfg).to(DEV)


def _loss_and_grads(model, ids, **kw):
    model.zero_grad()
    out = model(ids, targets=ids, **kw)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("extra", [{}, {"n_kv_heads": 1, "pairing": "halves"}, {"norms": "dnt"},
                                   {"head_norm_weight": False}], ids=str)
def test_a_model_on_the_kernels_matches_two_sdpa_calls(extra, monkeypatch):
    calls = []
    real = triton_diff._forward
    monkeypatch.setattr(triton_diff, "_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _model(**extra)
    ids = torch.randint(0, 61, (2, 29), generator=torch.Generator().manual_seed(1)).to(DEV)
    model.set_attention_backend("sdpa", "triton")
    loss, grads = _loss_and_grads(model, ids)
    assert len(calls) == 2  # both layers took the kernels
    model.set_attention_backend("sdpa", "2call")
    loss_r, grads_r = _loss_and_grads(model, ids)
    assert len(calls) == 2
    assert abs(float(loss - loss_r)) < 1e-5
    assert max(_rel(grads[n], grads_r[n]) for n in grads_r) < 1e-4
    assert set(grads) == set(grads_r)


def test_calls_the_kernels_do_not_serve_take_two_sdpa_calls(monkeypatch):
    calls = []
    real = triton_diff._forward
    monkeypatch.setattr(triton_diff, "_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _model()
    model.set_attention_backend("sdpa", "triton")
    ids = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(2)).to(DEV)
    pad = torch.ones(2, 24, dtype=torch.long, device=DEV)
    pad[1, :5] = 0  # left padding: a key mask, which the kernels do not take
    out = model(ids, targets=ids, attention_mask=pad)
    assert calls == [] and torch.isfinite(out.loss)
    model.set_attention_backend("sdpa", "2call")
    assert torch.allclose(model(ids, targets=ids, attention_mask=pad).loss, out.loss, atol=1e-6)
    model.set_attention_backend("sdpa", "auto")
    monkeypatch.setattr(backends, "resolve_diff_variant", lambda *a, **k: "triton")  # what auto picks on a GPU
    with torch.no_grad():  # generation under auto: the prompt's prefill takes the kernels, the decoding steps do not
        before = len(calls)
        model.generate(ids[:, :8], max_new_tokens=3, do_sample=False)
        assert len(calls) - before == 2


@pytest.mark.parametrize("n,nk,hk,masks", [(1, 70, 2, {}), (5, 77, 1, {}), (1, 100, 2, {"window": 40}),
                                           (16, 40, 2, {}), (20, 20, 2, {"window": 7})], ids=str)
def test_queries_after_a_prefix_match_float64(n, nk, hk, masks):
    """Without gradients the forward serves the last n of nk positions (decoding steps, a prompt after a cached
    prefix): causal by position, with a window or not."""
    q, k, v, lam, w = _inputs(2, 2, hk, nk, 16, torch.float32, seed=13)
    q = q[:, :, :, nk - n:]  # the queries' own rows, strided views of the longer tensor
    mask = AttnMask(causal=True, n_q=n, n_k=nk, q_start=nk - n, window=masks.get("window"))
    assert triton_diff.supports(q, k, v, mask, 0.0)
    with torch.no_grad():
        y = triton_diff.diff_attention(q, k, v, lam, 0.3, 0.25, w, norm=True, eps=1e-5, gain=0.7, **masks)
    c = lambda t: t.double().cpu()  # noqa: E731
    yr = triton_diff.reference(c(q), c(k), c(v), [c(t) for t in lam], 0.3, 0.25, c(w), norm=True, eps=1e-5, gain=0.7,
                               **masks)
    assert y.shape == (2, n, 2, 32) and _rel(y, yr) < TOL[torch.float32]
    if n < nk:  # the positions matter: the same queries at the start of the sequence see other keys
        y0 = triton_diff.reference(c(q), c(k[:, :, :, :n]), c(v[:, :, :n]), [c(t) for t in lam], 0.3, 0.25, c(w),
                                   norm=True, eps=1e-5, gain=0.7, **masks)
        assert _rel(y0, yr) > 1e-2
        # with gradients a prefix is not the kernels' (their backward is for square Q/K): torch's ops give them
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        assert not triton_diff.supports(*leaves, mask, 0.0)
        y1 = triton_diff.diff_attention(*leaves, lam, 0.3, 0.25, w, norm=True, eps=1e-5, gain=0.7, **masks)
        gk = torch.autograd.grad(y1.sum(), leaves[1])[0]
        kk = c(k).requires_grad_()
        yk = triton_diff.reference(c(q), kk, c(v), [c(t) for t in lam], 0.3, 0.25, c(w), norm=True, eps=1e-5, gain=0.7,
                                   **masks)
        assert _rel(y1, yr) < TOL[torch.float32] and _rel(gk, torch.autograd.grad(yk.sum(), kk)[0]) < 1e-4


@pytest.mark.parametrize("extra", [{}, {"n_kv_heads": 1, "pairing": "halves"}], ids=str)
def test_decoding_on_the_kernels_when_named_matches_two_sdpa_calls(extra, monkeypatch):
    """model.set_attention_backend("sdpa", "triton"): a prompt after a cached prefix and each decoding step take the
    kernels too (lambda, both maps over the cache, the combine and the head norm in one launch a layer)."""
    calls = []
    real = triton_diff._forward
    monkeypatch.setattr(triton_diff, "_forward", lambda *a, **k: calls.append(a[0].shape[3]) or real(*a, **k))
    model = _model(**extra).eval()
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(4)).to(DEV)

    def run(variant):
        model.set_attention_backend("sdpa", variant)
        cache = model.new_cache(2, 32)
        with torch.no_grad():
            steps = [model(ids[:, :7], cache=cache).logits, model(ids[:, 7:10], cache=cache).logits]
            steps += [model(ids[:, i:i + 1], cache=cache).logits for i in (10, 11)]
        return steps

    got = run("triton")
    assert calls == [7, 7, 3, 3, 1, 1, 1, 1]  # prefill, a prompt after the prefix, two steps: both layers each
    ref = run("2call")
    assert len(calls) == 8
    assert max(_rel(a, b) for a, b in zip(got, ref)) < 1e-5


def test_auto_picks_the_kernels_on_cuda_only_where_triton_runs(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(triton_diff, "available", lambda device: True)
    assert backends.resolve_diff_variant("auto", cuda, dtype=torch.bfloat16) == "triton"
    assert backends.resolve_diff_variant("auto", cuda, dtype=torch.float16) == "triton"
    assert backends.resolve_diff_variant("auto", cuda, dtype=torch.float32) == "2call"  # slower at 16 x 2048
    small = backends.FP32_TRITON_MAX_WORK  # float32 up to the measured 4 x 512 (4 heads) call: the kernels won there
    assert backends.resolve_diff_variant("auto", cuda, dtype=torch.float32, work=small) == "triton"
    assert backends.resolve_diff_variant("auto", cuda, dtype=torch.float32, work=small + 1) == "2call"
    assert backends.resolve_diff_variant("auto", cuda, dtype=torch.bfloat16, work=64 * small) == "triton"
    assert backends.resolve_diff_variant("triton", cuda, dtype=torch.float32) == "triton"
    assert backends.resolve_diff_variant("auto", cuda, dropout_p=0.1) == "2call"
    assert backends.resolve_diff_variant("triton", cuda, dropout_p=0.1) == "2call"
    assert backends.resolve_diff_variant("auto", torch.device("cpu")) == "fused"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # a compiled graph: torch's ops
    assert backends.resolve_diff_variant("auto", cuda, dtype=torch.bfloat16) == "2call"
    monkeypatch.undo()
    monkeypatch.setattr(triton_diff, "available", lambda device: True)
    monkeypatch.setattr(triton_diff, "available", lambda device: False)
    assert backends.resolve_diff_variant("auto", cuda, dtype=torch.bfloat16) == "2call"


def test_supports_names_what_the_kernels_take():
    q, k, v, _, _ = _inputs(1, 2, 2, 16, 16, torch.float32)
    causal = AttnMask(causal=True, n_q=16, n_k=16)
    assert triton_diff.supports(q, k, v, causal, 0.0)
    assert not triton_diff.supports(q, k, v, causal, 0.1)
    assert not triton_diff.supports(q.double(), k.double(), v.double(), causal, 0.0)
    assert triton_diff.supports(q, k, v, AttnMask(causal=True, n_q=16, n_k=16, window=4), 0.0)
    docs = torch.zeros(1, 16, dtype=torch.long, device=DEV)
    assert triton_diff.supports(q, k, v, AttnMask(causal=True, n_q=16, n_k=16, doc_ids=docs), 0.0)
    pad = torch.ones(1, 16, dtype=torch.bool, device=DEV)
    assert not triton_diff.supports(q, k, v, AttnMask(causal=True, n_q=16, n_k=16, key_valid=pad), 0.0)
    assert not triton_diff.supports(q, k, v, AttnMask(causal=False, n_q=16, n_k=16), 0.0)
    q24, k24, v24, _, _ = _inputs(1, 2, 2, 16, 24, torch.float32)
    assert not triton_diff.supports(q24, k24, v24, causal, 0.0)  # a head dim that is not a power of two


@pytest.mark.parametrize("where", ["_forward", "_backward"])
def test_a_failure_of_the_kernels_falls_back_to_torch_ops_with_a_warning(where, monkeypatch):
    """A GPU or Triton version the kernels do not build for: that call's output and gradients through torch's ops
    (``2call``), one warning, and ``auto`` off the kernels for the rest of the process."""
    q, k, v, lam, w = _inputs(1, 2, 2, 24, 16, torch.float32, seed=6)
    _, want, dy = _run(q, k, v, lam, w, True)
    yr, _ = _reference64(q, k, v, lam, w, True, dy)

    def boom(*a, **k):
        raise RuntimeError("PTX not supported here")

    monkeypatch.setattr(triton_diff, where, boom)
    with pytest.warns(RuntimeWarning, match="PTX not supported here"):
        y, got, _ = _run(q, k, v, lam, w, True)
    assert _rel(y, yr) < 2e-5 and max(_rel(a, b) for a, b in zip(got, want)) < 1e-4
    assert not triton_diff.available(DEV)
    assert backends.resolve_diff_variant("auto", torch.device("cuda"), dtype=torch.bfloat16) == "2call"
    triton_diff._FAILED.clear()  # (the fixture's check is for the kernels' own runs)
    assert triton_diff.available(DEV)


@pytest.mark.parametrize("capability,hip,want", [((9, 0), None, True), ((8, 0), None, True), ((7, 5), None, False),
                                                 ((9, 0), "6.2", False)])
def test_the_kernels_are_for_nvidia_gpus_from_ampere_on(capability, hip, want, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    triton_diff._capable.cache_clear()
    try:
        assert triton_diff.available(torch.device("cuda", 0)) is want
    finally:
        triton_diff._capable.cache_clear()


def _docs(b, n, cuts, seed=0):
    """(b, n) document ids: each row's documents end at ``cuts`` (a list per row)."""
    ids = torch.zeros(b, n, dtype=torch.long)
    for r, row in enumerate(cuts):
        for c in row:
            ids[r, c:] += 1
    return ids.to(DEV)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masks", [
    {"doc_ids": [[9, 40], [70]]},                 # packed documents; a document boundary inside a block
    {"doc_ids": [[1, 2, 3]]},                     # one row of ids for the whole batch; documents of one token
    {"window": 7},                                # a sliding window shorter than a block
    {"window": 40},                               # longer than a block: whole blocks skipped before it
    {"doc_ids": [[30], [5, 6]], "window": 12},    # both
], ids=str)
def test_documents_and_windows_match_float64(dtype, masks):
    b, h, hk, n, d = 2, 2, 1, 77, 16
    q, k, v, lam, w = _inputs(b, h, hk, n, d, dtype, seed=7)
    kw = dict(masks)
    if "doc_ids" in kw:
        cuts = kw["doc_ids"]
        kw["doc_ids"] = _docs(len(cuts), n, cuts)
    y, grads, dy = _run(q, k, v, lam, w, True, **kw)
    yr, gr = _reference64(q, k, v, lam, w, True, dy, **kw)
    names = ["y", "q", "k", "v", "lq1", "lk1", "lq2", "lk2", "w"]
    errs = {nm: _rel(a, b) for nm, a, b in zip(names, (y, *grads), (yr, *gr))}
    assert all(e < TOL[dtype] for e in errs.values()), errs
    # the mask is not the plain causal one: the same inputs without it give another output
    y0, _, _ = _run(q, k, v, lam, w, True)
    assert _rel(y0, yr) > 10 * TOL[dtype]


def test_a_model_with_documents_takes_the_kernels_only_when_named(monkeypatch):
    calls = []
    real = triton_diff._forward
    monkeypatch.setattr(triton_diff, "_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _model()
    ids = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(2)).to(DEV)
    doc = torch.tensor([[0] * 10 + [1] * 14, [0] * 24]).to(DEV)
    model.set_attention_backend("sdpa", "triton")
    loss, grads = _loss_and_grads(model, ids, document_ids=doc)
    assert len(calls) == 2
    model.set_attention_backend("sdpa", "2call")
    loss_r, grads_r = _loss_and_grads(model, ids, document_ids=doc)
    assert abs(float(loss - loss_r)) < 1e-5 and max(_rel(grads[n], grads_r[n]) for n in grads_r) < 1e-4
    monkeypatch.setattr(backends, "resolve_diff_variant", lambda *a, **k: "triton")  # what auto picks on a GPU
    model.set_attention_backend("sdpa", "auto")
    model(ids, targets=ids, document_ids=doc)
    assert len(calls) == 2  # auto: documents stay on two SDPA calls (not measured on a GPU yet)
    model(ids, targets=ids)
    assert len(calls) == 4
