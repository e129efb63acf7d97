"""Normalisation layers, computed in float32 (float64 for float64 inputs) whatever the activation dtype.

RMSNorm is the default everywhere (per-head norm of DIFF, DNT's placements,
QK-norm); LayerNorm is there for GPT-2/ViT layouts and the seed Transformer.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least float32: half/bfloat16 go up to float32, float32/float64 stay as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last ``dim`` channels, in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5, weight: bool = True):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None

    def forward(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``out_dtype`` (default x's): a caller whose next op is a matmul under autocast asks for the autocast
        dtype, so the output is rounded once, in this pass, instead of by a cast per consumer."""
        from .fused import rms_norm  # CPU: its own passes (autograd through F.rms_norm is ~2x); else F.rms_norm

        return rms_norm(x, self.weight, self.eps, out_dtype=out_dtype or x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, weight={self.weight is not None}"


class LayerNorm(nn.Module):
    """LayerNorm with gain and bias, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5, weight: bool = True):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None
        self.bias = nn.Parameter(torch.zeros(dim)) if weight else None

    def forward(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        xf = upcast(x)
        w = None if self.weight is None else self.weight.to(xf.dtype)
        b = None if self.bias is None else self.bias.to(xf.dtype)
        return F.layer_norm(xf, (self.dim,), w, b, self.eps).to(out_dtype or x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, weight={self.weight is not None}"


def make_norm(kind: str, dim: int, eps: float, weight: bool = True) -> nn.Module:
    if kind == "rms":
        return RMSNorm(dim, eps, weight)
    if kind == "layer":
        return LayerNorm(dim, eps, weight)
    raise ValueError(f"unknown norm kind {kind!r}")
