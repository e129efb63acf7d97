"""Rotary position embeddings in the two layouts real checkpoints use.

``half`` (GPT-NeoX / LLaMA / transformers' rotate_half): channel i rotates with
channel i + d/2.  ``interleaved`` (GPT-J / the official DIFF code): channel 2i
rotates with 2i + 1.  Both use frequencies theta^(-2i/d), i < d/2, and act on
each d-wide head (for DIFF: each of Q1, Q2, K1, K2 separately).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .linear import grad_wanted, traced


class RotaryEmbedding(nn.Module):
    """Angles position * theta^(-2i/d).  No buffers: the frequencies are computed in their own
    dtype and kept per dtype and device outside the state dict, so casting the model never degrades
    them.  Computed in float32 (exactly as transformers' LLaMA does) or in float64 for float64 models.

    The tables are the same for both ``style`` s: an attention module rotates its queries and keys in its own
    config's ``rope_style``; ``style`` here is recorded for display only."""

    def __init__(self, head_dim: int, theta: float = 10000.0, style: str = "half"):
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim!r}")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (0 < theta < float("inf")):
            raise ValueError(f"rotary embeddings need a positive finite theta, got {theta!r}")
        if style not in ("half", "interleaved"):
            raise ValueError(f"rotary style must be 'half' or 'interleaved', got {style!r}")
        self.head_dim = head_dim
        self.theta = theta
        self.style = style

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32):
        """cos, sin of shape (B or 1, 1, N, d/2) for integer ``positions`` (N,) or (B, N)."""
        if positions.dim() == 1:
            positions = positions[None]
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        freqs = positions.to(compute)[..., None] * self._inv_freq(compute, positions.device)
        return freqs.cos()[:, None], freqs.sin()[:, None]

    def _inv_freq(self, compute: torch.dtype, device: torch.device) -> torch.Tensor:
        """theta^(-2i/d) in ``compute``, kept per (dtype, device, theta, d) between calls (a decoding step's
        forward would otherwise spend five ops on it); the same values each time."""
        if torch.compiler.is_compiling():  # a graph computes it once anyway
            return self._compute_inv_freq(compute, device)
        key = (compute, device, self.theta, self.head_dim)
        memo = self.__dict__.setdefault("_inv_freq_memo", {})
        if key not in memo:
            memo[key] = self._compute_inv_freq(compute, device)
        return memo[key]

    def _compute_inv_freq(self, compute: torch.dtype, device: torch.device) -> torch.Tensor:
        idx = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).to(compute)
        return 1.0 / (self.theta ** (idx / self.head_dim))

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, style={self.style}"


class _NativeRope(torch.autograd.Function):
    """The rotation in one native pass per row (difftx.nn.native), float32 angles; the gradient is
    the inverse rotation.  x is read in place when strided (a head view of a projection's output);
    its gradient is written in x's own layout when x is dense (a permutation of a contiguous
    tensor, rows contiguous), so that the views back to the projection cost no copy."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved: bool):
        from . import native

        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        ctx.grad_layout = native.dense_layout(x) if x.dim() <= 5 else None
        return native.rope(x, cos, sin, interleaved)

    @staticmethod
    def backward(ctx, dy):
        from . import native

        cos, sin = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the inverse rotation in torch ops, which has a graph
            shape = (cos.shape[0],) + (1,) * (dy.dim() - 3) + cos.shape[1:]
            style = "interleaved" if ctx.interleaved else "half"
            return _rope_torch(dy, cos.view(shape), -sin.view(shape), style), None, None, None
        out = native.empty_in(ctx.grad_layout, dy.shape, dy.dtype, dy.device)
        return native.rope(dy, cos, sin, ctx.interleaved, inverse=True, out=out), None, None, None


def _native_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> Optional[torch.Tensor]:
    """The native rotation when it applies (CPU, fp32/bf16, float32 angles of shape (B|1, 1.., N, d/2) that want no
    gradient), else None."""
    from . import native

    if traced():  # first: native.supports takes the kernels' lock, which breaks a compiled graph
        return None
    if not (style in ("half", "interleaved") and x.dtype in (torch.float32, torch.bfloat16)
            and cos.dtype == torch.float32 and sin.dtype == torch.float32 and x.dim() >= 3
            and not grad_wanted(cos, sin)  # the kernel's gradient is x's only: differentiable angles take torch's
            and x.shape[-1] % 2 == 0 and native.supports(x.dtype, x.device)):
        return None
    n, half = x.shape[-2], x.shape[-1] // 2
    bc = cos.shape[0]
    if cos.shape[-2:] != (n, half) or sin.shape != cos.shape or bc not in (1, x.shape[0]) \
            or any(s != 1 for s in cos.shape[1:-2]):
        return None
    cos3, sin3 = cos.reshape(bc, n, half).contiguous(), sin.reshape(bc, n, half).contiguous()
    if not grad_wanted(x):  # inference: the kernel alone, no autograd node
        return native.rope(x, cos3, sin3, style == "interleaved")
    return _NativeRope.apply(x, cos3, sin3, style == "interleaved")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate ``x`` of shape (B, H, N, d) (or (B, M, H, N, d)) by the angles in cos/sin (B|1, 1, N, d/2)."""
    out = _native_rope(x, cos, sin, style) if x.device.type == "cpu" else None
    if out is not None:
        return out
    if x.dim() == 5 and cos.dim() == 4:  # DIFF's (B, 2, h, N, d): the angles broadcast over the maps axis too
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return _rope_torch(x, cos, sin, style)


def _rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if style == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    if style == "interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    raise ValueError(f"unknown rope style {style!r}")


def sinusoidal_table(n_positions: int, dim: int) -> torch.Tensor:
    """The fixed sin/cos position encoding of Vaswani et al. (even channels sin, odd cos)."""
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None]
    i = torch.arange(0, dim, 2, dtype=torch.float64)
    angle = pos / (10000.0 ** (i / dim))
    table = torch.zeros(n_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : dim // 2])
    return table.float()
