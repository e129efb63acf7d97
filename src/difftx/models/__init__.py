"""Models assembled from difftx.nn: the decoder LM and the vision encoder."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from .lm import DecoderLM, LMOutput
from .vision import VisionEncoder, VisionOutput


class _SkipMetaInit(TorchFunctionMode):
    """Random initialisation of meta tensors as a no-op.  Meta's ``normal_`` is a Python reference whose first
    call imports torch._dynamo: 2.4 s added to every parameter count (``difftx info``, ``difftx train``'s first
    line; 2026-11-26, AMD EPYC), for values a meta tensor does not have."""

    _SKIP = (torch.Tensor.normal_, torch.nn.init.normal_, torch.nn.init.trunc_normal_)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._SKIP:
            t = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by keyword
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def build_model(cfg, device=None, dtype=None) -> torch.nn.Module:
    """The model a :class:`~difftx.ModelConfig` describes (``domain`` picks LM or vision).

    ``device="meta"`` builds without allocating (parameter counting).
    """
    cls = DecoderLM if cfg.domain == "lm" else VisionEncoder
    if device is not None and str(device) == "meta":
        with torch.device("meta"), _SkipMetaInit():
            return cls(cfg)
    model = cls(cfg)
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    return model


__all__ = ["build_model", "DecoderLM", "LMOutput", "VisionEncoder", "VisionOutput"]
