"""PNG figures for the gradient studies (matplotlib, imported lazily; ``pip install difftx[plot]``).

Figures are drawn with the object-oriented API on an Agg canvas, so nothing
here touches pyplot's global backend.  A tail figure with nothing to draw (every
row diverged) is not written: its function returns None.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from .common import FLOW_GROUPS

COLORS = {"W_Q": "C0", "W_K": "C1", "W_V": "C2", "W_O": "C3", "FFN": "C4", "norms": "C5", "lambda": "C6"}


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> Path:
    from ..io import atomic_savefig

    fig.tight_layout()
    atomic_savefig(fig, path)
    return path


def plot_flow(result: dict, path: Path) -> Path:
    """Norms per group over steps (DIFF solid, Transformer dashed), their ratio, and the ratio per layer at step 0
    (init, or as saved for checkpoints)."""
    models = result["models"]
    has_ratio = "ratio" in result
    fig = _figure(15 if has_ratio else 6, 4.2)
    axes = fig.subplots(1, 3 if has_ratio else 1, squeeze=False)[0]
    ax = axes[0]
    styles = {"diff": "-", "transformer": "--"}
    for name, m in models.items():
        steps = np.arange(len(m["grad_norms"]))
        for g in FLOW_GROUPS:
            vals = [s["all"].get(g) for s in m["grad_norms"]]
            if any(v is None for v in vals):
                continue
            ax.plot(steps, vals, styles.get(name, ":"), color=COLORS[g], label=f"{g} ({name})")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm (all layers)")
    ax.set_title("gradient norm per group")
    ax.legend(fontsize=6, ncol=2)
    if has_ratio:
        r = result["ratio"]
        ax = axes[1]
        for g in FLOW_GROUPS:
            vals = [s["all"].get(g) for s in r["per_step"]]
            if all(v is not None for v in vals):
                ax.plot(np.arange(len(vals)), vals, color=COLORS[g], label=g)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("DIFF / Transformer")
        ax.set_title("gradient-norm ratio per group")
        ax.legend(fontsize=7)
        ax = axes[2]
        layers = r["init"]["layers"]
        groups = [g for g in FLOW_GROUPS if g in r["init"]["all"]]
        width = 0.8 / max(1, len(groups))
        for j, g in enumerate(groups):
            vals = [layer.get(g) or np.nan for layer in layers]
            ax.bar(np.arange(len(layers)) + j * width, vals, width, color=COLORS[g], label=g)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks(np.arange(len(layers)) + 0.4 - width / 2, [f"L{i + 1}" for i in range(len(layers))])
        from .flow import start_label

        at0 = start_label(result)
        ax.set_ylabel(f"DIFF / Transformer {at0}")
        ax.set_title(f"ratio per layer {at0}")
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_tail_histograms(result: dict, optimizer: str, path: Path) -> Optional[Path]:
    """DNT Fig. 1: log-binned histograms of |g| per matrix kind, one line per setting (None: no measured row)."""
    rows = [r for r in result["rows"] if r["optimizer"] == optimizer and "entries" in r]
    if not rows:
        return None
    rows = [r for r in rows if r.get("seed") == rows[0].get("seed")]  # several seeds: draw the first
    kinds = [k for k in ("W_q", "W_k", "W_v", "W_o", "W_g", "W_1", "W_2") if any(k in r["entries"] for r in rows)]
    cols = 4 if len(kinds) > 6 else 3
    n_rows = (len(kinds) + cols - 1) // cols
    fig = _figure(4.2 * cols, 3.2 * n_rows)
    axes = fig.subplots(n_rows, cols, squeeze=False).reshape(-1)
    for ax, kind in zip(axes, kinds):
        for i, r in enumerate(rows):
            h = r["entries"].get(kind, {}).get("histogram")
            if h is None:
                continue
            edges = np.asarray(h["log10_edges"])
            centres = 10 ** ((edges[:-1] + edges[1:]) / 2)
            frac = np.asarray(h["fraction"])
            keep = np.nonzero(frac)[0]
            if keep.size:
                sl = slice(max(keep[0] - 1, 0), keep[-1] + 2)
                ax.plot(centres[sl], frac[sl], drawstyle="steps-mid", color=f"C{i}", label=r["setting"])
        ax.set_xscale("log")
        ax.set_title(kind)
        ax.set_xlabel("|g|")
        ax.set_ylabel("fraction of entries")
    for ax in axes[len(kinds):]:
        ax.set_visible(False)
    if kinds:
        axes[0].legend(fontsize=7)
    saved = result.get("start") == "saved"  # checkpoints (difftx grads records it), else fresh models
    if result["steps"] == 0:  # optimizer "none": was "after 0 none steps"
        when = "as saved" if saved else "at initialisation"
    else:
        when = f"after {result['steps']} {optimizer} steps" + (" from the saved weights" if saved else "")
    fig.suptitle(f"|gradient| entries {when} (layers pooled)")
    return _save(fig, path)


def plot_tail_summary(result: dict, path: Path) -> Optional[Path]:
    """Per setting and optimiser: entry q99.9/q50, entry Hill index, and the noise alpha (all matrices pooled).

    Bars are means over seeds, with the sample standard deviation as error bars when there are several.
    None (nothing written) when no row was measured.
    """
    rows = [r for r in result["rows"] if "entries" in r]
    if not rows:
        return None
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    opts = list(dict.fromkeys(r["optimizer"] for r in rows))
    panels = (("entries", "q99_9_over_q50", "|g| entries: q99.9 / q50", True),
              ("entries", "hill", "|g| entries: Hill tail index", False),
              ("noise", "alpha_mohammadi", "gradient noise: alpha (Mohammadi)", False))
    fig = _figure(15, 4)
    axes = fig.subplots(1, 3)
    width = 0.8 / max(1, len(opts))
    for ax, (section, stat, title, log) in zip(axes, panels):
        for j, opt in enumerate(opts):
            means, sds = [], []
            for s in settings:
                v = [r[section]["all"].get(stat, np.nan) for r in rows if r["setting"] == s and r["optimizer"] == opt]
                v = [x for x in v if x is not None and np.isfinite(x)]
                means.append(np.mean(v) if v else np.nan)
                sds.append(np.std(v, ddof=1) if len(v) > 1 else 0.0)
            ax.bar(np.arange(len(settings)) + j * width, means, width, yerr=sds if any(sds) else None,
                   label=opt, color=f"C{j}", capsize=2)
        ax.set_xticks(np.arange(len(settings)) + 0.4 - width / 2, settings)
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        if stat == "alpha_mohammadi":
            ax.axhline(2.0, color="k", lw=0.8)
        ax.legend(fontsize=7)
    return _save(fig, path)
