"""Feed-forward sublayers: SwiGLU (LLaMA / DIFF paper) and a two-matrix GELU or ReLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import _autocast_input
from .linear import Linear, grad_wanted, project, traced


class _NativeSwiGLU(torch.autograd.Function):
    """silu(g) * u in one native pass (difftx.nn.native); saves g and u (torch saves silu(g) too)."""

    @staticmethod
    def forward(ctx, g, u):
        from . import native

        ctx.save_for_backward(g, u)
        return native.swiglu(g, u)

    @staticmethod
    def backward(ctx, dh):
        from . import native

        g, u = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: gradients with a graph, in torch ops
            return _swiglu_grads(g, u, dh)
        return native.swiglu_backward(g, u, dh.to(g.dtype).contiguous())


def _swiglu_grads(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor) -> tuple:
    """(dg, du) of silu(g) * u in differentiable torch ops, float32 arithmetic (the kernel's)."""
    gf, uf, dhf = g.float(), u.float(), dh.float()
    s = torch.sigmoid(gf)
    dg = dhf * uf * s * (1 + gf * (1 - s))
    return dg.to(g.dtype), (dhf * gf * s).to(u.dtype)


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u: the native kernel on the CPU for matching contiguous fp32/bf16 inputs, eager, else torch."""
    from . import native

    if (g.dtype == u.dtype and g.dtype in (torch.float32, torch.bfloat16) and g.shape == u.shape
            and g.is_contiguous() and u.is_contiguous() and native.supports(g.dtype, g.device) and not traced()):
        if not grad_wanted(g, u):  # inference: no autograd node
            return native.swiglu(g, u)
        return _NativeSwiGLU.apply(g, u)
    return F.silu(g) * u


class SwiGLU(nn.Module):
    """(swish(x W_gate) * x W_up) W_down, inner size ``ffn_dim``."""

    def __init__(self, d_model: int, ffn_dim: int, bias: bool = False):
        super().__init__()
        self.w_gate = Linear(d_model, ffn_dim, bias=bias)
        self.w_up = Linear(d_model, ffn_dim, bias=bias)
        self.w_down = Linear(ffn_dim, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one cast for both projections (autocast would cast x for each), one autograd node (linear.project)
        g, u = project(_autocast_input(x), (self.w_gate, self.w_up))
        return self.w_down(swiglu(g, u))


class MLP(nn.Module):
    """act(x W_up + b) W_down + b with act GELU (GPT-2, ViT) or ReLU (the original Transformer)."""

    def __init__(self, d_model: int, ffn_dim: int, activation: str = "gelu", bias: bool = False):
        super().__init__()
        self.activation = activation
        self.w_up = Linear(d_model, ffn_dim, bias=bias)
        self.w_down = Linear(ffn_dim, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w_up(x)
        h = F.gelu(h) if self.activation == "gelu" else F.relu(h)
        return self.w_down(h)


def make_ffn(cfg) -> nn.Module:
    if cfg.ffn == "swiglu":
        return SwiGLU(cfg.d_model, cfg.ffn_dim, cfg.bias)
    return MLP(cfg.d_model, cfg.ffn_dim, cfg.ffn, cfg.bias)
