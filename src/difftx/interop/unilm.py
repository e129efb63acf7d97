"""The official microsoft/unilm differential attention module -> a difftx DifferentialAttention.

The official module (``Diff-Transformer/multihead_flashdiff_{1,2}.py``,
``multihead_diffattn.py``) holds ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``
(no biases), ``lambda_q1``, ``lambda_k1``, ``lambda_q2``, ``lambda_k2`` and ``subln``
(an RMSNorm over 2d, eps 1e-5, with a weight in the current files and without
one in early versions).  Its conventions map onto difftx config fields, so its
weights load unpermuted: ``pairing='adjacent'`` (component heads 2i, 2i+1 are
Q1, Q2 of head i; V of a group is 2d contiguous), ``rope_style='interleaved'``
(flash-attn's ``apply_rotary_emb(..., interleaved=True)``), ``head_norm_weight``
= whether ``subln.weight`` exists, and ``lambda_init_fn(depth)`` with a 0-based
depth = difftx's schedule at layer depth + 1.

GQA: the flash files pair (Q1_i, K1_g) and (Q2_i, K2_g) with g = i // n_rep,
which is difftx's layout (``variant='flash'``, the default).  The naive file's
``repeat_kv`` over component heads instead pairs both maps of head i with key
component (2i) // n_rep and (2i + 1) // n_rep (SPEC notes, "verified
inconsistency"); ``variant='naive'`` reproduces that exactly by expanding the
keys and values to one K/V group per head (n_kv_heads = n_heads).  Without GQA
the two variants are the same.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch

from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError, DifftxError
from ..io import (atomic_write_text, cast_state, load_safetensors, load_state_dict_into, make_out_dir, model_dtype,
                  save_safetensors, torch_load_weights_only)
from .layouts import relayout

LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
REQUIRED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight") + LAMBDAS
MODULES_FILE, MODULES_WEIGHTS = "attention.json", "attention.safetensors"


def unilm_to_difftx(state: dict, depth: int, rope_theta: float = 10000.0, variant: str = "flash",
                    source: str = "unilm state dict") -> tuple[ModelConfig, dict]:
    """(config, difftx attention state dict without prefix) for one official module at 0-based ``depth``."""
    if variant not in ("flash", "naive"):
        raise ConfigError("variant", f"must be 'flash' or 'naive'; got {variant!r}")
    for key in REQUIRED:
        if key not in state:
            raise CheckpointError(f"{source}: tensor '{key}' is missing; not an official DIFF attention module")
    for key in state:
        if key not in REQUIRED and key != "subln.weight":
            raise CheckpointError(f"{source}: unexpected tensor '{key}' (the official module holds only the q/k/v/out "
                                  "projection weights, no biases, the four lambda vectors and subln.weight)")
    for key in state:
        if not isinstance(state[key], torch.Tensor):
            raise CheckpointError(f"{source}: '{key}' is a {type(state[key]).__name__}, not a tensor")
    if state["lambda_q1"].dim() != 1 or state["lambda_q1"].shape[0] < 1:
        raise CheckpointError(f"{source}: tensor 'lambda_q1' has shape {tuple(state['lambda_q1'].shape)}, "
                              "expected (head_dim,) with head_dim >= 1")
    for key in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
        if state[key].dim() != 2:
            raise CheckpointError(f"{source}: tensor '{key}' has shape {tuple(state[key].shape)}, expected a "
                                  "2-D (rows, embed_dim) weight")
    d = state["lambda_q1"].shape[0]
    e = state["q_proj.weight"].shape[1]
    rows = {k: state[k + ".weight"].shape[0] for k in ("q_proj", "k_proj", "v_proj")}
    if rows["q_proj"] % (2 * d) or rows["k_proj"] % (2 * d):
        bad = "q_proj.weight" if rows["q_proj"] % (2 * d) else "k_proj.weight"
        raise CheckpointError(f"{source}: tensor '{bad}' has {state[bad].shape[0]} rows, not a multiple of "
                              f"2 * head_dim = {2 * d} (head_dim from lambda_q1)")
    h, hk = rows["q_proj"] // (2 * d), rows["k_proj"] // (2 * d)
    expected = {"k_proj.weight": (2 * hk * d, e), "v_proj.weight": (2 * hk * d, e),
                "out_proj.weight": (e, 2 * h * d), "subln.weight": (2 * d,), **{k: (d,) for k in LAMBDAS}}
    for key, shape in expected.items():
        if key in state and tuple(state[key].shape) != shape:
            raise CheckpointError(f"{source}: tensor '{key}' has shape {tuple(state[key].shape)}, "
                                  f"expected {shape} for {h} heads of head_dim {d}")
    if h % hk:
        raise CheckpointError(f"{source}: {h} heads are not a multiple of {hk} K/V heads")
    out = {k: v for k, v in state.items() if k != "subln.weight"}
    if "subln.weight" in state:
        out["head_norm.weight"] = state["subln.weight"]
    n_rep = h // hk
    if variant == "naive" and n_rep > 1:  # one K/V group per head, keys as the naive repeat_kv pairs them
        k = state["k_proj.weight"].reshape(2 * hk, d, e)
        v = state["v_proj.weight"].reshape(hk, 2 * d, e)
        out["k_proj.weight"] = torch.stack([k[(2 * i + j) // n_rep] for i in range(h) for j in (0, 1)]).reshape(-1, e)
        out["v_proj.weight"] = torch.stack([v[i // n_rep] for i in range(h)]).reshape(-1, e)
        hk = h
    cfg = ModelConfig(attention="diff", d_model=e, n_layers=depth + 1, n_heads=h, n_kv_heads=hk, head_dim=d,
                      pairing="adjacent", rope_style="interleaved", rope_theta=rope_theta, head_norm=True,
                      head_norm_weight="subln.weight" in state, head_norm_eps=1e-5, lambda_init="schedule",
                      bias=False)
    return cfg, out


def load_unilm_attention(state, depth: int, rope_theta: float = 10000.0, variant: str = "flash",
                         pairing: Optional[str] = None, rope_style: Optional[str] = None,
                         source: Optional[str] = None):
    """A difftx :class:`~difftx.nn.attention.DifferentialAttention` with the official module's weights.

    ``state``: the module's state dict or a path to a safetensors / weights-only
    torch file holding it.  ``depth``: the official 0-based layer index (lambda_init
    uses it).  ``pairing`` / ``rope_style`` optionally re-lay the rows out (the
    module then expects inputs rotated in that style; the function is unchanged).
    ``source`` names the weights in errors.  Returns ``(module, config)``; call it as ``module(x, rope, mask)``.
    """
    from ..nn.attention import DifferentialAttention

    source = source or (str(state) if not isinstance(state, dict) else "unilm state dict")
    if not isinstance(state, dict):
        state = read_weights_file(Path(state))
    cfg, sd = unilm_to_difftx(state, depth, rope_theta, variant, source)
    if pairing or rope_style:
        prefix = f"layers.{depth}.attn."
        cfg, full = relayout({prefix + k: v for k, v in sd.items()}, cfg, pairing=pairing, rope_style=rope_style)
        sd = {k[len(prefix):]: v for k, v in full.items()}
    module = DifferentialAttention(cfg, layer=depth + 1)
    load_state_dict_into(module, sd, source)
    return module.eval(), cfg


def read_weights_file(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    if path.suffix == ".safetensors":
        return load_safetensors(path)
    try:
        state = torch_load_weights_only(path)
    except Exception as e:
        raise CheckpointError(f"{path}: not a safetensors or weights-only torch file ({type(e).__name__})") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # fairseq/torchscale-style checkpoints keep weights under "model"
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a state dict")
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def split_modules(state: dict) -> dict[str, dict]:
    """Group a state dict into official attention modules by the prefix before ``q_proj.weight``."""
    prefixes = [k[: -len("q_proj.weight")] for k in state if k.endswith("q_proj.weight")]
    modules = {}
    for p in prefixes:
        own = {k[len(p):]: v for k, v in state.items() if k.startswith(p)}
        if all(key in own for key in LAMBDAS):
            members = {k.split(".", 1)[0] for k in REQUIRED} | {"subln"}
            if p:  # the module's own tensors, expected or not (the loader refuses one it cannot map, such as a
                # q_norm / head_norm weight: dropping it would change the function); not those of a module inside
                inner = [q for q in prefixes if q != p and q.startswith(p)]
                modules[p] = {k: v for k, v in own.items()
                              if not any((p + k).startswith(q) for q in inner) and not k.endswith("inv_freq")}
            else:  # a module at the root of a file: the file's other tensors are not its own
                modules[p] = {k: v for k, v in own.items() if k.split(".", 1)[0] in members}
    return modules


def depth_from_prefix(prefix: str) -> Optional[int]:
    m = re.search(r"(?:^|\.)(\d+)\.", prefix)
    return int(m.group(1)) if m else None


def convert_unilm_file(src, dst, depth: Optional[int] = None, rope_theta: float = 10000.0,
                       variant: str = "flash", pairing: Optional[str] = None,
                       rope_style: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> Path:
    """Convert every official attention module in weights file ``src`` into directory ``dst``.

    Writes ``attention.safetensors`` (difftx names under each module's prefix) and
    ``attention.json`` (per prefix: difftx layer and ModelConfig); read them back
    with :func:`load_attention_modules`.  The depth of each module is taken from
    the first number in its prefix (``layers.3.self_attn.`` -> 3), else ``depth`` (one number cannot be the
    depth of several layers; a ``depth`` no module needs is refused, not ignored).
    Weights are stored in ``dtype``, else in the modules' own dtype (float32 if they mix several).
    """
    src, dst = Path(src), Path(dst)
    modules = split_modules(read_weights_file(src))
    if not modules:
        raise CheckpointError(f"{src}: no official DIFF attention module (q_proj.weight + lambda_q1 ...) inside")
    depths = {prefix: depth_from_prefix(prefix) for prefix in modules}
    if depth is not None and None not in depths.values():
        prefix = sorted(depths)[0]
        raise DifftxError(f"{src}: every module's key prefix holds its layer number ('{prefix}' -> {depths[prefix]}), "
                          "which gives its depth; --depth is for a module whose prefix has none: drop it")
    if dtype is None:  # the modules' own (bf16 weights with float32 lambdas: bf16), else float32
        dtype = model_dtype({f"{p}{k}": v for p, state in modules.items() for k, v in state.items()}) or torch.float32
    tensors, index = {}, {}
    for prefix, state in sorted(modules.items()):
        layer_depth = depths[prefix] if depths[prefix] is not None else depth
        if layer_depth is None:
            raise CheckpointError(f"{src}: cannot tell the depth of module '{prefix or '<root>'}' "
                                  "(lambda_init depends on it); pass --depth")
        module, cfg = load_unilm_attention(state, layer_depth, rope_theta, variant, pairing, rope_style,
                                           source=f"{src} (module '{prefix or '<root>'}')")
        tensors.update({prefix + k: v for k, v in cast_state(module.state_dict(), dtype).items()})  # lambdas fp32
        index[prefix] = {"layer": layer_depth + 1, "model": cfg.to_dict()}
    make_out_dir(dst, flag="DST")
    save_safetensors(tensors, dst / MODULES_WEIGHTS, metadata={"format": "pt"})
    atomic_write_text(dst / MODULES_FILE, json.dumps({"difftx_attention_modules": 1, "modules": index}, indent=2))
    return dst


def load_attention_modules(path) -> dict:
    """{prefix: DifferentialAttention} from a directory written by :func:`convert_unilm_file`."""
    from ..nn.attention import DifferentialAttention

    path = Path(path)
    try:
        index = json.loads((path / MODULES_FILE).read_text())["modules"]
    except (FileNotFoundError, KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a converted attention-module directory ({e})") from None
    if not isinstance(index, dict):
        raise CheckpointError(f"{path / MODULES_FILE}: 'modules' must map prefixes to modules; the file is corrupt")
    state = load_safetensors(path / MODULES_WEIGHTS)
    out = {}
    for prefix, entry in index.items():
        layer = entry.get("layer") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), dict) or not (
                isinstance(layer, int) and not isinstance(layer, bool) and layer >= 1):
            raise CheckpointError(f"{path / MODULES_FILE}: module {prefix!r} needs 'model' (a config object) and "
                                  "'layer' (>= 1); the file is corrupt")
        try:
            cfg = ModelConfig.from_dict(entry["model"])
        except ConfigError as e:
            raise CheckpointError(f"{path / MODULES_FILE}: module {prefix!r}: invalid model config: {e}") from None
        module = DifferentialAttention(cfg, layer=layer)
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        load_state_dict_into(module, own, str(path / MODULES_WEIGHTS))
        out[prefix] = module.eval()
    return out
