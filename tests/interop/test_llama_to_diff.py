"""Softmax (Llama) -> DIFF initialisation: what each mode preserves at step 0, checked exactly."""

from __future__ import annotations

import pytest
import torch

import difftx
from difftx.errors import ConfigError
from difftx.interop.llama_to_diff import llama_to_diff
from .hf_helpers import difftx_model, max_diff, tokens

GQA = dict(attention="softmax", n_heads=4, n_kv_heads=2)


def converted(source, mode, pairing="adjacent"):
    cfg, sd = llama_to_diff(source.config, source.state_dict(), mode=mode, pairing=pairing)
    model = difftx.build_model(cfg).eval()
    model.load_state_dict(sd)
    return model


def out_proj_inputs(model, x):
    """Each layer's attention output before out_proj (B, N, width), all layers fed the same input x."""
    from difftx.nn.mask import AttnMask

    seen = []
    hooks = [m.out_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
             for m in model.attention_modules()]
    rope = model.rope.cos_sin(torch.arange(x.shape[1]))
    with torch.no_grad():
        for m in model.attention_modules():
            m(x, rope, AttnMask(causal=True, n_q=x.shape[1], n_k=x.shape[1]))
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("fields", [GQA, dict(attention="softmax", n_heads=4, norms="S2", bias=True)])
@pytest.mark.parametrize("pairing", ["adjacent", "halves"])
def test_exact_mode_keeps_the_function(fields, pairing):
    source = difftx_model(**fields)
    model = converted(source, "exact", pairing)
    x = tokens(97)
    with torch.no_grad():
        assert max_diff(model(x).logits, source(x).logits) < 1e-5
    assert model.lambdas() == [0.0] * model.config.n_layers
    assert model.config.n_heads == source.config.n_heads  # one differential head per Transformer head


def test_exact_mode_lambda_is_trainable():
    model = converted(difftx_model(**GQA), "exact")
    x = tokens(97)
    model.train()
    model(x[:, :-1], targets=x[:, 1:]).loss.backward()
    attn = model.layers[0].attn
    assert float(attn.lambda_q1.grad.abs().sum()) > 0 and float(attn.lambda_k2.grad.abs().sum()) > 0


def test_twin_zero_keeps_the_first_half_of_every_head():
    source = difftx_model(**GQA)
    model = converted(source, "twin-zero")
    x = torch.randn(2, 11, 64)
    d, h = source.config.head_dim, model.config.n_heads
    for src, dst in zip(out_proj_inputs(source, x), out_proj_inputs(model, x)):
        src_heads = src.view(*src.shape[:2], 2 * h, d)
        dst_heads = dst.view(*dst.shape[:2], h, 2, d)
        assert max_diff(dst_heads[:, :, :, 0], src_heads[:, :, :h]) < 1e-5   # head j's own output, exactly
        assert max_diff(dst_heads[:, :, :, 1], src_heads[:, :, h:]) > 1e-3   # head j + H/2 uses head j's map
    matched = source.config.twin("diff").replace(head_norm=False)  # the twin without per-head norm gains
    assert model.num_parameters() == difftx.build_model(matched).num_parameters()


def test_twin_is_the_papers_diff_at_matched_size():
    source = difftx_model(**GQA)
    model = converted(source, "twin")
    twin = source.config.twin("diff")
    cfg = model.config
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim) == (twin.n_heads, twin.n_kv_heads,
                                                                         twin.head_dim, twin.ffn_dim)
    assert cfg.lambda_init == "schedule" and cfg.head_norm
    assert model.num_parameters() == difftx.build_model(twin).num_parameters()
    schedule = [cfg.lambda_init_for(layer) for layer in range(1, cfg.n_layers + 1)]
    assert all(abs(a - b) < 0.5 for a, b in zip(model.lambdas(), schedule))


@pytest.mark.parametrize("mode", ["exact", "twin-zero", "twin"])
def test_everything_outside_attention_is_copied(mode):
    source = difftx_model(**GQA)
    model = converted(source, mode)
    for name, t in source.state_dict().items():
        if ".attn." not in name or name.endswith("out_proj.bias"):
            assert torch.equal(model.state_dict()[name], t), name


def test_odd_head_counts_need_exact_mode():
    source = difftx_model(attention="softmax", n_heads=4, n_kv_heads=1)
    with pytest.raises(ConfigError, match="exact"):
        llama_to_diff(source.config, source.state_dict(), mode="twin")
    llama_to_diff(source.config, source.state_dict(), mode="exact")


def test_the_package_level_llama_to_diff_is_callable():
    """difftx.interop exports llama_to_diff (its docstring: `from difftx.interop import ..., llama_to_diff`), but
    once the submodule of the same name is imported the package attribute is that module: the documented
    import gave a module, and calling it was a TypeError."""
    import difftx.interop
    from difftx.interop import llama_to_diff as exported

    source = difftx_model(**GQA)
    cfg, sd = exported(source.config, source.state_dict(), mode="exact")
    ref_cfg, ref_sd = llama_to_diff(source.config, source.state_dict(), mode="exact")
    assert cfg == ref_cfg and all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
    assert difftx.interop.llama_to_diff.llama_to_diff is llama_to_diff  # the documented module path still works
