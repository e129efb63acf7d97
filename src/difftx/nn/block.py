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

from functools import partial

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from .attention import _out_dtype, make_attention
from .ffn import make_ffn
from .fused import SMALL_NORM, add_rms_norm
from .linear import autocast_on, functorch_active, no_hooks
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
        # activation checkpointing (ModelMixin.set_activation_checkpointing): keep only the block's inputs for
        # backward and run it again there.  Named as transformers names it, so its activation_checkpointing_enable
        # (gradient_checkpointing_enable) sets it, with its own checkpoint function in _gradient_checkpointing_func
        self.gradient_checkpointing = False

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
        if low_precision_ok and isinstance(norm, (RMSNorm, LayerNorm)) and autocast_on(x.device.type):
            return norm(x, out_dtype=torch.get_autocast_dtype(x.device.type))
        return norm(x)

    @staticmethod
    def _fusable_norm(norm, x: torch.Tensor) -> bool:
        """Whether a residual addition and ``norm`` after it may run as one op (fused.add_rms_norm): on the CPU,
        the norm difftx's own RMSNorm, unhooked (a compiled graph fuses the two ops itself)."""
        return (x.device.type == "cpu" and type(norm) is RMSNorm and no_hooks(norm)
                and not torch.compiler.is_compiling())

    def _fuse_residual_norm(self, x: torch.Tensor, p: float) -> bool:
        """Whether x + attention and the FFN's PreNorm run as one op: nothing between them (no MidNorm, PostNorm
        or dropout) and the PreNorm fusable."""
        return (p == 0.0 and self.attn_mid_norm is None and self.attn_post_norm is None
                and self._fusable_norm(self.ffn_norm, x))

    def chains(self, x: torch.Tensor, first: bool) -> bool:
        """Whether :meth:`forward_parts` can stand in for this block in a chain (``LM``'s loop): unhooked, Block's own
        forward (not a subclass's or one patched on the instance), no dropout, the output x1 + MidNorm(f) (no FFN
        PostNorm; :meth:`pending` is the addend), and unless ``first`` an attention PreNorm that can take the previous
        block's pending addition."""
        return (no_hooks(self) and getattr(self, "_compiled_call_impl", None) is None  # Module.compile()'d: call it
                and type(self).forward is Block.forward  # (a forward patched on the instance: no_hooks)
                and not torch.compiler.is_compiling() and (self.dropout == 0.0 or not self.training)
                and self.ffn_post_norm is None and (first or self._fusable_norm(self.attn_norm, x)))

    def pending(self, f: torch.Tensor) -> torch.Tensor:
        """What a chained block adds to its x1: the FFN output f through the FFN's MidNorm (DNT), if any."""
        return self._maybe(self.ffn_mid_norm, f)

    def forward(self, x: torch.Tensor, rope, mask, cache=None) -> torch.Tensor:
        """The block; with ``gradient_checkpointing`` set, under activation checkpointing (:func:`_checkpoint`):
        it then keeps only its inputs for backward and runs again there (inside the module's call, so hooks and
        FSDP2's unsharding run once)."""
        ckpt = _checkpoint(self, cache)
        if ckpt is not None:
            return ckpt(self._forward, x, rope, mask, cache)
        return self._forward(x, rope, mask, cache)

    def _forward(self, x: torch.Tensor, rope, mask, cache=None) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        x, f = self.forward_parts(x, None, rope, mask, cache)
        x = x + F.dropout(self._maybe(self.ffn_mid_norm, f), p)
        return self._maybe(self.ffn_post_norm, x)

    def forward_parts(self, x: torch.Tensor, pending, rope, mask, cache=None):
        """The block up to its last residual addition: (x1, f), with :meth:`forward` = x1 + f through the FFN's
        MidNorm and dropout, then its PostNorm.  ``pending`` (or None): the previous block's f, still to be
        added to x; it is added in the attention PreNorm's pass (fused.add_rms_norm), which needs
        :meth:`chains`."""
        p = self.dropout if self.training else 0.0
        low = getattr(self.attn, "low_precision_input", False)
        if pending is not None:  # x + pending and the attention's PreNorm in one op
            out_dtype = _out_dtype(x) if low else x.dtype
            x, h = add_rms_norm(x, pending, self.attn_norm.weight, self.attn_norm.eps, out_dtype)
        else:
            h = self._pre(self.attn_norm, x, low)
        a = self.attn(h, rope, mask, cache)
        if self._fuse_residual_norm(x, p):  # the residual addition and the FFN's PreNorm in one op
            x, h = add_rms_norm(x, a, self.ffn_norm.weight, self.ffn_norm.eps, _out_dtype(x))
        else:
            x = x + F.dropout(self._maybe(self.attn_mid_norm, a), p)
            x = self._maybe(self.attn_post_norm, x)
            h = self._pre(self.ffn_norm, x)
        return x, self.ffn(h)


def _checkpoint(block, cache):
    """The function to run ``block`` under for activation checkpointing, or None to run it as it is: its
    ``gradient_checkpointing`` set, autograd recording and no KV cache (decoding never checkpoints), no torch.func
    transform or forward-mode AD (torch.func.grad refuses the saved-tensor hooks checkpointing works by), and no
    evaluation probe attached (a probe would observe the recomputation again).  torch's non-reentrant
    checkpoint unless transformers gave the block its own (``_gradient_checkpointing_func``)."""
    if not getattr(block, "gradient_checkpointing", False) or cache is not None or not torch.is_grad_enabled() \
            or functorch_active():
        return None
    if getattr(getattr(block, "attn", None), "probe", None) is not None:
        return None
    return getattr(block, "_gradient_checkpointing_func", None) or _NON_REENTRANT


_NON_REENTRANT = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def run_blocks(blocks, x: torch.Tensor, rope, mask, cache=None, final_norm=None) -> torch.Tensor:
    """``final_norm(block_n(...block_1(x)))`` (``final_norm`` may be None), with each residual addition between
    two blocks done in the next attention PreNorm's pass, and the last in the final norm's, where every block
    :meth:`Block.chains` (training-sized CPU inputs, or any size without autograd: decoding); otherwise block by
    block.  A block with ``gradient_checkpointing`` set keeps only its inputs for backward (:func:`_checkpoint`;
    a chained one here, else in :meth:`Block.forward`): the same values and gradients, bit for bit (torch's
    checkpoint restores the RNG state for dropout).  ``mask``: one :class:`~difftx.nn.mask.AttnMask` for every
    block, or a list of one per block (local and global layers)."""
    masks = mask if isinstance(mask, (list, tuple)) else [mask] * len(blocks)
    if len(masks) != len(blocks):
        raise ValueError(f"run_blocks: {len(masks)} masks for {len(blocks)} blocks; give one mask, or one per block")
    if ((x.numel() > SMALL_NORM or not torch.is_grad_enabled()) and len(blocks) > 0
            and all(isinstance(b, Block) and b.chains(x, i == 0) for i, b in enumerate(blocks))):
        pending = None
        for block, mask in zip(blocks, masks):
            ckpt = _checkpoint(block, cache)
            if ckpt is None:
                x, f = block.forward_parts(x, pending, rope, mask, cache)
            else:
                x, f = ckpt(block.forward_parts, x, pending, rope, mask, cache)
            pending = block.pending(f)
        if final_norm is not None and Block._fusable_norm(final_norm, x):
            return add_rms_norm(x, pending, final_norm.weight, final_norm.eps, x.dtype)[1]
        x = x + pending
    else:
        for block, mask in zip(blocks, masks):
            x = block(x, rope, mask, cache)
    return x if final_norm is None else final_norm(x)
