"""What the gradient studies share: local data, models per setting, a short training loop, parameter groups.

* Data never leaves the machine: by default the byte-tokenised source of the
  Python standard library (found through ``sysconfig``), or any text file.
  Batches are a pure function of (seed, step), so every model sees the same ones.
* ``setting_config(base, "S3")``, ``setting_config(base, "diff")``,
  ``setting_config(base, "diff-S5")`` (see ``SETTINGS_ACCEPTED``): the matched model of a norm setting and
  attention kind, built from one base config (``ModelConfig.twin`` keeps DIFF
  and the Transformer at the same parameter count).
* The loop here is deliberately tiny (forward, backward, clip, step, constant
  learning rate): a few steps for analysis, not the trainer.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from ..config import NORM_PRESETS, ModelConfig
from ..errors import ConfigError, DataError

# ----------------------------------------------------------------------------- data

STDLIB_BYTES = 1_500_000


def stdlib_text(max_bytes: int = STDLIB_BYTES) -> str:
    """The Python standard library's top-level ``*.py`` files, concatenated in name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for f in sorted(root.glob("*.py")):
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if not parts:
        raise DataError(f"no Python source found under {root}; pass --data FILE")
    return "".join(parts)[:max_bytes]


def load_text(path: Optional[str] = None, max_bytes: int = STDLIB_BYTES) -> str:
    if path is None:
        return stdlib_text(max_bytes)
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: {'a directory, not a text file' if p.is_dir() else 'data file not found'}; give a "
                        "text file or leave out --data to use the stdlib source")
    from ..data.corpus import Source, binary_reason

    why = binary_reason(p)  # the checks of `difftx train --data`: NUL bytes or not UTF-8 is an error
    if why:
        raise DataError(f"{p}: looks like a binary file ({why}); --data needs UTF-8 text")
    pieces, n = [], 0
    for piece, _ in Source(p).pieces():
        pieces.append(piece)
        n += len(piece)
        if n >= max_bytes:
            break
    text = "".join(pieces)[:max_bytes]
    if len(text) < 1000:
        raise DataError(f"{p}: only {len(text)} characters; the studies need at least 1000")
    return text


def tokenize(text: str, vocab_size: int, tokenizer=None) -> np.ndarray:
    """Token ids for ``text``: the model's own tokenizer when given, else UTF-8 bytes.

    A character tokenizer drops characters it does not know.  Ids must fit the
    model's vocabulary; bytes on a model with fewer than 256 ids are an error.
    """
    if tokenizer is not None:
        stoi = getattr(tokenizer, "stoi", None)
        if stoi is not None:
            text = "".join(c for c in text if c in stoi)
        ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    else:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    if ids.size == 0:
        raise DataError("the data has no tokens this model's tokenizer knows")
    if int(ids.max()) >= vocab_size:
        raise DataError(f"token id {int(ids.max())} does not fit the model's vocabulary of {vocab_size}; "
                        "use a model with vocab_size >= 256 (byte tokens) or one saved with its tokenizer.json")
    return ids


class Batches:
    """Random windows of a token array; ``batch(step)`` depends only on (seed, step)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0, device="cpu"):
        if tokens.size < seq_len + 1:
            raise DataError(f"the data has {tokens.size} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        self.tokens = torch.from_numpy(np.ascontiguousarray(tokens))
        self.seq_len, self.batch_size, self.seed, self.device = seq_len, batch_size, seed, device

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, step])
        # every window of seq_len + 1 tokens may be drawn, the last one (start N - seq_len - 1) too
        starts = rng.integers(0, self.tokens.numel() - self.seq_len, size=self.batch_size)
        idx = torch.from_numpy(starts)[:, None] + torch.arange(self.seq_len + 1)[None]
        w = self.tokens[idx]
        return w[:, :-1].to(self.device), w[:, 1:].to(self.device)


# ----------------------------------------------------------------------------- settings and models


SETTING_KINDS = ("diff2", "diff", "softmax")
SETTINGS_ACCEPTED = ("a norm placement (S1..S5, dnt = S5, pre = S1, post: softmax attention), an attention kind "
                     "(diff, diff2, softmax: the base's norms), or KIND-PLACEMENT such as diff-S1..diff-S5, diff2-S5, "
                     "softmax-post")


def setting_config(base: ModelConfig, setting: str) -> ModelConfig:
    """The matched model of one setting: a norm placement (``S1``..``S5``, ``dnt``, ``pre``, ``post``; softmax
    attention), an attention kind (``diff``, ``diff2``, ``softmax``; the base's norms), or both as
    ``KIND-PLACEMENT`` (``diff-S5``, ``diff2-S3``, ``softmax-post``)."""
    attention, norms = "softmax", setting
    for kind in SETTING_KINDS:
        if setting == kind or setting.startswith(kind + "-"):
            attention, norms = kind, setting[len(kind) + 1:]
            if setting != kind and not norms:  # "diff-" was taken as "diff", and its rows named "diff-"
                norms = "-"
            break
    if norms and norms not in NORM_PRESETS:
        raise ConfigError("settings", f"unknown setting {setting!r}: use {SETTINGS_ACCEPTED}")
    cfg = base.twin(attention) if attention != base.attention else base
    return cfg.replace(norms=norms) if norms else cfg


def build(cfg: ModelConfig, seed: int, device="cpu") -> torch.nn.Module:
    from ..models import build_model

    torch.manual_seed(seed)
    return build_model(cfg).to(device)


def copy_matching(src: torch.nn.Module, dst: torch.nn.Module) -> int:
    """Copy every parameter whose name and shape agree (paired initialisation).  Returns how many."""
    dst_params = dict(dst.named_parameters())
    n = 0
    with torch.no_grad():
        for name, p in src.named_parameters():
            q = dst_params.get(name)
            if q is not None and q.shape == p.shape:
                q.copy_(p)
                n += 1
    return n


# ----------------------------------------------------------------------------- training


def model_kwargs(batches, x: torch.Tensor) -> dict:
    """What the model takes beside a batch's tokens: ``batches.model_kwargs(x)`` where the source has it (a
    training domain's document ids under document masking, :class:`difftx.compare.measure.DomainBatches`), else
    nothing."""
    fn = getattr(batches, "model_kwargs", None)
    return fn(x) if fn is not None else {}


def loss_backward(model, x, y, **kwargs) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(x, targets=y, **kwargs).loss
    loss.backward()
    return float(loss.detach())


def train(model, optimizer, batches: Batches, steps: int, clip: float = 1.0, start: int = 0,
          on_grads: Optional[Callable[[int, torch.nn.Module], None]] = None) -> dict:
    """``steps`` optimiser steps; ``on_grads(step, model)`` sees each step's raw gradients before clipping.

    Stops early (``diverged``) on a non-finite loss or gradient norm.
    """
    losses = []
    model.train()
    for step in range(start, start + steps):
        x, y = batches.batch(step)
        loss = loss_backward(model, x, y, **model_kwargs(batches, x))
        losses.append(loss)
        if on_grads is not None:
            on_grads(step, model)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf))
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return {"losses": losses, "diverged": True}
        optimizer.step()
    model.zero_grad(set_to_none=True)
    return {"losses": losses, "diverged": False}


# ----------------------------------------------------------------------------- parameter groups

FLOW_GROUPS = ("W_Q", "W_K", "W_V", "W_O", "FFN", "norms", "lambda")
MATRIX_KINDS = {"q_proj": "W_q", "k_proj": "W_k", "v_proj": "W_v", "out_proj": "W_o",
                "w_gate": "W_g", "w_up": "W_1", "w_down": "W_2"}


def flow_group(name: str) -> tuple[Optional[int], str]:
    """(0-based layer or None, group) of a parameter name: W_Q, W_K, W_V, W_O, FFN, norms, lambda, embed, head."""
    parts = name.split(".")
    layer = int(parts[1]) if parts[0] == "layers" and len(parts) > 2 else None
    leaf_module = parts[-2] if len(parts) >= 2 else parts[0]
    if layer is None:
        if "norm" in parts[0]:
            return None, "norms"
        return None, "head" if parts[0] == "lm_head" else "embed"
    if "lambda" in leaf_module or parts[-1].startswith("lambda"):
        return layer, "lambda"
    if "norm" in leaf_module:
        return layer, "norms"
    if leaf_module in ("q_proj", "k_proj", "v_proj", "out_proj"):
        return layer, {"q_proj": "W_Q", "k_proj": "W_K", "v_proj": "W_V", "out_proj": "W_O"}[leaf_module]
    if parts[2] == "ffn":
        return layer, "FFN"
    return layer, "other"


def matrix_kind(name: str) -> Optional[tuple[int, str]]:
    """(0-based layer, W_q|W_k|W_v|W_o|W_g|W_1|W_2) for a block weight matrix, else None."""
    parts = name.split(".")
    if parts[0] != "layers" or parts[-1] != "weight" or len(parts) < 4:
        return None
    kind = MATRIX_KINDS.get(parts[-2])
    return (int(parts[1]), kind) if kind else None


def group_grad_norms(model, n_layers: int) -> dict:
    """{"layers": [{group: norm}], "all": {group: norm over layers}, "total": norm} of the current gradients."""
    sq = [dict() for _ in range(n_layers)]
    total = 0.0
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        s = float(p.grad.detach().double().pow(2).sum())
        total += s
        layer, group = flow_group(name)
        if layer is not None:
            sq[layer][group] = sq[layer].get(group, 0.0) + s
    groups = sorted({g for d in sq for g in d}, key=lambda g: (FLOW_GROUPS + ("other",)).index(g))
    return {
        "layers": [{g: math.sqrt(d[g]) for g in groups if g in d} for d in sq],
        "all": {g: math.sqrt(sum(d.get(g, 0.0) for d in sq)) for g in groups},
        "total": math.sqrt(total),
    }


def json_safe(obj):
    """``obj`` with non-finite floats (a diverged run's loss, an infinite tail index) as None: strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
