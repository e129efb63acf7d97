"""difftx.nn.linear: Linear / project against torch's F.linear autograd (forward, every gradient, dtypes),
the transposing kernels against torch's transpose, and the fallbacks (hooks, frozen weights, no AMX)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from difftx.nn import linear as L
from difftx.nn import native

from .test_native import needs_amx, needs_bf16_linear, needs_native


@pytest.fixture(autouse=True)
def _torchs_float32_gemm(monkeypatch):
    """These tests compare float32 bits with F.linear: torch's GEMM for the float32 products (ONEDNN_FP32 off, as
    on CPUs other than AMD's with AVX-512); the oneDNN tests at the end turn it on themselves."""
    monkeypatch.setattr(L, "ONEDNN_FP32", False)


def _layers(widths, d_in, bias, seed=0):
    torch.manual_seed(seed)
    return [L.Linear(d_in, w, bias=bias) for w in widths]


def _reference(x, layers, dtype, autocast):
    """Outputs and gradients by plain F.linear + autograd (torch's own path), with the same loss."""
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ys = [F.linear(x, m.weight, m.bias) for m in layers]
    loss = sum((y.float() * torch.linspace(-1, 1, y.shape[-1])).sum() for y in ys)
    grads = torch.autograd.grad(loss, [x] + [p for m in layers for p in m.parameters()])
    return ys, grads


def _ours(x, layers, autocast):
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ys = L.project(x, layers) if len(layers) > 1 else [layers[0](x)]
    loss = sum((y.float() * torch.linspace(-1, 1, y.shape[-1])).sum() for y in ys)
    grads = torch.autograd.grad(loss, [x] + [p for m in layers for p in m.parameters()])
    return ys, grads


@pytest.mark.parametrize("widths", [[48], [48, 16, 32]])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_training_path_matches_torch(widths, bias):
    layers = _layers(widths, 24, bias)
    x = torch.randn(2, 7, 24)
    assert L._training_dtype(x, layers[0].weight) == torch.float32
    ys_ref, g_ref = _reference(x, layers, torch.float32, autocast=False)
    ys, g = _ours(x, layers, autocast=False)
    for a, b in zip(ys, ys_ref):
        assert torch.equal(a, b)  # the same F.linear
    for a, b in zip(g, g_ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # dx: addmm_ accumulation vs separate adds


def _f64_grads(x, layers):
    x = x.detach().double().requires_grad_(True)
    ys = [F.linear(x, m.weight.double(), None if m.bias is None else m.bias.double()) for m in layers]
    loss = sum((y * torch.linspace(-1, 1, y.shape[-1], dtype=torch.float64)).sum() for y in ys)
    return torch.autograd.grad(loss, [x] + [p for m in layers for p in m.parameters()])


@needs_bf16_linear
@pytest.mark.parametrize("widths,d_in", [([96], 64), ([64], 96), ([64, 64, 128], 64), ([160, 160], 64),
                                         ([40, 24], 56)])  # the last: shapes the kernels do not take
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_autocast_path_matches_torch(widths, d_in, bias):
    """Under autocast: the same bf16 outputs as torch's; every gradient in its parameter's dtype and as close
    to float64 as torch's own (the same bf16 GEMMs with fp32 accumulation, other operand layouts)."""
    layers = _layers(widths, d_in, bias)
    x = torch.randn(4, 64, d_in)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert L._training_dtype(x, layers[0].weight) == torch.bfloat16
    ys_ref, g_ref = _reference(x, layers, torch.bfloat16, autocast=True)
    ys, g = _ours(x, layers, autocast=True)
    for a, b in zip(ys, ys_ref):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    exact = _f64_grads(x, layers)
    for a, b, e in zip(g, g_ref, exact):
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        err = ((a.double() - e).norm() / e.norm()).item()
        err_ref = ((b.double() - e).norm() / e.norm()).item()
        assert err <= 1.25 * err_ref + 1e-4, (err, err_ref)


@needs_bf16_linear
def test_bf16_weights_without_autocast():
    """A model cast to bf16 (no autocast) takes the path too; its gradients come back in bf16."""
    layers = [m.to(torch.bfloat16) for m in _layers([64, 32], 64, False)]
    x = torch.randn(2, 64, 64).bfloat16()
    assert L._training_dtype(x, layers[0].weight) == torch.bfloat16
    _, g_ref = _reference(x, layers, torch.bfloat16, autocast=False)
    _, g = _ours(x, layers, autocast=False)
    for a, b in zip(g, g_ref):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_inference_and_other_dtypes_are_plain_f_linear():
    layer = _layers([8], 4, True)[0]
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert L._training_dtype(x, layer.weight) is None
    assert L._training_dtype(x.double(), layer.weight.double()) is None
    layer.weight.requires_grad_(False)
    assert L._training_dtype(x, layer.weight) is None
    with torch.autocast("cpu", dtype=torch.float16):
        assert L._training_dtype(x, _layers([8], 4, True)[0].weight) is None
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    state = layer.state_dict()
    plain = nn.Linear(4, 8)
    plain.load_state_dict(state)  # the same parameters and state dict as nn.Linear
    assert torch.equal(plain(x), layer(x))


def test_project_calls_hooked_or_wrapped_modules_one_by_one():
    layers = _layers([8, 8], 4, False)
    seen = []
    layers[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    x = torch.randn(2, 4, requires_grad=True)
    ys = L.project(x, layers)
    assert seen == [torch.Size([2, 8])]
    assert all(torch.equal(y, F.linear(x, m.weight)) for y, m in zip(ys, layers))

    grads_seen = []
    hooked = _layers([8, 8], 4, False)
    hooked[0].register_full_backward_hook(lambda m, gi, go: grads_seen.append(go[0].shape))
    sum(y.sum() for y in L.project(x, hooked)).backward()
    assert grads_seen == [torch.Size([2, 8])]

    class Scaled(L.Linear):  # a subclass overriding forward (a LoRA-style wrapper) is called as itself
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    mixed = [L.Linear(4, 8, bias=False), Scaled(4, 8, bias=False)]
    ys = L.project(x, mixed)
    assert torch.equal(ys[1], 2 * F.linear(x, mixed[1].weight))


def test_project_with_a_frozen_projection():
    layers = _layers([16, 8], 12, True)
    layers[0].weight.requires_grad_(False)
    layers[0].bias.requires_grad_(False)
    x = torch.randn(5, 12, requires_grad=True)
    ys = L.project(x, layers)
    (ys[0].sum() + (ys[1] ** 2).sum()).backward()
    assert layers[0].weight.grad is None and layers[0].bias.grad is None
    xr = x.detach().clone().requires_grad_(True)
    w1, b1 = layers[1].weight.detach().clone().requires_grad_(True), layers[1].bias.detach().clone().requires_grad_(True)
    (F.linear(xr, layers[0].weight, layers[0].bias).sum() + (F.linear(xr, w1, b1) ** 2).sum()).backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(layers[1].weight.grad, w1.grad)
    torch.testing.assert_close(layers[1].bias.grad, b1.grad)


@needs_amx
@pytest.mark.parametrize("rows,cols,pad", [(64, 48, 0), (96, 32, 32), (2048, 512, 32)])
def test_transpose_kernels_are_exact(rows, cols, pad):
    x = torch.randn(rows, cols + 16).bfloat16()[:, :cols]  # rows strided: the kernel reads x.stride(0)
    t = native.transpose_bf16(x, pad=pad)
    assert t.shape == (cols, rows) and t.stride() == (rows + pad, 1) and torch.equal(t, x.t())
    t32 = native.transpose_bf16(x, dtype=torch.float32)
    assert t32.is_contiguous() and torch.equal(t32, x.t().float())


def _count_mm(monkeypatch, calls):
    """Record the output shape of every torch.mm / torch.addmm called with ``out=`` (None without)."""
    mm, addmm = torch.mm, torch.addmm

    def counted_mm(x, y, **kw):
        calls.append(tuple(kw["out"].shape) if "out" in kw else None)
        return mm(x, y, **kw)

    def counted_addmm(b, x, y, **kw):
        calls.append(tuple(kw["out"].shape) if "out" in kw else None)
        return addmm(b, x, y, **kw)

    monkeypatch.setattr(torch, "mm", counted_mm)
    monkeypatch.setattr(torch, "addmm", counted_addmm)


@pytest.mark.parametrize("m,k,n,split", [
    (512, 256, 512, "rows"), (384, 256, 512, "rows"), (512, 256, 384, "rows"), (384, 256, 384, None),
    (512, 256, 256, None), (544, 256, 512, None), (512, 256, 544, None), (400, 256, 512, None),
    (512, 2048, 1408, "cols"), (512, 1024, 1408, None), (512, 2048, 1536, None)])
def test_weight_grad_product_by_halves_on_two_threads(m, k, n, split, monkeypatch):
    """_mm (a weight gradient's GEMM) on two threads: outputs from 384 x 512 to 512 x 512 (rows a multiple of
    32) run as two row halves, the products in _WGRAD_COLUMN_HALVES as two column halves, each half exactly
    torch's product of that half; everything else, and everything on one thread, is torch's whole product."""
    assert ((m, k, n) in L._WGRAD_COLUMN_HALVES) == (split == "cols")
    torch.manual_seed(0)
    a = torch.randn(m, k + 32).bfloat16()[:, :k]  # the transposing kernel's padded rows, as in the step
    b = torch.randn(k, n).bfloat16()
    calls = []
    _count_mm(monkeypatch, calls)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(L._mm(a, b), a @ b) and not calls
        torch.set_num_threads(2)
        out = L._mm(a, b)
        if split == "rows":
            h = m // 2
            assert calls == [(h, n), (m - h, n)]
            assert torch.equal(out, torch.cat([a[:h] @ b, a[h:] @ b]))
        elif split == "cols":
            h = n // 2
            assert calls == [(m, h), (m, n - h)]
            assert torch.equal(out, torch.cat([a @ b[:, :h], a @ b[:, h:]], 1))
        else:
            assert not calls and torch.equal(out, a @ b)
        exact = a.double() @ b.double()
        assert ((out.double() - exact).norm() / exact.norm()).item() < 1e-2
    finally:
        torch.set_num_threads(before)


@needs_amx
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens,split", [(2048, True), (1024, False)])
def test_forward_product_by_column_halves_on_two_threads(tokens, split, bias, monkeypatch):
    """The training forward of a 512 -> 1408 Linear under autocast: at 2048 tokens on two threads (a product in
    _FORWARD_COLUMN_HALVES) it runs as two halves of the weight's rows, each exactly F.linear of that half, and
    its gradients match torch's; at other token counts, and on one thread, it is F.linear itself."""
    assert ((tokens, 512, 1408) in L._FORWARD_COLUMN_HALVES) == split
    layer = _layers([1408], 512, bias)[0]
    x = torch.randn(4, tokens // 4, 512)
    w, b = layer.weight.bfloat16(), None if layer.bias is None else layer.bias.bfloat16()
    h = 704
    halves = torch.cat([F.linear(x.bfloat16(), w[:h], None if b is None else b[:h]),
                        F.linear(x.bfloat16(), w[h:], None if b is None else b[h:])], -1)
    calls = []
    _count_mm(monkeypatch, calls)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        torch.set_num_threads(2)
        (y,), g = _ours(x, [layer], autocast=True)
        fwd_calls = [c for c in calls if c is not None and c[-1] in (h, 1408 - h) and c[0] == tokens]
        assert len(fwd_calls) == (2 if split else 0)
        assert y.dtype == torch.bfloat16 and y.shape == (4, tokens // 4, 1408)
        assert torch.equal(y, halves if split else F.linear(x.bfloat16(), w, b))
        _, g_ref = _reference(x, [layer], torch.bfloat16, autocast=True)
        exact = _f64_grads(x, [layer])
        for a, r, e in zip(g, g_ref, exact):
            err = ((a.double() - e).norm() / e.norm()).item()
            err_ref = ((r.double() - e).norm() / e.norm()).item()
            assert err <= 1.25 * err_ref + 1e-4, (err, err_ref)
    finally:
        torch.set_num_threads(before)


@needs_native
def test_transpose_kernels_decline_what_they_do_not_take():
    assert native.transpose_bf16(torch.randn(48, 32).bfloat16()) is None  # rows not a multiple of 32
    assert native.transpose_bf16(torch.randn(64, 24).bfloat16()) is None  # columns not of 16
    assert native.transpose_bf16(torch.randn(24, 32).bfloat16(), dtype=torch.float32) is None
    assert native.transpose_bf16(torch.randn(64, 32)) is None  # float32 input
    assert native.transpose_bf16(torch.randn(32, 64).bfloat16().t()) is None  # column stride not 1


def test_torch_func_and_second_derivatives_in_float32():
    """torch.func transforms see plain F.linear; create_graph=True differentiates through the float32 path."""
    torch.manual_seed(0)
    m = L.Linear(4, 3)
    x = torch.randn(5, 4)
    params = dict(m.named_parameters())
    g = torch.func.grad(lambda p: torch.func.functional_call(m, p, (x,)).pow(2).sum())(params)
    gr = torch.autograd.grad(F.linear(x, m.weight, m.bias).pow(2).sum(), [m.weight, m.bias])
    torch.testing.assert_close(g["weight"], gr[0])
    torch.testing.assert_close(g["bias"], gr[1])

    layers = _layers([6, 5], 4, True)
    xs = torch.randn(3, 4, requires_grad=True)
    outs = L.project(xs, layers)
    (gx,) = torch.autograd.grad(sum(o.pow(2).sum() for o in outs), xs, create_graph=True)
    (ggw,) = torch.autograd.grad(gx.pow(2).sum(), layers[1].weight)
    xr = xs.detach().clone().requires_grad_(True)
    (gxr,) = torch.autograd.grad(sum(F.linear(xr, m.weight, m.bias).pow(2).sum() for m in layers), xr,
                                 create_graph=True)
    (ggwr,) = torch.autograd.grad(gxr.pow(2).sum(), layers[1].weight)
    torch.testing.assert_close(gx, gxr)
    torch.testing.assert_close(ggw, ggwr)


@needs_bf16_linear
def test_bf16_second_derivative_refused_in_one_line():
    layers = _layers([64, 32], 64, False)
    x = torch.randn(2, 32, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = L.project(x, layers)
    with pytest.raises(RuntimeError, match="DIFFTX_NATIVE=0"):
        torch.autograd.grad(sum(o.float().sum() for o in outs), x, create_graph=True)


@needs_native
def test_few_rows_inference_takes_the_native_product_only_where_it_applies(monkeypatch):
    """``linear`` (Linear's and the LM head's inference product): float32 with at most FEW_ROWS rows and no
    gradient wanted runs native.few_rows_linear (F.linear's values to float32 rounding); with a gradient
    wanted, more rows, bfloat16, autocast or the native kernels off it is F.linear itself (the same bits)."""
    calls = []
    real = native.few_rows_linear
    monkeypatch.setattr(native, "few_rows_linear", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(L, "FEW_ROWS", 8)  # the AMD default; off by default elsewhere
    g = torch.Generator().manual_seed(0)
    layer = L.Linear(96, 40)
    x = torch.randn(2, 4, 96, generator=g)  # 8 rows
    with torch.no_grad():
        y = layer(x)
        assert calls == [1]
        torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    # a gradient wanted (the weight's, then x's only)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    frozen = L.Linear(96, 40).requires_grad_(False)
    xg = x.clone().requires_grad_(True)
    assert torch.equal(frozen(xg), F.linear(xg, frozen.weight, frozen.bias))
    with torch.no_grad():
        x9 = torch.randn(9, 96, generator=g)
        assert torch.equal(layer(x9), F.linear(x9, layer.weight, layer.bias))
        xb, lb = x.bfloat16(), L.Linear(96, 40).bfloat16()
        assert torch.equal(lb(xb), F.linear(xb, lb.weight, lb.bias))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        monkeypatch.setattr(native, "ENABLED", False)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert calls == [1]


def test_few_rows_default_is_on_for_amd_cpus_only(monkeypatch):
    """Measured faster than torch's GEMM on an AMD EPYC only: the default is 8 rows there and off elsewhere."""
    for vendor, rows in (("AuthenticAMD", 8), ("GenuineIntel", 0), ("", 0)):
        monkeypatch.setattr(native, "cpu_vendor", lambda v=vendor: v)
        assert L._default_few_rows() == rows
    monkeypatch.setattr(L, "FEW_ROWS", 0)
    x, layer = torch.randn(4, 96), L.Linear(96, 40)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@needs_native
@pytest.mark.parametrize("attention", ["softmax", "diff"])
def test_cached_decoding_with_the_few_row_kernel_matches_f_linear(monkeypatch, attention):
    """A model's cached decoding steps (4 sequences: 4-row projections and LM head) through the few-row kernel
    give F.linear's logits to float32 rounding.  (Whole decoding is not batch-invariant: the prefill's GEMMs
    and the attention round by batch size; only the few-row products themselves are, test_native.py.)"""
    from difftx import ModelConfig
    from difftx.models import build_model

    calls = []
    real = native.few_rows_linear
    monkeypatch.setattr(native, "few_rows_linear", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    cfg = ModelConfig(attention=attention, d_model=64, n_heads=2, n_layers=2, vocab_size=50, max_seq_len=32,
                      tie_embeddings=False)
    model = build_model(cfg).eval()
    prompt = torch.randint(0, 50, (4, 9))

    def decode(rows, ids):
        monkeypatch.setattr(L, "FEW_ROWS", rows)
        with torch.no_grad():
            cache = model.new_cache(ids.shape[0], 16)
            logits = model(ids, cache=cache).logits[:, -1:]
            out = []
            for t in range(4):
                logits = model(torch.full((ids.shape[0], 1), t + 3), cache=cache).logits
                out.append(logits)
        return torch.cat(out, 1)

    ref = decode(0, prompt)
    assert not calls
    got = decode(8, prompt)
    assert len(calls) == 4 * (2 * 7 + 1)  # each step: q, k, v, o, gate, up, down in 2 layers, and the head
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_wrapped_or_hooked_lm_head_still_runs_its_own_forward(monkeypatch):
    """The LM head takes ``linear`` only as a plain nn.Linear without hooks; a subclass (a LoRA-style wrapper)
    or a hooked head runs its own forward, decoding's few rows included."""
    from difftx import ModelConfig
    from difftx.models import build_model

    monkeypatch.setattr(L, "FEW_ROWS", 8)

    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=32, n_heads=2, n_layers=1, vocab_size=40, max_seq_len=16,
                                    tie_embeddings=False)).eval()
    h = torch.randn(2, 1, 32)
    plain = model.lm_head
    with torch.no_grad():
        torch.testing.assert_close(model.head(h), F.linear(h, plain.weight), rtol=1e-5, atol=1e-6)
        model.lm_head = Doubled(32, 40, bias=False)
        model.lm_head.weight.copy_(plain.weight)
        torch.testing.assert_close(model.head(h), 2 * F.linear(h, plain.weight), rtol=1e-5, atol=1e-6)
        model.lm_head = plain
        handle = plain.register_forward_hook(lambda m, args, out: out + 1)
        torch.testing.assert_close(model.head(h), F.linear(h, plain.weight) + 1, rtol=1e-5, atol=1e-6)
        handle.remove()


needs_dot_linear = pytest.mark.skipif(not native.dot_linear(),
                                      reason="the bf16 dot-product Linear kernels need AVX512-BF16 without AMX")


def _bf16_exact(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in float64 of the bfloat16-rounded operands: what a bf16 GEMM with float32 sums approximates to
    within its float32 rounding."""
    return a.bfloat16().double() @ b.bfloat16().double()


@needs_dot_linear
@pytest.mark.parametrize("m,k,n", [(256, 64, 96), (77, 96, 32), (5, 32, 64), (130, 128, 160),
                                   (70, 48, 80), (33, 16, 16), (9, 80, 48)])  # odd multiples of 16 of k and n
@pytest.mark.parametrize("threads", [1, 2])
def test_dot_kernels_against_float64(m, k, n, threads):
    """pack_wt / pack_rows / dot_mm: float32 outputs within float32 summation error of the float64 product
    of the bf16-rounded operands (remainder rows of the 8-row block and of a thread's 64-row task included;
    a contraction or a width that is an odd multiple of 16: half a tile, one strip of 16 columns), bf16
    outputs that exact value rounded once, and the packing's rounding of float32 = torch's .bfloat16()."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(m + k + n)
        x = torch.randn(m, k, generator=g).bfloat16()
        w = torch.randn(n, k, generator=g)  # a float32 weight, packed as W^T
        w2 = torch.randn(k, n, generator=g)  # packed over its rows
        bias = torch.randn(n, generator=g)
        for bp, b in ((native.pack_wt(w), w.t()), (native.pack_rows(w2, k), w2), (native.pack_wt(w.bfloat16()), w.t())):
            out = torch.empty(m, n)
            assert native.dot_mm(x, bp, n, out)
            bound = k * 2.0 ** -23 * (x.double().abs() @ b.bfloat16().double().abs())  # float32 sums' error bound
            assert ((out.double() - _bf16_exact(x, b)).abs() <= bound).all()
            ob = torch.empty(m, n, dtype=torch.bfloat16)
            assert native.dot_mm(x, bp, n, ob, bias=bias)
            assert torch.equal(ob, (out + bias).bfloat16())  # one rounding of the same float32 sums
            add = torch.randn(m, n, generator=g)
            assert native.dot_mm(x, bp, n, ob, add=add)  # sums from add: float32 order differs, within half an ulp
            torch.testing.assert_close(ob.float(), out + add, rtol=2.0 ** -8 * 1.01, atol=1e-5)
            acc = add.clone()
            assert native.dot_mm(x, bp, n, acc, add=acc)
            torch.testing.assert_close(acc, out + add, rtol=1e-6, atol=1e-5)
        # the float32 packing rounds as torch does: packing w's bf16 copy gives the same bits
        assert torch.equal(native.pack_wt(w), native.pack_wt(w.bfloat16()))
        # rows past the matrix are zero: a padded contraction gives the unpadded product
        rows = native.pack_rows(w2[: k - 3], k)
        out = torch.empty(m, n)
        assert native.dot_mm(x, rows, n, out)
        torch.testing.assert_close(out.double(), _bf16_exact(x[:, : k - 3], w2[: k - 3]), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


@needs_dot_linear
def test_float32_packing_rounds_specials_as_torch_does():
    """pack_wt and pack_rows round float32 to bf16 as torch's .bfloat16() does, bit for bit, also for subnormals,
    ties, the largest finite values and infinities, and NaN to a NaN (vcvtne2ps2bf16 would flush the
    subnormals: vectors that hold one take the integer path), in vectors of specials, specials among normals,
    and normals alone."""
    from .test_native import _special_bf16_values

    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 96, generator=g)
    bits = _special_bf16_values().float().view(torch.int32)
    specials = torch.cat([bits, bits | 0x7FFF, bits | 0x8000, bits + 0x8001]).view(torch.float32)  # around ties
    specials[specials.isnan()] = float("nan")  # torch writes every NaN as 0x7FC0: a quiet NaN alone
    w[3, :64] = specials
    w[10, 40] = specials[0]  # one subnormal among normals
    w[20:22, 32:96:7] = float("inf")
    for got, want in ((native.pack_wt(w), native.pack_wt(w.bfloat16())),
                      (native.pack_rows(w, 64), native.pack_rows(w.bfloat16(), 64))):
        nan = want.isnan()
        assert nan.any() and torch.equal(got.isnan(), nan)  # (torch's vectorised cast writes 0xFFFF)
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@needs_dot_linear
def test_dot_kernels_bitwise_the_same_on_one_and_two_threads():
    x = torch.randn(300, 256).bfloat16()
    bp = native.pack_wt(torch.randn(224, 256))
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.empty(300, 224)
            assert native.dot_mm(x, bp, 224, out)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(*outs)


@needs_dot_linear
@pytest.mark.parametrize("m,k,n", [(256, 64, 96), (64, 48, 80), (32, 16, 16), (96, 176, 48)])
@pytest.mark.parametrize("threads", [1, 2])
def test_dot_kernels_pack_a_and_a_packed_operand(m, k, n, threads):
    """dot_mm's pack_a writes pack_rows(a) bit for bit beside the same product (one row block shared by two
    threads' column blocks included), and dot_mm_t on that packed operand (dY^T X with no transpose of dY) gives
    the bits of the product on the transposed copy, within float32 summation error of the float64 product."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(m + k + n)
        a = torch.randn(m, k, generator=g).bfloat16()
        bp = native.pack_wt(torch.randn(n, k, generator=g))
        plain, out = torch.empty(m, n, dtype=torch.bfloat16), torch.empty(m, n, dtype=torch.bfloat16)
        pa = torch.full((native.packed_rows_numel(m, k),), float("nan"), dtype=torch.bfloat16)
        assert native.dot_mm(a, bp, n, plain) and native.dot_mm(a, bp, n, out, pack_a=pa)
        assert torch.equal(out, plain) and torch.equal(pa, native.pack_rows(a, m))
        x = torch.randn(m, n, generator=g).bfloat16()  # the other operand over the same m rows
        xp = native.pack_rows(x, m)
        for dtype in (torch.float32, torch.bfloat16):
            dw, ref = torch.empty(k, n, dtype=dtype), torch.empty(k, n, dtype=dtype)
            assert native.dot_mm_t(pa, m, k, xp, n, dw)
            assert native.dot_mm(a.t().contiguous(), xp, n, ref)
            assert torch.equal(dw, ref)
        bound = m * 2.0 ** -23 * (a.double().abs().t() @ x.double().abs())
        dw = torch.empty(k, n)
        assert native.dot_mm_t(pa, m, k, xp, n, dw)
        assert ((dw.double() - a.double().t() @ x.double()).abs() <= bound).all()
    finally:
        torch.set_num_threads(before)


@needs_dot_linear
@pytest.mark.parametrize("m,ks,n", [(70, (512, 48, 16), 96), (64, (64, 176), 48), (256, (32, 32, 32, 32), 16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_dot_mm_sum_gives_the_bits_of_the_chained_products(m, ks, n, threads):
    """dot_mm_sum (dx of several projections: their products summed in registers, written once) equals the
    chain of dot_mm calls that pass float32 sums on with ``add`` bit for bit, into float32 or bfloat16, rows not a
    multiple of 8 and contractions an odd multiple of 16 included; its pack_a writes pack_rows of each a."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(m + n + len(ks))
        a_list = [torch.randn(m, k, generator=g).bfloat16() for k in ks]
        bps = [native.pack_rows(torch.randn(k, n, generator=g), k) for k in ks]
        sums = torch.empty(m, n)
        for i, (a, bp) in enumerate(zip(a_list, bps)):
            assert native.dot_mm(a, bp, n, sums, add=sums if i else None)
        last = torch.empty(m, n, dtype=torch.bfloat16)  # the chain's bf16 end: the last product rounds once
        before_last = torch.empty(m, n)
        for i, (a, bp) in enumerate(zip(a_list[:-1], bps[:-1])):
            assert native.dot_mm(a, bp, n, before_last, add=before_last if i else None)
        assert native.dot_mm(a_list[-1], bps[-1], n, last, add=before_last)
        for dtype, want in ((torch.float32, sums), (torch.bfloat16, last)):
            got = torch.full((m, n), float("nan"), dtype=dtype)
            packs = [torch.full((native.packed_rows_numel(m, k),), float("nan"), dtype=torch.bfloat16) if m % 32 == 0
                     else None for k in ks]
            assert native.dot_mm_sum(a_list, bps, n, got, pack_a=packs)
            assert torch.equal(got, want)
            for a, pa in zip(a_list, packs):
                assert pa is None or torch.equal(pa, native.pack_rows(a, m))
        assert not native.dot_mm_sum(a_list, bps[:-1], n, torch.empty(m, n))  # lists of different lengths
        assert not native.dot_mm_sum([], [], n, torch.empty(m, n))
        assert not native.dot_mm_sum(a_list, [None] * len(ks), n, torch.empty(m, n))  # pack_rows declined a width
        assert not native.dot_mm_sum(a_list, bps, n, torch.empty(m, n + 16))  # out of the wrong shape
    finally:
        torch.set_num_threads(before)


@needs_dot_linear
@pytest.mark.parametrize("rows,cols", [(64, 48), (96, 32), (2048, 512)])
def test_the_dot_paths_transpose_is_exact(rows, cols):
    """transpose_rows_bf16 runs the transpose kernel on a CPU with AVX512-BF16 and no AMX, where
    test_transpose_kernels_are_exact (AMX's transpose_bf16) skips: x^T exactly, contiguous, from strided rows."""
    x = torch.randn(rows, cols + 16).bfloat16()[:, :cols]  # rows strided: the kernel reads x.stride(0)
    t = native.transpose_rows_bf16(x)
    assert t is not None and t.shape == (cols, rows) and t.is_contiguous() and torch.equal(t, x.t())


@needs_dot_linear
def test_dot_kernels_decline_what_they_do_not_take():
    assert native.pack_wt(torch.randn(40, 64)) is None  # rows not a multiple of 16
    assert native.pack_wt(torch.randn(64, 40)) is None
    assert native.pack_wt(torch.randn(64, 64).double()) is None
    assert native.pack_rows(torch.randn(64, 40), 64) is None  # columns not a multiple of 16
    assert native.pack_rows(torch.randn(40, 64), 40) is None  # nor the rows it pads to
    assert native.pack_rows(torch.randn(70, 64), 64) is None  # more rows than the padding
    assert native.transpose_rows_bf16(torch.randn(48, 64).bfloat16()) is None
    bp = native.pack_wt(torch.randn(64, 64))
    x = torch.randn(8, 64).bfloat16()
    assert not native.dot_mm(x.float(), bp, 64, torch.empty(8, 64))  # a float32 A
    assert not native.dot_mm(x, bp, 64, torch.empty(8, 32))  # out of the wrong shape
    assert not native.dot_mm(x, bp, 32, torch.empty(8, 32))  # bp for another n
    assert not native.dot_mm(x, bp, 64, torch.empty(8, 64), add=torch.zeros(8, 64))  # float32 out: add must be out
    assert not native.dot_mm(x, bp, 64, torch.empty(8, 64, dtype=torch.float16))
    pa = torch.empty(native.packed_rows_numel(8, 64), dtype=torch.bfloat16)
    assert not native.dot_mm(x, bp, 64, torch.empty(8, 64), pack_a=pa)  # 8 rows: not whole 32-row tiles
    x32, pa = torch.randn(32, 64).bfloat16(), torch.empty(native.packed_rows_numel(32, 64), dtype=torch.bfloat16)
    assert not native.dot_mm(x32, bp, 64, torch.empty(32, 64), pack_a=pa[1:])  # a buffer of the wrong size
    yp, xp = native.pack_rows(torch.randn(48, 64), 48), native.pack_rows(torch.randn(48, 32), 48)
    assert not native.dot_mm_t(yp, 48, 64, xp, 32, torch.empty(64, 32))  # 48 rows: not whole 32-row tiles
    yp, xp = native.pack_rows(torch.randn(64, 64), 64), native.pack_rows(torch.randn(64, 32), 64)
    assert native.dot_mm_t(yp, 64, 64, xp, 32, torch.empty(64, 32))
    assert not native.dot_mm_t(yp, 64, 64, xp, 32, torch.empty(32, 64))  # out of the wrong shape
    assert not native.dot_mm_t(yp, 64, 64, xp[16:], 32, torch.empty(64, 32))  # B packed for other rows


@needs_dot_linear
@pytest.mark.parametrize("tokens", [256, 50])  # 50: the weight gradients' contraction is not a multiple of 32
@pytest.mark.parametrize("widths,d_in", [([64, 96, 32], 64), ([48, 80, 16], 48)])  # 48, 80, 16: odd x 16
def test_dot_path_is_taken_and_matches_torch(tokens, widths, d_in, monkeypatch):
    """On a CPU with AVX512-BF16 and without AMX, bf16 training calls whose widths are multiples of 16 run
    _DotLinear, and a width that is not falls back to _Linear (torch's GEMMs); both as close to float64 as
    torch's own path."""
    calls, wcalls, scalls = [], [], []
    real, real_t, real_s = native.dot_mm, native.dot_mm_t, native.dot_mm_sum
    monkeypatch.setattr(native, "dot_mm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    monkeypatch.setattr(native, "dot_mm_t", lambda *a, **k: wcalls.append(a[1:3]) or real_t(*a, **k))
    monkeypatch.setattr(native, "dot_mm_sum", lambda *a, **k: scalls.append(len(a[0])) or real_s(*a, **k))
    layers = _layers(widths, d_in, True)
    x = torch.randn(tokens, d_in)
    ys, g = _ours(x, layers, autocast=True)
    assert ys[0].grad_fn.name().startswith("_DotLinear")
    assert len(calls) == 3 and scalls == [3]  # three forward products; dx of the three in one summed call
    # the weight gradients: on dY packed by the dx products (no transpose of dY), or torch's GEMM at 50 tokens
    assert len(wcalls) == (3 if tokens % 32 == 0 else 0)
    ys_ref, g_ref = _reference(x, layers, torch.bfloat16, autocast=True)
    for a, b in zip(ys, ys_ref):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    exact = _f64_grads(x, layers)
    for a, b, e in zip(g, g_ref, exact):
        assert a.dtype == b.dtype == torch.float32
        err = ((a.double() - e).norm() / e.norm()).item()
        err_ref = ((b.double() - e).norm() / e.norm()).item()
        assert err <= 1.25 * err_ref + 1e-4, (err, err_ref)
    calls.clear()
    wcalls.clear()
    scalls.clear()
    odd = _layers([40], d_in, False)  # 40 rows: not a multiple of 16
    ys, _ = _ours(x, odd, autocast=True)
    assert ys[0].grad_fn.name().startswith("_Linear") and not calls and not wcalls and not scalls


@needs_dot_linear
@pytest.mark.parametrize("rows,d_in,d_out,bias", [(4, 64, 96, True), (37, 48, 80, False), (300, 128, 32, True)])
def test_bf16_inference_in_a_packed_scope_runs_the_dot_kernels(rows, d_in, d_out, bias, monkeypatch):
    """Inside packed_weights (a KV cache's decoding), bf16 inference on AVX512-BF16 without AMX runs the
    dot-product kernels on each weight packed once: within float32 summation error plus one bf16 rounding of the
    float64 product of the bf16-rounded operands, a row the same bits alone as in a batch, packed again after an
    in-place update; outside the scope, or with a gradient wanted, or a width not a multiple of 16: not."""
    calls, packs = [], []
    real_mm, real_pack = native.dot_mm, native.pack_wt
    monkeypatch.setattr(native, "dot_mm", lambda *a, **k: calls.append(a[0].shape) or real_mm(*a, **k))
    monkeypatch.setattr(native, "pack_wt", lambda *a, **k: packs.append(1) or real_pack(*a, **k))
    layer = _layers([d_out], d_in, bias)[0]
    x = torch.randn(2, rows, d_in, generator=torch.Generator().manual_seed(rows))
    store: dict = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        outside = layer(x)  # no scope: autocast's F.linear
        assert not calls and not packs and torch.equal(outside, F.linear(x, layer.weight, layer.bias))
        with L.packed_weights(store):
            y = layer(x)
            one = layer(x[1:, 3:4])
    assert len(calls) == 2 and len(packs) == 1 and len(store) == 1  # packed once for both calls
    w = layer.weight.detach().bfloat16().double()  # (no graph: it would hold the weight)
    exact = x.bfloat16().double() @ w.t() + (layer.bias.detach().bfloat16().double() if bias else 0)
    bound = 2.0 ** -8 * exact.abs() + d_in * 2.0 ** -23 * (x.bfloat16().double().abs() @ w.abs().t()) + 1e-30
    assert y.dtype == torch.bfloat16 and ((y.double() - exact).abs() <= bound).all()
    assert torch.equal(one, y[1:, 3:4])
    with torch.no_grad():
        layer.weight.mul_(-1.0)  # an in-place update: a new version, packed again
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), L.packed_weights(store):
        y2 = layer(x)
        odd = _layers([40], d_in, bias)[0]
        n_calls = len(calls)
        assert torch.equal(odd(x), F.linear(x, odd.weight, odd.bias)) and len(calls) == n_calls  # 40: F.linear
    assert len(packs) == 2
    exact2 = x.bfloat16().double() @ -w.t() + (layer.bias.detach().bfloat16().double() if bias else 0)
    bound2 = 2.0 ** -8 * exact2.abs() + d_in * 2.0 ** -23 * (x.bfloat16().double().abs() @ w.abs().t()) + 1e-30
    assert ((y2.double() - exact2).abs() <= bound2).all()
    with torch.autocast("cpu", dtype=torch.bfloat16), L.packed_weights(store):
        node = type(layer(x).grad_fn).__name__  # (its .name() raised on torch 2.6-2.8)
    assert node.startswith("_DotLinear")  # a gradient wanted: the training path
    alive = [entry[0] for entry in store.values()]
    del layer, odd
    gc.collect()
    dead = [entry() is None for entry in alive]
    assert alive and all(dead), dead  # the store does not keep the weights alive


@needs_dot_linear
def test_a_weight_given_new_storage_at_the_packed_ones_address_is_packed_again():
    """Regression: the packed store keyed a weight on its id, version and data_ptr, so a weight given new storage
    (``.data =``, which bumps no version) at the address of the storage it was packed from -- two replacements
    between calls, the allocator handing the freed block back -- was served its old packed values."""
    n, k = 32, 64
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(k, n, bias=False).bfloat16()
    x = torch.randn(3, k, generator=g).bfloat16()
    buf = bytearray(n * k * 2)  # one block of memory, two storages over it (deterministic address reuse)
    first = torch.frombuffer(buf, dtype=torch.bfloat16).view(n, k)
    with torch.no_grad():
        first.copy_(torch.randn(n, k, generator=g))
    store: dict = {}
    with torch.no_grad(), L.packed_weights(store):
        layer.weight.data = first
        L.linear(x, layer.weight)  # packed from `first`
        second = torch.frombuffer(buf, dtype=torch.bfloat16).view(n, k)
        fresh = torch.randn(n, k, generator=g).bfloat16()
        del first
        second.copy_(fresh)
        layer.weight.data = second  # new storage, the same address, the weight's version unchanged
        y = L.linear(x, layer.weight)
    exact = x.double() @ fresh.double().t()
    assert (y.double() - exact).abs().max() <= 0.02 * exact.abs().max()


@needs_dot_linear
@pytest.mark.parametrize("remake", ["parametrize", "prune"])
def test_a_weight_made_anew_at_each_call_does_not_grow_the_packed_store(remake):
    """A parametrized weight (torch.nn.utils.parametrize), pruning's weight (a forward pre-hook) and accelerate's
    offloaded one are new tensors at every call: each call packs it again, and the store (a KV cache's, for the
    whole generation) kept every packed copy: one per layer and decoding step.  Entries of weights that are gone
    are dropped; the results are still the dot kernels' on the current weight."""
    from torch.nn.utils import parametrize, prune

    layer = _layers([32], 64, True)[0]
    if remake == "parametrize":
        parametrize.register_parametrization(layer, "weight", _Double())
    else:
        prune.l1_unstructured(layer, "weight", amount=0.5)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    store: dict = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.linear(x, layer.weight, layer.bias)
        with L.packed_weights(store):
            ys, held = [], []
            for _ in range(20):  # other objects made between the calls, as a model's forward makes them: the
                ys.append(layer(x))  # next weight is not given the id of the one just gone
                held += [torch.empty(0) for _ in range(3)]
    assert len(store) <= 1, len(store)
    for y in ys:
        torch.testing.assert_close(y.float(), ref.float(), rtol=0.02, atol=0.02)


class _Double(nn.Module):
    def forward(self, w):
        return 2 * w


@needs_dot_linear
@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
def test_a_kv_caches_bf16_decoding_packs_each_weight_once(monkeypatch, attention):
    """bf16 cached decoding (autocast) runs every projection and the LM head on weights the cache packed at the
    prefill: one pack per weight for the whole generation, logits close to autocast's F.linear ones (a cache
    whose store is taken away), and reset() drops the packed weights (decoding after it: the same bits as a
    fresh cache)."""
    from difftx import ModelConfig
    from difftx.models import build_model

    packs = []
    real = native.pack_wt
    monkeypatch.setattr(native, "pack_wt", lambda *a, **k: packs.append(1) or real(*a, **k))
    torch.manual_seed(0)
    cfg = ModelConfig(attention=attention, d_model=64, n_heads=2, n_layers=2, vocab_size=64, max_seq_len=32,
                      tie_embeddings=False)
    model = build_model(cfg).eval()
    prompt = torch.randint(0, 64, (4, 9))

    def decode(cache):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(prompt, cache=cache).logits[:, -1:]
            out = [logits]
            for t in range(4):
                out.append(model(torch.full((4, 1), t + 3), cache=cache).logits)
        return torch.cat(out, 1).float()

    cache = model.new_cache(4, 16)
    got = decode(cache)
    n_weights = 2 * (4 + 3) + 1  # q, k, v, o, gate, up, down in 2 layers, and the LM head
    assert len(packs) == len(cache.packed) == n_weights
    plain = model.new_cache(4, 16)
    plain.packed = None  # no store: autocast's F.linear throughout
    ref = decode(plain)
    # the same operands and float32 sums as autocast's GEMMs, rounded once (bitwise the same here): to 1% of the
    # logits' scale (0.05 absolute, about 40% of their typical size, passed with every packed weight 10% off)
    torch.testing.assert_close(got, ref, rtol=0.01, atol=0.01 * float(ref.abs().max()))
    cache.reset()
    assert not cache.packed
    assert torch.equal(decode(cache), decode(model.new_cache(4, 16)))


def test_a_forward_patched_on_the_instance_is_called():
    """A difftx module's forward patched on the instance (accelerate's hooks, ad hoc wrappers) is called by the
    fast paths that would otherwise compute its forward themselves (project's shared node, the LM head, the
    attention's head norm): it used to be skipped silently."""
    from difftx import ModelConfig, build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(attention="diff", d_model=64, n_layers=1, n_heads=2, vocab_size=40,
                                    tie_embeddings=False))
    ids = torch.randint(0, 40, (2, 24))
    calls = []
    attn = model.layers[0].attn
    for m in (attn.q_proj, attn.head_norm, model.lm_head):
        orig = m.forward
        m.forward = lambda *a, _orig=orig, _m=m, **k: calls.append(type(_m).__name__) or _orig(*a, **k)
    model(ids, targets=ids).loss.backward()
    assert sorted(calls) == ["Linear", "Linear", "RMSNorm"]


# ---------------------------------------------------------------------- float32 products on oneDNN

needs_onednn = pytest.mark.skipif(not (torch.backends.mkldnn.is_available()
                                       and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
                                  reason="this torch has no oneDNN linear op")


def _counting(monkeypatch):
    calls = []
    real = L._onednn
    monkeypatch.setattr(L, "_onednn", lambda *a, **kw: calls.append(kw.get("add") is not None) or real(*a, **kw))
    return calls


@needs_onednn
@pytest.mark.parametrize("rows,widths", [(14, [48]), (14, [48, 16, 32]), (200, [96, 40]), (200, [8])])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_products_on_onednn_match_float64(rows, widths, bias, monkeypatch):
    """Where ONEDNN_FP32 holds, a float32 training call's every product runs on oneDNN: n forwards, n dx products
    (the ones after the first summed in the add post-op) and n weight gradients (200 rows: from one x^T shared by
    the projections; 14 rows, or one narrow projection: from each dY's copy); outputs and gradients within float32
    rounding of float64, as torch's path is."""
    monkeypatch.setattr(L, "ONEDNN_FP32", True)
    calls = _counting(monkeypatch)
    layers = _layers(widths, 24, bias)
    x = torch.randn(rows // 2, 2, 24)
    ys, g = _ours(x, layers, autocast=False)
    n = len(widths)
    assert len(calls) == 3 * n and sum(calls) == n - 1
    g64 = _f64_grads(x, layers)
    with torch.no_grad():
        for y, m in zip(ys, layers):
            ref = F.linear(x.double(), m.weight.double(), None if m.bias is None else m.bias.double())
            torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, g64):
        assert a.dtype == torch.float32 and a.shape == b.shape and a.is_contiguous()
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_float32_inference_and_the_lm_head_on_onednn(monkeypatch):
    """linear(): float32 past FEW_ROWS rows without a gradient runs oneDNN; a training call (the LM head) runs
    _Linear's products (its weight gradient too); autocast, bfloat16, torch.func and ONEDNN_FP32 off are
    F.linear itself."""
    monkeypatch.setattr(L, "ONEDNN_FP32", True)
    calls = _counting(monkeypatch)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    x = torch.randn(3, 12, 96, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(L.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert len(calls) == 1
    wg = w.clone().requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    L.linear(xg, wg).pow(2).sum().backward()
    assert len(calls) == 4  # forward, dx, dW
    w64, x64 = w.double().requires_grad_(True), x.double().requires_grad_(True)
    F.linear(x64, w64).pow(2).sum().backward()
    torch.testing.assert_close(wg.grad.double(), w64.grad, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(xg.grad.double(), x64.grad, rtol=1e-5, atol=1e-4)
    calls.clear()
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(L.linear(x, w, b), F.linear(x, w, b))
        assert torch.equal(L.linear(x.bfloat16(), w.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))
    assert torch.equal(torch.func.grad(lambda ww: L.linear(x, ww).sum())(w), torch.func.grad(
        lambda ww: F.linear(x, ww).sum())(w))
    monkeypatch.setattr(L, "ONEDNN_FP32", False)
    with torch.no_grad():
        assert torch.equal(L.linear(x, w, b), F.linear(x, w, b))
    assert calls == []


@needs_onednn
@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8)])
def test_an_empty_float32_input_trains_and_infers_where_onednn_runs(shape, monkeypatch):
    """oneDNN has no primitive for an empty product: such calls keep torch's (an empty output, zero gradients)."""
    monkeypatch.setattr(L, "ONEDNN_FP32", True)
    m = L.Linear(8, 4)
    x = torch.randn(*shape, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert y.shape == (*shape[:-1], 4) and torch.equal(m.weight.grad, torch.zeros(4, 8))
    with torch.no_grad():
        assert L.linear(x, m.weight, m.bias).shape == y.shape


def test_onednn_float32_default_is_zen5_or_the_environments_choice(monkeypatch):
    """On by default on AMD CPUs of family 26 (Zen 5) or later with AVX-512 (measured there), off elsewhere (Zen
    4, AVX2-only AMD, Intel, an unreadable family); DIFFTX_FP32_GEMM=torch / onednn decides instead, and nothing
    turns it on where torch has no oneDNN."""
    monkeypatch.delenv(L.FP32_GEMM_ENV, raising=False)
    have = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    for vendor, family, flags, want in (("AuthenticAMD", "26", "fpu avx2 avx512f avx512bw", True),
                                        ("AuthenticAMD", "27", "fpu avx512f", True),
                                        ("AuthenticAMD", "25", "fpu avx2 avx512f avx512bw", False),
                                        ("AuthenticAMD", "26", "fpu avx2", False),
                                        ("AuthenticAMD", "", "fpu avx512f", False),
                                        ("GenuineIntel", "6", "fpu avx512f", False)):
        monkeypatch.setattr(native, "cpu_vendor", lambda v=vendor: v)
        info = {"cpu family": family, "flags": flags}
        monkeypatch.setattr(native, "cpuinfo_value", lambda *k, i=info: i.get(k[0], ""))
        assert L._default_onednn_fp32() == (want and have), (vendor, family, flags)
        for choice, on in (("torch", False), ("onednn", True), (" ONEDNN ", True)):
            monkeypatch.setenv(L.FP32_GEMM_ENV, choice)
            assert L._default_onednn_fp32() == (on and have)
        monkeypatch.delenv(L.FP32_GEMM_ENV)
    monkeypatch.setenv(L.FP32_GEMM_ENV, "onednn")
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert L._default_onednn_fp32() is False


@needs_onednn
@pytest.mark.parametrize("attention", ["softmax", "diff"])
def test_a_float32_training_step_on_onednn_matches_torchs_gemm(attention, monkeypatch):
    """A model's float32 loss and every gradient with the products on oneDNN and on torch's GEMM: equal to float32
    rounding (the same sums in another order)."""
    import difftx

    cfg = difftx.ModelConfig(attention=attention, d_model=64, n_heads=2, n_layers=2, vocab_size=97, max_seq_len=64)
    x = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    out = {}
    for on in (True, False):
        monkeypatch.setattr(L, "ONEDNN_FP32", on)
        torch.manual_seed(0)
        model = difftx.build_model(cfg)
        loss = model(x, targets=x).loss
        loss.backward()
        out[on] = (loss.item(), {n: p.grad for n, p in model.named_parameters()})
    assert abs(out[True][0] - out[False][0]) < 1e-5
    for name, grad in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@needs_onednn
def test_a_compiled_float32_step_runs_onednn_too_and_matches_eager(monkeypatch):
    """Under torch.compile the float32 products enter the graph as the opaque ``difftx::onednn_linear`` op (inductor
    has no lowering for oneDNN's linear op on a weight it did not pack), so a compiled step is not back on torch's
    slower GEMM: every product of the forward and backward runs it, and loss and gradients match eager's."""
    import torch._dynamo

    monkeypatch.setattr(L, "ONEDNN_FP32", True)
    calls = []
    real = L._onednn_eager
    monkeypatch.setattr(L, "_onednn_eager", lambda *a: calls.append(1) or real(*a))
    layers = _layers([48, 16], 24, True)
    head = L.Linear(64, 8)
    x = torch.randn(2, 7, 24)

    def loss_of(x):
        q, k = L.project(x, layers)
        return head(torch.cat((q, k), -1)).pow(2).mean()

    def grads(fn):
        for p in (*head.parameters(), *(p for m in layers for p in m.parameters())):
            p.grad = None
        loss = fn(x)
        loss.backward()
        return loss.detach(), [p.grad.clone() for m in (*layers, head) for p in m.parameters()]

    eager = grads(loss_of)
    assert len(calls) == 3 + 1 + 3  # three forwards (q, k, the head), the head's dx (x wants none), three dW
    torch._dynamo.reset()
    calls.clear()
    compiled = grads(torch.compile(loss_of, backend="inductor", fullgraph=False))
    torch._dynamo.reset()
    assert len(calls) == 3 + 1 + 3
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
