"""The vision encoder (ViT / V-DNT / DIFF-ViT): patches -> blocks without a causal mask -> pooled classifier.

The same blocks as the language model, with ``causal=False``; a class token or
mean pooling; learned, sinusoidal, rotary (1-D over the token sequence) or no
positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DifftxError
from ..nn.block import Block
from ..nn.mask import AttnMask
from ..nn.norms import make_norm, upcast
from ..nn.rope import RotaryEmbedding, sinusoidal_table
from .common import ModelMixin
from .init import init_weights


@dataclass
class VisionOutput:
    logits: torch.Tensor
    loss: Optional[torch.Tensor] = None


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/p * W/p, C*p*p), patches in row-major order, channels outermost."""
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


class VisionEncoder(ModelMixin, nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg.domain != "vision":
            raise DifftxError(f"domain: VisionEncoder needs domain='vision', got {cfg.domain!r}")
        self.config = cfg
        self.patch_embed = nn.Linear(cfg.in_channels * cfg.patch_size ** 2, cfg.d_model, bias=True)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model)) if cfg.pooling == "cls" else None
        self.n_tokens = cfg.n_patches + (1 if cfg.pooling == "cls" else 0)
        if cfg.positions == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, self.n_tokens, cfg.d_model))
        elif cfg.positions == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(self.n_tokens, cfg.d_model)[None], persistent=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_style) if cfg.positions == "rope" else None
        self.input_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.input_norm else None
        self.layers = nn.ModuleList(Block(cfg, layer) for layer in range(1, cfg.n_layers + 1))
        self.final_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.final_norm else None
        self.head = nn.Linear(cfg.d_model, cfg.num_classes, bias=True)
        init_weights(self, cfg)
        with torch.no_grad():
            if self.cls_token is not None:
                nn.init.normal_(self.cls_token, 0.0, cfg.init_std)
            if cfg.positions == "learned":
                nn.init.normal_(self.pos_embed, 0.0, cfg.init_std)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Token features after the last block and final norm: (B, n_tokens, d_model)."""
        cfg = self.config
        if images.dim() == 3:
            images = images[:, None]
        if images.dim() != 4 or tuple(images.shape[1:]) != (cfg.in_channels, cfg.image_size, cfg.image_size):
            raise DifftxError(
                f"images must be (batch, {cfg.in_channels}, {cfg.image_size}, {cfg.image_size}) for this model; "
                f"got {tuple(images.shape)}"
            )
        # the residual stream in the weights' dtype, as the language model's embedding gives it: under autocast the
        # patch embedding's product comes out in bf16, and every residual addition would round to bf16 after it
        w = getattr(self.patch_embed, "weight", None)  # a swapped-in layer may hold none (quantize_dynamic's
        # Linear: weight() is a method, the int8 weight packed): then the dtype of the model's floating parameters
        dtype = w.dtype if isinstance(w, torch.Tensor) else next(
            (p.dtype for p in self.parameters() if p.is_floating_point()), torch.float32)
        x = self.patch_embed(patchify(images, cfg.patch_size).to(dtype)).to(dtype)
        if self.cls_token is not None:
            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x), dim=1)
        if cfg.positions == "learned":
            x = x + self.pos_embed.to(x.dtype)
        elif cfg.positions == "sinusoidal":
            x = x + self.pos_table.to(x.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        x = F.dropout(x, cfg.dropout if self.training else 0.0)
        n = x.shape[1]
        rope = self.rope.cos_sin(torch.arange(n, device=x.device), x.dtype) if self.rope is not None else None
        mask = AttnMask(causal=False, n_q=n, n_k=n)
        for block in self.layers:
            x = block(x, rope, mask)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x

    def forward(self, images: torch.Tensor, targets: Optional[torch.Tensor] = None,
                label_smoothing: float = 0.0, loss_reduction: str = "mean") -> VisionOutput:
        """Logits (B, num_classes); ``targets``: class indices (B,) or soft targets (B, num_classes).

        ``loss_reduction`` is ``mean`` over the images or ``sum`` (for accumulation over micro-batches).
        """
        x = self.features(images)
        pooled = x[:, 0] if self.cls_token is not None else x.mean(dim=1)
        logits = self.head(pooled)
        loss = None
        if targets is not None:
            if loss_reduction not in ("mean", "sum"):
                raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
            if targets.dim() == 2:  # soft targets (mixup / cutmix)
                loss = torch.sum(-targets * F.log_softmax(upcast(logits), dim=-1), dim=-1)
                loss = loss.sum() if loss_reduction == "sum" else loss.mean()
            else:
                loss = F.cross_entropy(upcast(logits), targets, label_smoothing=label_smoothing,
                                       reduction=loss_reduction)
        return VisionOutput(logits=logits, loss=loss)
