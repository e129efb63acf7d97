"""Optimisers and schedules: mSGDW against torch SGD + decoupled decay, parameter groups, schedules, Muon."""

import copy
import math

import pytest
import torch

from difftx import ModelConfig, build_model
from difftx.errors import ConfigError
from difftx.optim import MSGDW, build_optimizer, is_no_decay, lr_at, param_groups, set_lr

from .conftest import needs_muon


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest, and the CPU may be shared
    yield
    torch.set_num_threads(n)


def _model(attention="diff", **kw):
    torch.manual_seed(0)
    return build_model(ModelConfig(attention=attention, d_model=32, n_layers=2, n_heads=2, vocab_size=40,
                                   max_seq_len=16, bias=True, **kw))


def _loss(model, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 40, (3, 12), generator=g)
    return model(x, targets=x).loss


@pytest.mark.parametrize("nesterov", [False, True])
def test_msgdw_equals_sgd_plus_decoupled_decay(nesterov):
    ours, ref = _model(), _model()
    wd, mu = 0.05, 0.9
    opt = MSGDW(ours.parameters(), lr=0.1, momentum=mu, weight_decay=wd, nesterov=nesterov)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=mu, weight_decay=0.0, nesterov=nesterov)
    for step in range(5):
        lr = 0.1 * (1 - step / 10)  # a changing learning rate, as under a schedule
        set_lr(opt, lr), set_lr(sgd, lr)
        for model, o in ((ours, opt), (ref, sgd)):
            o.zero_grad()
            _loss(model, step).backward()
        opt.step()
        with torch.no_grad():
            for p in ref.parameters():
                p.mul_(1 - lr * wd)  # decoupled: shrink the weights, not the gradient
        sgd.step()
        for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step} {n}: {m}")


def test_msgdw_is_not_coupled_l2():
    """torch SGD's weight_decay (L2 in the gradient, then momentum) gives a different trajectory."""
    ours, coupled = _model(), _model()
    opt = MSGDW(ours.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    sgd = torch.optim.SGD(coupled.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    for step in range(3):
        for model, o in ((ours, opt), (coupled, sgd)):
            o.zero_grad()
            _loss(model, step).backward()
            o.step()
    diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), coupled.parameters()))
    assert diff > 1e-5


def test_no_decay_groups():
    model = _model("diff", norms="dnt")
    groups = {g["name"]: g for g in param_groups(model, 0.1)}
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for p in groups["no_decay"]["params"]}
    decay = {names[id(p)] for p in groups["decay"]["params"]}
    assert groups["no_decay"]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == 0.1
    assert "embed.weight" in no_decay and "layers.0.attn.lambda_q1" in no_decay
    assert "layers.0.attn.head_norm.weight" in no_decay and "layers.0.attn.q_norm.weight" in no_decay
    assert "layers.1.attn.q_proj.bias" in no_decay and "input_norm.weight" in no_decay
    assert "layers.0.attn.q_proj.weight" in decay and "layers.1.ffn.w_down.weight" in decay and "lm_head.weight" in decay
    assert decay.isdisjoint(no_decay) and decay | no_decay == set(names.values())
    everything = param_groups(model, 0.1, decay_all=True)
    assert len(everything) == 1 and len(everything[0]["params"]) == len(names)
    vit = build_model(ModelConfig.from_preset("vit-tiny"))
    assert is_no_decay("cls_token", vit.cls_token) and is_no_decay("pos_embed", vit.pos_embed)
    assert not is_no_decay("patch_embed.weight", vit.patch_embed.weight)


def test_no_decay_params_are_not_shrunk():
    model = _model()
    opt = build_optimizer(model, "msgdw", lr=0.5, weight_decay=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # zero gradient: only weight decay moves weights
    opt.step()
    for n, p in model.named_parameters():
        expect = before[n] if is_no_decay(n, p) else before[n] * (1 - 0.25)
        torch.testing.assert_close(p.detach(), expect, msg=lambda m: f"{n}: {m}")


def test_build_optimizer_kinds():
    model = _model()
    adamw = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    assert isinstance(adamw, torch.optim.AdamW) and adamw.param_groups[0]["betas"] == (0.9, 0.95)
    assert adamw.defaults["fused"] and not adamw.defaults["foreach"]  # torch's fused kernel, on the CPU too
    assert build_optimizer(model, "adamw", fused=False).defaults["foreach"]
    assert isinstance(build_optimizer(model, "sgd"), torch.optim.SGD)
    with pytest.raises(ConfigError, match="optimizer"):
        build_optimizer(model, "lion")


@needs_muon
def test_muon_for_matrices_adamw_for_the_rest():
    model = _model("softmax")
    opt = build_optimizer(model, "muon", lr=0.02, weight_decay=0.01)
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    matrices = {id(p) for g in muon.param_groups for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in matrices}
    assert "layers.0.attn.q_proj.weight" in names and "embed.weight" not in names and "lm_head.weight" not in names
    before = copy.deepcopy(model.state_dict())
    opt.zero_grad()
    _loss(model, 0).backward()
    opt.step()
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    state = opt.state_dict()
    opt.load_state_dict(state)
    assert len(opt.param_groups) == len(muon.param_groups) + len(adamw.param_groups)
    set_lr(opt, 0.5)  # after a load (a resume) the schedule must still reach the optimisers' own groups
    assert all(g["lr"] == 0.5 for o in opt.optimizers for g in o.param_groups)
    rest = build_optimizer(model, "muon", weight_decay=0.01, decay_all=True).optimizers[1]
    assert [g["weight_decay"] for g in rest.param_groups] == [0.01]  # --decay-all reaches AdamW's side too


@needs_muon
def test_combined_state_of_another_number_of_optimizers_is_refused():
    """A Muon + AdamW state holding one part only loaded Muon's and left AdamW's moments fresh, silently (a resume
    then trained on another trajectory); it is refused as a mismatch (checkpoint.py makes it one line)."""
    model = _model("softmax")
    opt = build_optimizer(model, "muon", lr=0.02)
    opt.zero_grad()
    _loss(model, 0).backward()
    opt.step()
    state = opt.state_dict()
    fresh = build_optimizer(model, "muon", lr=0.02)
    with pytest.raises(ValueError, match="1 optimizer"):
        fresh.load_state_dict({"optimizers": state["optimizers"][:1]})
    fresh.load_state_dict(state)
    assert len(fresh.optimizers[1].state) == len(opt.optimizers[1].state) > 0


@needs_muon
@pytest.mark.parametrize("nesterov, rule", [(True, "match_rms_adamw"), (False, "original")])
def test_muon_in_bf16_is_torchs_muon_exactly(nesterov, rule):
    """Same hyperparameters, state and update as torch.optim.Muon, bit for bit, when it iterates in bf16."""
    from difftx.optim import Muon

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(40, 24)), torch.nn.Parameter(torch.randn(16, 48))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=rule)
    a, b = Muon(ours, ns_dtype=torch.bfloat16, **kw), torch.optim.Muon(ref, **kw)
    for _ in range(3):
        for p, q in zip(ours, ref):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        a.step()
        b.step()
        for p, q in zip(ours, ref):
            assert torch.equal(p, q)
    for s, t in zip(a.state.values(), b.state.values()):
        assert torch.equal(s["momentum_buffer"], t["momentum_buffer"])
    b.load_state_dict(a.state_dict())  # the checkpoints are interchangeable


def test_muon_fp32_iteration_matches_a_float64_reference():
    """fp32 Newton-Schulz (the CPU without bf16 hardware) is the same map as in float64, to fp32 rounding."""
    from difftx.optim import newton_schulz

    coeffs = (3.4445, -4.7750, 2.0315)
    for shape in [(48, 20), (20, 48)]:
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        x = g.double().T if shape[0] > shape[1] else g.double()  # independent reference: the wide orientation
        x = x / x.norm()
        for _ in range(5):
            a = x @ x.T
            x = coeffs[0] * x + (coeffs[1] * a + coeffs[2] * a @ a) @ x
        ref = x.T if shape[0] > shape[1] else x
        got = newton_schulz(g, coeffs, 5, 1e-7, torch.float32)
        assert got.dtype == torch.float32 and got.shape == g.shape
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)
        sv = torch.linalg.svdvals(ref)
        assert sv.min() > 0.5 and sv.max() < 1.5  # it orthogonalises (singular values near 1)


def test_muon_on_a_torch_without_it_is_one_clear_error(monkeypatch):
    """Before torch 2.9 (no torch.optim.Muon) the optimizer name and the class both say what is missing and what to do,
    where the class raised a bare TypeError on lr=... (its base is a plain Optimizer then)."""
    from difftx.optim import Muon
    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    model = build_model(ModelConfig(d_model=16, n_heads=2, head_dim=8, n_layers=1, vocab_size=32))
    for make in (lambda: build_optimizer(model, "muon", lr=0.02),
                 lambda: Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)):
        with pytest.raises(ConfigError, match=r"(?i)muon needs torch >= 2\.9.*this is torch .*adamw or msgdw"):
            make()


@needs_muon
def test_muon_iterates_in_fp32_where_bf16_matmul_is_slow(monkeypatch):
    import difftx.runtime

    model = _model("softmax")
    for native, dtype in [(False, torch.float32), (True, torch.bfloat16)]:
        monkeypatch.setattr(difftx.runtime, "native_bf16_matmul", lambda device, native=native: native)
        assert build_optimizer(model, "muon").optimizers[0].ns_dtype == dtype


def test_schedules():
    peak, lo, total, warm = 1.0, 0.1, 100, 10
    assert lr_at(0, total, peak, "cosine", warm, lo) == pytest.approx(0.1)
    assert lr_at(9, total, peak, "cosine", warm, lo) == pytest.approx(1.0)
    assert lr_at(10, total, peak, "cosine", warm, lo) == pytest.approx(1.0)
    assert lr_at(99, total, peak, "cosine", warm, lo) == pytest.approx(lo)
    mid = warm + (total - warm - 1) / 2
    assert lr_at(int(mid), total, peak, "cosine", warm, lo) == pytest.approx(
        lo + 0.5 * (peak - lo) * (1 + math.cos(math.pi * int(mid - warm) / (total - warm - 1))))
    assert lr_at(99, total, peak, "linear", warm, lo) == pytest.approx(lo)
    assert lr_at(10 + 89 // 2, total, peak, "linear", warm, lo) == pytest.approx(peak + (lo - peak) * (44 / 89))
    assert lr_at(50, total, peak, "constant", warm, lo) == peak
    assert lr_at(200, total, peak, "linear", 0, lo) == pytest.approx(lo)  # past the end stays at the minimum
    with pytest.raises(ConfigError, match="schedule"):
        lr_at(0, 10, 1.0, "step")


def test_fused_adamw_matches_foreach():
    """The CPU default (fused) takes the same steps as foreach AdamW, weight decay and no-decay groups included."""
    torch.manual_seed(0)
    a, b = _model(), _model()
    b.load_state_dict(a.state_dict())
    opts = [build_optimizer(m, "adamw", lr=1e-2, weight_decay=0.1, fused=f) for m, f in ((a, True), (b, False))]
    assert opts[0].defaults["fused"] and opts[1].defaults["foreach"]
    for step in range(5):
        grads = {n: torch.randn_like(p) for n, p in a.named_parameters()}
        for m, opt in zip((a, b), opts):
            for n, p in m.named_parameters():
                p.grad = grads[n].clone()
            opt.step()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7, msg=lambda m: f"{n}: {m}")
