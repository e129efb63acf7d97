"""Normalisation layers, computed in at least float32 whatever the activation dtype.

RMSNorm is the default everywhere (per-head norm of DIFF, DNT's placements,
QK-norm); LayerNorm is there for GPT-2/ViT layouts and the seed Transformer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bfloat16/float32 inputs, float64 for float64: statistics never lose precision."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last ``dim`` channels, in (at least) fp32."""

    def __init__(self, dim: int, eps: float = 1e-5, weight: bool = True):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = compute_dtype(x.dtype)
        w = None if self.weight is None else self.weight.to(f)
        return F.rms_norm(x.to(f), (self.dim,), w, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, weight={self.weight is not None}"


class LayerNorm(nn.Module):
    """LayerNorm with gain and bias, computed in (at least) fp32."""

    def __init__(self, dim: int, eps: float = 1e-5, weight: bool = True):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None
        self.bias = nn.Parameter(torch.zeros(dim)) if weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = compute_dtype(x.dtype)
        w = None if self.weight is None else self.weight.to(f)
        b = None if self.bias is None else self.bias.to(f)
        return F.layer_norm(x.to(f), (self.dim,), w, b, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, weight={self.weight is not None}"


def make_norm(kind: str, dim: int, eps: float, weight: bool = True) -> nn.Module:
    if kind == "rms":
        return RMSNorm(dim, eps, weight)
    if kind == "layer":
        return LayerNorm(dim, eps, weight)
    raise ValueError(f"unknown norm kind {kind!r}")
