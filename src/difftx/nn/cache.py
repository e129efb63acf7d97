"""A static key/value cache for incremental decoding.

Buffers are allocated once per layer at the first write (shape known only then)
with room for ``max_len`` positions, so decoding never reallocates and the
cache works with ``torch.compile``.  A layer stores what its attention needs:
K of shape (B, Hk, T, dk) and V of shape (B, Hv, T, dv).  For DIFF this is
K = [K1; K2] (2 h_kv heads of d; in bf16/fp16 [K1 | K2] as h_kv heads of 2d) and V (h_kv heads of 2d): the bytes of
a Transformer with 2 h_kv heads of d.

The cache also tracks which key positions are real tokens (left padding) and the
next rotary position of every row.
"""

from __future__ import annotations

from typing import Optional

import torch


class KVCache:
    def __init__(self, n_layers: int, batch_size: int, max_len: int, device=None, dtype=None):
        self.n_layers = n_layers
        self.batch_size = batch_size
        self.max_len = max_len
        self.device = device
        self.dtype = dtype
        self.k: list[Optional[torch.Tensor]] = [None] * n_layers
        self.v: list[Optional[torch.Tensor]] = [None] * n_layers
        self.length = 0
        self.padded = False  # some committed position is padding (then masks carry key_valid)
        self.key_valid = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)

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
            raise ValueError(f"KV cache full: {end} positions needed, room for {self.max_len}")
        if self.k[layer] is None:
            if self.dtype is not None and self.dtype != k.dtype:
                # the attention paths read the cache's own buffers as K and V: they must be what the model computes
                raise ValueError(f"KV cache made for {self.dtype}, but the model computes K/V in {k.dtype}; make the "
                                 "cache with dtype=None (the model's), or run the model in that dtype")
            dtype = k.dtype
            self.k[layer] = torch.zeros(k.shape[0], k.shape[1], self.max_len, k.shape[3], dtype=dtype, device=k.device)
            self.v[layer] = torch.zeros(v.shape[0], v.shape[1], self.max_len, v.shape[3], dtype=dtype, device=v.device)
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, n: int, step_valid: Optional[torch.Tensor] = None) -> None:
        """Commit ``n`` new positions (called once per model forward, after all layers)."""
        if step_valid is not None:
            if not bool(step_valid.all()):
                self.padded = True
            self.key_valid[:, self.length:self.length + n] = step_valid.to(self.key_valid.device)
            self.next_position += step_valid.to(self.next_position.device).long().sum(-1)
        else:
            self.next_position += n
        self.length += n

    def bytes(self) -> int:
        """Bytes held by the K/V buffers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def bytes_per_token(self) -> float:
        """Bytes per cached position per sequence (all layers, K and V)."""
        return self.bytes() / (self.max_len * self.batch_size) if self.k[0] is not None else 0.0
