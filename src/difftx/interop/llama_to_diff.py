"""Initialise a DIFF model from a softmax Transformer (e.g. a converted Llama) for continued training.

Everything outside attention (embeddings, FFNs, block and final norms, LM head)
is copied unchanged in every mode.  What attention can keep is limited by the
math: a DIFF layer with h differential heads forms only h "signal" maps, each
applied to a 2d-wide value, so a Transformer's 2h distinct maps cannot all
survive at matched size, and the per-head RMSNorm rescales every head's output
per token, which no weight can undo.  Three modes:

``exact``  (function identical at step 0; attention twice the size)
    One differential head per Transformer head (n_heads = H, n_kv_heads = H_kv).
    Q1 = Q2 = q_i, K1 = K2 = k_i, V = [v_i, v_i], out_proj = [o_i, 0];
    lambda_init = 0, no per-head norm, and the four lambda vectors mirrored
    (lq1 = lq2, lk1 = lk2, random) so lambda = 0 exactly yet has a gradient.
    The attention projections and the KV cache are 2x the Transformer's.

``twin-zero``  (matched size, paper head layout; half of every head exact)
    The matched twin (n_heads = H/2, n_kv_heads = H_kv/2, same parameters as the
    Transformer up to the lambda vectors).  Head j takes Transformer heads j and
    j + H/2 as its two maps (they sit in K/V groups g and g + H_kv/2, which become
    the group's K1 and K2), V = [v_g, v_{g + H_kv/2}], out_proj columns follow.
    lambda = 0 (as above) and no per-head norm: the first d output channels of
    every head equal Transformer head j's output exactly; the second d apply head
    j's map to head j + H/2's values instead of that head's own map.

``twin``  (the paper's DIFF at matched size)
    Same weights as ``twin-zero`` but lambda_init follows the depth schedule,
    lambda vectors ~ N(0, lambda_std) and the per-head RMSNorm (gain 1) with the
    (1 - lambda_init) factor are on.  Nothing of attention's function is kept;
    only the weights are reused.

benchmarks/llama_to_diff.py measures logit differences and KL at step 0 for
each mode (numbers in docs/interop.md).
"""

from __future__ import annotations

import sys
import types

import torch

from ..config import ModelConfig
from ..errors import ConfigError
from .layouts import _swap_pairing

DIFF_INIT_MODES = ("exact", "twin-zero", "twin")


def _rows(w: torch.Tensor, d: int, heads: list[int]) -> torch.Tensor:
    """Stack the d-row blocks ``heads`` of ``w`` (n*d, ...) in that order."""
    blocks = w.reshape(-1, d, *w.shape[1:])
    return blocks[torch.as_tensor(heads)].reshape(len(heads) * d, *w.shape[1:]).clone()


def diff_config_for(cfg: ModelConfig, mode: str, pairing: str = "adjacent",
                    head_norm_eps: float = 1e-5) -> ModelConfig:
    """The DIFF config ``mode`` turns softmax config ``cfg`` into (``head_norm_eps``: ``twin``'s per-head norm,
    1e-5 as in the official code; DiffLlama's is the model's ``norm_eps``)."""
    if mode not in DIFF_INIT_MODES:
        raise ConfigError("diff_init", f"must be one of {', '.join(DIFF_INIT_MODES)}; got {mode!r}")
    if cfg.attention != "softmax":
        raise ConfigError("attention", f"a DIFF initialisation starts from a softmax model; got {cfg.attention!r}")
    common = dict(attention="diff", head_dim=cfg.head_dim, ffn_dim=cfg.ffn_dim, pairing=pairing)
    if mode == "exact":
        return cfg.replace(n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, lambda_init=0.0, head_norm=False,
                           **common)
    if cfg.n_heads % 2 or cfg.n_kv_heads % 2:
        raise ConfigError("n_kv_heads", f"mode {mode!r} pairs heads and K/V heads; {cfg.n_heads} heads and "
                          f"{cfg.n_kv_heads} K/V heads must both be even (use --diff-init exact)")
    twin = dict(n_heads=cfg.n_heads // 2, n_kv_heads=cfg.n_kv_heads // 2, **common)
    if mode == "twin-zero":
        return cfg.replace(lambda_init=0.0, head_norm=False, **twin)
    return cfg.replace(lambda_init="schedule", head_norm=True, head_norm_weight=True, head_norm_eps=head_norm_eps,
                       **twin)


def llama_to_diff(cfg: ModelConfig, state: dict, mode: str = "twin-zero", pairing: str = "adjacent",
                  seed: int = 0, head_norm_eps: float = 1e-5) -> tuple[ModelConfig, dict]:
    """(DIFF config, DIFF state dict) initialised from softmax model ``(cfg, state)``; see the module doc
    (``head_norm_eps``: see :func:`diff_config_for`)."""
    new = diff_config_for(cfg, mode, pairing, head_norm_eps)
    d, H, Hk = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    if mode == "exact":  # halves order: component c of 2H is head c % H (both maps from the same head)
        q_src, kv_src = [c % H for c in range(2 * H)], [c % Hk for c in range(2 * Hk)]
    else:  # component c of 2h is Transformer head c: (j, j + H/2) and groups (g, g + Hk/2)
        q_src, kv_src = list(range(H)), list(range(Hk))
    h_new, hk_new = new.n_heads, new.n_kv_heads
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key, t in state.items():
        parts = key.split(".")
        if len(parts) < 4 or parts[0] != "layers" or parts[2] != "attn":
            out[key] = t
            continue
        name, suffix = parts[3], parts[-1]
        prefix = ".".join(parts[:3]) + "."
        if name in ("q_proj", "k_proj", "v_proj"):
            src, n = (q_src, h_new) if name == "q_proj" else (kv_src, hk_new)
            out[key] = _swap_pairing(_rows(t, d, src), n, d, "halves", pairing)
        elif name == "out_proj" and suffix == "weight":
            o = t.reshape(t.shape[0], H, d)
            if mode == "exact":
                o = torch.stack((o, torch.zeros_like(o)), dim=2)  # (D, H, 2, d): [o_i, 0]
            else:
                o = o.reshape(t.shape[0], 2, h_new, d).transpose(1, 2)  # head j: [o_j, o_{j + H/2}]
            out[key] = o.reshape(t.shape[0], -1).contiguous()
        else:  # out_proj.bias, q_norm, k_norm: unchanged
            out[key] = t
        if name == "q_proj" and suffix == "weight":
            lam = {n: torch.zeros(d).normal_(0.0, cfg.lambda_std, generator=gen)
                   for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")}
            if mode != "twin":  # mirrored: exp(lq1.lk1) - exp(lq2.lk2) = 0 exactly, gradients are not 0
                lam["lambda_q2"], lam["lambda_k2"] = lam["lambda_q1"].clone(), lam["lambda_k1"].clone()
            out.update({prefix + n: v for n, v in lam.items()})
            if new.head_norm and new.head_norm_weight:
                out[prefix + "head_norm.weight"] = torch.ones(2 * d)
    return new, out


class _CallableModule(types.ModuleType):
    """This module is also ``difftx.interop.llama_to_diff`` as the package exports the function of that name:
    once the module is imported, Python's import system sets the package attribute to the module, so
    ``from difftx.interop import llama_to_diff`` gives the module; calling it calls the function."""

    def __call__(self, *args, **kwargs):
        return llama_to_diff(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
