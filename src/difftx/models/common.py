"""What every difftx model offers besides forward: counting, lambda readout, backend switching."""

from __future__ import annotations

from typing import Optional


class ModelMixin:
    config: "object"

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Number of parameters (tied weights once); ``non_embedding`` leaves out token/position embeddings."""
        seen, total = set(), 0
        for name, p in self.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if non_embedding and name.split(".")[0] in ("embed", "pos_embed"):
                continue
            total += p.numel()
        return total

    def attention_modules(self) -> list:
        from ..nn.attention import AttentionBase

        return [m for m in self.modules() if isinstance(m, AttentionBase)]

    def lambdas(self) -> list[Optional[float]]:
        """Per-layer lambda (1-based layer order).

        DIFF: the layer's lambda from its parameters.  DIFF V2: the mean of
        sigmoid(W x) over the last forward pass outside torch.func transforms (None before any).  Softmax: [].
        """
        out = []
        for m in self.attention_modules():
            if m.kind == "diff":
                out.append(float(m.lambda_full().detach()))
            elif m.kind == "diff2":
                out.append(None if m.last_lambda is None else float(m.last_lambda))
        return out

    def set_activation_checkpointing(self, every: int = 1) -> None:
        """Activation checkpointing: every ``every``-th block (the 1st, the ``every + 1``-th, ...) keeps only its
        inputs for backward and runs its forward again during backward; 1: every block, 0: none.  Training
        memory falls to about one block's activations plus the blocks' inputs; a step costs about one more
        forward.  Values and gradients stay the same, bit for bit (in eager mode; a compiled graph, partitioned
        differently, agrees to float rounding).  Decoding with a KV cache and code without
        autograd never recompute.  Not saved with the model: a runtime setting, as the attention backend."""
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"every must be a non-negative integer (0: off, 1: every block); got {every!r}")
        for i, block in enumerate(self.layers):
            block.gradient_checkpointing = every > 0 and i % every == 0
            block.__dict__.pop("_gradient_checkpointing_func", None)  # torch's non-reentrant checkpoint

    def activation_checkpointing(self) -> list[bool]:
        """Per block (1-based layer order), whether it recomputes its activations in backward."""
        return [bool(getattr(b, "gradient_checkpointing", False)) for b in self.layers]

    def set_attention_backend(self, backend: str, diff_variant: Optional[str] = None) -> None:
        """Switch every layer to ``backend`` (auto, eager, sdpa, flex) and optionally a DIFF sdpa variant."""
        from ..config import BACKENDS
        from ..nn.backends import DIFF_SDPA_VARIANTS

        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if diff_variant is not None and diff_variant not in DIFF_SDPA_VARIANTS:
            raise ValueError(f"diff_variant must be one of {DIFF_SDPA_VARIANTS}, got {diff_variant!r}")
        for m in self.attention_modules():
            m.backend = backend
            if diff_variant is not None:
                m.diff_variant = diff_variant
