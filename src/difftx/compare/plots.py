"""The study's PNGs, drawn from ``results.json`` (matplotlib's object API on an Agg canvas; no pyplot state).

``loss_curves.png`` (validation loss by tokens, seed mean and min-max band;
training loss), ``retrieval.png`` (arms x cells heat map), ``attention.png``
(answer and noise shares), ``grad_hist.png`` (gradient-entry histograms per
matrix kind), ``cost.png`` (throughput and memory relative to the reference
arm) and ``lr_sweep.png``.  Without matplotlib nothing is drawn and the report
says so by leaving the pictures out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..analysis.plots import _figure, _save, have_matplotlib


def write_plots(res: dict, out) -> list[str]:
    if not have_matplotlib():
        return []
    out = Path(out)
    written = []
    for name, fn in (("loss_curves.png", loss_curves), ("retrieval.png", retrieval), ("attention.png", attention),
                     ("grad_hist.png", grad_hist), ("cost.png", cost), ("lr_sweep.png", lr_sweep)):
        if fn(res, out / name):
            written.append(name)
    return written


def _colors(res: dict) -> dict:
    return {a: f"C{i % 10}" for i, a in enumerate(res["arms"])}


def _smooth(y: np.ndarray, frac: float = 0.05) -> np.ndarray:
    k = max(1, int(len(y) * frac))
    if k == 1:
        return y
    kernel = np.ones(k) / k
    return np.convolve(np.pad(y, (k - 1, 0), mode="edge"), kernel, mode="valid")


def loss_curves(res: dict, path: Path) -> bool:
    fig = _figure(12, 4.2)
    a1, a2 = fig.subplots(1, 2)
    colors = _colors(res)
    by_size = False  # x in tokens (images for a vision study: the trainer counts its images as "tokens")
    for arm, c in res["corpus"].items():
        cv = c["curve"]
        if not cv["steps"]:
            continue
        x = [t if t is not None else s for t, s in zip(cv["tokens"], cv["steps"])]
        by_size = by_size or any(t is not None for t in cv["tokens"])
        a1.plot(x, cv["mean"], marker="o", ms=3, color=colors[arm], label=res["arms"][arm]["label"])
        a1.fill_between(x, cv["min"], cv["max"], color=colors[arm], alpha=0.2)
        runs = [np.asarray(t, dtype=float) for t in cv["train"] if t]
        if runs:
            n = min(len(r) for r in runs)
            mean = np.mean([r[:n, 1] for r in runs], axis=0)
            a2.plot(runs[0][:n, 0], _smooth(mean), color=colors[arm], label=res["arms"][arm]["label"])
    a1.set_xlabel(("images" if res["domain"] == "vision" else "tokens") if by_size else "step")
    a1.set_ylabel("validation loss")
    a1.set_title("validation loss (seed mean, min-max band)")
    a1.legend(fontsize=7)
    a2.set_xlabel("step")
    a2.set_ylabel("training loss (smoothed)")
    a2.set_title("training loss (seed mean)")
    lo = min((min(c["curve"]["mean"]) for c in res["corpus"].values() if c["curve"]["mean"]), default=None)
    if lo is not None:
        a2.set_ylim(bottom=lo * 0.9, top=lo * 2.5)
    _save(fig, path)
    return True


def retrieval(res: dict, path: Path) -> bool:
    r = res.get("retrieval")
    if not r or not r["cells"]:
        return False
    arms = list(r["arms"])
    means = [[(r["arms"][a]["cells"].get(c) or {}).get("mean") for c in r["cells"]] for a in arms]
    grid = np.array([[np.nan if m is None else m for m in row] for row in means], dtype=float)  # 0.0 is a value
    fig = _figure(1.6 + 0.9 * len(r["cells"]), 1.2 + 0.45 * len(arms))
    ax = fig.subplots()
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(r["cells"])), r["cells"], fontsize=8)
    ax.set_yticks(range(len(arms)), [res["arms"][a]["label"] for a in arms], fontsize=8)
    for i in range(len(arms)):
        for j in range(len(r["cells"])):
            if grid[i, j] == grid[i, j]:
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_title(f"retrieval accuracy ({r['task']}, seed mean)")
    fig.colorbar(im, ax=ax)
    _save(fig, path)
    return True


def attention(res: dict, path: Path) -> bool:
    r = res.get("retrieval")
    if not r or not any(x["attention"] for x in r["arms"].values()):
        return False
    arms = list(r["arms"])
    fig = _figure(2 + 1.3 * len(arms), 3.6)
    ax = fig.subplots()
    width = 0.38
    for k, (region, color) in enumerate((("answer", "C2"), ("noise", "C3"))):
        means, errs = [], [[], []]
        for a in arms:
            s = r["arms"][a]["attention"].get(region) or {}
            m = s.get("mean")
            means.append(np.nan if m is None else m)
            errs[0].append(0 if m is None else m - s["min"])
            errs[1].append(0 if m is None else s["max"] - m)
        ax.bar(np.arange(len(arms)) + (k - 0.5) * width, means, width, yerr=errs, color=color, label=region,
               capsize=3)
    ax.set_xticks(range(len(arms)), [res["arms"][a]["label"] for a in arms], fontsize=7, rotation=15)
    ax.axhline(0, color="k", lw=0.6)
    ax.set_ylabel("share of attention (L1-normalised rows)")
    ax.set_title("attention allocation at the answer (Table 3); bars: seed min-max")
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


def grad_hist(res: dict, path: Path) -> bool:
    kinds = []
    for c in res["corpus"].values():
        for k in (c.get("tails") or {}).get("histograms", {}):
            if k not in kinds:
                kinds.append(k)
    kinds = [k for k in ("W_q", "W_k", "W_v", "W_o", "W_g", "W_1", "W_2", "all") if k in kinds]  # as tabulated
    if not kinds:
        return False
    cols = min(4, len(kinds))
    rows = -(-len(kinds) // cols)
    fig = _figure(3.4 * cols, 2.8 * rows)
    axes = np.atleast_1d(fig.subplots(rows, cols)).reshape(-1)
    colors = _colors(res)
    for ax, kind in zip(axes, kinds):
        for arm, c in res["corpus"].items():
            h = (c.get("tails") or {}).get("histograms", {}).get(kind)
            if not h:
                continue
            edges = np.asarray(h["log10_edges"])
            frac = np.asarray(h["fraction"])
            nz = np.flatnonzero(frac)
            if not nz.size:
                continue
            sl = slice(max(0, nz[0] - 1), nz[-1] + 2)
            ax.plot(((edges[:-1] + edges[1:]) / 2)[sl], frac[sl], color=colors[arm], lw=1.2,
                    label=res["arms"][arm]["label"])
        ax.set_yscale("log")
        ax.set_title(kind, fontsize=9)
        ax.set_xlabel("log10 |g|", fontsize=8)
    for ax in axes[len(kinds):]:
        ax.set_visible(False)
    axes[0].set_ylabel("fraction of entries")
    axes[0].legend(fontsize=6)
    _save(fig, path)
    return True


def cost(res: dict, path: Path) -> bool:
    arms = res["questions"]["cost"]["arms"]
    tp = [arms[a]["throughput_ratio"] for a in arms]
    mem = [arms[a]["memory_ratio"] for a in arms]
    if all(v is None for v in tp + mem):
        return False
    fig = _figure(2 + 1.2 * len(arms), 3.4)
    ax = fig.subplots()
    x = np.arange(len(arms))
    ax.bar(x - 0.2, [np.nan if v is None else v for v in tp], 0.4, label="throughput", color="C0")
    ax.bar(x + 0.2, [np.nan if v is None else v for v in mem], 0.4, label="peak step memory", color="C1")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, [res["arms"][a]["label"] for a in arms], fontsize=7, rotation=15)
    ax.set_ylabel(f"relative to {res['arms'][res['questions']['cost']['reference']]['label']}")
    ax.set_title("speed and memory")
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


def lr_sweep(res: dict, path: Path) -> bool:
    sw = res.get("lr_sweep")
    if not sw:
        return False
    fig = _figure(6, 4)
    ax = fig.subplots()
    colors = _colors(res)
    for arm in res["arms"]:
        pts = sorted((r["lr"], r["val_loss"]) for r in sw["rows"] if r["arm"] == arm and r["val_loss"] is not None)
        if pts:
            ax.plot(*zip(*pts), marker="o", color=colors[arm], label=res["arms"][arm]["label"])
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final validation loss")
    ax.set_title("learning-rate sweep (missing points diverged)")
    ax.legend(fontsize=7)
    _save(fig, path)
    return True
