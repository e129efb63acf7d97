"""Heavy-tailed gradients across norm settings and optimisers (DNT Fig. 1; Simsekli et al. 2019).

For each model (a norm setting S1..S5, DIFF, or a checkpoint) and optimiser
(AdamW, mSGDW), train a few steps from the same initialisation and batches,
then at the reached weights draw B mini-batch gradients and measure, per block
weight matrix kind (W_q, W_k, W_v, W_o, W_g, W_1, W_2; layers pooled, and per layer):

* entries: the distribution of |g| for the mean of the B gradients (a batch
  B times larger than a training batch): log-binned histogram, q99.9/q50,
  max/RMS, excess kurtosis, Hill index.  DNT's Fig. 1 is this, per matrix.
* noise: the B gradients minus their mean, on a fixed random subset of at most
  ``max_noise_entries`` coordinates per kind, pooled, then the Mohammadi alpha
  (Simsekli's tail index of gradient noise), Hill and quantile ratio.

A non-finite gradient at the measurement batches (weights that training left
finite but about to blow up) is recorded like a diverged training run: the row
gets ``diverged`` and ``nonfinite_gradients`` and no statistics.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..optim import build_optimizer
from . import tails
from .common import MATRIX_KINDS, Batches, loss_backward, matrix_kind, model_kwargs, train

KIND_ORDER = tuple(MATRIX_KINDS.values())
DEFAULT_LRS = {"adamw": 1e-3, "msgdw": 0.1, "sgd": 0.1, "muon": 1e-3}
DEFAULT_WD = {"adamw": 0.1, "msgdw": 1e-4, "sgd": 0.0, "muon": 0.1}


def sample_gradients(model, batches: Batches, start: int, n_batches: int, max_entries: int, seed: int = 0):
    """Mean gradient per block matrix, and the per-batch gradients on a fixed coordinate subset per kind.

    Returns (means {(layer, kind): array}, samples {kind: array (n_batches, m)}, subsets {kind: indices}),
    the subset indices pointing into the kind's gradients flattened and concatenated in layer order.
    """
    mats = [(name, p, *mk) for name, p in model.named_parameters() if (mk := matrix_kind(name)) is not None]
    kinds = [k for k in KIND_ORDER if any(m[3] == k for m in mats)]
    rng = np.random.default_rng(seed)
    subsets = {}
    for kind in kinds:
        size = sum(p.numel() for _, p, _, k in mats if k == kind)
        subsets[kind] = torch.from_numpy(np.sort(rng.choice(size, size=min(size, max_entries), replace=False)))
    sums = {name: torch.zeros_like(p, dtype=torch.float64) for name, p, _, _ in mats}
    rows: dict[str, list[np.ndarray]] = {k: [] for k in kinds}
    model.train()
    for b in range(n_batches):
        x, y = batches.batch(start + b)
        loss_backward(model, x, y, **model_kwargs(batches, x))
        for kind in kinds:
            flat = torch.cat([p.grad.detach().reshape(-1) for _, p, _, k in mats if k == kind])
            rows[kind].append(flat[subsets[kind].to(flat.device)].double().cpu().numpy())
        for name, p, _, _ in mats:
            sums[name] += p.grad.detach().double()
    model.zero_grad(set_to_none=True)
    means = {(layer, kind): (sums[name] / n_batches).cpu().numpy() for name, _, layer, kind in mats}
    return means, {k: np.stack(v) for k, v in rows.items()}, {k: v.numpy() for k, v in subsets.items()}


def measure(model, batches: Batches, start: int, n_batches: int = 16, max_entries: int = 32768,
            seed: int = 0) -> dict:
    """Entry and noise statistics of ``model`` at its current weights (see the module docstring).

    Without statistics, and with ``nonfinite_gradients``, if any measured gradient is NaN or infinite.
    """
    means, samples, _ = sample_gradients(model, batches, start, n_batches, max_entries, seed)
    kinds = list(samples)
    if not all(np.isfinite(m).all() for m in means.values()):  # the means hold every sampled gradient
        return {"kinds": kinds, "noise_batches": n_batches, "nonfinite_gradients": True}
    n_layers = 1 + max(layer for layer, _ in means)
    entries, noise = {}, {}
    for kind in kinds:
        pooled = np.concatenate([means[(i, kind)].reshape(-1) for i in range(n_layers) if (i, kind) in means])
        entries[kind] = {**tails.entry_stats(pooled), "histogram": tails.log_histogram(pooled),
                         "by_layer": [tails.entry_stats(means[(i, kind)]) for i in range(n_layers)
                                      if (i, kind) in means]}
        noise[kind] = tails.noise_stats(samples[kind], seed=seed)
    all_entries = np.concatenate([m.reshape(-1) for m in means.values()])
    entries["all"] = {**tails.entry_stats(all_entries), "histogram": tails.log_histogram(all_entries)}
    noise["all"] = tails.noise_stats(np.concatenate([samples[k] for k in kinds], axis=1), seed=seed)
    return {"kinds": kinds, "noise_batches": n_batches, "entries": entries, "noise": noise}


def run_tail_study(candidates: list[tuple[str, Callable[[], torch.nn.Module]]], batches: Batches,
                   optimizers: list[str], steps: int, lrs: dict | None = None, weight_decays: dict | None = None,
                   clip: float = 1.0, noise_batches: int = 16, max_noise_entries: int = 32768, seed: int = 0,
                   progress: Callable[[str], None] | None = None) -> dict:
    """Every (candidate, optimiser) pair: ``steps`` of training, then :func:`measure`.

    ``candidates`` are (name, factory) with ``factory()`` returning a fresh model
    (the same initialisation for every optimiser).  With ``steps == 0`` the
    optimiser axis is dropped (one row per candidate, ``optimizer: "none"``).
    """
    lrs = {**DEFAULT_LRS, **(lrs or {})}
    weight_decays = {**DEFAULT_WD, **(weight_decays or {})}
    opts = optimizers if steps > 0 else ["none"]
    rows = []
    for name, factory in candidates:
        for opt_name in opts:
            model = factory()
            cfg = model.config
            row = {"setting": name, "optimizer": opt_name, "attention": cfg.attention, "norms": cfg.norms,
                   "params": model.num_parameters(), "steps": steps}
            if steps > 0:
                opt = build_optimizer(model, opt_name, lr=lrs[opt_name], weight_decay=weight_decays[opt_name])
                tr = train(model, opt, batches, steps, clip=clip)
                row.update(lr=lrs[opt_name], weight_decay=weight_decays[opt_name], loss_first=tr["losses"][0],
                           loss_last=tr["losses"][-1], diverged=tr["diverged"])
                if tr["diverged"]:
                    rows.append(row)
                    if progress is not None:
                        progress(f"tails: {name} / {opt_name}: diverged")
                    continue
            row.update(measure(model, batches, start=10_000_000, n_batches=noise_batches,
                               max_entries=max_noise_entries, seed=seed))
            if row.get("nonfinite_gradients"):
                row["diverged"] = True
            rows.append(row)
            if progress is not None:
                done = f"final loss {row['loss_last']:.3f}" if "loss_last" in row else "measured as saved (no steps)"
                if row.get("nonfinite_gradients"):
                    done = "non-finite gradients at the measurement batches (recorded as diverged)"
                progress(f"tails: {name} / {opt_name}: {done}")
    return {"steps": steps, "optimizers": opts, "clip": clip, "noise_batches": noise_batches,
            "max_noise_entries": max_noise_entries, "rows": rows}


TABLE_KINDS = ("W_q", "W_k", "W_v", "W_o", "W_1", "W_2")


def _fmt(values: list) -> str:
    values = [v for v in values if v is not None and np.isfinite(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3g}"
    return f"{np.mean(values):.3g} ± {np.std(values, ddof=1):.2g}"


def tails_table(result: dict, stat: str = "q99_9_over_q50", section: str = "entries") -> str:
    """Markdown: one row per (setting, optimiser), one column per matrix kind, values of ``stat``.

    Rows from several seeds are merged into mean ± sample standard deviation.
    """
    rows = result["rows"]
    kinds = [k for k in TABLE_KINDS + ("W_g", "all") if any(k in r.get(section, {}) for r in rows)]
    lines = ["| setting | optimizer | final loss " + "".join(f"| {k} " for k in kinds) + "|",
             "|---|---|---" + "|---" * len(kinds) + "|"]
    keys = list(dict.fromkeys((r["setting"], r["optimizer"]) for r in rows))
    for setting, opt in keys:
        group = [r for r in rows if r["setting"] == setting and r["optimizer"] == opt]
        diverged = sum(bool(r.get("diverged")) for r in group)
        loss = _fmt([r.get("loss_last") for r in group if not r.get("diverged")]) if "loss_last" in group[0] else "-"
        if diverged:
            loss = f"{loss} ({diverged} diverged)"
        vals = [_fmt([r.get(section, {}).get(k, {}).get(stat) for r in group]) for k in kinds]
        lines.append(f"| {setting} | {opt} | {loss} | " + " | ".join(vals) + " |")
    return "\n".join(lines)
