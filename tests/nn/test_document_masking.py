"""Document masking: packed documents attend only within themselves, on every backend and attention kind.

The references are independent of the product's masks: an explicit per-entry loop for the mask, the equations
of tests/nn/reference_attention.py under that mask, and each document run on its own.
"""

from __future__ import annotations

import pytest
import torch

from difftx import ModelConfig, build_model, lambda_init_for_layer
from difftx.nn import fused, native
from difftx.nn.attention import make_attention
from difftx.nn.backends import flex_available
from difftx.nn.mask import AttnMask, document_ids, document_positions
from difftx.nn.rope import RotaryEmbedding

from .reference_attention import ref_diff2_attention, ref_diff_attention, ref_softmax_attention

# two rows: three documents (10, 20, 7 tokens), and a 5-token document before a 32-token one
N = 37
DOCS = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [4] * 5 + [9] * 32])


def allowed_docs(doc: torch.Tensor, causal: bool = True, valid=None, q_start: int = 0, n_q=None) -> torch.Tensor:
    """(B, n_q, n_k) by an explicit loop: query t sees key s when s <= t (causal), s is a real token and both are
    in the same document; and always itself."""
    b, n_k = doc.shape
    n_q = n_k - q_start if n_q is None else n_q
    out = torch.zeros(b, n_q, n_k, dtype=torch.bool)
    for bi in range(b):
        for i in range(n_q):
            t = q_start + i
            for s in range(n_k):
                ok = (s <= t or not causal) and int(doc[bi, s]) == int(doc[bi, t])
                if valid is not None:
                    ok = ok and bool(valid[bi, s])
                out[bi, i, s] = ok or s == t
    return out


def test_mask_forms_match_an_explicit_loop():
    valid = torch.ones(2, N, dtype=torch.bool)
    valid[1, -3:] = False
    for causal in (True, False):
        for kv in (None, valid):
            m = AttnMask(causal=causal, n_q=N, n_k=N, key_valid=kv, doc_ids=DOCS)
            assert not m.is_plain_causal and not m.is_empty
            ref = allowed_docs(DOCS, causal, kv)
            assert torch.equal(m.dense(torch.device("cpu"))[:, 0], ref)
            assert torch.equal(m.additive(torch.device("cpu"), torch.float32)[:, 0] == 0, ref)
            for i0, i1 in ((0, 16), (16, 37)):
                ke = min(N, i1) if causal else N
                blk = fused._block_mask(m, i0, i1, ke, torch.device("cpu"))[:, 0, 0, 0]
                assert torch.equal(blk, ref[:, i0:i1, :ke])
    # queries after a cache: the last 5 of the keys
    m = AttnMask(causal=True, n_q=5, n_k=N, q_start=N - 5, doc_ids=DOCS)
    assert torch.equal(m.dense(torch.device("cpu"))[:, 0], allowed_docs(DOCS, q_start=N - 5))


def test_segments_only_for_contiguous_documents_of_a_plain_call():
    m = AttnMask(causal=True, n_q=N, n_k=N, doc_ids=DOCS)
    assert m.segments() == [[(0, 10), (10, 30), (30, 37)], [(0, 5), (5, 37)]]
    assert AttnMask(causal=False, n_q=4, n_k=4, doc_ids=torch.tensor([[7, 7, 7, 7]])).segments() == [[(0, 4)]]
    back = torch.tensor([[0, 0, 1, 1, 0]])  # an id that comes back: not one run per document
    assert AttnMask(causal=True, n_q=5, n_k=5, doc_ids=back).segments() is None
    padded = AttnMask(causal=True, n_q=N, n_k=N, doc_ids=DOCS, key_valid=torch.ones(2, N, dtype=torch.bool))
    assert padded.segments() is None
    assert AttnMask(causal=True, n_q=5, n_k=N, q_start=N - 5, doc_ids=DOCS).segments() is None
    assert AttnMask(causal=True, n_q=N, n_k=N).segments() is None


def test_bad_doc_ids_are_refused():
    with pytest.raises(ValueError, match=r"doc_ids must be an integer tensor \(B, n_k=4\)"):
        AttnMask(causal=True, n_q=4, n_k=4, doc_ids=torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"doc_ids must be an integer tensor \(B, n_k=4\)"):
        AttnMask(causal=True, n_q=4, n_k=4, doc_ids=torch.zeros(1, 5, dtype=torch.long))
    m = AttnMask(causal=True, n_q=4, n_k=4, doc_ids=torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="doc_ids has 3 rows for a batch of 2"):
        m.check(torch.zeros(2, 4, 8), 8)


def test_document_ids_and_positions():
    ids = torch.tensor([[5, 0, 6, 7, 0, 0, 8], [0, 1, 2, 3, 4, 5, 6]])
    # the end-of-text token (0) ends its document; the token after it starts the next
    assert document_ids(ids, 0).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    assert document_positions(document_ids(ids, 0)).tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5]]
    # with padding only the real tokens count (left padding before the first document)
    valid = torch.tensor([[False, False, True, True, True, True, True]])
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    assert document_positions(doc, valid).tolist() == [[0, 0, 0, 1, 0, 1, 2]]


def _module(kind: str, h: int, h_kv: int, dtype=torch.float64):
    head_dim = 8 if dtype == torch.float64 else (16 if kind == "diff" else 32)
    cfg = ModelConfig(attention=kind, d_model=64, n_heads=h, n_kv_heads=h_kv, head_dim=head_dim, n_layers=4,
                      rope_style="interleaved")
    torch.manual_seed(1)
    m = make_attention(cfg, 3).to(dtype)
    with torch.no_grad():  # lambda far from its init, so that a wrong map shows
        for name, p in m.named_parameters():
            if name.startswith("lambda_") and p.dim() == 1:
                p.normal_(0, 0.4)
    return cfg, m


def _rope(cfg, positions, dtype):
    return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_style).cos_sin(positions, dtype)


def _reference(kind, cfg, m, x, positions, allowed):
    p = {k.replace(".weight", ""): v for k, v in m.named_parameters()}
    kw = dict(h=cfg.n_heads, h_kv=cfg.n_kv_heads, d=cfg.head_dim, positions=positions, theta=cfg.rope_theta,
              rope_style=cfg.rope_style, allowed=allowed)
    if kind == "diff":
        return ref_diff_attention(x, p, pairing=cfg.pairing, lambda_init=lambda_init_for_layer(3), **kw)
    if kind == "diff2":
        return ref_diff2_attention(x, p, **kw)
    return ref_softmax_attention(x, p, **kw)


BACKENDS = [("eager", "auto"), ("sdpa", "auto"), ("sdpa", "fused"), ("sdpa", "2call"), ("sdpa", "4call"),
            ("sdpa", "sdpa")]


@pytest.mark.parametrize("kind,h,h_kv", [("softmax", 4, 2), ("diff", 2, 2), ("diff", 4, 1), ("diff2", 2, 1)])
@pytest.mark.parametrize("backend,variant", BACKENDS)
@pytest.mark.parametrize("docs", ["contiguous", "interleaved"])
def test_attention_under_documents_matches_the_equations(kind, h, h_kv, backend, variant, docs):
    """float64 outputs and gradients against SPEC's equations under an explicitly built document mask; the
    interleaved ids (a document that comes back) take the masked blocks instead of one call per document."""
    cfg, m = _module(kind, h, h_kv)
    m.backend, m.diff_variant = backend, variant
    doc = DOCS if docs == "contiguous" else torch.arange(N).remainder(3)[None].expand(2, N) + DOCS
    positions = document_positions(doc)
    x = torch.randn(2, N, cfg.d_model, dtype=torch.float64, requires_grad=True)
    out = m(x, _rope(cfg, positions, torch.float64), AttnMask(causal=True, n_q=N, n_k=N, doc_ids=doc))
    assert_matches(out, _reference(kind, cfg, m, x, positions, allowed_docs(doc)), [x, *m.parameters()])


def assert_matches(out: torch.Tensor, ref: torch.Tensor, params: list, tol: float = 1e-10) -> None:
    """``out`` equals ``ref``, and so do the gradients of a random projection of each for ``params``."""
    assert torch.allclose(out, ref, atol=tol), (out - ref).abs().max()
    w = torch.randn(out.shape, dtype=out.dtype)
    g_out = torch.autograd.grad((out * w).sum(), params, allow_unused=True)
    g_ref = torch.autograd.grad((ref * w).sum(), params, allow_unused=True)
    for a, b in zip(g_out, g_ref):
        if a is None or b is None:
            assert a is None or not a.any()
            continue
        assert torch.allclose(a, b, atol=tol), (a - b).abs().max()


@pytest.mark.skipif(not flex_available(), reason="FlexAttention is not available in this torch")
@pytest.mark.parametrize("kind", ["softmax", "diff", "diff2"])
def test_flex_block_mask_keeps_documents_apart(kind):
    cfg, m = _module(kind, 2, 2)
    x = torch.randn(2, N, cfg.d_model, dtype=torch.float64)
    rope = _rope(cfg, document_positions(DOCS), torch.float64)
    mask = AttnMask(causal=True, n_q=N, n_k=N, doc_ids=DOCS)
    with torch.no_grad():
        m.backend = "flex"
        out = m(x, rope, mask)
        m.backend = "eager"
        ref = m(x, rope, AttnMask(causal=True, n_q=N, n_k=N, doc_ids=DOCS))
    assert torch.allclose(out, ref, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("maps,h,hk,d,lam_kind", [(1, 4, 2, 32, None), (2, 2, 2, 32, "scalar"),
                                                  (2, 2, 1, 32, "rows")])
def test_fused_kernel_packs_documents_for_free(maps, h, hk, d, lam_kind, dtype, monkeypatch):
    """The CPU's fused attention (native kernels where built) runs a packed batch as plain causal calls over
    batches of documents of similar lengths, right-padded: the same values as each document's call alone (to
    rounding), outputs and gradients of q, k, v and lambda; the kernel sees only unmasked calls (softmax; DIFF's
    two maps; V2's per-token lambda with one K for both maps)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, maps, h, N, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(2, 1 if lam_kind == "rows" else maps, hk, N, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(2, hk, N, d * (2 if lam_kind == "scalar" else 1), generator=g).to(dtype).requires_grad_()
    lam = None
    if lam_kind == "scalar":
        lam = torch.tensor(0.6, requires_grad=True)
    elif lam_kind == "rows":
        lam = torch.rand(2, h, N, 1, generator=g).requires_grad_()
    calls = []
    real = fused._FusedAttention.apply

    def spy(q_, k_, v_, lam_, mask, *rest):
        calls.append((q_.shape[0], q_.shape[3], mask.is_plain_causal))
        return real(q_, k_, v_, lam_, mask, *rest)

    monkeypatch.setattr(fused._FusedAttention, "apply", spy)
    inputs = [t for t in (q, k, v, lam) if t is not None]
    out = fused.fused_attention(q, k, v, AttnMask(causal=True, n_q=N, n_k=N, doc_ids=DOCS), 0.3, lam)
    w = torch.randn(out.shape, generator=g).to(dtype)
    grads = torch.autograd.grad((out.float() * w.float()).sum(), inputs)
    # lengths 5 and 7 in one batch (padded to 7), 10 alone, 20 and 32 together (padded to 32)
    assert calls == [(2, 7, True), (1, 10, True), (2, 32, True)]
    # each document alone, from its own copies of the inputs
    ref = torch.empty_like(out)
    ref_grads = [torch.zeros_like(t) for t in inputs]
    for b, spans in enumerate(AttnMask(causal=True, n_q=N, n_k=N, doc_ids=DOCS).segments()):
        for s0, s1 in spans:
            parts = [q[b:b + 1, :, :, s0:s1], k[b:b + 1, :, :, s0:s1], v[b:b + 1, :, s0:s1]]
            if lam is not None:
                parts.append(lam if lam.dim() == 0 else lam[b:b + 1, :, s0:s1])
            parts = [t.detach().clone().requires_grad_() for t in parts]
            lam_p = parts[3] if lam is not None else None
            o = fused.fused_attention(parts[0], parts[1], parts[2], AttnMask(causal=True, n_q=s1 - s0, n_k=s1 - s0),
                                      0.3, lam_p)
            ref[b, s0:s1] = o.detach()[0]
            gs = torch.autograd.grad((o.float() * w[b:b + 1, s0:s1].float()).sum(), parts)
            ref_grads[0][b, :, :, s0:s1] = gs[0][0]
            ref_grads[1][b, :, :, s0:s1] = gs[1][0]
            ref_grads[2][b, :, s0:s1] = gs[2][0]
            if lam is not None and lam.dim() == 0:
                ref_grads[3] += gs[3]
            elif lam is not None:
                ref_grads[3][b, :, s0:s1] = gs[3][0]
    assert torch.equal(out.detach(), ref)
    for i, (a, r) in enumerate(zip(grads, ref_grads)):
        if i == 3 and lam.dim() == 0:  # one scalar summed over the documents: in another order
            assert torch.allclose(a, r, rtol=1e-5)
        else:
            assert torch.equal(a, r), i


@pytest.mark.parametrize("kind", ["softmax", "diff", "diff2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_step_over_documents(kind, dtype, monkeypatch):
    """One query after a cache (the native decoding kernel where built): only its own document's keys, as the
    eager reference's dense mask says."""
    from difftx.nn import backends

    taken = []
    real = backends.native_diff_decode
    monkeypatch.setattr(backends, "native_diff_decode", lambda *a, **k: taken.append(1) or real(*a, **k))
    cfg, m = _module(kind, 2, 2, dtype)
    m.eval()
    x = torch.randn(2, N, cfg.d_model, dtype=dtype)
    positions = torch.arange(N)[None].expand(2, N)
    outs = {}
    for backend in ("eager", "sdpa"):
        m.backend = backend
        cache = build_model(cfg.replace(vocab_size=8, max_seq_len=64)).new_cache(2, 64, dtype=dtype)
        with torch.no_grad():
            m(x[:, :-1], _rope(cfg, positions[:, :-1], dtype),
              AttnMask(causal=True, n_q=N - 1, n_k=N - 1, doc_ids=DOCS[:, :-1]), cache)
            cache.advance(N - 1)
            outs[backend] = m(x[:, -1:], _rope(cfg, positions[:, -1:], dtype),
                              AttnMask(causal=True, n_q=1, n_k=N, q_start=N - 1, doc_ids=DOCS), cache)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(outs["sdpa"].float(), outs["eager"].float(), atol=tol)
    assert bool(taken) == native.supports(dtype, torch.device("cpu"))
    # and the step does see the other document's keys without the mask
    with torch.no_grad():
        m.backend = "eager"
        cache = build_model(cfg.replace(vocab_size=8, max_seq_len=64)).new_cache(2, 64, dtype=dtype)
        m(x[:, :-1], _rope(cfg, positions[:, :-1], dtype), AttnMask(causal=True, n_q=N - 1, n_k=N - 1), cache)
        cache.advance(N - 1)
        plain = m(x[:, -1:], _rope(cfg, positions[:, -1:], dtype), AttnMask(causal=True, n_q=1, n_k=N, q_start=N - 1),
                  cache)
    assert not torch.allclose(plain.float(), outs["eager"].float(), atol=tol)


@pytest.mark.parametrize("kind", ["softmax", "diff", "diff2"])
@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_model_scores_packed_documents_as_if_each_were_alone(kind, positions):
    cfg = ModelConfig(attention=kind, d_model=64, n_heads=2, n_layers=2, vocab_size=50, max_seq_len=64,
                      positions=positions)
    torch.manual_seed(0)
    model = build_model(cfg).double()
    ids = torch.randint(1, 50, (2, 40))
    ids[0, 9] = ids[0, 25] = ids[1, 2] = 0  # end-of-text tokens
    doc = document_ids(ids, 0)
    packed = model(ids, document_ids=doc).logits
    for b in range(2):
        for d in doc[b].unique():
            idx = (doc[b] == d).nonzero().flatten()
            s0, s1 = int(idx[0]), int(idx[-1]) + 1
            alone = model(ids[b:b + 1, s0:s1]).logits[0]
            assert torch.allclose(packed[b, s0:s1], alone, atol=1e-10)
    # without the mask the later documents see the earlier ones
    assert not torch.allclose(model(ids).logits[0, 10:], packed[0, 10:], atol=1e-3)


def test_model_refuses_bad_document_ids():
    model = build_model(ModelConfig(d_model=32, n_heads=2, n_layers=1, vocab_size=16, max_seq_len=16))
    ids = torch.randint(0, 16, (2, 6))
    with pytest.raises(ValueError, match=r"document_ids must be integer ids of input_ids' shape \(2, 6\)"):
        model(ids, document_ids=torch.zeros(2, 6))
    with pytest.raises(ValueError, match=r"document_ids must be integer ids of input_ids' shape \(2, 6\)"):
        model(ids, document_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="decoding with a KV cache takes one document per sequence"):
        model(ids, document_ids=torch.zeros(2, 6, dtype=torch.long), cache=model.new_cache(2, 16))


def test_logit_quantization_scales_come_from_the_querys_own_document():
    """The attention-logit quantization eval sets its scales from the logits a query may see: under a document
    mask, only its own document's."""
    from difftx.evals.quant import scale_entries

    m = AttnMask(causal=True, n_q=N, n_k=N, doc_ids=DOCS)
    assert torch.equal(scale_entries(m, N, N, torch.device("cpu"))[:, 0], allowed_docs(DOCS))


@pytest.mark.parametrize("kind", ["softmax", "diff", "diff2"])
def test_second_derivatives_through_packed_documents(kind):
    """A Hessian-vector product (create_graph=True) through the batched documents of the fused path equals the
    eager reference's under the dense document mask."""
    cfg = ModelConfig(attention=kind, d_model=64, n_heads=2, n_layers=2, vocab_size=50, max_seq_len=64)
    torch.manual_seed(0)
    model = build_model(cfg).double()
    ids = torch.randint(1, 50, (2, 40))
    ids[0, 9] = ids[0, 25] = ids[1, 2] = 0
    doc = document_ids(ids, 0)
    hvps = {}
    for backend in ("sdpa", "eager"):
        model.set_attention_backend(backend)
        params = list(model.parameters())
        grads = torch.autograd.grad(model(ids, targets=ids, document_ids=doc).loss, params, create_graph=True)
        hv = torch.autograd.grad(sum(g.sum() for g in grads), params, allow_unused=True)
        hvps[backend] = torch.cat([h.flatten() for h in hv if h is not None])
    assert torch.allclose(hvps["sdpa"], hvps["eager"], atol=1e-11)
