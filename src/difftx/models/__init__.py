"""Models assembled from difftx.nn: the decoder LM and the vision encoder."""

from __future__ import annotations

import torch

from .lm import DecoderLM, LMOutput
from .vision import VisionEncoder, VisionOutput


def build_model(cfg, device=None, dtype=None) -> torch.nn.Module:
    """The model a :class:`~difftx.ModelConfig` describes (``domain`` picks LM or vision).

    ``device="meta"`` builds without allocating (parameter counting).
    """
    cls = DecoderLM if cfg.domain == "lm" else VisionEncoder
    if device is not None and str(device) == "meta":
        with torch.device("meta"):
            return cls(cfg)
    model = cls(cfg)
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    return model


__all__ = ["build_model", "DecoderLM", "LMOutput", "VisionEncoder", "VisionOutput"]
