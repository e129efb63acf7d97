"""transformers Phi-3 <-> difftx: its fused Q/K/V and gate/up tensors split and joined exactly, the sliding window,
generation, a DIFF initialisation from it, and what cannot be expressed refused in one line."""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import difftx  # noqa: E402
from difftx.errors import CheckpointError, ConfigError  # noqa: E402
from difftx.interop.convert import convert, save_hf  # noqa: E402
from .hf_helpers import (assert_edited_config_refused, assert_exports_back, difftx_model,  # noqa: E402
                         hf_to_difftx, max_diff, randomize_, tokens)

TOL = 1e-5


def hf_phi3(kv: int = 2, window=None, tie: bool = False, seed: int = 0):
    """A random transformers Phi3ForCausalLM, 3 layers of 4 heads of 16 (eager attention), built locally."""
    cfg = transformers.Phi3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=kv, max_position_embeddings=128,
                                  rms_norm_eps=1e-5, tie_word_embeddings=tie, sliding_window=window,
                                  rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.Phi3ForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    return randomize_(model, seed=seed).eval()


@pytest.mark.parametrize("kv,window,tie", [(2, None, False), (4, 5, True), (1, 5, False)])
def test_phi3_to_difftx_and_back(tmp_path, kv, window, tie):
    """Phi-3's qkv_proj and gate_up_proj read as difftx's separate projections give transformers' logits, and an
    export joins them again: the same class, every tensor bit-identical."""
    hf = hf_phi3(kv=kv, window=window, tie=tie)
    x, ref, model = hf_to_difftx(hf, tmp_path)
    cfg = model.config
    assert (cfg.attention, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim) == ("softmax", 4, kv, 16, 96)
    assert cfg.sliding_window == window and cfg.tie_embeddings == tie and not (cfg.bias or cfg.qkv_bias)
    with torch.no_grad():
        assert max_diff(model(x).logits, ref) < TOL
    back = assert_exports_back(tmp_path, "hf-phi3", hf, x, ref, window, TOL)
    assert type(back).__name__ == "Phi3ForCausalLM" and back.state_dict().keys() == hf.state_dict().keys()


def test_the_split_order_and_the_window_matter(tmp_path):
    """Guard for the test above: gate and up swapped, K and V swapped, or the window dropped, the logits move."""
    hf = hf_phi3(kv=4, window=5)
    hf.save_pretrained(tmp_path / "hf")
    model = difftx.load_model(tmp_path / "hf")
    x = tokens(97)
    with torch.no_grad():
        ref = hf(x).logits
        assert max_diff(model(x).logits, ref) < TOL
        state = model.state_dict()
        for a, b in (("ffn.w_gate", "ffn.w_up"), ("attn.k_proj", "attn.v_proj")):
            swapped = {k: v for k, v in state.items()}
            for i in range(3):
                ka, kb = f"layers.{i}.{a}.weight", f"layers.{i}.{b}.weight"
                swapped[ka], swapped[kb] = state[kb], state[ka]
            other = difftx.build_model(model.config).eval()
            other.load_state_dict(swapped)
            assert max_diff(other(x).logits, ref) > 1e-2, a
        whole = difftx.build_model(model.config.replace(sliding_window=None)).eval()
        whole.load_state_dict(state)
        assert max_diff(whole(x).logits, ref) > 1e-2


def test_greedy_generation_and_a_diff_initialisation_from_phi3(tmp_path):
    hf = hf_phi3(window=6)
    hf.save_pretrained(tmp_path / "hf")
    model = difftx.load_model(tmp_path / "hf")
    prompt = tokens(97, batch=1, n=5)
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, max_new_tokens=12, temperature=0), theirs)
    convert(tmp_path / "hf", tmp_path / "diff", diff_init="exact")
    diff = difftx.load_model(tmp_path / "diff")
    x = tokens(97)
    with torch.no_grad():
        assert diff.config.attention == "diff" and max_diff(diff(x).logits, hf(x).logits) < TOL


@pytest.mark.parametrize("edit,needle", [  # transformers reads the factor from rope_parameters, else the top level
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.75}),
     "partial_rotary_factor=0.75 is not supported"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}, partial_rotary_factor=0.5),
     "partial_rotary_factor=0.5 is not supported"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 500.0, "short_factor": [1.0] * 8,
                           "long_factor": [1.0] * 8}), "RoPE scaling 'longrope' is not supported"),
    (dict(sliding_window=0), "'sliding_window' must be a positive integer or null"),
])
def test_a_phi3_config_difftx_cannot_express_is_refused(tmp_path, edit, needle):
    assert_edited_config_refused(hf_phi3(), tmp_path, edit, needle)


@pytest.mark.parametrize("fused", ["self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"])
@pytest.mark.parametrize("damage", ["missing", "short"])
def test_a_bad_fused_tensor_is_named(tmp_path, fused, damage):
    from safetensors.torch import load_file, save_file

    hf_phi3().save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    sd = {k: v.clone() for k, v in load_file(path).items()}
    name = f"model.layers.1.{fused}"
    if damage == "missing":
        del sd[name]
        needle = f"tensor '{name}' is missing"
    else:
        sd[name] = sd[name][:-16].contiguous()
        needle = f"tensor '{name}' has shape"
    save_file(sd, path)
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        convert(tmp_path / "hf", tmp_path / "dx")


def test_export_refuses_what_phi3_cannot_hold():
    for fields, field in ((dict(bias=True), "bias"), (dict(qkv_bias=True), "qkv_bias"), (dict(norms="S2"), "qk_norm"),
                          (dict(sliding_window=4, full_attention_layers=[1]), "full_attention_layers")):
        with pytest.raises(ConfigError, match=f"{field}: cannot export to hf-phi3"):
            save_hf(difftx_model(attention="softmax", n_heads=2, **fields), "/nonexistent", "hf-phi3")
    with pytest.raises(ConfigError, match="attention: cannot export to hf-phi3"):
        save_hf(difftx_model(attention="diff", n_heads=2), "/nonexistent", "hf-phi3")
