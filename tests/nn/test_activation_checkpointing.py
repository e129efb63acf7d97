"""Activation checkpointing (``set_activation_checkpointing``, ``--activation-checkpointing``).

A checkpointed block keeps only its inputs for backward and runs again there: the loss and every gradient must be
the same bits as without it, on the chained block path (the residual additions fused into the next norm) and the
block-by-block one (dropout), for each attention kind, in fp32 and under bf16 autocast; and the step's memory must
really fall.  Decoding, evaluation probes and code without autograd never recompute.
"""

import pytest
import torch

from difftx.benchmarking.memory import peak_live_bytes
from difftx.config import ModelConfig
from difftx.models import build_model
from difftx.nn.mask import AttnMask
from difftx.nn.probe import AttentionProbe, attach_probe


def _grads(model, x, y, every, bf16=False, seed=0):
    model.set_activation_checkpointing(every)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # dropout's draws: the recomputation must repeat them
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(x, targets=y).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(a, b):
    (la, ga), (lb, gb) = a, b
    assert torch.equal(la, lb), (float(la), float(lb))
    assert ga.keys() == gb.keys()
    for name in ga:
        assert torch.equal(ga[name], gb[name]), (name, float((ga[name] - gb[name]).abs().max()))


@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
@pytest.mark.parametrize("norms", ["pre", "dnt"])
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_same_loss_and_gradients_bit_for_bit(attention, norms, bf16, dropout, monkeypatch):
    """Without dropout the blocks run chained (each one's last residual addition pending into the next block's
    norm, checked below); with dropout, block by block."""
    from difftx.nn.block import Block

    chained = []
    parts = Block.forward_parts
    monkeypatch.setattr(Block, "forward_parts", lambda self, x, pending, *a: chained.append(pending is not None)
                        or parts(self, x, pending, *a))
    cfg = ModelConfig.from_preset("nano", attention=attention, norms=norms, dropout=dropout, max_seq_len=256)
    torch.manual_seed(0)
    model = build_model(cfg).train()
    x, y = torch.randint(0, cfg.vocab_size, (4, 256)), torch.randint(0, cfg.vocab_size, (4, 256))
    ref = _grads(model, x, y, 0, bf16)
    for every in (1, 2):
        _same(_grads(model, x, y, every, bf16), ref)
    assert any(chained) == (dropout == 0.0), chained
    assert model.activation_checkpointing() == [i % 2 == 0 for i in range(cfg.n_layers)]  # every=2, the last set


def test_a_vision_model_too():
    cfg = ModelConfig.from_preset("vdnt-tiny", attention="diff")
    torch.manual_seed(0)
    model = build_model(cfg).train()
    x = torch.randn(4, cfg.in_channels, cfg.image_size, cfg.image_size)
    y = torch.randint(0, cfg.num_classes, (4,))
    _same(_grads(model, x, y, 1), _grads(model, x, y, 0))


@pytest.mark.parametrize("attention", ["softmax", "diff"])
def test_the_step_holds_far_fewer_activations(attention):
    """Peak live tensor bytes of forward + backward: every block recomputed holds about a third of the activations
    of none (measured 0.34x at the small preset), every other block about two thirds."""
    cfg = ModelConfig.from_preset("nano", attention=attention, n_layers=4, max_seq_len=256)
    torch.manual_seed(0)
    model = build_model(cfg)
    x, y = torch.randint(0, cfg.vocab_size, (4, 256)), torch.randint(0, cfg.vocab_size, (4, 256))
    peaks = {}
    for every in (0, 2, 1):
        model.set_activation_checkpointing(every)

        def step():
            model(x, targets=y).loss.backward()
            model.zero_grad(set_to_none=True)

        step()
        peaks[every] = peak_live_bytes(step)[0]
    assert peaks[1] < 0.6 * peaks[0] and peaks[1] < peaks[2] < 0.9 * peaks[0], peaks


def test_decoding_and_no_grad_code_never_recompute(monkeypatch):
    """A KV cache or no autograd: the checkpoint function is never called, and the outputs are the same."""
    import difftx.nn.block as block

    cfg = ModelConfig.from_preset("nano", attention="diff", max_seq_len=64)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (2, 9))
    ref = model.generate(prompt, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        logits = model(prompt).logits
    calls = []

    def checkpoint(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("recomputed")

    monkeypatch.setattr(block, "_NON_REENTRANT", checkpoint)
    model.set_activation_checkpointing(1)
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), ref)
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, logits)
    assert calls == []
    with pytest.raises(RuntimeError, match="recomputed"):  # with autograd, it is reached
        model(prompt)
    assert calls == [1]


def test_a_probe_observes_each_layer_once_per_forward():
    """Probes see inside the forward; the recomputation in backward would show them every map again."""
    cfg = ModelConfig.from_preset("nano", attention="diff", max_seq_len=32)
    torch.manual_seed(0)
    model = build_model(cfg)
    model.set_activation_checkpointing(1)
    seen = []

    class Count(AttentionProbe):
        def observe(self, layer, logits, effective, mask):
            seen.append(layer)

    x = torch.randint(0, cfg.vocab_size, (1, 32))
    with attach_probe(model, Count()):
        model(x, targets=x).loss.backward()
    assert seen == list(range(1, cfg.n_layers + 1))


@pytest.mark.parametrize("every", [-1, 1.5, True, "1"])
def test_a_bad_setting_is_refused(every):
    model = build_model(ModelConfig.from_preset("nano"))
    with pytest.raises(ValueError, match="every must be a non-negative integer"):
        model.set_activation_checkpointing(every)
    assert model.activation_checkpointing() == [False] * model.config.n_layers


def test_a_block_called_on_its_own_honours_its_flag():
    """``difftx.nn.Block`` in a user's own loop: the flag is read in its forward, not only by difftx's models, so
    it is never set and silently ignored; the checkpoint function (transformers' slot) runs once per call."""
    from torch.utils.checkpoint import checkpoint

    from difftx.nn import AttnMask, Block, RotaryEmbedding

    cfg = ModelConfig.from_preset("nano", attention="diff", max_seq_len=32)
    torch.manual_seed(0)
    block = Block(cfg, 1)
    x = torch.randn(2, 32, cfg.d_model, requires_grad=True)
    rope = RotaryEmbedding(cfg.head_dim).cos_sin(torch.arange(32))
    mask = AttnMask(causal=True, n_q=32, n_k=32)
    calls = []

    def run(flag):
        block.gradient_checkpointing = flag
        block.zero_grad(set_to_none=True)
        x.grad = None
        block(x, rope, mask).square().sum().backward()
        return [x.grad] + [p.grad for p in block.parameters()]

    ref = run(False)
    block._gradient_checkpointing_func = lambda *a, **k: calls.append(1) or checkpoint(*a, use_reentrant=False, **k)
    got = run(True)
    assert calls == [1]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_torch_func_and_forward_mode_ad_run_without_recomputing():
    """torch.func.grad refuses saved-tensor hooks (what checkpointing works by: "don't yet support saved tensor
    hooks"); under it, and under forward-mode AD, the blocks run as they are: the same gradients and tangents."""
    import torch.autograd.forward_ad as fwAD
    from torch.func import functional_call, grad

    cfg = ModelConfig.from_preset("nano", attention="diff", max_seq_len=32)
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 32))
    params = {k: v.detach() for k, v in model.named_parameters()}
    tangent = torch.randn(2, 32, cfg.d_model)

    def run(every):
        model.set_activation_checkpointing(every)
        g = grad(lambda p: functional_call(model, p, (x,), {"targets": x}).loss)(params)
        with fwAD.dual_level():
            dual = fwAD.make_dual(torch.randn(2, 32, cfg.d_model, generator=torch.Generator().manual_seed(1)),
                                  tangent)
            out = model.layers[0](dual, model.rope.cos_sin(torch.arange(32)[None].expand(2, 32)),
                                  AttnMask(causal=True, n_q=32, n_k=32))
            jvp = fwAD.unpack_dual(out).tangent
        return g, jvp

    (g0, t0), (g1, t1) = run(0), run(1)
    assert all(torch.equal(g0[k], g1[k]) for k in g0)
    assert torch.equal(t0, t1)


def test_a_hessian_vector_product_through_recomputed_blocks():
    """Double backward (create_graph=True) through checkpointed blocks: the same Hessian-vector product, bit for bit."""
    cfg = ModelConfig.from_preset("nano", attention="diff", max_seq_len=32)
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 32))

    def hvp(every):
        model.set_activation_checkpointing(every)
        params = list(model.parameters())
        g = torch.autograd.grad(model(x, targets=x).loss, params, create_graph=True)
        return torch.autograd.grad(sum(t.sum() for t in g), params, allow_unused=True)

    ref, got = hvp(0), hvp(1)
    assert sum(t is not None for t in ref) > len(ref) // 2
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(ref, got))
