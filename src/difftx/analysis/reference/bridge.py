"""Read difftx modules' weights (or gradients) into the reference's per-head layout.

The row layouts are written out here from their documentation (official DIFF
code: ``adjacent``; transformers' DiffLlama: ``halves``), independently of
:meth:`DifferentialAttention.split`, so a reference-versus-library comparison
also checks the library's layout.  ``grad=True`` reads ``.grad`` instead of the
values, giving the library's gradients in the reference's keys.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .diff import DiffBlockConfig
from .seed import SeedConfig


def _reader(module, grad: bool) -> Callable[[str], np.ndarray]:
    params = dict(module.named_parameters())

    def get(name: str) -> np.ndarray:
        t = params[name].grad if grad else params[name]
        if t is None:
            raise ValueError(f"{name} has no gradient; run backward first")
        return t.detach().double().cpu().numpy()

    return get


def diff_block_config(block) -> DiffBlockConfig:
    """The reference config of a difftx ``Block`` with differential attention (pre-RMSNorm, SwiGLU, no biases)."""
    from ...nn.ffn import SwiGLU
    from ...nn.norms import RMSNorm

    a = block.attn
    if a.kind != "diff" or a.n_kv_heads != a.n_heads:
        raise ValueError("the reference DIFF block has no GQA: need attention='diff' and n_kv_heads == n_heads")
    if block.attn_norm is None or block.ffn_norm is None or a.q_norm is not None or block.attn_mid_norm is not None:
        raise ValueError("the reference DIFF block is the paper's pre-norm layout (norms='S1')")
    post = block.attn_post_norm is not None or block.ffn_post_norm is not None
    for flag, on in (("mid_norm_ffn", block.ffn_mid_norm is not None), ("post_norm", post)):  # flags beyond S1
        if on:
            raise ValueError(f"the reference DIFF block is the paper's pre-norm layout (norms='S1'): need {flag}=False")
    if not isinstance(block.attn_norm, RMSNorm):
        raise ValueError(f"the reference DIFF block uses RMSNorm: need norm='rms', not "
                         f"{type(block.attn_norm).__name__}")
    if not isinstance(block.ffn, SwiGLU):
        raise ValueError(f"the reference DIFF block's FFN is SwiGLU: need ffn='swiglu', not {type(block.ffn).__name__}")
    if any(name.endswith("bias") for name, _ in block.named_parameters()):
        raise ValueError("the reference DIFF block has no biases: need bias=False")
    if block.dropout > 0 or a.dropout > 0:  # a training-mode comparison would hold dropout the reference lacks
        raise ValueError("the reference DIFF block has no dropout: need dropout=0")
    return DiffBlockConfig(
        d_model=a.d_model, n_heads=a.n_heads, head_dim=a.head_dim, ffn_dim=block.ffn.w_gate.out_features,
        lambda_init=a.lambda_init, eps=block.attn_norm.eps,
        head_eps=a.head_norm.eps if a.head_norm is not None else 1e-5,
        head_norm=a.head_norm is not None, causal=True, rope_style=a.rope_style,
    )


def diff_block_arrays(block, grad: bool = False) -> dict[str, np.ndarray]:
    """Parameters (or their gradients) of a difftx DIFF ``Block`` in :mod:`.diff`'s keys."""
    get = _reader(block, grad)
    a = block.attn
    h, d = a.n_heads, a.head_dim
    Wq, Wk, Wv, Wo = get("attn.q_proj.weight"), get("attn.k_proj.weight"), get("attn.v_proj.weight"), \
        get("attn.out_proj.weight")

    def rows(W: np.ndarray, i: int, component: int) -> np.ndarray:  # d rows of Q/K component 0|1 of head i
        start = (2 * i + component) * d if a.pairing == "adjacent" else (component * h + i) * d
        return W[start:start + d].T

    out = {}
    for j, (q, k) in enumerate((("WQ1", "WK1"), ("WQ2", "WK2"))):
        out[q] = np.stack([rows(Wq, i, j) for i in range(h)])
        out[k] = np.stack([rows(Wk, i, j) for i in range(h)])
    if a.pairing == "adjacent":
        out["WV"] = np.stack([Wv[2 * i * d:(2 * i + 2) * d].T for i in range(h)])
    else:
        out["WV"] = np.stack([np.concatenate((Wv[i * d:(i + 1) * d], Wv[(h + i) * d:(h + i + 1) * d])).T
                              for i in range(h)])
    out["WO"] = np.stack([Wo[:, 2 * i * d:(2 * i + 2) * d].T for i in range(h)])
    for k in ("lq1", "lk1", "lq2", "lk2"):
        out[k] = get("attn.lambda_" + k[1:])
    if a.head_norm is not None and a.head_norm.weight is not None:
        out["head_norm"] = get("attn.head_norm.weight")
    out["attn_norm"], out["ffn_norm"] = get("attn_norm.weight"), get("ffn_norm.weight")
    out["Wg"], out["Wu"], out["Wd"] = get("ffn.w_gate.weight").T, get("ffn.w_up.weight").T, get("ffn.w_down.weight").T
    return out


def seed_config(model) -> SeedConfig:
    """The reference config of a difftx ``DecoderLM`` in the seed's layout (post-LayerNorm, ReLU MLP with biases)."""
    c = model.config
    ok = (c.attention == "softmax" and c.post_norm and c.norm == "layer" and c.ffn == "relu" and c.bias
          and c.qkv_bias and c.sliding_window is None and c.positions in ("learned", "sinusoidal") and not c.tie_embeddings and not c.final_norm
          and not c.input_norm and not c.pre_norm_attn and not c.pre_norm_ffn and not c.qk_norm
          and not c.mid_norm_attn and not c.mid_norm_ffn and c.n_kv_heads == c.n_heads and c.dropout == 0)
    if not ok:
        raise ValueError("the seed layout is softmax attention, norms='post', norm='layer', ffn='relu', bias=True "
                         "(qkv_bias too), learned or sinusoidal positions, untied embeddings, no GQA, no dropout, no "
                         "sliding window")
    return SeedConfig(vocab_size=c.vocab_size, d_model=c.d_model, n_heads=c.n_heads, head_dim=c.head_dim,
                      ffn_dim=c.ffn_dim, n_layers=c.n_layers, max_len=c.max_seq_len,
                      positions="learned" if c.positions == "learned" else "fixed", causal=True, eps=c.norm_eps)


def seed_arrays(model, grad: bool = False) -> dict[str, np.ndarray]:
    """Parameters (or gradients) of a seed-layout ``DecoderLM`` in :mod:`.seed`'s keys.

    The library's attention biases have no place in the seed; set them to zero
    before comparing (their gradients are not read).
    """
    get = _reader(model, grad)
    c = model.config
    h, k = c.n_heads, c.head_dim
    out = {"E": get("embed.weight"), "Wout": get("lm_head.weight").T}
    if c.positions == "learned":
        out["P"] = get("pos_embed.weight")
    for layer in range(c.n_layers):
        pre, src = f"{layer}.", f"layers.{layer}."
        for ours, theirs in (("WQ", "q_proj"), ("WK", "k_proj"), ("WV", "v_proj")):
            W = get(src + f"attn.{theirs}.weight")
            out[pre + ours] = np.stack([W[i * k:(i + 1) * k].T for i in range(h)])
        Wo = get(src + "attn.out_proj.weight")
        out[pre + "WO"] = np.stack([Wo[:, i * k:(i + 1) * k].T for i in range(h)])
        out[pre + "ln1_g"], out[pre + "ln1_b"] = get(src + "attn_post_norm.weight"), get(src + "attn_post_norm.bias")
        out[pre + "W1"], out[pre + "b1"] = get(src + "ffn.w_up.weight").T, get(src + "ffn.w_up.bias")
        out[pre + "W2"], out[pre + "b2"] = get(src + "ffn.w_down.weight").T, get(src + "ffn.w_down.bias")
        out[pre + "ln2_g"], out[pre + "ln2_b"] = get(src + "ffn_post_norm.weight"), get(src + "ffn_post_norm.bias")
    return out
