"""Checkpoint conversion between difftx and Hugging Face layouts, both ways, without transformers.

Formats (``--from`` / ``--to`` of ``difftx convert``):

* ``difftx``: a difftx model directory (``config.json`` with ``difftx_format`` + ``model.safetensors``).
* ``hf-llama``: transformers' ``LlamaForCausalLM`` <-> the difftx softmax Transformer
  (pre-norm ``S1``, RMSNorm, SwiGLU, RoPE; GQA kept as is).
* ``hf-mistral``: transformers' ``MistralForCausalLM``, Llama's blocks without biases and with
  an optional ``sliding_window`` <-> the same Transformer with difftx's ``sliding_window`` (the
  same keys: a query sees itself and the ``window - 1`` before it).
* ``hf-qwen2``: transformers' ``Qwen2ForCausalLM`` (Qwen2, Qwen2.5): Llama's blocks with biases on the q, k and v
  projections only <-> the Transformer with ``qkv_bias`` (and no other bias).
* ``hf-qwen3``: transformers' ``Qwen3ForCausalLM``: Llama's blocks with a per-head RMSNorm of q and k (over
  ``head_dim``, with a gain, before RoPE) <-> the Transformer with norms ``S2`` (difftx's QK norm is that norm).
  A Qwen sliding window covers the layers ``layer_types`` names; the others are difftx's
  ``full_attention_layers``.
* ``hf-phi3``: transformers' ``Phi3ForCausalLM`` (Phi-3, Phi-3.5-mini, Phi-4): Llama's blocks with Q/K/V in one
  ``qkv_proj`` and gate/up in one ``gate_up_proj`` (split on reading, joined on writing), no biases, an optional
  ``sliding_window`` on every layer; a ``partial_rotary_factor`` under 1 (Phi-4-mini) or LongRoPE is refused.
* ``hf-diffllama``: transformers' ``DiffLlamaForCausalLM`` <-> difftx DIFF.  DiffLlama's
  conventions are expressed as config fields, so its weights load unpermuted:
  ``num_attention_heads`` counts component heads (difftx ``n_heads`` = half of it),
  ``pairing='halves'``, ``rope_style='half'``, per-head RMSNorm without weight
  (``head_norm_weight=False``) and with ``rms_norm_eps``, and ``lambda_init_fn(layer_idx)``
  with a 0-based index equal to difftx's 1-based schedule.  Exporting a difftx DIFF
  model with other conventions re-lays its rows out first (:mod:`.layouts`).
* ``hf-difftx``: :class:`difftx.interop.hf.DifftxForCausalLM` (``model_type='difftx'``),
  any attention kind and norm placement.

Every tensor is checked by name and shape against what the config implies; a
mismatch raises :class:`~difftx.errors.CheckpointError` naming the tensor.  Nothing
is unpickled and no code from the directory runs (see :mod:`.hf_io`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ..config import NORM_FLAGS, NORM_PRESETS, ModelConfig
from ..errors import CheckpointError, ConfigError, DifftxError
from ..io import (CONFIG_FILE, WEIGHTS_FILE, atomic_copyfile, cast_model, cast_state, check_finite, clean_state_dict,
                  is_model_dir, list_checkpoints, load_safetensors, make_out_dir, model_dtype, read_model_config,
                  refuse_unplain_state, save_model)
from . import hf_io
from .layouts import relayout

HF_FORMATS = ("hf-llama", "hf-diffllama", "hf-mistral", "hf-qwen2", "hf-qwen3", "hf-phi3", "hf-difftx")
# Llama's blocks (Phi-3's with its fused Q/K/V and gate/up tensors: :func:`_unfuse_phi3` / :func:`_fuse_phi3`)
LLAMA_LIKE = ("hf-llama", "hf-diffllama", "hf-mistral", "hf-qwen2", "hf-qwen3", "hf-phi3")
FORMATS = ("difftx",) + HF_FORMATS
MODEL_TYPES = {"llama": "hf-llama", "diffllama": "hf-diffllama", "mistral": "hf-mistral", "qwen2": "hf-qwen2",
               "qwen3": "hf-qwen3", "phi3": "hf-phi3", "difftx": "hf-difftx"}
ARCHITECTURES = {"hf-llama": "LlamaForCausalLM", "hf-diffllama": "DiffLlamaForCausalLM",
                 "hf-mistral": "MistralForCausalLM", "hf-qwen2": "Qwen2ForCausalLM", "hf-qwen3": "Qwen3ForCausalLM",
                 "hf-phi3": "Phi3ForCausalLM", "hf-difftx": "DifftxForCausalLM"}
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
TOKEN_IDS_KEY = "hf_token_ids"  # where a difftx model directory keeps a Hugging Face source's token ids
HF_DIFFTX_PREFIX = "model."  # DifftxForCausalLM holds the DecoderLM as ``.model``
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-persistent buffers some old checkpoints saved


# ---------------------------------------------------------------------- configs
QWEN = ("hf-qwen2", "hf-qwen3")
WINDOWED = ("hf-mistral", "hf-phi3") + QWEN  # the formats with a sliding window field
NO_BIAS = ("hf-mistral", "hf-phi3")  # formats whose projections have no biases (and no option for them)


def _hf_window(hf: dict, src: str, fmt: str, n_layers: int) -> tuple[Optional[int], Optional[list]]:
    """(``sliding_window``, ``full_attention_layers``) of difftx for a Mistral / Qwen2 / Qwen3 ``config.json``
    ((None, None) elsewhere).

    Mistral's window covers every layer.  Qwen's covers the layers ``layer_types`` names ``sliding_attention``
    (without it: the layers from ``max_window_layers`` on, when ``use_sliding_window``), as transformers reads it;
    the others are difftx's ``full_attention_layers`` (1-based)."""
    if fmt not in WINDOWED:
        return None, None
    window, full = hf.get("sliding_window"), None
    if fmt in QWEN:
        use = hf.get("use_sliding_window", False)
        if not isinstance(use, bool):
            raise CheckpointError(f"{src}: 'use_sliding_window' must be true or false; got {use!r}")
        window = window if use else None  # transformers drops the window unless use_sliding_window
        types = hf.get("layer_types")
        if types is None:
            first = hf.get("max_window_layers", 28)
            if isinstance(first, bool) or not isinstance(first, int):
                raise CheckpointError(f"{src}: 'max_window_layers' must be an integer; got {first!r}")
            types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                     for i in range(n_layers)]
        if not isinstance(types, list) or len(types) != n_layers \
                or any(t not in ("full_attention", "sliding_attention") for t in types):
            raise CheckpointError(f"{src}: 'layer_types' must list 'full_attention' or 'sliding_attention' for each "
                                  f"of the {n_layers} layers; got {types!r}")
        if "sliding_attention" not in types:
            return None, None
        if window is None:
            raise CheckpointError(f"{src}: 'layer_types' names sliding_attention layers but there is no sliding "
                                  "window (use_sliding_window false, or sliding_window null); the config is malformed")
        full = [i + 1 for i, t in enumerate(types) if t == "full_attention"] or None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise CheckpointError(f"{src}: 'sliding_window' must be a positive integer or null; got {window!r}")
    return window, full


def _llama_like_config(hf: dict, src: str, fmt: str) -> ModelConfig:
    """difftx config for a Llama / DiffLlama / Mistral / Qwen2 / Qwen3 ``config.json`` (``src`` names it in
    errors)."""
    diff = fmt == "hf-diffllama"

    def need(key):
        if hf.get(key) is None:
            raise CheckpointError(f"{src}: '{key}' is missing")
        return hf[key]

    def number(key, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{src}: '{key}' must be a number; got {value!r}")
        return float(value)

    def flag(key):  # JSON true / false; null or absent is false, as transformers' Llama configs default them
        value = hf.get(key)
        if value is not None and not isinstance(value, bool):
            raise CheckpointError(f"{src}: '{key}' must be true or false; got {value!r}: the config is malformed")
        return bool(value)

    heads, d_model = need("num_attention_heads"), need("hidden_size")
    for key, value in (("num_attention_heads", heads), ("hidden_size", d_model)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{src}: '{key}' must be a positive integer; got {value!r}")
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or d_model // heads
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{src}: hidden_act={act!r} is not supported; difftx's SwiGLU uses silu")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}  # transformers takes rope_scaling first
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type != "default":
        raise CheckpointError(f"{src}: RoPE scaling {rope_type!r} is not supported by difftx (only plain RoPE)")
    theta = (rope.get("rope_theta") if isinstance(rope, dict) else None) or hf.get("rope_theta", 10000.0)
    theta = number("rope_theta", theta)
    partial = (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) \
        or hf.get("partial_rotary_factor") or 1.0  # absent or null: every channel
    if number("partial_rotary_factor", partial) != 1.0:  # Phi-4-mini's 0.75: RoPE on part of each head
        raise CheckpointError(f"{src}: partial_rotary_factor={partial} is not supported by difftx (RoPE rotates "
                              "every channel of a head)")
    if fmt in NO_BIAS:  # no bias options: Mistral's and Phi-3's projections have none
        bias = qkv_bias = False
    elif fmt == "hf-qwen2":  # no bias options: Qwen2's q, k and v projections always have biases, o and the MLP none
        bias, qkv_bias = False, True
    elif fmt == "hf-qwen3":  # attention_bias: q, k, v and o; its MLP has none
        if flag("attention_bias"):
            raise CheckpointError(f"{src}: attention_bias=True is not supported for Qwen3 (biases on q, k, v and o "
                                  "but not the MLP; difftx's 'bias' covers attention and FFN together, "
                                  "'qkv_bias' q, k and v)")
        bias = qkv_bias = False
    else:
        attn_bias, mlp_bias = flag("attention_bias"), flag("mlp_bias")
        if diff and attn_bias:  # DiffLlama's FFN has no bias option: its biases would be attention-only
            raise CheckpointError(f"{src}: attention_bias=True is not supported for DiffLlama (its MLP has no bias, "
                                  "and difftx has one 'bias' switch for attention and FFN)")
        if attn_bias != mlp_bias:
            raise CheckpointError(f"{src}: attention_bias={attn_bias} but mlp_bias={mlp_bias}; difftx has one "
                                  "'bias' switch for attention and FFN")
        bias = qkv_bias = attn_bias
    fields = dict(
        domain="lm", d_model=d_model, n_layers=need("num_hidden_layers"), head_dim=head_dim,
        ffn_dim=need("intermediate_size"), vocab_size=need("vocab_size"),
        max_seq_len=hf.get("max_position_embeddings", 2048), norms="S2" if fmt == "hf-qwen3" else "S1", norm="rms",
        norm_eps=number("rms_norm_eps", hf.get("rms_norm_eps", 1e-5 if diff else 1e-6)),  # transformers' defaults
        ffn="swiglu", positions="rope", rope_style="half",
        rope_theta=theta, tie_embeddings=flag("tie_word_embeddings"), bias=bias, qkv_bias=qkv_bias,
        init_std=number("initializer_range", hf.get("initializer_range", 0.02)),
    )
    n_layers = fields["n_layers"]
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise CheckpointError(f"{src}: 'num_hidden_layers' must be a positive integer; got {n_layers!r}")
    window, full = _hf_window(hf, src, fmt, n_layers)
    if window is not None:
        fields.update(sliding_window=window, full_attention_layers=full)
    if not diff:
        fields.update(attention="softmax", n_heads=heads, n_kv_heads=kv)
    else:
        if heads % 2 or kv % 2:
            raise CheckpointError(f"{src}: DiffLlama needs even num_attention_heads and num_key_value_heads; "
                                  f"got {heads} and {kv}")
        std = hf.get("lambda_std_dev")  # 0.0 is a value (lambdas initialised to 0), not a missing one
        fields.update(attention="diff", n_heads=heads // 2, n_kv_heads=kv // 2, pairing="halves",
                      head_norm=True, head_norm_weight=False, head_norm_eps=fields["norm_eps"],
                      lambda_init="schedule", lambda_std=number("lambda_std_dev", 0.1 if std is None else std))
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        raise CheckpointError(f"{src}: cannot be expressed as a difftx config: {e}") from None


def _require(cfg: ModelConfig, fmt: str, field: str, ok: bool, why: str) -> None:
    if not ok:
        raise ConfigError(field, f"cannot export to {fmt}: {why} (got {getattr(cfg, field, None)!r})")


def _check_llama_like(cfg: ModelConfig, fmt: str) -> None:
    want = "diff" if fmt == "hf-diffllama" else "softmax"
    _require(cfg, fmt, "domain", cfg.domain == "lm", "only language models")
    _require(cfg, fmt, "attention", cfg.attention == want, f"{fmt} holds attention={want!r}")
    placement = "S2" if fmt == "hf-qwen3" else "S1"
    want_flags = {f: bool(NORM_PRESETS[placement].get(f, False)) for f in NORM_FLAGS}
    for flag in NORM_FLAGS:
        _require(cfg, fmt, flag, getattr(cfg, flag) == want_flags[flag],
                 "Qwen3's blocks are pre-norm with a per-head QK norm and a final norm (norms='S2')"
                 if fmt == "hf-qwen3" else "Llama-style blocks are pre-norm (norms='S1') with a final norm"
                 + ("; Qwen3's add a per-head QK norm: export to hf-qwen3" if flag == "qk_norm" else ""))
    _require(cfg, fmt, "norm", cfg.norm == "rms", "Llama uses RMSNorm")
    _require(cfg, fmt, "ffn", cfg.ffn == "swiglu", "Llama uses a SwiGLU FFN")
    _require(cfg, fmt, "positions", cfg.positions == "rope", "Llama uses rotary positions")
    if fmt == "hf-qwen2":
        _require(cfg, fmt, "qkv_bias", cfg.qkv_bias, "Qwen2's q, k and v projections always have biases; export "
                 "to hf-llama or hf-mistral")
        _require(cfg, fmt, "bias", not cfg.bias, "Qwen2's output projection and MLP have no biases")
    elif fmt in ("hf-mistral", "hf-phi3", "hf-qwen3", "hf-diffllama"):
        why = {"hf-mistral": "Mistral's projections have no biases", "hf-phi3": "Phi-3's projections have no biases",
               "hf-qwen3": "difftx's biases cannot be expressed as Qwen3's (q, k, v and o, not the MLP)",
               "hf-diffllama": "DiffLlama's FFN has no bias"}[fmt]
        _require(cfg, fmt, "bias", not cfg.bias, why)
        _require(cfg, fmt, "qkv_bias", not cfg.qkv_bias,
                 why + ("; export to hf-qwen2 (biases on q, k and v)" if fmt in NO_BIAS else ""))
    else:  # Llama's attention_bias covers q, k, v and o, mlp_bias the MLP: difftx's one 'bias' is both
        _require(cfg, fmt, "qkv_bias", cfg.qkv_bias == cfg.bias,
                 "Llama's biases are on every projection or none; export to hf-qwen2 (biases on q, k and v only)")
    if fmt in NO_BIAS:
        _require(cfg, fmt, "full_attention_layers", not cfg.full_attention_layers,
                 f"{'Mistral' if fmt == 'hf-mistral' else 'Phi-3'}'s sliding window covers every layer; export to "
                 "hf-difftx (or a Qwen format)")
    if fmt not in WINDOWED:
        _require(cfg, fmt, "sliding_window", cfg.sliding_window is None,
                 f"{fmt} attends over the whole context (no sliding window); export to hf-difftx"
                 + (", or to hf-mistral (a Llama with a sliding window)" if fmt == "hf-llama" else ""))
    if fmt == "hf-diffllama":
        _require(cfg, fmt, "head_norm", cfg.head_norm, "DiffLlama always applies the per-head RMSNorm")
        _require(cfg, fmt, "lambda_init", cfg.lambda_init == "schedule",
                 "DiffLlama always uses the depth schedule 0.8 - 0.6 exp(-0.3 (l-1))")
        _require(cfg, fmt, "head_norm_eps", cfg.head_norm_eps == cfg.norm_eps,
                 f"DiffLlama's per-head norm uses rms_norm_eps = norm_eps = {cfg.norm_eps}")


def llama_config_dict(cfg: ModelConfig, fmt: str) -> dict:
    """The transformers ``config.json`` for ``cfg`` as LlamaForCausalLM, DiffLlamaForCausalLM, MistralForCausalLM,
    Qwen2ForCausalLM or Qwen3ForCausalLM."""
    diff = fmt == "hf-diffllama"
    heads, kv = (2 * cfg.n_heads, 2 * cfg.n_kv_heads) if diff else (cfg.n_heads, cfg.n_kv_heads)
    model_type = next(t for t, f in MODEL_TYPES.items() if f == fmt)
    out = dict(
        architectures=[ARCHITECTURES[fmt]], model_type=model_type,
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rope_theta=cfg.rope_theta,  # the pre-v5 spelling, for older transformers
        attention_bias=cfg.bias, attention_dropout=0.0, use_cache=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,  # save_hf fills in the known ids, and the dtype
        # when the weights have one (a mixed model's config names none: each tensor loads in its stored dtype)
    )
    if diff:
        out["lambda_std_dev"] = cfg.lambda_std
    elif fmt in NO_BIAS:  # no bias options: Mistral's and Phi-3's projections have none
        del out["attention_bias"]
        out["sliding_window"] = cfg.sliding_window
        if fmt == "hf-phi3":  # its fields with Llama's meaning, and its dropouts (training settings) off
            out.update(original_max_position_embeddings=cfg.max_seq_len, resid_pdrop=0.0, embd_pdrop=0.0)
    elif fmt in QWEN:  # layer_types says which layers the window covers (max_window_layers: for older readers)
        if fmt == "hf-qwen2":  # no bias options: q, k and v always have them
            del out["attention_bias"]
        types = ["full_attention" if cfg.layer_window(i) is None else "sliding_attention"
                 for i in range(1, cfg.n_layers + 1)]
        first = next((i for i, t in enumerate(types) if t == "sliding_attention"), cfg.n_layers)
        out.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                   max_window_layers=first, layer_types=types)
    else:
        out["mlp_bias"] = cfg.bias
    return out


# ---------------------------------------------------------------------- tensor names
def llama_key_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(transformers name, difftx name) for every tensor of a Llama / DiffLlama / Qwen-shaped difftx model."""
    pairs = [("model.embed_tokens.weight", "embed.weight")]
    suffixes = ("weight", "bias") if cfg.bias else ("weight",)
    qkv_suffixes = ("weight", "bias") if cfg.qkv_bias else ("weight",)
    for i in range(cfg.n_layers):
        a, b = f"model.layers.{i}.", f"layers.{i}."
        pairs += [(a + "input_layernorm.weight", b + "attn_norm.weight"),
                  (a + "post_attention_layernorm.weight", b + "ffn_norm.weight")]
        for hf_name, dx_name in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"),
                                 ("o_proj", "out_proj")):
            pairs += [(a + f"self_attn.{hf_name}.{s}", b + f"attn.{dx_name}.{s}")
                      for s in (suffixes if hf_name == "o_proj" else qkv_suffixes)]
        if cfg.qk_norm:  # Qwen3's per-head RMSNorm of q and k (over head_dim, before RoPE)
            pairs += [(a + f"self_attn.{n}.weight", b + f"attn.{n}.weight") for n in ("q_norm", "k_norm")]
        for hf_name, dx_name in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
            pairs += [(a + f"mlp.{hf_name}.{s}", b + f"ffn.{dx_name}.{s}") for s in suffixes]
        if cfg.attention == "diff":
            pairs += [(a + f"self_attn.{n}", b + f"attn.{n}")
                      for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")]
    pairs.append(("model.norm.weight", "final_norm.weight"))
    if not cfg.tie_embeddings:
        pairs.append(("lm_head.weight", "lm_head.weight"))
    return pairs


def _phi3_fused(cfg: ModelConfig, i: int) -> tuple:
    """Layer ``i``'s two fused Phi-3 tensors: (name, [(Llama name, rows)]) each, in their row order."""
    a, d = f"model.layers.{i}.", cfg.head_dim
    q, kv = cfg.n_heads * d, cfg.n_kv_heads * d
    return ((a + "self_attn.qkv_proj.weight", [(a + "self_attn.q_proj.weight", q), (a + "self_attn.k_proj.weight", kv),
                                                (a + "self_attn.v_proj.weight", kv)]),
            (a + "mlp.gate_up_proj.weight", [(a + "mlp.gate_proj.weight", cfg.ffn_dim),  # gate first: up * silu(gate)
                                             (a + "mlp.up_proj.weight", cfg.ffn_dim)]))


def _unfuse_phi3(raw: dict, cfg: ModelConfig, source: str) -> dict:
    """A Phi-3 state dict under Llama's names: qkv_proj split into q/k/v_proj, gate_up_proj into gate/up_proj (row
    blocks, views); a fused tensor missing or of the wrong shape is named."""
    out = dict(raw)
    for i in range(cfg.n_layers):
        for fused, parts in _phi3_fused(cfg, i):
            t = out.pop(fused, None)
            want = (sum(rows for _, rows in parts), cfg.d_model)
            if t is None:
                raise CheckpointError(f"{source}: tensor '{fused}' is missing; the weights do not match the config")
            if tuple(t.shape) != want:
                raise CheckpointError(f"{source}: tensor '{fused}' has shape {tuple(t.shape)}, the config implies "
                                      f"{want}; the weights do not match the config")
            for (name, _), piece in zip(parts, t.split([rows for _, rows in parts])):
                out[name] = piece
    return out


def _fuse_phi3(tensors: dict, cfg: ModelConfig) -> dict:
    """The reverse of :func:`_unfuse_phi3`: Llama-named tensors into Phi-3's fused ones."""
    out = dict(tensors)
    for i in range(cfg.n_layers):
        for fused, parts in _phi3_fused(cfg, i):
            out[fused] = torch.cat([out.pop(name) for name, _ in parts])
    return out


def expected_shapes(cfg: ModelConfig) -> dict:
    """difftx tensor name -> shape, from a model built on the meta device (nothing allocated)."""
    from ..models import build_model

    return {k: tuple(v.shape) for k, v in build_model(cfg, device="meta").state_dict().items()}


def map_and_check(state: dict, pairs: list[tuple[str, str]], shapes: dict, source: str,
                  ignore: tuple = ()) -> dict:
    """Rename ``state`` (source names) to target names; errors name the first bad source tensor."""
    wanted = {src: dst for src, dst in pairs}
    for name in state:
        if name not in wanted and not name.endswith(_IGNORED_SUFFIXES) and name not in ignore:
            raise CheckpointError(f"{source}: unexpected tensor '{name}'; the weights do not match the config")
    out = {}
    for src, dst in pairs:
        if src not in state:
            raise CheckpointError(f"{source}: tensor '{src}' is missing; the weights do not match the config")
        t = state[src]
        if tuple(t.shape) != shapes[dst]:
            raise CheckpointError(f"{source}: tensor '{src}' has shape {tuple(t.shape)}, the config implies "
                                  f"{shapes[dst]}; the weights do not match the config")
        if not t.is_floating_point():  # every difftx tensor is a float: an integer one is a corrupt file
            raise CheckpointError(f"{source}: tensor '{src}' is {str(t.dtype).removeprefix('torch.')}, not floating "
                                  "point; the weights are corrupt")
        check_finite(src, t, source)
        out[dst] = t
    missing = set(shapes) - set(out)
    if missing:  # a difftx tensor no pair provides: a config this format cannot hold
        raise CheckpointError(f"{source}: nothing provides difftx tensor '{sorted(missing)[0]}'")
    return out


# ---------------------------------------------------------------------- reading
def detect_format(path) -> str:
    """``difftx``, one of :data:`HF_FORMATS` or ``unilm`` (a weights file)."""
    path = Path(path)
    if path.is_file():
        return "unilm"
    if (path / hf_io.CONFIG_FILE).is_file() and not list_checkpoints(path):
        hf_io.read_json(path / hf_io.CONFIG_FILE)  # corrupt: say so (not "needs --to" or "not a model")
    if is_model_dir(path) or _is_difftx_run(path):
        return "difftx"
    if hf_io.is_hf_dir(path):
        model_type = hf_io.read_hf_config(path)["model_type"]
        if model_type in MODEL_TYPES:
            return MODEL_TYPES[model_type]
        raise CheckpointError(f"{path}: model_type {model_type!r} is not supported; "
                              f"difftx converts {', '.join(sorted(MODEL_TYPES))}")
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    raise CheckpointError(f"{path}: neither a difftx model directory nor a Hugging Face directory "
                          "(config.json with model_type)")


def _is_difftx_run(path: Path) -> bool:
    """A difftx training run or checkpoint directory (load_model resolves it to a model)."""
    try:
        return "difftx_format" in hf_io.read_json(path / hf_io.CONFIG_FILE)
    except CheckpointError:
        return False


def read_hf_as_difftx(path) -> tuple[ModelConfig, dict]:
    """(difftx config, difftx state dict) of a Hugging Face directory of one of :data:`HF_FORMATS`."""
    path = Path(path)
    hf = hf_io.read_hf_config(path)
    src = str(path / hf_io.CONFIG_FILE)
    fmt = MODEL_TYPES.get(hf["model_type"])
    if fmt is None:
        raise CheckpointError(f"{src}: model_type {hf['model_type']!r} is not supported; "
                              f"difftx converts {', '.join(sorted(MODEL_TYPES))}")
    if fmt == "hf-difftx":
        cfg = model_config_from_hf(hf, src)
        raw = hf_io.read_hf_weights(path)
        state = {k[len(HF_DIFFTX_PREFIX):] if k.startswith(HF_DIFFTX_PREFIX) else k: v for k, v in raw.items()}
        shapes = expected_shapes(cfg)
        return cfg, map_and_check(state, [(k, k) for k in shapes], shapes, str(path))
    cfg = _llama_like_config(hf, src, fmt)
    raw = hf_io.read_hf_weights(path)
    if fmt == "hf-phi3":
        raw = _unfuse_phi3(raw, cfg, str(path))
    head, embed = raw.get("lm_head.weight"), raw.get("model.embed_tokens.weight")
    if cfg.tie_embeddings and head is not None and embed is not None and head.shape == embed.shape \
            and not torch.equal(head, embed):  # a head of its own despite the config: transformers keeps it untied
        cfg = cfg.replace(tie_embeddings=False)
    ignore = ("lm_head.weight",) if cfg.tie_embeddings else ()
    state = map_and_check(raw, llama_key_pairs(cfg), expected_shapes(cfg), str(path), ignore=ignore)
    return cfg, state


def read_any(path) -> tuple[ModelConfig, dict, str]:
    """(config, difftx state dict, detected format) of a difftx or Hugging Face model directory."""
    fmt = detect_format(path)
    if fmt == "unilm":
        raise DifftxError(f"{path}: a unilm attention state dict holds one module, not a model; "
                          "use difftx.interop.unilm.load_unilm_attention")
    if fmt == "difftx":
        if is_model_dir(path):  # tensors checked by name and shape against the config before anything is written
            cfg = read_model_config(path)
            state = clean_state_dict(load_safetensors(Path(path) / WEIGHTS_FILE))
            shapes = expected_shapes(cfg)
            return cfg, map_and_check(state, [(k, k) for k in shapes], shapes, str(Path(path) / WEIGHTS_FILE)), fmt
        from ..io import load_model

        model = load_model(path)  # a run or checkpoint directory: its newest checkpoint
        return model.config, clean_state_dict(model.state_dict()), fmt
    cfg, state = read_hf_as_difftx(path)
    return cfg, state, fmt


def load_hf_model(path, device: Optional[str] = None, dtype: Optional[torch.dtype] = None):
    """A difftx :class:`~difftx.models.DecoderLM` from a Hugging Face directory (the load_model resolver).

    Without ``dtype`` the model comes back in the dtype its ``config.json`` names (``dtype``, or transformers'
    older ``torch_dtype``), else each tensor in its stored dtype, as :func:`difftx.load_model` gives a difftx
    directory back; DIFF's lambda vectors stay float32 below float32.
    """
    from ..io import load_state_dict_into, saved_dtype
    from ..models import build_model

    hf = hf_io.read_hf_config(path)
    cfg, state = read_hf_as_difftx(path)
    model = build_model(cfg)
    load_state_dict_into(model, state, str(path))
    if dtype is None:
        named = hf.get("dtype")  # transformers takes torch_dtype where dtype is absent or null
        dtype = saved_dtype(model, state, named if named is not None else hf.get("torch_dtype"))
    return cast_model(model, device, dtype).eval()


def resolve_hf_dir(path: Path, device: Optional[str] = None):
    """``difftx.io`` resolver: Hugging Face directories of :data:`HF_FORMATS`, else None."""
    if not hf_io.is_hf_dir(path):
        return None
    if hf_io.read_hf_config(path).get("model_type") not in MODEL_TYPES:
        return None
    return load_hf_model(path, device)


# ---------------------------------------------------------------------- writing
def difftx_to_hf(cfg: ModelConfig, state: dict, fmt: str) -> tuple[dict, dict]:
    """(config.json dict, tensors) of a difftx model in Hugging Face format ``fmt``."""
    state = clean_state_dict(state)
    if fmt == "hf-difftx":  # DifftxConfig refuses another domain: transformers could not load the directory
        _require(cfg, fmt, "domain", cfg.domain == "lm", "DifftxForCausalLM holds language models only")
        return hf_config_dict(cfg), {HF_DIFFTX_PREFIX + k: v for k, v in state.items()}
    if fmt not in LLAMA_LIKE:
        raise DifftxError(f"unknown Hugging Face format {fmt!r}; one of {', '.join(HF_FORMATS)}")
    _check_llama_like(cfg, fmt)
    if fmt == "hf-diffllama":
        for i in range(cfg.n_layers):
            w = state.get(f"layers.{i}.attn.head_norm.weight")
            if w is not None and not torch.equal(w, torch.ones_like(w)):
                raise ConfigError("head_norm_weight", f"cannot export to hf-diffllama: layer {i}'s per-head norm "
                                  "has a trained gain and DiffLlama's groupnorm has none")
        state = {k: v for k, v in state.items() if not k.endswith("head_norm.weight")}
        cfg = cfg.replace(head_norm_weight=False)
    cfg, state = relayout(state, cfg, pairing="halves" if fmt == "hf-diffllama" else None, rope_style="half")
    dx_to_hf = {dst: src for src, dst in llama_key_pairs(cfg)}
    tensors = {dx_to_hf[k]: v for k, v in state.items()}
    return llama_config_dict(cfg, fmt), _fuse_phi3(tensors, cfg) if fmt == "hf-phi3" else tensors


def save_hf(model_or_state, path, fmt: str, cfg: Optional[ModelConfig] = None,
            dtype: Optional[torch.dtype] = None, token_ids: Optional[dict] = None) -> Path:
    """Write a difftx model (or ``state`` + ``cfg``) as a Hugging Face directory of format ``fmt``.

    ``config.json``'s ``dtype`` names the stored weights' dtype (``dtype``, else the state's own); below
    float32, DIFF's lambda vectors are written in float32 (:data:`difftx.io.FP32_PARAMETERS`), as a bf16
    ``DifftxForCausalLM`` saves them (DiffLlama's loader casts them to its model dtype).
    ``token_ids`` (``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``) go into it as given.
    """
    if isinstance(model_or_state, torch.nn.Module):
        cfg, state = model_or_state.config, model_or_state.state_dict()
    else:
        state = model_or_state
        if not isinstance(cfg, ModelConfig):
            raise DifftxError("save_hf: a state dict needs cfg=, the ModelConfig of the model it came from (or pass "
                              "the model itself)")
    refuse_unplain_state(clean_state_dict(state), cfg, "save_hf")
    hf_config, tensors = difftx_to_hf(cfg, state, fmt)
    stored = dtype or model_dtype(tensors)
    if stored is not None:
        hf_config["dtype"] = str(stored).removeprefix("torch.")
        tensors = cast_state(tensors, stored)
    hf_config.update({k: v for k, v in (token_ids or {}).items() if k in TOKEN_ID_KEYS})
    return hf_io.write_hf_dir(path, hf_config, tensors)


def source_token_ids(src: Path, fmt: str) -> dict:
    """A source's ``bos/eos/pad_token_id``: from a Hugging Face ``config.json``, or kept by an earlier
    conversion in a difftx model directory's ``config.json`` (under ``hf_token_ids``)."""
    if fmt == "unilm" or not (src / CONFIG_FILE).is_file():
        return {}
    data = hf_io.read_json(src / CONFIG_FILE)
    if fmt == "difftx":
        data = data.get(TOKEN_IDS_KEY)
        if not isinstance(data, dict):
            return {}

    def ok(v):  # an id, or a list of ids (several end-of-sequence tokens)
        return (isinstance(v, int) and not isinstance(v, bool)) or (
            isinstance(v, list) and v and all(isinstance(i, int) and not isinstance(i, bool) for i in v))

    return {k: data[k] for k in TOKEN_ID_KEYS if ok(data.get(k))}


def _copy_tokenizer(src: Path, dst: Path, src_fmt: str, dst_fmt: str) -> None:
    """Carry the tokenizer files of ``src`` to ``dst``, each under its own name, with one renaming either way:
    difftx's byte / char ``tokenizer.json`` (not a Hugging Face file) goes to a Hugging Face directory as
    ``difftx_tokenizer.json``, and that file comes back as ``tokenizer.json`` when the Hugging Face directory holds
    no ``tokenizer.json``.  A Hugging Face directory holding both keeps both: its ``tokenizer.json`` stays the
    tokenizer (the one difftx reads first there too) and ``difftx_tokenizer.json`` travels beside it, through a
    difftx directory and back (a difftx ``tokenizer.json`` beside a ``difftx_tokenizer.json`` is refused by
    :func:`_check_tokenizer_files` before anything is written)."""
    if src.is_file():
        return
    src_hf, dst_hf = src_fmt != "difftx", dst_fmt != "difftx"
    tok, dx_tok = "tokenizer.json", hf_io.DIFFTX_TOKENIZER_IN_HF
    if dst_hf and not src_hf and _holds_difftx_tokenizer(src):
        # the Hugging Face files beside it (generation_config.json, ... from an earlier Hugging Face source) go
        # along as they are
        atomic_copyfile(src / tok, dst / dx_tok)
        hf_io.copy_files(src, dst, hf_io.HF_FILES_BESIDE_TOKENIZER)
    elif src_hf and not dst_hf and not (src / tok).is_file() and (src / dx_tok).is_file():
        hf_io.copy_files(src, dst, hf_io.HF_FILES_BESIDE_TOKENIZER)
        atomic_copyfile(src / dx_tok, dst / tok)
    else:  # same kind (difftx -> difftx too), a Hugging Face tokenizer.json, or a bpe trained here
        hf_io.copy_files(src, dst, hf_io.HF_TOKENIZER_FILES + (dx_tok,))


def _holds_difftx_tokenizer(src: Path) -> bool:
    """Whether directory ``src`` holds a ``tokenizer.json`` that is not a Hugging Face one (difftx's byte, char)."""
    return (src / "tokenizer.json").is_file() and not _is_hf_tokenizer(src / "tokenizer.json")


def _check_tokenizer_files(src: Path, src_fmt: str, dst_fmt: str) -> None:
    """Refuse, before anything is written, a conversion whose tokenizer files cannot all travel: a difftx
    directory whose difftx ``tokenizer.json`` would become the Hugging Face ``difftx_tokenizer.json`` it already
    holds."""
    if src.is_dir() and src_fmt == "difftx" and dst_fmt != "difftx" \
            and (src / hf_io.DIFFTX_TOKENIZER_IN_HF).is_file() and _holds_difftx_tokenizer(src):
        raise DifftxError(f"{src}: holds a difftx tokenizer.json and a {hf_io.DIFFTX_TOKENIZER_IN_HF}, and a Hugging "
                          f"Face directory keeps a difftx tokenizer as {hf_io.DIFFTX_TOKENIZER_IN_HF}, so one would "
                          "be lost; remove or rename the one the model does not use")


def _is_hf_tokenizer(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face ``tokenizers`` file (the rule of :func:`difftx.data.load_tokenizer`)."""
    from ..data.tokenizers import is_hf_tokenizer_json

    try:
        return is_hf_tokenizer_json(hf_io.read_json(path, "tokenizer"))
    except CheckpointError:
        return False


def check_options(dst_format: Optional[str], *, pairing: Optional[str] = None, rope_style: Optional[str] = None,
                  diff_init: Optional[str] = None) -> None:
    """Refuse the options that contradict one another whatever the source is (``difftx convert`` calls this
    before it looks at DST, so a wrong option is named before a full destination directory)."""
    if dst_format in LLAMA_LIKE and (pairing or rope_style):
        raise DifftxError(f"--{'pairing' if pairing else 'rope-style'}: --to {dst_format} has a fixed layout (DIFF "
                          "heads paired by halves, RoPE half); drop it (or keep a layout with --to difftx or "
                          "hf-difftx)")
    if dst_format == "hf-diffllama" and diff_init in ("exact", "twin-zero"):
        raise DifftxError(f"--diff-init {diff_init} turns the per-head norm off, and DiffLlama always applies it; "
                          "use --diff-init twin for --to hf-diffllama, or keep this mode with --to difftx or "
                          "hf-difftx")


def convert(src, dst, src_format: str = "auto", dst_format: Optional[str] = None, *,
            pairing: Optional[str] = None, rope_style: Optional[str] = None, diff_init: Optional[str] = None,
            dtype: Optional[torch.dtype] = None, depth: Optional[int] = None, variant: Optional[str] = None) -> Path:
    """Convert the model at ``src`` into directory ``dst`` (the library side of ``difftx convert``).

    ``pairing`` / ``rope_style`` re-lay a difftx or hf-difftx output out (function unchanged;
    the other Hugging Face formats fix their own layout); ``diff_init`` turns a softmax (Llama) model
    into DIFF for continued training (see :mod:`.llama_to_diff`).  ``depth`` / ``variant``
    (default ``flash``) apply to unilm weight files only (see :mod:`.unilm`).  An option the
    conversion would not use is refused, not ignored.  Weights keep the source's dtype unless
    ``dtype`` is given; a Hugging Face source's ``bos/eos/pad_token_id`` and tokenizer files
    travel with the model (through a difftx directory too, so HF -> difftx -> HF gives them
    back).  Returns ``dst``.
    """
    src, dst = Path(src), Path(dst)
    detected = detect_format(src)
    if src_format not in ("auto", detected):
        raise DifftxError(f"{src}: --from {src_format} but this looks like {detected}")
    if detected == "unilm":
        from .unilm import convert_unilm_file

        if src_format == "auto" and (is_model_dir(src.parent) or hf_io.is_hf_dir(src.parent)) \
                and src.name in (WEIGHTS_FILE, hf_io.SAFE_FILE, hf_io.BIN_FILE):
            raise DifftxError(f"{src}: the weights of the model directory {src.parent}; give the directory "
                              "(a weights file alone is read as official unilm attention modules: --from unilm)")

        if dst_format not in (None, "difftx"):
            raise DifftxError("unilm attention modules convert to difftx modules only (--to difftx)")
        if diff_init is not None:
            raise DifftxError("--diff-init turns a softmax model into DIFF, and unilm modules are DIFF attention "
                              "already; drop it")
        return convert_unilm_file(src, dst, depth=depth, variant=variant or "flash", pairing=pairing,
                                  rope_style=rope_style, dtype=dtype)
    for flag, value in (("--depth", depth), ("--unilm-variant", variant)):
        if value is not None:
            raise DifftxError(f"{flag} applies to a unilm weights file, and {src} is a {detected} model; drop it")
    if dst_format is None:
        if detected == "difftx" and not (diff_init or pairing or rope_style):
            raise DifftxError(f"converting a difftx model needs --to ({', '.join(HF_FORMATS)}), "
                              "or --diff-init / --pairing / --rope-style")
        dst_format = "difftx"
    if dst_format not in FORMATS:
        raise DifftxError(f"unknown --to {dst_format!r}; one of {', '.join(FORMATS)}")
    check_options(dst_format, pairing=pairing, rope_style=rope_style, diff_init=diff_init)
    if dst.resolve() == src.resolve():
        raise DifftxError(f"{dst}: the destination is the source; pick another directory")
    _check_tokenizer_files(src, detected, dst_format)
    cfg, state, _ = read_any(src)
    dtype = dtype or model_dtype(state)  # default: the source's dtype
    token_ids = source_token_ids(src, detected)
    if diff_init is not None:
        from .llama_to_diff import llama_to_diff

        # DiffLlama's per-head norm has the model's rms_norm_eps; twin's is otherwise 1e-5, as in the official code
        eps = cfg.norm_eps if dst_format == "hf-diffllama" else 1e-5
        cfg, state = llama_to_diff(cfg, state, mode=diff_init, pairing=pairing or "adjacent", head_norm_eps=eps)
    if pairing and cfg.attention != "diff":
        raise DifftxError(f"--pairing lays out DIFF heads, and the result has {cfg.attention} attention (no pairs); "
                          "drop it" + (" (or add --diff-init)" if cfg.attention == "softmax" else ""))
    if rope_style and cfg.positions != "rope":
        raise DifftxError(f"--rope-style orders rotary channels, and the model has {cfg.positions} positions; drop it")
    if pairing or rope_style:  # a difftx or hf-difftx result keeps the layout asked for
        cfg, state = relayout(state, cfg, pairing=pairing, rope_style=rope_style)
    if dst_format == "difftx":
        from ..io import load_state_dict_into
        from ..models import build_model

        model = build_model(cfg)
        load_state_dict_into(model, state, str(src))
        if dtype is not None:  # DIFF's lambdas stay float32 below float32
            model = cast_model(model, dtype=dtype)
        make_out_dir(dst, flag="DST")  # a path that cannot be a directory: the error names DST, not save_model
        save_model(model, dst, extra_config={TOKEN_IDS_KEY: token_ids} if token_ids else None)
    else:
        save_hf(state, dst, dst_format, cfg=cfg, dtype=dtype, token_ids=token_ids)
    _copy_tokenizer(src, dst, detected, dst_format)
    return dst


# ---------------------------------------------------------------------- the hf-difftx config (no transformers needed)
def hf_config_dict(cfg: ModelConfig) -> dict:
    """``config.json`` of a :class:`~difftx.interop.hf.DifftxForCausalLM` directory.

    The difftx ModelConfig lives under ``difftx``; the standard names next to it
    (``hidden_size``, ...) are derived from it for tools that read them.
    """
    return dict(architectures=[ARCHITECTURES["hf-difftx"]], model_type="difftx", difftx=cfg.to_dict(),
                **hf_standard_fields(cfg))


def hf_standard_fields(cfg: ModelConfig) -> dict:
    """transformers' standard config attributes, derived from a difftx config (``n_heads`` as difftx counts them)."""
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
                num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings)


def model_config_from_hf(hf: dict, src: str = "config.json") -> ModelConfig:
    """The difftx ModelConfig stored in an hf-difftx ``config.json``."""
    data = hf.get("difftx")
    if not isinstance(data, dict):
        raise CheckpointError(f"{src}: model_type 'difftx' but no 'difftx' object with the model config")
    try:
        return ModelConfig.from_dict(data)
    except ConfigError as e:
        raise CheckpointError(f"{src}: invalid difftx model config: {e}") from None
