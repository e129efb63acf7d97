"""Weights offloaded between calls (accelerate's cpu_offload/disk_offload): each module's parameters sit on the meta
device and hooks load them for that module's call only.  Reproduced with plain torch hooks, so it runs without
accelerate; the real library is checked too where it is installed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from difftx import DifftxError, ModelConfig, build_model


def model_for(attention, tie=False):
    torch.manual_seed(0)
    cfg = ModelConfig(attention=attention, d_model=32, n_layers=2, n_heads=2 if attention == "diff" else 4,
                      vocab_size=53, max_seq_len=64, tie_embeddings=tie)
    return build_model(cfg).eval()


def offload(model: nn.Module) -> nn.Module:
    """Every module's own parameters on the meta device, loaded by a forward pre-hook and put back by a forward
    hook: what accelerate's AlignDevicesHook does for an offloaded model."""
    for m in model.modules():
        names = [n for n, _ in m.named_parameters(recurse=False)]
        if not names:
            continue
        store = {n: m._parameters[n] for n in names}

        def to_meta(mod, *args, _store=store):
            for n, p in _store.items():
                mod._parameters[n] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)

        def load(mod, args, _store=store):
            for n, p in _store.items():
                mod._parameters[n] = p

        to_meta(m)
        m.register_forward_pre_hook(load)
        m.register_forward_hook(lambda mod, args, out, _f=to_meta: _f(mod))
    return model


@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
def test_generate_on_an_offloaded_model_equals_the_plain_model(attention):
    # the KV cache was made on embed.weight's device: meta here, and the first step failed copying out of it
    model = model_for(attention)
    plain = copy.deepcopy(model)
    offload(model)
    x = torch.randint(0, 53, (2, 5))
    with torch.no_grad():
        assert torch.allclose(model(x).logits, plain(x).logits, atol=1e-5)  # hooked modules: unfused paths
    assert torch.equal(model.generate(x, max_new_tokens=6, temperature=0),
                       plain.generate(x, max_new_tokens=6, temperature=0))


@pytest.mark.parametrize("loss_chunk", [0, 8])
def test_a_tied_head_over_an_offloaded_embedding_is_one_clear_error(loss_chunk):
    # the tied head reads embed.weight outside the embedding's call: there it is a meta tensor, and F.linear of a
    # real input and a meta weight returned an uninitialised tensor (NaN or garbage logits, no error)
    model = offload(model_for("softmax", tie=True))
    x = torch.randint(0, 53, (2, 20))
    with pytest.raises(DifftxError, match="meta device"):
        model(x, targets=x, loss_chunk=loss_chunk)


def test_accelerate_cpu_offload():
    accelerate = pytest.importorskip("accelerate")
    model = model_for("diff")
    plain = copy.deepcopy(model)
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    x = torch.randint(0, 53, (2, 5))
    with torch.no_grad():
        assert torch.allclose(model(x).logits, plain(x).logits, atol=1e-6)
    assert torch.equal(model.generate(x, max_new_tokens=4, temperature=0),
                       plain.generate(x, max_new_tokens=4, temperature=0))
    tied = model_for("softmax", tie=True)
    accelerate.cpu_offload(tied, execution_device=torch.device("cpu"))
    with pytest.raises(DifftxError, match="meta device"):
        tied(x)
