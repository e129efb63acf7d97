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
