"""One residual block whose norms are placed by flags (SPEC section 4).

    h = PreNorm_a(x)            if pre_norm_attn
    x = x + MidNorm_a(Attn(h))  (MidNorm only if mid_norm_attn)
    x = PostNorm_a(x)           if post_norm
    h = PreNorm_f(x)            if pre_norm_ffn
    x = x + MidNorm_f(FFN(h))
    x = PostNorm_f(x)           if post_norm

QK-norm lives inside the attention module; InputNorm and the final norm in the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import make_attention
from .ffn import make_ffn
from .fused import add_rms_norm
from .linear import no_hooks
from .norms import LayerNorm, RMSNorm, make_norm


class Block(nn.Module):
    def __init__(self, cfg, layer: int):
        super().__init__()
        self.layer = layer
        self.dropout = cfg.dropout

        def norm(flag: bool):
            return make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if flag else None

        self.attn_norm = norm(cfg.pre_norm_attn)
        self.attn = make_attention(cfg, layer)
        self.attn_mid_norm = norm(cfg.mid_norm_attn)
        self.attn_post_norm = norm(cfg.post_norm)
        self.ffn_norm = norm(cfg.pre_norm_ffn)
        self.ffn = make_ffn(cfg)
        self.ffn_mid_norm = norm(cfg.mid_norm_ffn)
        self.ffn_post_norm = norm(cfg.post_norm)

    @staticmethod
    def _maybe(norm, x):
        return x if norm is None else norm(x)

    @staticmethod
    def _pre(norm, x, low_precision_ok: bool = True):
        """A PreNorm whose output only feeds projections: under autocast it comes out in the autocast dtype
        (rounded once, in the norm's pass) rather than in x's, to be cast again by every projection reading it.
        difftx's own norms only (a norm module swapped in by a user is called as it is)."""
        if norm is None:
            return x
        if low_precision_ok and isinstance(norm, (RMSNorm, LayerNorm)) and torch.is_autocast_enabled(x.device.type):
            return norm(x, out_dtype=torch.get_autocast_dtype(x.device.type))
        return norm(x)

    def _fuse_residual_norm(self, x: torch.Tensor, p: float) -> bool:
        """Whether x + attention and the FFN's PreNorm run as one op (fused.add_rms_norm): on the CPU, with no
        MidNorm, PostNorm or dropout between them and the PreNorm difftx's own RMSNorm, unhooked."""
        return (x.device.type == "cpu" and p == 0.0 and self.attn_mid_norm is None and self.attn_post_norm is None
                and type(self.ffn_norm) is RMSNorm and no_hooks(self.ffn_norm)
                and not torch.compiler.is_compiling())  # a compiled graph fuses the two ops itself

    def forward(self, x: torch.Tensor, rope, mask, cache=None) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        a = self.attn(self._pre(self.attn_norm, x, getattr(self.attn, "low_precision_input", False)), rope, mask,
                      cache)
        if self._fuse_residual_norm(x, p):
            # the residual addition and the FFN's PreNorm in one pass each way (bitwise the two ops)
            autocast = torch.is_autocast_enabled(x.device.type)
            out_dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
            x, h = add_rms_norm(x, a, self.ffn_norm.weight, self.ffn_norm.eps, out_dtype)
        else:
            x = x + F.dropout(self._maybe(self.attn_mid_norm, a), p)
            x = self._maybe(self.attn_post_norm, x)
            h = self._pre(self.ffn_norm, x)
        f = self.ffn(h)
        x = x + F.dropout(self._maybe(self.ffn_mid_norm, f), p)
        return self._maybe(self.ffn_post_norm, x)
