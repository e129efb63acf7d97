"""Gradient flow of DIFF versus the Transformer (DIFF paper, Appendix E; SPEC section 2).

The appendix argues that the gradients of W^Q, W^K, W^V, W^O under
differential attention have the form of softmax attention's, up to constant
factors, so Transformer hyper-parameters carry over.  This module measures it:
two matched models (``ModelConfig.twin``: a Transformer with 2h heads and DIFF
with h heads, same parameter count), by default with *paired* initialisation
(every tensor the two share by name and shape starts equal), see the same
batches; per layer and per parameter group (W_Q, W_K, W_V, W_O, FFN, norms,
lambda) we record the gradient's Frobenius norm at initialisation and over the
first K optimiser steps, and the DIFF / Transformer ratio per group.

Groups have the same shapes in both models except ``norms`` (DIFF adds the
per-head norm's gain) and ``lambda`` (DIFF only, so it has no ratio).

A ``diff2`` (DIFF V2) base is compared as itself: its twin is the softmax
baseline with the same heads.  There W_Q (2h query heads) and FFN (shrunk to
pay for them) differ in shape too, so paired initialisation leaves those two
groups independent; ``lambda`` is its lambda projection.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional

import torch

from ..config import ModelConfig
from ..optim import build_optimizer
from .common import FLOW_GROUPS, Batches, build, copy_matching, group_grad_norms, train

PAIR = ("diff", "transformer")


def twin_models(base: ModelConfig, seed: int = 0, paired: bool = True, device="cpu") -> dict[str, torch.nn.Module]:
    """{"transformer": softmax twin, "diff": DIFF twin} of ``base``, optionally with paired initialisation.

    The DIFF twin is ``base`` itself when it is differential (``diff`` or ``diff2``), else DIFF V1.
    """
    cfg_t = base if base.attention == "softmax" else base.twin("softmax")
    cfg_d = base if base.attention in ("diff", "diff2") else cfg_t.twin("diff")
    transformer, diff = build(cfg_t, seed, device), build(cfg_d, seed, device)
    if paired:
        copy_matching(transformer, diff)
    return {"transformer": transformer, "diff": diff}


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b not in (None, 0.0) else None


def _ratios(num: dict, den: dict) -> dict:
    """Per-group ratio of two ``group_grad_norms`` results (all layers and per layer)."""
    groups = [g for g in FLOW_GROUPS if g in num["all"] and g in den["all"]]
    return {
        "all": {g: _ratio(num["all"][g], den["all"][g]) for g in groups},
        "layers": [{g: _ratio(a.get(g), b.get(g)) for g in groups} for a, b in zip(num["layers"], den["layers"])],
        "total": _ratio(num["total"], den["total"]),
    }


def _median_ratios(per_step: list[dict]) -> dict:
    """Median over steps of each ratio (robust to the odd noisy batch); a diverged step's NaN is left out."""
    if not per_step:
        return {}

    def med(values):
        values = [v for v in values if v is not None and math.isfinite(v)]
        return statistics.median(values) if values else None

    groups = list(per_step[0]["all"])
    n_layers = len(per_step[0]["layers"])
    return {
        "all": {g: med([r["all"][g] for r in per_step]) for g in groups},
        "layers": [{g: med([r["layers"][i][g] for r in per_step]) for g in groups} for i in range(n_layers)],
        "total": med([r["total"] for r in per_step]),
    }


START_LABELS = {"init": "at init", "saved": "as saved"}  # what step 0 is: fresh weights, or a checkpoint's


def run_flow(models: dict[str, torch.nn.Module], batches: Batches, steps: int = 20, optimizer: str = "adamw",
             lr: float = 1e-3, weight_decay: float = 0.0, clip: float = 1.0, start: str = "init") -> dict:
    """Record gradient norms of each model over ``steps`` + 1 gradient evaluations (step 0 = the given weights).

    All models see the same batches.  With a "diff" and a "transformer" model the
    result carries ``ratio``: per step, at ``init`` (step 0) and the median over
    steps 1..K (``early``).  ``start`` says what step 0 is, for the tables and
    figures: ``"init"`` (freshly initialised models) or ``"saved"`` (trained
    checkpoints, measured as saved; ``ratio["init"]`` is then their step 0).
    """
    if start not in START_LABELS:
        raise ValueError(f"start must be one of {', '.join(START_LABELS)}; got {start!r}")
    out: dict = {"optimizer": optimizer, "lr": lr, "weight_decay": weight_decay, "clip": clip, "steps": steps,
                 "start": start, "groups": list(FLOW_GROUPS), "models": {}}
    for name, model in models.items():
        n_layers = model.config.n_layers
        norms: list[dict] = []
        opt = build_optimizer(model, optimizer, lr=lr, weight_decay=weight_decay)
        record = lambda step, m: norms.append(group_grad_norms(m, n_layers))  # noqa: E731
        result = train(model, opt, batches, steps + 1, clip=clip, on_grads=record)
        cfg = model.config
        out["models"][name] = {
            "attention": cfg.attention, "n_heads": cfg.n_heads, "head_dim": cfg.head_dim, "norms_setting": cfg.norms,
            "params": model.num_parameters(), "loss": result["losses"], "diverged": result["diverged"],
            "lambdas": model.lambdas() if cfg.attention in ("diff", "diff2") else None, "grad_norms": norms,
        }
    if all(k in out["models"] for k in PAIR):
        d, t = out["models"]["diff"]["grad_norms"], out["models"]["transformer"]["grad_norms"]
        per_step = [_ratios(a, b) for a, b in zip(d, t)]
        out["ratio"] = {"definition": "||grad DIFF|| / ||grad Transformer|| per group (Frobenius norm)",
                        "init": per_step[0], "early": _median_ratios(per_step[1:]), "per_step": per_step}
    return out


def start_label(result: dict) -> str:
    """What step 0 of a flow result is, as the tables say it: "at init" or "as saved" (a checkpoint)."""
    return START_LABELS[result.get("start", "init")]


def flow_table(result: dict) -> str:
    """A markdown table: per group, norms at step 0 (init, or as saved), the DIFF/Transformer ratio there and early,
    per layer at step 0."""
    models = result["models"]
    at0 = start_label(result)
    if "ratio" not in result:
        lines = [f"| model | group | step 0 ({at0.removeprefix('at ')}) | step {result['steps']} |",
                 "|---|---|---|---|"]
        for name, m in models.items():
            reached = len(m["grad_norms"]) - 1  # a diverged run stopped before step K: say which step it shows
            at = f" (diverged at step {reached})" if reached < result["steps"] else ""
            for g, v in m["grad_norms"][0]["all"].items():
                last = m["grad_norms"][-1]["all"].get(g)
                lines.append(f"| {name} | {g} | {v:.3g} | {last:.3g}{at} |")
        return "\n".join(lines)
    r, d0, t0 = result["ratio"], models["diff"]["grad_norms"][0], models["transformer"]["grad_norms"][0]
    n_layers = len(r["init"]["layers"])
    k = len(r["per_step"]) - 1  # the steps both models reached: fewer than asked when one diverged
    early = f"ratio steps 1-{k}" + (f" (of {result['steps']}: a model diverged)" if k < result["steps"] else "")
    head = ["group", f"Transformer {at0}", f"DIFF {at0}", f"ratio {at0}", early]
    head += [f"L{i + 1} {at0}" for i in range(n_layers)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    for g in FLOW_GROUPS:
        if g not in d0["all"]:
            continue
        row = [g, fmt(t0["all"].get(g)), fmt(d0["all"][g]), fmt(r["init"]["all"].get(g)),
               fmt(r["early"].get("all", {}).get(g))]
        row += [fmt(layer.get(g)) for layer in r["init"]["layers"]]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("| total | " + " | ".join([fmt(t0["total"]), fmt(d0["total"]), fmt(r["init"]["total"]),
                                            fmt(r["early"].get("total"))] + ["" for _ in range(n_layers)]) + " |")
    return "\n".join(lines)
