"""transformers Qwen2 / Qwen3 <-> difftx: exact logits on random local models, the same tensors back, the sliding
window, a DIFF initialisation from them, generation, and what cannot be expressed refused in one line."""

from __future__ import annotations

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import difftx  # noqa: E402
from difftx.errors import ConfigError  # noqa: E402
from difftx.interop.convert import convert, save_hf  # noqa: E402
from .hf_helpers import (assert_edited_config_refused, assert_exports_back, difftx_model,  # noqa: E402
                         hf_to_difftx, max_diff, randomize_, tokens)

TOL = 1e-5


def hf_qwen(kind: str, kv: int = 2, window=None, first_windowed: int = 0, tie: bool = False, seed: int = 0):
    """A random transformers Qwen2ForCausalLM / Qwen3ForCausalLM, 3 layers; ``window``: a sliding window on the
    layers from ``first_windowed`` on (Qwen's max_window_layers)."""
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=kv, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
                  tie_word_embeddings=tie, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                  use_sliding_window=window is not None, sliding_window=window, max_window_layers=first_windowed)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    model.config._attn_implementation = "eager"
    return randomize_(model, seed=seed).eval()


@pytest.mark.parametrize("kind,kv,window,tie", [("qwen2", 2, None, False), ("qwen2", 4, 5, True),
                                                ("qwen3", 2, None, True), ("qwen3", 1, 5, False)])
def test_qwen_to_difftx_and_back(tmp_path, kind, kv, window, tie):
    """Qwen2 (biases on q, k, v only) and Qwen3 (a per-head RMSNorm of q and k) read as difftx's Transformer
    (qkv_bias; norms S2) give transformers' logits, and export back to the same class and the same tensors."""
    hf = hf_qwen(kind, kv=kv, window=window, tie=tie)
    x, ref, model = hf_to_difftx(hf, tmp_path)
    cfg = model.config
    assert (cfg.attention, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == ("softmax", 4, kv, 16)
    assert (cfg.qkv_bias, cfg.bias, cfg.qk_norm) == ((True, False, False) if kind == "qwen2" else (False, False, True))
    assert cfg.sliding_window == window and cfg.tie_embeddings == tie
    names = model.state_dict()
    assert ("layers.0.attn.q_proj.bias" in names) == (kind == "qwen2") and "layers.0.attn.out_proj.bias" not in names
    assert ("layers.0.attn.q_norm.weight" in names) == (kind == "qwen3")
    with torch.no_grad():
        assert max_diff(model(x).logits, ref) < TOL
    back = assert_exports_back(tmp_path, f"hf-{kind}", hf, x, ref, window, TOL)
    assert back.state_dict().keys() == hf.state_dict().keys()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_each_qwen_part_matters(tmp_path, kind):
    """Guard for the test above: without the q/k/v biases, the QK norm or the window, the logits move."""
    hf = hf_qwen(kind, window=5)
    hf.save_pretrained(tmp_path / "hf")
    model = difftx.load_model(tmp_path / "hf")
    x = tokens(97)
    changes = [dict(sliding_window=None)]
    changes.append(dict(qkv_bias=False) if kind == "qwen2" else dict(norms="S1"))
    with torch.no_grad():
        ref = hf(x).logits
        assert max_diff(model(x).logits, ref) < TOL
        for change in changes:
            other = difftx.build_model(model.config.replace(**change)).eval()
            other.load_state_dict(model.state_dict(), strict=False)
            assert max_diff(other(x).logits, ref) > 1e-2, change


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_greedy_generation_matches_transformers(tmp_path, kind):
    """The KV cache path (the biases and the QK norm on every decoded token; a window that drops keys)."""
    hf = hf_qwen(kind, window=6)
    hf.save_pretrained(tmp_path / "hf")
    model = difftx.load_model(tmp_path / "hf")
    x = tokens(97, batch=1, n=5)
    with torch.no_grad():
        theirs = hf.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ours = model.generate(x, max_new_tokens=12, temperature=0)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_diff_init_exact_from_qwen_keeps_the_function(tmp_path, kind):
    """--diff-init exact over a Qwen model (q/k/v biases duplicated with their rows; the QK norm per head)."""
    hf = hf_qwen(kind)
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "diff", diff_init="exact")
    model = difftx.load_model(tmp_path / "diff")
    assert model.config.attention == "diff" and model.config.qkv_bias == (kind == "qwen2")
    assert model.config.qk_norm == (kind == "qwen3")
    x = tokens(97)
    with torch.no_grad():
        assert max_diff(model(x).logits, hf(x).logits) < TOL


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_a_qwen_mixing_windowed_and_whole_layers_reads_as_full_attention_layers(tmp_path, kind):
    """Layer 1 over the whole context, layers 2-3 windowed (max_window_layers 1): difftx's full_attention_layers
    [1]; transformers' logits and greedy tokens (the cache keeps every key for layer 1), and the same layer_types
    back."""
    from transformers import AutoModelForCausalLM

    hf = hf_qwen(kind, window=4, first_windowed=1)
    assert hf.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "dx")
    model = difftx.load_model(tmp_path / "dx")
    assert model.config.sliding_window == 4 and model.config.full_attention_layers == (1,)
    x = tokens(97, n=15)
    with torch.no_grad():
        ref = hf(x).logits
        assert max_diff(model(x).logits, ref) < TOL
        for change in (dict(full_attention_layers=None), dict(full_attention_layers=[2])):
            other = difftx.build_model(model.config.replace(**change)).eval()
            other.load_state_dict(model.state_dict())
            assert max_diff(other(x).logits, ref) > 1e-2, change
        prompt = x[:1, :5]
        theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, max_new_tokens=12, temperature=0), theirs)
    convert(tmp_path / "dx", tmp_path / "hf2", dst_format=f"hf-{kind}")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="sdpa").eval()
    assert back.config.layer_types == hf.config.layer_types and back.config.max_window_layers == 1
    with torch.no_grad():
        assert max_diff(back(x).logits, ref) < TOL


@pytest.mark.parametrize("edit,needle", [
    (dict(layer_types=["full_attention", "local"]), "'layer_types' must list"),
    (dict(layer_types=None, use_sliding_window="yes"), "'use_sliding_window' must be true or false"),
    (dict(layer_types=None, max_window_layers=1.5, use_sliding_window=True, sliding_window=4),
     "'max_window_layers' must be an integer"),
    (dict(layer_types=["sliding_attention"] * 3, use_sliding_window=True, sliding_window=0),
     "'sliding_window' must be a positive integer or null"),
    (dict(attention_bias=True), "attention_bias=True is not supported for Qwen3"),
    (dict(layer_types=["sliding_attention"] * 3, use_sliding_window=False), "names sliding_attention layers but "
                                                                            "there is no sliding window"),
])
def test_a_malformed_qwen_config_is_refused(tmp_path, edit, needle):
    assert_edited_config_refused(hf_qwen("qwen3"), tmp_path, edit, needle)


def test_a_qwen_config_without_layer_types_reads_as_transformers_does(tmp_path):
    """Older Qwen configs name no layer_types: the window covers the layers from max_window_layers on, when
    use_sliding_window (all of them here), else none."""
    hf = hf_qwen("qwen2", window=4)
    hf.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    del data["layer_types"]
    path.write_text(json.dumps(data))
    assert difftx.load_model(tmp_path / "hf").config.sliding_window == 4
    data.update(use_sliding_window=False)
    path.write_text(json.dumps(data))
    assert difftx.load_model(tmp_path / "hf").config.sliding_window is None


def test_export_refuses_what_qwen_cannot_hold():
    with pytest.raises(ConfigError, match="qkv_bias: cannot export to hf-qwen2: Qwen2's q, k and v projections "
                                          "always have biases"):
        save_hf(difftx_model(attention="softmax", n_heads=2), "/nonexistent", "hf-qwen2")
    with pytest.raises(ConfigError, match="bias: cannot export to hf-qwen2"):
        save_hf(difftx_model(attention="softmax", n_heads=2, bias=True), "/nonexistent", "hf-qwen2")
    with pytest.raises(ConfigError, match="qk_norm: cannot export to hf-qwen3: Qwen3's blocks are pre-norm with a "
                                          "per-head QK norm"):
        save_hf(difftx_model(attention="softmax", n_heads=2), "/nonexistent", "hf-qwen3")
    with pytest.raises(ConfigError, match="qkv_bias: cannot export to hf-qwen3"):
        save_hf(difftx_model(attention="softmax", n_heads=2, norms="S2", qkv_bias=True), "/nonexistent", "hf-qwen3")
    with pytest.raises(ConfigError, match="attention: cannot export to hf-qwen3"):
        save_hf(difftx_model(attention="diff", n_heads=2, norms="S2"), "/nonexistent", "hf-qwen3")
    # Llama's attention_bias covers q, k, v and o: a q/k/v-only bias goes to Qwen2
    with pytest.raises(ConfigError, match="qkv_bias: cannot export to hf-llama: .* export to hf-qwen2"):
        save_hf(difftx_model(attention="softmax", n_heads=2, qkv_bias=True), "/nonexistent", "hf-llama")
    with pytest.raises(ConfigError, match="qkv_bias: cannot export to hf-mistral: .* export to hf-qwen2"):
        save_hf(difftx_model(attention="softmax", n_heads=2, qkv_bias=True), "/nonexistent", "hf-mistral")
    with pytest.raises(ConfigError, match="qk_norm: cannot export to hf-llama: .* export to hf-qwen3"):
        save_hf(difftx_model(attention="softmax", n_heads=2, norms="S2"), "/nonexistent", "hf-llama")


def test_a_difftx_model_exports_to_qwen_and_transformers_agrees(tmp_path):
    """A difftx-built model (not a transformers round trip) in both Qwen formats, windowed."""
    from transformers import AutoModelForCausalLM

    x = tokens(97)
    for fmt, fields in (("hf-qwen2", dict(qkv_bias=True)), ("hf-qwen3", dict(norms="S2"))):
        model = difftx_model(attention="softmax", n_heads=4, n_kv_heads=2, norm_eps=1e-6, sliding_window=4, **fields)
        save_hf(model, tmp_path / fmt, fmt)
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / fmt, attn_implementation="sdpa").eval()
        with torch.no_grad():
            assert max_diff(hf(x).logits, model(x).logits) < TOL, fmt


def test_convert_cli_verifies_a_qwen_directory_with_transformers(tmp_path, capsys):
    from difftx.cli import main

    hf_qwen("qwen3", window=5).save_pretrained(tmp_path / "hf")
    rc = main(["convert", str(tmp_path / "hf"), str(tmp_path / "dx"), "--verify"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "source read by transformers, result by difftx" in out.out
    assert float(re.search(r"max \|logit difference\| (\S+)", out.out).group(1)) < TOL
    rc = main(["convert", str(tmp_path / "dx"), str(tmp_path / "back"), "--to", "hf-qwen3", "--verify"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert float(re.search(r"max \|logit difference\| (\S+)", out.out).group(1)) < TOL


def test_convert_cli_refuses_a_qwen_export_it_cannot_express_in_one_line(tmp_path, capsys):
    from difftx.cli import main

    model = difftx_model(attention="softmax", n_heads=2)
    difftx.save_model(model, tmp_path / "dx")
    rc = main(["convert", str(tmp_path / "dx"), str(tmp_path / "q"), "--to", "hf-qwen2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "qkv_bias" in err[0] and "hf-qwen2" in err[0], err
    assert not (tmp_path / "q").exists()
