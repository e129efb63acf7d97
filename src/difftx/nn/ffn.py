"""Feed-forward sublayers: SwiGLU (LLaMA / DIFF paper) and a two-matrix GELU or ReLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """(swish(x W_gate) * x W_up) W_down, inner size ``ffn_dim``."""

    def __init__(self, d_model: int, ffn_dim: int, bias: bool = False):
        super().__init__()
        self.w_gate = nn.Linear(d_model, ffn_dim, bias=bias)
        self.w_up = nn.Linear(d_model, ffn_dim, bias=bias)
        self.w_down = nn.Linear(ffn_dim, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class MLP(nn.Module):
    """act(x W_up + b) W_down + b with act GELU (GPT-2, ViT) or ReLU (the original Transformer)."""

    def __init__(self, d_model: int, ffn_dim: int, activation: str = "gelu", bias: bool = False):
        super().__init__()
        self.activation = activation
        self.w_up = nn.Linear(d_model, ffn_dim, bias=bias)
        self.w_down = nn.Linear(ffn_dim, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w_up(x)
        h = F.gelu(h) if self.activation == "gelu" else F.relu(h)
        return self.w_down(h)


def make_ffn(cfg) -> nn.Module:
    if cfg.ffn == "swiglu":
        return SwiGLU(cfg.d_model, cfg.ffn_dim, cfg.bias)
    return MLP(cfg.d_model, cfg.ffn_dim, cfg.ffn, cfg.bias)
