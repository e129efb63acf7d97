"""Evaluation probes: a window into the reference attention path.

Attach a probe to a model (``with attach_probe(model, probe): model(x)``) and
every attention layer runs the eager backend and calls

* ``transform_logits(layer, index, logits, mask)``: may return modified logits (e.g.
  quantized), ``index`` 0 for softmax / A1 maps, 1 for DIFF's A2 maps; ``mask`` is the
  layer's :class:`~difftx.nn.mask.AttnMask` (causality, key padding);
* ``observe(layer, logits, effective_map, mask)``: the float32 logits (list, one
  per softmax map, before masking) and the effective attention map: A for
  softmax, A1 - lambda A2 for DIFF, A_2i - lambda_i A_2i+1 for DIFF V2.

Layers are 1-based.  Probes are how evaluations see inside without copying the
model code.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch


class AttentionProbe:
    def transform_logits(self, layer: int, index: int, logits: torch.Tensor, mask=None) -> torch.Tensor:
        return logits

    def observe(self, layer: int, logits: list, effective: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
        pass


@contextlib.contextmanager
def attach_probe(model: torch.nn.Module, probe: AttentionProbe):
    from .attention import AttentionBase

    mods = [m for m in model.modules() if isinstance(m, AttentionBase)]
    old = [m.probe for m in mods]
    for m in mods:
        m.probe = probe
    try:
        yield probe
    finally:
        for m, o in zip(mods, old):
            m.probe = o
