"""Weight initialisation schemes (ModelConfig.init).

* ``normal``: N(0, init_std) for every matrix, the residual output projections
  (attention ``out_proj``, FFN ``w_down``) scaled by 1/sqrt(2 n_layers) as in
  GPT-2 / nanoGPT; embeddings N(0, init_std).
* ``xavier``: Glorot-uniform matrices (the DNT language recipe); embeddings N(0, init_std).
* ``truncated_xavier``: Glorot-normal truncated at 2 std (the DNT vision recipe).

Biases start at 0, norm gains at 1.  DIFF's lambda vectors keep N(0, lambda_std)
from their construction and DIFF V2's lambda projection keeps torch's default
Linear init, as in the official code.
"""

from __future__ import annotations

import math

from torch import nn

from ..nn.norms import LayerNorm, RMSNorm

RESIDUAL_OUTPUTS = ("out_proj", "w_down")
KEEP_DEFAULT = ("lambda_proj",)


def init_weights(model: nn.Module, cfg) -> None:
    for name, m in model.named_modules():
        init_module(m, name.rsplit(".", 1)[-1], cfg)


def init_module(m: nn.Module, leaf: str, cfg, constructed: bool = False) -> None:
    """The scheme for one module's own parameters (``leaf``: its name in its parent).  ``constructed``: also
    what modules otherwise get at construction (norm gains 1, LayerNorm shifts 0, DIFF's lambda vectors
    N(0, lambda_std), DIFF V2's lambda projection torch's default), for a model whose construction left memory
    uninitialised (meta device)."""
    if isinstance(m, nn.Linear):
        if leaf in KEEP_DEFAULT:
            if constructed:
                m.reset_parameters()
            return
        w = m.weight
        if cfg.init == "normal":
            std = cfg.init_std * (scale_out(cfg) if leaf in RESIDUAL_OUTPUTS else 1.0)
            nn.init.normal_(w, 0.0, std)
        elif cfg.init == "xavier":
            nn.init.xavier_uniform_(w)
        else:
            fan_out, fan_in = w.shape
            std = math.sqrt(2.0 / (fan_in + fan_out))
            nn.init.trunc_normal_(w, 0.0, std, -2 * std, 2 * std)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, 0.0, cfg.init_std)
    elif constructed and isinstance(m, (RMSNorm, LayerNorm)):
        if m.weight is not None:
            nn.init.ones_(m.weight)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)
    elif constructed:
        for name, p in m.named_parameters(recurse=False):
            if name.startswith("lambda_"):
                nn.init.normal_(p, 0.0, cfg.lambda_std)


def scale_out(cfg) -> float:
    """The residual output projections' std factor, 1/sqrt(2 n_layers)."""
    return 1.0 / math.sqrt(2 * cfg.n_layers)
