"""The CUDA paths against the float64 CPU reference: every attention backend and DIFF formulation,
forward and backward; bf16 and fp16 autocast; second derivatives; cached decoding; the fused kernel's pure-torch path; training
resumed mid-run (to float rounding), activation checkpointing, document masking, sliding windows, evaluation and the bench on the
GPU.

Skipped without a CUDA GPU (CI has none); run on a GPU machine with
``python -m pytest tests/test_cuda.py`` (what ``benchmarks/performance/cuda_session.sh`` does).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import difftx
from difftx.nn import backends, fused
from difftx.nn.mask import AttnMask

# DIFFTX_TEST_DEVICE=cpu runs the same checks on the CPU (to check the tests themselves without a GPU)
DEV = torch.device(os.environ.get("DIFFTX_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(DEV.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (backend, diff_variant): every way a layer reaches its kernel on the GPU
PATHS = [("eager", None), ("sdpa", "auto"), ("sdpa", "2call"), ("sdpa", "4call"), ("sdpa", "fused"), ("sdpa", "triton"),
         ("flex", None)]
KINDS = [("softmax", {}), ("diff", {}), ("diff", {"n_kv_heads": 1, "pairing": "halves"}), ("diff2", {}),
         ("diff", {"norms": "dnt"})]


def _cfg(attention: str, **kw) -> difftx.ModelConfig:
    return difftx.ModelConfig(attention=attention, d_model=128, n_layers=2, n_heads=2, vocab_size=97,
                              max_seq_len=64, **kw)


def _ids(b: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (b, n), generator=torch.Generator().manual_seed(seed))


def _reference(cfg, ids, targets):
    """float64 CPU eager model: the model, its logits, its parameter gradients."""
    torch.manual_seed(0)
    ref = difftx.build_model(cfg).double()
    ref.set_attention_backend("eager")
    out = ref(ids, targets=targets)
    out.loss.backward()
    return ref, out.logits.detach(), {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
    assert torch.isfinite(got).all() and err <= tol, f"{what}: relative max error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("attention,extra", KINDS, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())))
@pytest.mark.parametrize("backend,variant", PATHS, ids=lambda v: str(v))
def test_fp32_paths_match_float64_reference(attention, extra, backend, variant):
    _check_fp32_path(_cfg(attention, **extra), backend, variant)


def _check_fp32_path(cfg, backend: str, variant, lambda_slack: float = 1.0) -> None:
    """The model of ``cfg`` on ``DEV`` through one attention path: the float64 CPU eager model's logits and
    parameter gradients.  ``lambda_slack`` widens lambda's tolerance (a sum over every query and key)."""
    ids, targets = _ids(2, 48), _ids(2, 48, seed=1)
    ref, ref_logits, ref_grads = _reference(cfg, ids, targets)
    model = difftx.build_model(cfg).to(DEV)
    model.load_state_dict(ref.state_dict())
    model.set_attention_backend(backend, variant)
    out = model(ids.to(DEV), targets=targets.to(DEV))
    out.loss.backward()
    tol = 2e-3 if backend == "flex" else 2e-4  # fp32 everywhere (TF32 off); flex's Triton dots may use TF32
    _close(out.logits, ref_logits, tol, "logits")
    for name, p in model.named_parameters():
        _close(p.grad, ref_grads[name], (lambda_slack if ".lambda_" in name else 1.0) * 5 * tol, f"grad of {name}")


@pytest.mark.parametrize("attention,extra", KINDS[:4], ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())))
@pytest.mark.parametrize("variant", ["auto", "2call", "4call", "fused", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_paths_track_float64(attention, extra, variant, dtype):
    """bf16 and fp16 autocast (fp16: the fused formulation's products in float32, past float16's range)."""
    cfg = _cfg(attention, **extra)
    ids, targets = _ids(2, 48), _ids(2, 48, seed=1)
    ref, ref_logits, ref_grads = _reference(cfg, ids, targets)
    model = difftx.build_model(cfg).to(DEV)
    model.load_state_dict(ref.state_dict())
    model.set_attention_backend("sdpa", variant)
    with torch.autocast(DEV.type, dtype=dtype):
        out = model(ids.to(DEV), targets=targets.to(DEV))
    out.loss.backward()
    _close(out.logits, ref_logits, 5e-2, "logits")
    for name, p in model.named_parameters():
        g, r = p.grad.double().cpu().flatten(), ref_grads[name].flatten()
        if r.norm() > 1e-8:
            cos = float(g @ r / (g.norm() * r.norm()))
            assert cos > 0.99, f"grad of {name}: cosine {cos:.4f} to the float64 gradient"


@pytest.mark.parametrize("attention,extra", KINDS[:4], ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())))
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "bf16-weights"])
def test_cached_decoding_matches_full_forward(attention, extra, dtype):
    """Prefill a prompt into the KV cache, decode token by token: each step's logits equal a full,
    uncached forward of the whole prefix (and both equal the float64 CPU model)."""
    cfg = _cfg(attention, **extra)
    torch.manual_seed(0)
    ref = difftx.build_model(cfg).double().eval()
    model = difftx.build_model(cfg).to(DEV).eval()
    model.load_state_dict(ref.state_dict())
    if dtype == "bf16-weights":
        model = model.to(torch.bfloat16)
    ids = _ids(3, 20).to(DEV)
    tol = 2e-4 if dtype == "fp32" else 6e-2
    with torch.no_grad(), torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
        cache = model.new_cache(3, 20)
        steps = [model(ids[:, :14], cache=cache).logits[:, -1]]
        for t in range(14, 19):
            steps.append(model(ids[:, t:t + 1], cache=cache).logits[:, -1])
        fulls = [model(ids[:, : t + 1]).logits[:, -1] for t in range(13, 19)]
    with torch.no_grad():
        for j, t in enumerate(range(13, 19)):
            _close(steps[j], fulls[j].float(), tol, f"cached step {t} vs the uncached forward")
            _close(steps[j], ref(ids[:, : t + 1].cpu()).logits[:, -1], tol, f"cached step {t} vs float64")


def test_padded_generation_matches_cpu():
    """Left-padded batched greedy decoding on the GPU gives the CPU's tokens (fp32, DIFF)."""
    cfg = _cfg("diff")
    torch.manual_seed(0)
    cpu = difftx.build_model(cfg).double()
    gpu = difftx.build_model(cfg).to(DEV)
    gpu.load_state_dict(cpu.state_dict())
    ids = _ids(2, 10)
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0
    a = cpu.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=mask)
    b = gpu.generate(ids.to(DEV), max_new_tokens=8, do_sample=False, attention_mask=mask.to(DEV))
    assert torch.equal(a, b.cpu())


@pytest.mark.parametrize("attention,extra", KINDS, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())))
@pytest.mark.parametrize("backend,variant", [("eager", None), ("sdpa", "fused"), ("sdpa-math", "2call"),
                                             ("sdpa-math", "4call")], ids=str)
def test_hessian_vector_product_on_cuda(attention, extra, backend, variant):
    """Second derivatives (create_graph) in fp32 on the GPU against the float64 CPU model's Hessian-vector
    product: the eager backend, the fused formulation's graph-carrying backward, and SDPA under its math
    kernel (SDPA's fused CUDA kernels have no double backward)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests.nn.test_second_derivatives import _hvp

    cfg = _cfg(attention, **extra)
    ids = _ids(2, 48)
    torch.manual_seed(0)
    ref = difftx.build_model(cfg).double()
    ref.set_attention_backend("eager")
    g = torch.Generator().manual_seed(3)
    vec = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in ref.parameters()]
    want = _hvp(ref, ids, vec)
    model = difftx.build_model(cfg).to(DEV)
    model.load_state_dict(ref.state_dict())
    model.set_attention_backend(backend.split("-")[0], variant)
    with sdpa_kernel(SDPBackend.MATH) if backend == "sdpa-math" else torch.enable_grad():
        got = _hvp(model, ids.to(DEV), [v.to(DEV) for v in vec])
    err = float((got.cpu() - want).norm() / want.norm())
    assert err < 1e-3, f"Hessian-vector product: relative error {err:.1e}"


def _leaf(t: torch.Tensor, device, dtype) -> torch.Tensor:
    return t.detach().to(device=device, dtype=dtype).requires_grad_()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("lam_kind,hk,padded,q_start,shared_k", [
    (None, 2, True, 5, False), ("scalar", 4, False, 0, False), ("scalar", 1, True, 5, False),
    ("rows", 2, False, 0, False), ("scalar", 2, True, 5, True), ("rows", 4, False, 0, True)])
def test_fused_kernel_on_cuda(dtype, tol, lam_kind, hk, padded, q_start, shared_k):
    """difftx.nn.fused's pure-torch blocks on the GPU against explicit float64 maps on the CPU; shared_k: one K
    read by both maps (DIFF V2's layout, k of shape (B, 1, Hk, Nk, d)), whose gradient sums both maps'."""
    g = torch.Generator().manual_seed(0)
    b, m, h, n, d, dv = 2, 1 if lam_kind is None else 2, 4, 45, 16, 32
    nk = n + q_start
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in
               ((b, m, h, n, d), (b, 1 if shared_k else m, hk, nk, d), (b, hk, nk, dv)))
    lam = None if lam_kind is None else (torch.tensor(0.37, dtype=torch.float64) if lam_kind == "scalar"
                                         else torch.rand(b, h, n, 1, generator=g, dtype=torch.float64))
    valid = None
    if padded:
        valid = torch.ones(b, nk, dtype=torch.bool)
        valid[0, :5], valid[1, -3:] = False, False
    mask = AttnMask(causal=True, n_q=n, n_k=nk, q_start=q_start, key_valid=valid)
    w = torch.randn(b, n, h, dv, generator=g, dtype=torch.float64)
    # reference: explicit maps in float64 (keys/values repeated to the query heads)
    ins = [_leaf(t, "cpu", torch.float64) for t in (q, k, v)] + ([] if lam is None else [_leaf(lam, "cpu", torch.float64)])
    rep = h // hk
    s = ins[0] @ ins[1].expand(b, m, hk, nk, d).repeat_interleave(rep, 2).transpose(-1, -2) * 0.3
    s = s.masked_fill(~mask.dense("cpu")[:, None], float("-inf"))
    p = torch.softmax(s, -1)
    p = p[:, 0] if m == 1 else p[:, 0] - ins[3] * p[:, 1]
    ref = (p @ ins[2].repeat_interleave(rep, 1)).transpose(1, 2)
    ref_grads = torch.autograd.grad((ref * w).sum(), ins)
    lam_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    gins = [_leaf(t, DEV, dtype) for t in (q, k, v)] + ([] if lam is None else [_leaf(lam, DEV, lam_dtype)])
    for chunk in (16, 64):
        out = fused.fused_attention(*gins[:3], mask, 0.3, gins[3] if lam is not None else None, chunk=chunk)
        assert out.device.type == DEV.type and out.dtype == dtype
        _close(out, ref, tol, f"fused output (chunk {chunk})")
        grads = torch.autograd.grad((out.double() * w.to(DEV)).sum(), gins)
        for name, a, r in zip("q k v lambda".split(), grads, ref_grads):
            _close(a, r, tol, f"d{name} (chunk {chunk})")


def test_diff_variants_agree_at_long_context():
    """2call / 4call / fused on the GPU in bf16 at 4K tokens (the shapes the variants are timed at): outputs and
    gradients, the gradient reaching SDPA in the transposed layout a model's head merge hands it, against the
    float32 eager reference (cuDNN's backward gave wrong gradients for one layout of grad_out in
    attention_variants.py's ``stacked`` row, docs/performance.md)."""
    torch.manual_seed(0)
    b, h, n, d = 1, 4, 4096, 64
    base = [torch.randn(b, h, n, d, device=DEV) for _ in range(4)] + [torch.randn(b, h, n, 2 * d, device=DEV)]
    w = torch.randn(b, n, h, 2 * d, device=DEV)
    mask = AttnMask(causal=True, n_q=n, n_k=n)

    def run(variant, dtype):
        q1, q2, k1, k2, v = (t.to(dtype).requires_grad_() for t in base)
        lam = torch.tensor(0.3, device=DEV, requires_grad=True)
        if variant == "eager":
            out = backends.eager_diff_attention(q1, q2, k1, k2, v, lam, mask, d ** -0.5).transpose(1, 2)
        elif variant == "fused":
            out = fused.fused_attention(torch.stack((q1, q2), 1), torch.stack((k1, k2), 1), v, mask, d ** -0.5, lam)
        else:
            o1, o2 = backends.diff_sdpa(q1, q2, k1, k2, v, mask, d ** -0.5, variant=variant)
            out = backends.combine(o1, o2, lam).transpose(1, 2)
        grads = torch.autograd.grad((out.float() * w).sum(), (q1, q2, k1, k2, v, lam))
        return [out] + list(grads)

    ref = [t.detach().double().cpu() for t in run("eager", torch.float32)]
    for variant in ("2call", "4call", "fused"):
        for name, got, r in zip("out dq1 dq2 dk1 dk2 dv dlam".split(), run(variant, torch.bfloat16), ref):
            err = float((got.detach().double().cpu() - r).norm() / r.norm())
            assert err < 2e-2, f"{variant} {name}: relative L2 error {err:.1e}"


def test_train_resume_eval_and_bench_on_cuda(tmp_path):
    """`difftx train --device cuda`: a resumed run continues the uninterrupted one (losses to float
    rounding: SDPA's backward kernels need not be bitwise deterministic); `difftx eval` and
    `difftx bench --quick` run on the GPU.  In process (a subprocess would pay CUDA's start each time)."""
    from difftx.cli import main
    from tests.train._helpers import losses, write_corpus

    data = write_corpus(tmp_path / "corpus.txt")
    common = ["train", "--data", data, "--cache-dir", tmp_path / "cache", "--tokenizer", "char", "--d-model", 64,
              "--n-layers", 2, "--n-heads", 2, "--seq-len", 32, "--batch-size", 4, "--warmup", 1, "--steps", 8,
              "--eval-every", 4, "--eval-batches", 2, "--no-progress", "--seed", 7, "--attention", "diff",
              "--device", str(DEV)]

    def cli(*args) -> int:
        return main([str(a) for a in args])

    for dtype in ("fp32", "bf16"):
        full, half = tmp_path / f"full-{dtype}", tmp_path / f"half-{dtype}"
        assert cli(*common, "--dtype", dtype, "--out", full) == 0
        assert cli(*common, "--dtype", dtype, "--out", half, "--stop-at", 4) == 0
        assert cli(*common, "--dtype", dtype, "--out", half, "--resume", "auto") == 0
        a, b = losses(full), losses(half)
        assert len(a) == len(b) == 8 and a[:4] == b[:4]
        assert max(abs(x - y) / abs(y) for x, y in zip(a, b)) < 1e-4, (a, b)
    run = tmp_path / "full-fp32"
    for name, args in (("lm", ["--max-tokens", 512, "--seq-len", 32]), ("quant", ["--bits", "16,4", "--max-tokens", 128])):
        assert cli("eval", name, "--checkpoint", run, "--out", tmp_path / f"eval-{name}", "--device", str(DEV),
                   "--quiet", "--no-plot", "--data", data, *args) == 0
        env = json.loads((tmp_path / f"eval-{name}" / f"{name}.json").read_text())
        assert env["eval"] == name and env["results"]
    assert cli("bench", "--quick", "--device", str(DEV), "--out", tmp_path / "bench", "--no-peers") == 0
    res = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert res["environment"]["device"].startswith(DEV.type) and res["ratios"]["diff_over_transformer_train"] > 0


def test_compiled_flex_matches_sdpa(monkeypatch):
    """Compiled FlexAttention (Triton) for DIFF and softmax, forward and backward, against SDPA.  Last in the
    file: it compiles (tens of seconds)."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(backends, "_FLEX", torch.compile(flex_attention, dynamic=False))
    for attention in ("softmax", "diff"):
        cfg = _cfg(attention)
        torch.manual_seed(0)
        a = difftx.build_model(cfg).to(DEV)
        b = difftx.build_model(cfg).to(DEV)
        b.load_state_dict(a.state_dict())
        a.set_attention_backend("flex")
        b.set_attention_backend("sdpa", "2call")
        ids, targets = _ids(2, 64).to(DEV), _ids(2, 64, seed=1).to(DEV)
        la, lb = a(ids, targets=targets), b(ids, targets=targets)
        la.loss.backward()
        lb.loss.backward()
        _close(la.logits, lb.logits.detach().cpu(), 2e-3, f"{attention} logits")
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            _close(pa.grad, pb.grad.cpu(), 1e-2, f"{attention} grad of {name}")


def _same_numbers(a, b, path="results"):
    """Nested JSON values equal, floats to 1e-3 relative (1e-4 absolute)."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _same_numbers(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same_numbers(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, (int, float)):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-4, nan_ok=True), path
    else:
        assert a == b, path


def test_every_eval_runs_on_cuda(tmp_path):
    """Each `difftx eval` with --device on the GPU; the continuous ones (lm, attention, outliers, quant) give the
    CPU's numbers, the accuracy ones (niah, mqar, icl) their schema (a random model's near-ties may flip)."""
    from difftx.cli import main
    from difftx.data import ByteTokenizer

    torch.manual_seed(0)
    ckpt = tmp_path / "ckpt"
    difftx.save_model(difftx.build_model(difftx.ModelConfig(attention="diff", d_model=64, n_layers=2, n_heads=2,
                                                            vocab_size=256, max_seq_len=256)), ckpt)
    ByteTokenizer().save(ckpt)
    words = ["river", "garden", "window", "lantern", "harbor", "meadow", "violin", "pebble"]
    hay = ckpt / "haystack.txt"
    hay.write_text(" ".join(f"The {words[i % 8]} was near the {words[i * 3 % 8]} on day {i}." for i in range(400)))
    small = {
        "lm": ["--max-tokens", "512", "--seq-len", "64"],
        "niah": ["--grid", "N1R1,N2R2", "--lengths", "320", "--depths", "0,100", "--samples", "1"],
        "mqar": ["--lengths", "32,64", "--pairs", "4,8", "--samples", "2"],
        "attention": ["--length", "160", "--depths", "0,50,100", "--samples", "1"],
        "outliers": ["--max-tokens", "256", "--seq-len", "64"],
        "quant": ["--bits", "16,4", "--max-tokens", "128"],
        "icl": ["--shots", "1,2", "--seeds", "2", "--test-examples", "4"],
    }
    for name, args in small.items():
        data = [] if name in ("mqar", "icl") else ["--data", str(hay)]
        docs = {}
        for i, dev in enumerate(("cpu", str(DEV))):
            out = tmp_path / f"{name}-{i}"
            assert main(["eval", name, "--checkpoint", str(ckpt), "--out", str(out), "--device", dev, "--quiet",
                         "--no-plot", *data, *args]) == 0
            docs[dev] = json.loads((out / f"{name}.json").read_text())["results"]
        if name in ("lm", "attention", "outliers", "quant"):
            _same_numbers(docs[str(DEV)], docs["cpu"], name)
        else:
            assert set(docs[str(DEV)]) == set(docs["cpu"])


def test_vision_training_resumes_on_cuda(tmp_path):
    """`difftx train --domain vision --device cuda` (DIFF in DNT, mSGDW): a run stopped and resumed continues
    the uninterrupted one (to float rounding)."""
    import numpy as np

    from difftx.cli import main
    from tests.train._helpers import losses

    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(3), 20)
    x = rng.uniform(0, 0.3, (60, 1, 8, 8)).astype(np.float32)
    for i, k in enumerate(y):
        r, c = divmod(int(k), 2)
        x[i, :, r * 4:(r + 1) * 4, c * 4:(c + 1) * 4] += 0.7
    np.savez(tmp_path / "blobs.npz", x=x, y=y)
    common = ["train", "--data", tmp_path / "blobs.npz", "--domain", "vision", "--preset", "vdnt-tiny", "--d-model",
              32, "--n-layers", 2, "--n-heads", 2, "--batch-size", 8, "--no-progress", "--seed", 5, "--steps", 6,
              "--eval-every", 3, "--log-every", 1, "--attention", "diff", "--optimizer", "msgdw", "--lr", 0.05,
              "--device", str(DEV)]
    run = lambda *a: main([str(v) for v in (*common, *a)])  # noqa: E731
    assert run("--out", tmp_path / "full") == 0
    assert run("--out", tmp_path / "half", "--stop-at", 3) == 0
    assert run("--out", tmp_path / "half", "--resume", "auto") == 0
    for key, n in (("loss", 6), ("val_loss", 2)):
        a, b = losses(tmp_path / "full", key), losses(tmp_path / "half", key)
        assert len(a) == len(b) == n and a[: n // 2] == b[: n // 2], (key, a, b)
        assert max(abs(p - q) / abs(q) for p, q in zip(a, b)) < 1e-4, (key, a, b)
    assert losses(tmp_path / "full", "val_acc") == losses(tmp_path / "half", "val_acc")


def test_hf_wrapper_generates_the_cpu_tokens_on_cuda():
    """DifftxForCausalLM on the GPU: transformers' greedy generate gives the CPU difftx model's tokens."""
    pytest.importorskip("transformers")
    from difftx.interop.hf import DifftxForCausalLM

    for attention in ("softmax", "diff", "diff2"):
        torch.manual_seed(0)
        model = difftx.build_model(_cfg(attention)).eval()
        for p in model.parameters():  # larger weights than the init's: logits far from ties
            p.data.normal_(0, 0.1) if p.dim() > 1 else None
        x = _ids(2, 7)
        ours = model.generate(x, max_new_tokens=10, temperature=0)
        hf = DifftxForCausalLM.from_difftx(model).to(DEV).eval()  # shares (and so moves) the model's weights
        theirs = hf.generate(x.to(DEV), max_new_tokens=10, do_sample=False)
        assert torch.equal(ours, theirs.cpu()), attention


@pytest.mark.parametrize("attention", ["softmax", "diff"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(attention):
    """Every block recomputed in backward on the device (dropout on: torch's checkpoint restores the device's RNG
    state): the loss and gradients of no checkpointing, to float rounding (a GPU attention backward may add in a
    varying order; on the CPU they are the same bits, tests/nn/test_activation_checkpointing.py)."""
    torch.manual_seed(0)
    model = difftx.build_model(_cfg(attention, dropout=0.1)).to(DEV).train()
    ids = _ids(2, 64).to(DEV)

    def step(every):
        model.set_activation_checkpointing(every)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the dropout masks, on every device
        loss = model(ids, targets=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    (loss, grads), (ref_loss, ref) = step(1), step(0)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("attention,extra", KINDS[:4], ids=lambda v: v if isinstance(v, str) else
                         "-".join(map(str, v.values())))
@pytest.mark.parametrize("backend,variant", PATHS, ids=lambda v: str(v))
def test_document_masking_matches_float64_reference(attention, extra, backend, variant):
    """Packed documents (document_ids) on every GPU path: the float64 CPU eager model's logits and gradients
    under the same document ids (its dense mask)."""
    from difftx.nn import document_ids

    cfg = _cfg(attention, **extra)
    ids, targets = _ids(2, 48), _ids(2, 48, seed=1)
    ids[0, [7, 30]] = ids[1, 12] = 0  # documents of 8, 23, 17 and 13, 35 tokens
    doc = document_ids(ids, 0)
    torch.manual_seed(0)
    ref = difftx.build_model(cfg).double()
    ref.set_attention_backend("eager")
    out = ref(ids, targets=targets, document_ids=doc)
    out.loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    model = difftx.build_model(cfg).to(DEV)
    model.load_state_dict(ref.state_dict())
    model.set_attention_backend(backend, variant)
    got = model(ids.to(DEV), targets=targets.to(DEV), document_ids=doc.to(DEV))
    got.loss.backward()
    tol = 2e-3 if backend == "flex" else 2e-4  # as test_fp32_paths_match_float64_reference
    _close(got.logits, out.logits, tol, "logits")
    for n, p in model.named_parameters():
        # lambda's gradient sums over every query and key with cancellation: in fp32, 4call's reaches 1.3e-3 of its
        # largest entry on the CPU (its float64 run agrees with the reference to 4e-13)
        _close(p.grad, ref_grads[n], (20 if ".lambda_" in n else 5) * tol, f"grad of {n}")


@pytest.mark.parametrize("attention,extra", KINDS[:4], ids=lambda v: v if isinstance(v, str) else
                         "-".join(map(str, v.values())))
@pytest.mark.parametrize("backend,variant", PATHS, ids=lambda v: str(v))
def test_sliding_window_matches_float64_reference(attention, extra, backend, variant):
    """sliding_window on every GPU path: the float64 CPU eager model's logits and gradients (its dense mask)."""
    _check_fp32_path(_cfg(attention, sliding_window=9, **extra), backend, variant, lambda_slack=4.0)
