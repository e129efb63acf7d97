"""Helpers for interop tests: random transformers models built locally (never downloaded)."""

from __future__ import annotations

import pytest
import torch

import difftx


def randomize_(model: torch.nn.Module, std: float = 0.1, seed: int = 0) -> torch.nn.Module:
    """Overwrite every parameter with seeded noise (norm gains around 1) so wrong mappings show up."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * std
            if p.dim() == 1 and ("norm" in name or name.endswith("layernorm.weight")):
                p.copy_(1.0 + noise)
            else:
                p.copy_(noise)
    return model


def tokens(vocab: int, batch: int = 2, n: int = 13, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def hf_llama(kind: str = "llama", heads: int = 4, kv: int = 2, tie: bool = False, eps: float = 1e-6,
             bias: bool = False, seed: int = 0, window=None):
    """A random transformers LlamaForCausalLM / DiffLlamaForCausalLM / MistralForCausalLM (``kind`` "mistral",
    ``window`` its sliding window; eager attention), built locally."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=heads, num_key_value_heads=kv, head_dim=16, max_position_embeddings=128,
                  rms_norm_eps=eps, tie_word_embeddings=tie, attention_bias=bias,
                  rope_parameters={"rope_type": "default", "rope_theta": 500.0})  # not the default: mapped
    if kind == "llama":
        cfg = transformers.LlamaConfig(mlp_bias=bias, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "mistral":
        del common["attention_bias"]  # Mistral has no biases
        cfg = transformers.MistralConfig(sliding_window=window, **common)
        model = transformers.MistralForCausalLM(cfg)
    else:
        cfg = transformers.DiffLlamaConfig(**common)
        model = transformers.DiffLlamaForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    return randomize_(model, seed=seed).eval()


def difftx_model(seed: int = 0, **fields) -> torch.nn.Module:
    base = dict(d_model=64, n_layers=2, vocab_size=97, max_seq_len=64)
    base.update(fields)
    torch.manual_seed(seed)
    return randomize_(difftx.build_model(difftx.ModelConfig(**base)), seed=seed).eval()


def hf_to_difftx(hf, tmp_path):
    """(tokens, transformers' logits on them, the difftx model) after ``hf`` is saved to ``tmp_path / "hf"`` and
    converted to ``tmp_path / "dx"``."""
    from difftx.interop.convert import convert

    hf.save_pretrained(tmp_path / "hf")
    x = tokens(97)
    with torch.no_grad():
        ref = hf(x).logits
    convert(tmp_path / "hf", tmp_path / "dx")
    return x, ref, difftx.load_model(tmp_path / "dx")


def assert_exports_back(tmp_path, fmt: str, hf, x, ref, window, tol: float = 1e-5):
    """``tmp_path / "dx"`` exported to ``fmt`` reads back in transformers (eager and SDPA) as ``hf``'s class with its
    sliding window and logits within ``tol``, every tensor of ``hf`` equal; returns the last model read."""
    from transformers import AutoModelForCausalLM

    from difftx.interop.convert import convert

    convert(tmp_path / "dx", tmp_path / "hf2", dst_format=fmt)
    for impl in ("eager", "sdpa"):
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation=impl).eval()
        assert type(back).__name__ == type(hf).__name__ and back.config.sliding_window == window
        with torch.no_grad():
            assert max_diff(back(x).logits, ref) < tol
    for name, t in hf.state_dict().items():
        assert torch.equal(t, back.state_dict()[name]), name
    return back


def assert_edited_config_refused(hf, tmp_path, edit: dict, needle: str) -> None:
    """``hf`` saved with ``edit`` merged into its config.json: converting it raises a CheckpointError containing
    ``needle`` and writes no destination."""
    import json
    import re

    from difftx.errors import CheckpointError
    from difftx.interop.convert import convert

    hf.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    data.update(edit)
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        convert(tmp_path / "hf", tmp_path / "dx")
    assert not (tmp_path / "dx").exists()
