"""transformers Llama / DiffLlama / Mistral <-> difftx: exact round trips on random local models, GQA included."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import difftx  # noqa: E402
from difftx.errors import CheckpointError, ConfigError  # noqa: E402
from difftx.interop.convert import convert, save_hf  # noqa: E402
from .hf_helpers import assert_exports_back, difftx_model, hf_llama, hf_to_difftx, max_diff, tokens  # noqa: E402

TOL = 1e-5

LAYOUTS = [
    ("llama", 4, 4, False),   # MHA
    ("llama", 4, 2, False),   # GQA
    ("llama", 4, 1, True),    # MQA, tied embeddings
    ("diffllama", 4, 4, False),
    ("diffllama", 4, 2, False),  # GQA: 2 differential heads over 1 K/V group
    ("diffllama", 8, 4, True),
]


@pytest.mark.parametrize("kind,heads,kv,tie", LAYOUTS)
def test_hf_to_difftx_and_back(tmp_path, kind, heads, kv, tie):
    from transformers import AutoModelForCausalLM

    hf = hf_llama(kind, heads=heads, kv=kv, tie=tie)
    hf.save_pretrained(tmp_path / "hf")
    x = tokens(97)
    with torch.no_grad():
        ref = hf(x).logits

    convert(tmp_path / "hf", tmp_path / "dx")
    model = difftx.load_model(tmp_path / "dx")
    cfg = model.config
    assert cfg.attention == ("softmax" if kind == "llama" else "diff")
    assert cfg.n_kv_heads == (kv if kind == "llama" else kv // 2)
    with torch.no_grad():
        assert max_diff(model(x).logits, ref) < TOL

    convert(tmp_path / "dx", tmp_path / "hf2", dst_format=f"hf-{kind}")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager").eval()
    assert type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        assert max_diff(back(x).logits, ref) < TOL
    # the same tensors come back under the same names
    sd_a, sd_b = hf.state_dict(), back.state_dict()
    for name, t in sd_a.items():
        assert torch.equal(t, sd_b[name]), name


def test_load_model_reads_hf_dirs_directly(tmp_path):
    hf = hf_llama("diffllama", heads=4, kv=2)
    hf.save_pretrained(tmp_path / "hf")
    x = tokens(97)
    with torch.no_grad():
        assert max_diff(difftx.load_model(tmp_path / "hf")(x).logits, hf(x).logits) < TOL


@pytest.mark.parametrize("pairing,rope_style", [("adjacent", "half"), ("adjacent", "interleaved"),
                                                ("halves", "interleaved")])
def test_difftx_diff_exports_to_diffllama_from_any_layout(tmp_path, pairing, rope_style):
    from transformers import AutoModelForCausalLM

    model = difftx_model(attention="diff", n_heads=2, n_kv_heads=1, head_norm_weight=False, norm_eps=1e-5,
                         pairing=pairing, rope_style=rope_style)
    save_hf(model, tmp_path / "hf", "hf-diffllama")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    x = tokens(97)
    with torch.no_grad():
        assert max_diff(hf(x).logits, model(x).logits) < TOL


def test_a_wrong_layout_is_detected_by_these_checks(tmp_path):
    """Guard for the tests above: loading halves-paired weights as adjacent changes the logits a lot."""
    hf = hf_llama("diffllama", heads=4, kv=2)
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "dx")
    model = difftx.load_model(tmp_path / "dx")
    wrong = difftx.build_model(model.config.replace(pairing="adjacent"))
    wrong.load_state_dict(model.state_dict())
    x = tokens(97)
    with torch.no_grad():
        assert max_diff(wrong(x).logits, hf(x).logits) > 1e-2


def test_export_refuses_what_the_target_cannot_hold():
    model = difftx_model(attention="softmax", n_heads=4, norms="S2")
    with pytest.raises(ConfigError, match="qk_norm"):
        save_hf(model, "/nonexistent", "hf-llama")
    model = difftx_model(attention="diff", n_heads=2, norm_eps=1e-5)  # trained head-norm gain
    with pytest.raises(ConfigError, match="head_norm_weight"):
        save_hf(model, "/nonexistent", "hf-diffllama")
    model = difftx_model(attention="diff", n_heads=2, head_norm_weight=False, lambda_init=0.5, norm_eps=1e-5)
    with pytest.raises(ConfigError, match="lambda_init"):
        save_hf(model, "/nonexistent", "hf-diffllama")
    for attention, fmt in (("softmax", "hf-llama"), ("diff", "hf-diffllama")):  # a window Llama has no field for
        model = difftx_model(attention=attention, n_heads=2, head_norm_weight=False, norm_eps=1e-5, sliding_window=8)
        with pytest.raises(ConfigError, match=f"sliding_window: cannot export to {fmt}: {fmt} attends over the whole"):
            save_hf(model, "/nonexistent", fmt)
    with pytest.raises(ConfigError, match="or to hf-mistral"):
        save_hf(difftx_model(attention="softmax", n_heads=2, sliding_window=8), "/nonexistent", "hf-llama")
    with pytest.raises(ConfigError, match="bias: cannot export to hf-mistral: Mistral's projections have no biases"):
        save_hf(difftx_model(attention="softmax", n_heads=2, bias=True), "/nonexistent", "hf-mistral")
    with pytest.raises(ConfigError, match="attention: cannot export to hf-mistral: hf-mistral holds attention='softmax'"):
        save_hf(difftx_model(attention="diff", n_heads=2, sliding_window=8), "/nonexistent", "hf-mistral")


@pytest.mark.parametrize("window,kv", [(5, 2), (None, 4), (5, 1)])
def test_mistral_to_difftx_and_back_keeps_the_sliding_window(tmp_path, window, kv):
    """transformers' MistralForCausalLM (a Llama with a sliding window) <-> difftx's Transformer with
    ``sliding_window``: the same logits over 13 tokens (a window of 5 hides keys), the same tensors back; the window
    is what makes them equal (the same weights without it differ)."""
    hf = hf_llama("mistral", heads=4, kv=kv, window=window)
    x, ref, model = hf_to_difftx(hf, tmp_path)
    assert model.config.attention == "softmax" and model.config.sliding_window == window and not model.config.bias
    with torch.no_grad():
        assert max_diff(model(x).logits, ref) < TOL
        if window is not None:
            whole = difftx.build_model(model.config.replace(sliding_window=None)).eval()
            whole.load_state_dict(model.state_dict())
            assert max_diff(whole(x).logits, ref) > 1e-2
    back = assert_exports_back(tmp_path, "hf-mistral", hf, x, ref, window, TOL)
    assert type(back).__name__ == "MistralForCausalLM"


@pytest.mark.parametrize("bad", [0, -2, 2.5, "4096", True])
def test_a_mistral_config_with_a_bad_sliding_window_is_refused(tmp_path, bad):
    import json

    hf = hf_llama("mistral", heads=4, kv=2, window=5)
    hf.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    data["sliding_window"] = bad
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="'sliding_window' must be a positive integer or null"):
        convert(tmp_path / "hf", tmp_path / "dx")
    assert not (tmp_path / "dx").exists()


def test_shape_mismatch_names_the_tensor(tmp_path):
    from safetensors.torch import save_file
    from tests.conftest import load_owned

    hf_llama("llama", heads=4, kv=2).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    sd = load_owned(path)
    sd["model.layers.1.self_attn.k_proj.weight"] = sd["model.layers.1.self_attn.k_proj.weight"][:16]
    save_file(sd, path)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' has shape \(16, 64\)"):
        difftx.load_model(tmp_path / "hf")
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, path)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' is missing"):
        difftx.load_model(tmp_path / "hf")


def test_unsupported_config_is_one_clear_error(tmp_path):
    import json

    hf_llama("llama").save_pretrained(tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="llama3"):
        difftx.load_model(tmp_path / "hf")


def test_llama_with_biases(tmp_path):
    hf = hf_llama("llama", heads=4, kv=2, bias=True)
    hf.save_pretrained(tmp_path / "hf")
    model = difftx.load_model(tmp_path / "hf")
    assert model.config.bias and model.layers[0].attn.q_proj.bias is not None
    x = tokens(97)
    with torch.no_grad():
        assert max_diff(model(x).logits, hf(x).logits) < TOL


def _bpe_tokenizer_json() -> str:
    from difftx.data.tokenizers import train_bpe

    return train_bpe(["the quick brown fox jumps over the lazy dog. " * 20], vocab_size=300)._json  # the files are what is checked


@pytest.mark.parametrize("kind", ["llama", "diffllama"])
def test_hf_to_difftx_to_hf_keeps_tokenizer_token_ids_and_dtype(tmp_path, kind):
    """A bf16 checkpoint with its tokenizer files and special-token ids survives HF -> difftx -> HF."""
    import json

    from transformers import AutoModelForCausalLM

    hf = hf_llama(kind, heads=4, kv=2)
    hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id = 1, 2, 0
    hf.generation_config.bos_token_id, hf.generation_config.eos_token_id = 1, 2
    hf = hf.to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text(_bpe_tokenizer_json())
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    names = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]

    convert(tmp_path / "hf", tmp_path / "dx")
    from safetensors.torch import load_file

    stored = load_file(tmp_path / "dx" / "model.safetensors")
    for name, t in stored.items():  # as the source, with no --dtype; DIFF's lambdas in float32 (exact upcasts)
        assert t.dtype == (torch.float32 if name.rsplit(".", 1)[-1].startswith("lambda_") else torch.bfloat16), name
    convert(tmp_path / "dx", tmp_path / "hf2", dst_format=f"hf-{kind}")
    for name in names:
        assert (tmp_path / "hf2" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    written = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert written["dtype"] == "bfloat16"
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (1, 2, 0)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager").eval()
    assert back.dtype == torch.bfloat16 and back.config.eos_token_id == 2
    for name, t in hf.state_dict().items():
        assert torch.equal(t, back.state_dict()[name]), name


def test_a_sentencepiece_tokenizer_without_tokenizer_json_survives_hf_to_difftx_to_hf(tmp_path):
    """A Hugging Face directory whose tokenizer is tokenizer.model alone (SentencePiece, no tokenizer.json): its
    files travel both ways (difftx -> Hugging Face copied nothing when tokenizer.json was absent)."""
    import json

    hf_llama("llama", heads=4, kv=2).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.model").write_bytes(b"\x0a\x05a sentencepiece model, as bytes")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    convert(tmp_path / "hf", tmp_path / "dx")
    convert(tmp_path / "dx", tmp_path / "hf2", dst_format="hf-llama")
    for name in ("tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf2" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name


def test_chat_templates_and_added_tokens_survive_hf_to_difftx_to_hf(tmp_path):
    """transformers >= 4.43 saves a tokenizer's chat template as chat_template.jinja (further templates under
    additional_chat_templates/), not in tokenizer_config.json; slow tokenizers keep added_tokens.json: all travel."""
    import json

    hf_llama("llama", heads=4, kv=2).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text(_bpe_tokenizer_json())
    (tmp_path / "hf" / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (tmp_path / "hf" / "additional_chat_templates").mkdir()
    (tmp_path / "hf" / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    (tmp_path / "hf" / "added_tokens.json").write_text(json.dumps({"<tool>": 300}))
    names = ["chat_template.jinja", "additional_chat_templates/tool_use.jinja", "added_tokens.json"]
    convert(tmp_path / "hf", tmp_path / "dx")
    convert(tmp_path / "dx", tmp_path / "hf2", dst_format="hf-llama")
    convert(tmp_path / "hf2", tmp_path / "hf3", dst_format="hf-difftx")  # Hugging Face -> Hugging Face too
    for out in ("dx", "hf2", "hf3"):
        for name in names:
            assert (tmp_path / out / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), (out, name)


def test_difftx_byte_tokenizer_goes_along_under_its_own_name(tmp_path):
    import json

    from difftx.data.tokenizers import ByteTokenizer

    model = difftx_model(attention="softmax", n_heads=4, vocab_size=256)
    difftx.save_model(model, tmp_path / "m")
    ByteTokenizer().save(tmp_path / "m")
    convert(tmp_path / "m", tmp_path / "hf", dst_format="hf-llama")
    assert not (tmp_path / "hf" / "tokenizer.json").exists()  # not a Hugging Face tokenizer
    assert json.loads((tmp_path / "hf" / "difftx_tokenizer.json").read_text())["difftx_tokenizer"] == "byte"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
    convert(tmp_path / "hf", tmp_path / "back")
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (tmp_path / "m" / "tokenizer.json").read_bytes()


def test_diffllama_config_without_rms_norm_eps_uses_diffllamas_default(tmp_path):
    import json

    hf = hf_llama("diffllama", heads=4, kv=2, eps=1e-5)
    hf.save_pretrained(tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["rms_norm_eps"]  # transformers' DiffLlamaConfig then uses 1e-5 (Llama's default is 1e-6)
    cfg_path.write_text(json.dumps(cfg))
    model = difftx.load_model(tmp_path / "hf")
    assert model.config.norm_eps == model.config.head_norm_eps == 1e-5
    x = tokens(97)
    with torch.no_grad():
        assert max_diff(model(x).logits, hf(x).logits) < TOL


@pytest.mark.parametrize("kind", ["llama", "diffllama"])
def test_tied_config_with_a_different_lm_head_keeps_the_head(tmp_path, kind):
    """config.json ties the embeddings but the checkpoint holds an lm_head.weight of other values: transformers
    loads that head untied; the conversion used to drop it and tie (logits off by ~3)."""
    from safetensors.torch import save_file
    from tests.conftest import load_owned
    from transformers import AutoModelForCausalLM

    hf_llama(kind, tie=True).save_pretrained(tmp_path / "hf")
    sd = load_owned(tmp_path / "hf" / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    sd["lm_head.weight"] = 0.1 * torch.randn(sd["model.embed_tokens.weight"].shape, generator=g)
    save_file(sd, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    x = tokens(97)
    with torch.no_grad():
        ref = ref_model(x).logits
        convert(tmp_path / "hf", tmp_path / "dx")
        model = difftx.load_model(tmp_path / "dx")
        assert not model.config.tie_embeddings
        assert max_diff(model(x).logits, ref) < TOL
        assert max_diff(difftx.load_model(tmp_path / "hf")(x).logits, ref) < TOL


def test_other_hugging_face_files_travel_beside_a_difftx_tokenizer(tmp_path):
    """A Hugging Face directory holding difftx_tokenizer.json (a byte tokenizer) and generation_config.json /
    tokenizer_config.json: converting it to difftx copied the difftx tokenizer alone, and difftx -> Hugging Face
    then dropped the other files too."""
    import json

    from difftx.data.tokenizers import ByteTokenizer

    model = difftx_model(attention="softmax", n_heads=4, vocab_size=256)
    difftx.save_model(model, tmp_path / "m")
    ByteTokenizer().save(tmp_path / "m")
    convert(tmp_path / "m", tmp_path / "hf", dst_format="hf-llama")
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7, "do_sample": False}))
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    names = ["generation_config.json", "tokenizer_config.json"]
    convert(tmp_path / "hf", tmp_path / "dx")
    assert (tmp_path / "dx" / "tokenizer.json").read_bytes() == (tmp_path / "m" / "tokenizer.json").read_bytes()
    convert(tmp_path / "dx", tmp_path / "hf2", dst_format="hf-llama")
    assert not (tmp_path / "hf2" / "tokenizer.json").exists()
    assert (tmp_path / "hf2" / "difftx_tokenizer.json").read_bytes() == \
        (tmp_path / "hf" / "difftx_tokenizer.json").read_bytes()
    for out in ("dx", "hf2"):
        for name in names:
            assert (tmp_path / out / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), (out, name)


@pytest.mark.parametrize("stale", ["model.safetensors.index.json", "pytorch_model.bin.index.json",
                                   "pytorch_model.bin"])
def test_weights_are_read_from_the_file_transformers_reads(tmp_path, stale):
    """save_hf into a directory holding older weights (shards and their index, a pytorch_model.bin) writes
    model.safetensors beside them: transformers loads that file first, and load_model / convert read the older
    shards (or the .bin) instead, another model's weights, silently."""
    import json

    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    old = difftx_model(attention="softmax", n_heads=4, n_kv_heads=2, seed=1)
    new = difftx_model(attention="softmax", n_heads=4, n_kv_heads=2, seed=2)
    save_hf(old, tmp_path / "old", "hf-llama")
    old_sd = LlamaForCausalLM.from_pretrained(tmp_path / "old").state_dict()
    hf = tmp_path / "hf"
    hf.mkdir()
    if stale == "pytorch_model.bin":
        torch.save(old_sd, hf / stale)
    else:
        shard = "model-00001-of-00001.safetensors" if stale.startswith("model") else "pytorch_model-00001-of-00001.bin"
        (save_file if shard.endswith(".safetensors") else torch.save)(old_sd, hf / shard)
        (hf / stale).write_text(json.dumps({"weight_map": {k: shard for k in old_sd}}))
    save_hf(new, hf, "hf-llama")
    x = tokens(97)
    with torch.no_grad():
        ref = new(x).logits
        assert max_diff(LlamaForCausalLM.from_pretrained(hf).eval()(x).logits, ref) < TOL
        assert max_diff(difftx.load_model(hf)(x).logits, ref) < TOL
        convert(hf, tmp_path / "dx")
        assert max_diff(difftx.load_model(tmp_path / "dx")(x).logits, ref) < TOL


def test_a_diffllama_lambda_std_dev_of_zero_survives_hf_to_difftx_to_hf(tmp_path):
    """lambda_std_dev 0.0 (lambda vectors initialised to zero) was read with `or 0.1`, so the difftx config and the
    Hugging Face config written back from it said 0.1."""
    import json

    hf = hf_llama("diffllama", heads=4, kv=2, eps=1e-5)
    hf.config.lambda_std_dev = 0.0
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "dx")
    assert difftx.load_model(tmp_path / "dx").config.lambda_std == 0.0
    convert(tmp_path / "dx", tmp_path / "hf2", dst_format="hf-diffllama")
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["lambda_std_dev"] == 0.0


def test_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it(tmp_path):
    """A config holding rope_parameters and a rope_scaling (the older name, added by hand to extend the context):
    transformers uses rope_scaling, and difftx read rope_parameters, so a linear scaling was converted as plain RoPE
    and another theta ignored, the logits off without a word."""
    import json

    from transformers import LlamaForCausalLM

    hf_llama("llama").save_pretrained(tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    assert cfg["rope_parameters"]["rope_theta"] == 500.0
    cfg["rope_scaling"] = {"rope_type": "default", "rope_theta": 10000.0}
    cfg_path.write_text(json.dumps(cfg))
    x = tokens(97)
    with torch.no_grad():
        ref = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()(x).logits
        assert max_diff(difftx.load_model(tmp_path / "hf")(x).logits, ref) < TOL
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="RoPE scaling 'linear' is not supported"):
        difftx.load_model(tmp_path / "hf")
