"""A static key/value cache for incremental decoding.

Buffers are allocated once per layer at the first write (shape known only then)
with room for ``max_len`` positions, so decoding never reallocates and the
cache works with ``torch.compile``.  A layer stores what its attention needs:
K of shape (B, Hk, T, dk) and V of shape (B, Hv, T, dv).  For DIFF this is
K = [K1; K2] (2 h_kv heads of d; in bf16/fp16 [K1 | K2] as h_kv heads of 2d) and V (h_kv heads of 2d): the bytes of
a Transformer with 2 h_kv heads of d.

The cache also tracks which key positions are real tokens (left padding) and the
next rotary position of every row.

To decode another prompt (same batch size, up to ``max_len`` positions), call
:meth:`KVCache.reset` rather than building a new cache: it then behaves exactly as
a fresh one (bitwise the same logits) in the buffers it already holds.

Under a sliding window (``sliding_window``) on every layer a model drops the keys no later
query can see when a call would overflow the cache (:meth:`KVCache.drop_oldest`): decoding
goes on past ``max_len`` positions with the cache's memory bounded by ``max_len``.  A model
with ``full_attention_layers`` drops none (those layers read every key).
"""

from __future__ import annotations

import operator
from typing import Optional

import torch


class KVCache:
    """K/V buffers of ``n_layers`` attention layers for ``batch_size`` sequences of up to ``max_len`` positions
    (usually made by ``model.new_cache(batch_size, max_len)``).

    Reuse: :meth:`reset` empties the cache for a new prompt of the same batch size without reallocating; decoding
    after it gives bitwise the logits of a freshly built cache.

    ``packed``: the weights packed for bf16 decoding on CPUs with AVX512-BF16 and without AMX
    (:func:`difftx.nn.linear.packed_weights`): filled at the first bf16 call through the cache, half the float32
    weights' bytes, dropped by :meth:`reset` or with the cache.  Set it to None to decode on autocast's F.linear.

    Gradients: each call writes its K/V into the buffers in place, so a backward through the logits of more than
    one call over a cache raises torch's "modified by an inplace operation" error; train on whole sequences
    without a cache (the cache is for inference).
    """

    def __init__(self, n_layers: int, batch_size: int, max_len: int, device=None, dtype=None):
        for name, value in (("n_layers", n_layers), ("batch_size", batch_size), ("max_len", max_len)):
            try:  # else torch's "negative dimension" from the first buffer, or a cache that never fits a step
                ok = not isinstance(value, bool) and operator.index(value) >= 1
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"KVCache {name} must be a positive integer; got {value!r}")
        self.n_layers = n_layers
        self.batch_size = batch_size
        self.max_len = max_len
        self.device = device
        self.dtype = dtype
        self.k: list[Optional[torch.Tensor]] = [None] * n_layers
        self.v: list[Optional[torch.Tensor]] = [None] * n_layers
        self._recycled = [False] * n_layers  # buffers kept by reset(): reused at the next write when they fit
        self.length = 0
        self.dropped = 0  # positions dropped from the front (drop_oldest): buffer index i holds position dropped + i
        self.padded = False  # some committed position is padding (then masks carry key_valid)
        self.key_valid = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.packed: dict = {}  # weights packed for bf16 decoding (difftx.nn.linear.packed_weights)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's k, v (B, H, n, d) for ``layer`` (0-based); return all keys/values so far."""
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"KV cache made for {self.n_layers} layers has no slot for layer {layer + 1} (1-based); "
                             f"make it with n_layers >= the number of attention layers")
        if k.shape[0] != self.batch_size or v.shape[0] != self.batch_size:  # else the write broadcasts
            raise ValueError(f"KV cache made for {self.batch_size} sequences, but layer {layer + 1} gave K/V for "
                             f"a batch of {k.shape[0]}; make the cache with batch_size={k.shape[0]}")
        n = k.shape[2]
        end = self.length + n
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} positions needed, room for {self.max_len}; make the cache with "
                             f"max_len >= {end} (model.new_cache(batch_size, max_len)), or reset() it for a new prompt")
        if self._recycled[layer]:  # the first write since reset(): K/V of another shape get new buffers, as fresh
            self._recycled[layer] = False
            if not (_fits(self.k[layer], k) and _fits(self.v[layer], v)):
                self.k[layer] = self.v[layer] = None
        if self.k[layer] is None:
            if self.dtype is not None and self.dtype != k.dtype:
                # the attention paths read the cache's own buffers as K and V: they must be what the model computes
                raise ValueError(f"KV cache made for {self.dtype}, but the model computes K/V in {k.dtype}; make the "
                                 "cache with dtype=None (the model's), or run the model in that dtype")
            dtype = k.dtype
            self.k[layer] = torch.zeros(k.shape[0], k.shape[1], self.max_len, k.shape[3], dtype=dtype, device=k.device)
            self.v[layer] = torch.zeros(v.shape[0], v.shape[1], self.max_len, v.shape[3], dtype=dtype, device=v.device)
        elif not (_fits(self.k[layer], k) and _fits(self.v[layer], v)):
            # else the write broadcasts (fewer heads) or casts into buffers made for other K/V: silently wrong keys
            kb, vb = self.k[layer], self.v[layer]
            raise ValueError(f"KV cache layer {layer + 1} holds K {tuple(kb.shape)} and V {tuple(vb.shape)} "
                             f"({kb.dtype}, {kb.device}), which this step's K {tuple(k.shape)} and V "
                             f"{tuple(v.shape)} ({k.dtype}, {k.device}) do not fit: the cache was filled by another "
                             "model, or before the model changed dtype or device; call cache.reset() and prefill again")
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, n: int, step_valid: Optional[torch.Tensor] = None) -> None:
        """Commit ``n`` new positions (called once per model forward, after all layers)."""
        if self.length == 0 and any(self._recycled):  # layers the first forward since reset() left unwritten:
            for layer in [i for i, kept in enumerate(self._recycled) if kept]:  # none in a fresh cache either
                self.k[layer] = self.v[layer] = None
                self._recycled[layer] = False
        if step_valid is not None:
            if not bool(step_valid.all()):
                self.padded = True
            self.key_valid[:, self.length:self.length + n] = step_valid.to(self.key_valid.device)
            self.next_position += step_valid.to(self.next_position.device).long().sum(-1)
        else:
            self.next_position += n
        self.length += n

    def drop_oldest(self, n: int) -> None:
        """Forget the ``n`` oldest positions: the rest move to the front of the buffers (keys, values and which are
        real tokens), and the positions' rotary numbering goes on (``next_position`` is unchanged).  A model under
        a sliding window calls it when a call would overflow the cache, keeping the ``window - 1`` keys the next
        query still sees; the later keys' distances, all a window looks at, stay as they were."""
        if not 0 <= n <= self.length:
            raise ValueError(f"KVCache.drop_oldest: can drop 0..{self.length} positions; got {n}")
        if n == 0:
            return
        keep = self.length - n
        for buf in self.k + self.v:
            if buf is not None and keep:
                buf[:, :, :keep] = buf[:, :, n:self.length].clone()  # overlapping ranges: through a copy
        self.key_valid[:, :keep] = self.key_valid[:, n:self.length].clone()
        self.key_valid[:, keep:].fill_(True)
        self.length = keep
        self.dropped += n
        self.padded = not bool(self.key_valid[:, :keep].all())

    def reset(self) -> None:
        """Empty the cache for a new prompt: it then behaves exactly as a freshly built one (no positions, no
        padding, every row's next position 0) while keeping its K/V buffers, zeroed in place (no reallocation, the
        same tensors for ``torch.compile`` and CUDA graphs).  A layer whose next K/V differ in shape, dtype or
        device from its buffer gets a new one, as a fresh cache would.  Buffers made under ``torch.inference_mode()``
        cannot be written outside it: reset outside inference mode, such a cache gets new buffers."""
        if not torch.is_inference_mode_enabled():
            for layer, k in enumerate(self.k):
                if k is not None and (k.is_inference() or self.v[layer].is_inference()):
                    self.k[layer] = self.v[layer] = None  # allocated again at the layer's next write
                    self._recycled[layer] = False
            if self.key_valid.is_inference():
                self.key_valid = self.key_valid.clone()
            if self.next_position.is_inference():
                self.next_position = self.next_position.clone()
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            if k is not None:
                for t in (k, v):
                    if t.grad_fn is not None:  # written with autograd on: drop the history of the earlier prompts
                        t.detach_()  # (in place: the same tensors), else each reset kept every earlier graph alive
                    t.zero_()
                self._recycled[layer] = True
        self.length = 0
        self.dropped = 0
        self.padded = False
        self.key_valid.fill_(True)
        self.next_position.zero_()
        self.packed.clear()

    def bytes(self) -> int:
        """Bytes held by the K/V buffers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def bytes_per_token(self) -> float:
        """Bytes per cached position per sequence (all layers, K and V)."""
        return self.bytes() / (self.max_len * self.batch_size) if self.k[0] is not None else 0.0


def _fits(buffer: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``buffer`` (B, H, max_len, d) is the one a fresh cache would allocate for K or V ``x`` (B, H, n, d)."""
    return (buffer.dtype == x.dtype and buffer.device == x.device and buffer.shape[:2] == x.shape[:2]
            and buffer.shape[3] == x.shape[3])
