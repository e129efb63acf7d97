"""The decoder language model: embeddings -> [InputNorm] -> blocks -> [final norm] -> LM head.

Any attention kind and any norm placement; RoPE, learned or sinusoidal
positions; a static KV cache for incremental decoding; padding masks with
positions that skip left padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DifftxError
from ..nn.block import Block, run_blocks
from ..nn.cache import KVCache
from ..nn.linear import linear, packed_weights, plain_layer, traced
from ..nn.loss import linear_cross_entropy
from ..nn.mask import AttnMask, document_positions
from ..nn.norms import make_norm, upcast
from ..nn.rope import RotaryEmbedding, sinusoidal_table
from .common import ModelMixin
from .init import init_weights


@dataclass
class LMOutput:
    logits: Optional[torch.Tensor]  # None when the loss was computed in chunks (loss_chunk)
    loss: Optional[torch.Tensor] = None
    n_targets: Optional[torch.Tensor] = None  # number of non-ignored targets in the loss
    cache: Optional[KVCache] = None


def _make_room(cache: KVCache, n: int, window: int) -> None:
    """Drop a full cache's positions that no query of a sliding-window model will see again, so that a call of ``n``
    tokens fits: the first of them sees the ``window - 1`` positions before it, and the rest only positions after
    those (:meth:`KVCache.drop_oldest`)."""
    keep = min(cache.length, window - 1)
    if keep + n > cache.max_len:
        raise ValueError(f"KV cache full: a call of {n} tokens under a sliding window of {window} needs room for "
                         f"{keep + n} positions, the cache has {cache.max_len}; make the cache with max_len >= "
                         f"{keep + n} (model.new_cache(batch_size, max_len)), or pass fewer tokens per call")
    cache.drop_oldest(cache.length - keep)


def _with_packed(cache, fn, *args):
    """fn(*args), inside :func:`difftx.nn.linear.packed_weights` over a difftx KVCache's store when ``cache`` is
    one (bf16 decoding on weights packed once; not under torch.compile)."""
    packed = getattr(cache, "packed", None)
    if isinstance(packed, dict) and not traced():
        with packed_weights(packed):
            return fn(*args)
    return fn(*args)


class DecoderLM(ModelMixin, nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg.domain != "lm":
            raise DifftxError(f"domain: DecoderLM needs domain='lm', got {cfg.domain!r}")
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.positions == "learned":
            self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        elif cfg.positions == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(cfg.max_seq_len, cfg.d_model), persistent=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_style) if cfg.positions == "rope" else None
        self.input_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.input_norm else None
        self.layers = nn.ModuleList(Block(cfg, layer) for layer in range(1, cfg.n_layers + 1))
        self.final_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.final_norm else None
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        cache: Optional[KVCache] = None,
        loss_reduction: str = "mean",
        loss_chunk: int = 0,
        document_ids: Optional[torch.Tensor] = None,
    ) -> LMOutput:
        """Logits (B, N, V) for ``input_ids`` (B, N).

        ``targets`` (B, N) are aligned with the logits (position t predicts
        targets[t]); -100 is ignored.  ``loss_reduction`` is ``mean`` over the
        counted targets or ``sum`` (for accumulation over micro-batches).
        ``loss_chunk`` > 0 (with ``targets``): the loss ``loss_chunk`` tokens at a
        time, never all (B, N, V) logits (:func:`difftx.nn.loss.linear_cross_entropy`);
        ``logits`` is then None.
        ``attention_mask`` (B, N): 1 for tokens, 0 for padding (left or right).
        With a ``cache``, ``input_ids`` are the new tokens only.
        ``document_ids`` (B, N) integer: packed documents, each attending only to itself, with positions that
        restart at each document unless ``position_ids`` are given (:func:`difftx.nn.mask.document_ids` makes
        them from an end-of-text token); not with a ``cache``.
        """
        hidden = self.features(input_ids, attention_mask, position_ids, cache, document_ids)
        logits = loss = n_targets = None
        flat = targets.reshape(-1) if targets is not None else None
        # the chunked loss reads the head's weight itself: a hooked or swapped-in head (a LoRA wrapper) is called
        if flat is not None and loss_chunk > 0 and (self.lm_head is None or plain_layer(self.lm_head)):
            weight = self.lm_head.weight if self.lm_head is not None else self._tied_weight(hidden)
            loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, flat, loss_chunk)
        else:
            logits = _with_packed(cache, self.head, hidden)
            if flat is not None:
                # at least float32; a float64 model keeps float64 (gradient checks against a float64 reference)
                loss = F.cross_entropy(upcast(logits).reshape(-1, logits.shape[-1]), flat, ignore_index=-100,
                                       reduction="sum")
                if loss_chunk > 0:
                    logits = None  # as documented for loss_chunk
        if flat is not None:
            n_targets = (flat != -100).sum()
            if loss_reduction == "mean":
                loss = loss / n_targets.clamp_min(1)
            elif loss_reduction != "sum":
                raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        return LMOutput(logits=logits, loss=loss, n_targets=n_targets, cache=cache)

    def features(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        cache: Optional[KVCache] = None,
        document_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The final hidden states (B, N, d_model): :meth:`forward` up to, not including, the LM head.

        ``model.head(model.features(ids))`` equals ``model(ids).logits``; calling :meth:`head` on a few
        positions, or on chunks of them, never holds all (B, N, V) logits (difftx.evals do this).
        """
        cfg = self.config
        if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0 \
                or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids of shape (batch >= 1, tokens >= 1); got a "
                             f"{input_ids.dtype} tensor of shape {tuple(input_ids.shape)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)} (1 = token, "
                             f"0 = padding); got {tuple(attention_mask.shape)}")
        if document_ids is not None:
            if not isinstance(document_ids, torch.Tensor) or document_ids.shape != input_ids.shape \
                    or document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool:
                what = (f"a {document_ids.dtype} tensor of shape {tuple(document_ids.shape)}"
                        if isinstance(document_ids, torch.Tensor) else type(document_ids).__name__)
                raise ValueError(f"document_ids must be integer ids of input_ids' shape {tuple(input_ids.shape)}, "
                                 f"one per token (difftx.nn.mask.document_ids(input_ids, eos_id)); got {what}")
            if cache is not None:
                raise ValueError("document_ids packs documents for training and scoring; decoding with a KV cache "
                                 "takes one document per sequence (drop document_ids, or the cache)")
        b, n = input_ids.shape
        device = input_ids.device
        rows = getattr(cache, "batch_size", b)  # a difftx KVCache holds one row per sequence
        if rows != b:  # else its buffers broadcast: one row's keys written into every row
            raise ValueError(f"KV cache made for {rows} sequences, but input_ids has a batch of {b}; make the "
                             f"cache with model.new_cache({b}, max_len)")
        seen = n + ((cache.length + getattr(cache, "dropped", 0)) if cache is not None else 0)  # positions so far
        if cfg.positions in ("learned", "sinusoidal") and seen > cfg.max_seq_len:
            raise DifftxError(
                f"sequence of {seen} tokens is longer than max_seq_len={cfg.max_seq_len} "
                f"allowed by positions={cfg.positions!r}; shorten the input or raise max_seq_len"
            )
        if isinstance(cache, KVCache) and cfg.uniform_window is not None and cache.length + n > cache.max_len:
            _make_room(cache, n, cfg.uniform_window)  # (a layer of full_attention_layers keeps every key)
        q_start = cache.length if cache is not None else 0
        step_valid = None
        if attention_mask is not None:
            step_valid = attention_mask.to(device=device, dtype=torch.bool)
        has_pad = step_valid is not None and not bool(step_valid.all())
        if cache is not None and (has_pad or cache.padded):
            prev = cache.key_valid[:, :q_start]
            now = step_valid if step_valid is not None else torch.ones(b, n, dtype=torch.bool, device=device)
            key_valid = torch.cat((prev.to(device), now), dim=1)
        else:
            key_valid = step_valid if has_pad else None

        doc = None if document_ids is None else document_ids.to(device)
        if position_ids is None and doc is not None:
            position_ids = document_positions(doc, step_valid if has_pad else None)
        if position_ids is None:
            if step_valid is not None and has_pad:
                position_ids = step_valid.long().cumsum(-1) - 1
            else:
                position_ids = torch.arange(n, device=device)[None].expand(b, n)
            if cache is not None:
                position_ids = position_ids + cache.next_position.to(device)[:, None]
            position_ids = position_ids.clamp_min(0)

        x = self.embed(input_ids)
        if cfg.positions == "learned":
            x = x + self.pos_embed(position_ids)
        elif cfg.positions == "sinusoidal":
            x = x + self.pos_table[position_ids].to(x.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        x = F.dropout(x, cfg.dropout if self.training else 0.0)

        rope = self.rope.cos_sin(position_ids, x.dtype) if self.rope is not None else None
        mask = AttnMask(causal=True, n_q=n, n_k=q_start + n, q_start=q_start, key_valid=key_valid, doc_ids=doc,
                        window=cfg.sliding_window)
        if cfg.full_attention_layers:  # local and global layers: each block its mask (each AttnMask its own dense
            # forms, built once per forward for the layers that share it)
            whole = AttnMask(causal=True, n_q=n, n_k=q_start + n, q_start=q_start, key_valid=key_valid, doc_ids=doc)
            mask = [mask if cfg.layer_window(i + 1) is not None else whole for i in range(len(self.layers))]
        x = _with_packed(cache, run_blocks, self.layers, x, rope, mask, cache, self.final_norm)
        if cache is not None:
            cache.advance(n, step_valid)
        return x

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states (any leading shape): the LM head, tied to the embedding or not."""
        if self.lm_head is None:
            return linear(hidden, self._tied_weight(hidden))
        if plain_layer(self.lm_head):
            # not a wrapper or a hooked layer: linear.linear (decoding's few rows on the native product)
            return linear(hidden, self.lm_head.weight, self.lm_head.bias)
        return self.lm_head(hidden)

    def _tied_weight(self, hidden: torch.Tensor) -> torch.Tensor:
        """The embedding's weight for the tied head, which reads it outside the embedding's call.  An offloaded
        embedding (accelerate's ``cpu_offload``/``disk_offload`` hooks load it for the lookup only and leave it on
        the meta device between calls) is refused: F.linear of real inputs and a meta weight hands back an
        uninitialised tensor (NaN or garbage logits) and the native kernels would read a null pointer."""
        w = self.embed.weight
        if w.is_meta and not hidden.is_meta:
            raise DifftxError(
                "tie_embeddings: the LM head reads embed.weight, which is on the meta device (offloaded: "
                "accelerate's cpu_offload/disk_offload load it for the embedding lookup only); keep the "
                "embedding on the execution device (dispatch_model with embed in the device map), or untie it")
        return w

    # ------------------------------------------------------------------ decoding
    def new_cache(self, batch_size: int, max_len: int, dtype: Optional[torch.dtype] = None,
                  device: Optional[torch.device] = None) -> KVCache:
        """An empty KV cache for ``batch_size`` rows of up to ``max_len`` positions.  Its buffers take the dtype
        the model computes K/V in (under autocast: the autocast dtype); ``dtype``, when given, must be that one
        (a cache in another dtype is refused at its first write).  ``device`` (default: the embedding's) is where
        the inputs are: give it for a model whose weights are offloaded (accelerate's ``cpu_offload`` keeps them
        on the meta device between calls)."""
        if device is None:
            device = self.embed.weight.device
        return KVCache(self.config.n_layers, batch_size, max_len, device=device, dtype=dtype)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32, **kwargs) -> torch.Tensor:
        """Sample or greedily decode; see :func:`difftx.models.generation.generate`."""
        from .generation import generate

        return generate(self, input_ids, max_new_tokens=max_new_tokens, **kwargs)
