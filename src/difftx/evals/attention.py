"""Attention allocation in retrieval (DIFF paper Table 3): how much attention goes to the answer vs the noise.

On multi-needle samples (:mod:`difftx.evals.niah`), a probe reads each layer's
*effective* attention map -- A for softmax, A1 - lambda A2 for DIFF, the
per-pair difference for DIFF V2 -- at the query rows that predict the first
answer's tokens, and sums it over the token regions of the context:

    answer         the number tokens of the answer needle
    answer_needle  the rest of the answer needle ("The special magic number for ...")
    other_needles  the distractor needles
    noise          the haystack (the paper's "attention noise")
    query          the query line and the answer tokens already emitted

Normalisation.  The paper shows "normalized attention scores" without saying
how a differential map, whose rows sum to 1 - lambda and which has negative
entries, is normalised.  We divide each row by its L1 mass, sum_j |a_ij|
(``normalize="l1"``, the default): a softmax row is unchanged (its L1 mass is
1), a DIFF row becomes scale-free (the per-head RMSNorm after the map removes
the (1 - lambda) scale anyway), shares lie in [-1, 1], and cancelled noise
(positive and negative entries over the haystack) counts as little, which is
the effect Table 3 describes.  Also available: ``rowsum`` (divide by the signed
row sum 1 - lambda; unstable when lambda is near 1), ``positive`` (negatives
clipped, then renormalised) and ``none``.  The mean signed row mass per layer
is reported as ``row_mass`` (1 for softmax, 1 - lambda for DIFF).

Shares are averaged over heads and query rows, then over samples; reported per
depth and per layer, and averaged over layers (the paper averages over heads
and layers, unilm issue #1654).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..errors import ConfigError
from ..nn.probe import AttentionProbe
from .common import (attach, batches, check_count, check_depths, check_seed, hard_limit, map_batch_size, model_device,
                     pad_right, require_memory, rng_for, task_context)
from .niah import DEPTHS, REGION_NAMES, NiahBuilder, NiahSample, depth_key

NORMALIZATIONS = ("l1", "rowsum", "positive", "none")


def normalize_rows(rows: torch.Tensor, how: str = "l1", eps: float = 1e-12) -> torch.Tensor:
    """Normalise attention rows (..., Nk) as described in the module docstring."""
    if how == "l1":
        return rows / rows.abs().sum(-1, keepdim=True).clamp_min(eps)
    if how == "rowsum":
        s = rows.sum(-1, keepdim=True)
        return rows / torch.where(s.abs() < eps, torch.full_like(s, eps), s)
    if how == "positive":
        r = rows.clamp_min(0)
        return r / r.sum(-1, keepdim=True).clamp_min(eps)
    if how == "none":
        return rows
    raise ConfigError("normalize", f"must be one of {NORMALIZATIONS}, got {how!r}")


def region_shares(effective: torch.Tensor, query_idx: torch.Tensor, query_w: torch.Tensor,
                  regions: torch.Tensor, n_regions: int, normalize: str = "l1") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence share of attention per region, averaged over heads and query rows.

    effective (B, H, Nq, Nk); query_idx (B, Q) row indices; query_w (B, Q) 1 for
    real rows, 0 for padding; regions (B, Nk) region id per key (-1: none).
    Returns shares (B, n_regions) and the mean signed row mass (B,).
    """
    b, h, _, nk = effective.shape
    idx = query_idx[:, None, :, None].expand(b, h, query_idx.shape[1], nk)
    rows = effective.float().gather(2, idx)  # (B, H, Q, Nk)
    mass = rows.sum(-1)  # (B, H, Q)
    onehot = torch.nn.functional.one_hot(regions.clamp_min(0), n_regions).float()
    onehot = onehot * (regions >= 0)[..., None].float()
    shares = torch.einsum("bhqk,bkr->bhqr", normalize_rows(rows, normalize), onehot)  # (B, H, Q, R)
    w = query_w.float()[:, None, :, None]
    denom = (query_w.float().sum(-1) * h).clamp_min(1)
    return (shares * w).sum((1, 2)) / denom[:, None], (mass * w[..., 0]).sum((1, 2)) / denom


class AllocationProbe(AttentionProbe):
    """Collects :func:`region_shares` per layer for the batch it is armed with."""

    def __init__(self, n_regions: int, normalize: str = "l1"):
        self.n_regions, self.normalize = n_regions, normalize
        self.query_idx = self.query_w = self.regions = None
        self.shares: dict[int, list[torch.Tensor]] = {}
        self.mass: dict[int, list[torch.Tensor]] = {}

    def arm(self, query_idx, query_w, regions) -> None:
        self.query_idx, self.query_w, self.regions = query_idx, query_w, regions

    def observe(self, layer, logits, effective, mask):
        if self.query_idx is None:
            return
        dev = effective.device
        s, m = region_shares(effective, self.query_idx.to(dev), self.query_w.to(dev), self.regions.to(dev),
                             self.n_regions, self.normalize)
        self.shares.setdefault(layer, []).append(s.cpu())
        self.mass.setdefault(layer, []).append(m.cpu())


def _query_rows(samples: Sequence[NiahSample]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows predicting the first answer's number tokens: a-1+lead .. b-2, where ``lead`` counts the answer's leading
    whitespace-only tokens (a byte tokenizer's ' ': predicting it retrieves nothing)."""
    rows = [list(range(s.answers[0][0] - 1 + s.meta.get("answer_lead", [0])[0], s.answers[0][1] - 1))
            for s in samples]
    q = max(len(r) for r in rows)
    idx = torch.tensor([r + [r[-1]] * (q - len(r)) for r in rows], dtype=torch.long)
    w = torch.tensor([[1] * len(r) + [0] * (q - len(r)) for r in rows], dtype=torch.long)
    return idx, w


@torch.no_grad()
def allocation(model, samples: Sequence[NiahSample], normalize: str = "l1",
               batch_size: Optional[int] = None) -> dict:
    """Region shares per layer (and their layer mean) over ``samples``; means over samples."""
    n_regions = len(REGION_NAMES)
    probe = AllocationProbe(n_regions, normalize)
    device = model_device(model)
    bs = batch_size or map_batch_size(model.config.n_heads, max(len(s.ids) for s in samples), cap=16)
    with attach(model, probe):
        for chunk in batches(list(samples), bs):
            ids = pad_right([s.ids for s in chunk])
            regions = pad_right([s.regions for s in chunk], pad=-1)
            probe.arm(*_query_rows(chunk), regions)
            model.features(ids.to(device))  # the probe reads the attention; the LM head is not needed
    layers = sorted(probe.shares)
    per_layer = {layer: torch.cat(probe.shares[layer]).mean(0) for layer in layers}  # (R,)
    mass = {layer: float(torch.cat(probe.mass[layer]).mean()) for layer in layers}
    # in float64: the mean of the float32 values reported per layer, not a float32 sum's rounding of it
    mean = torch.stack([per_layer[layer] for layer in layers]).double().mean(0)
    return {
        "mean": dict(zip(REGION_NAMES, mean.tolist())),
        "by_layer": [{"layer": layer, "row_mass": mass[layer], **dict(zip(REGION_NAMES, per_layer[layer].tolist()))}
                     for layer in layers],
    }


def evaluate_attention(model, tokenizer, depths: Sequence[float] = DEPTHS, length: Optional[int] = None,
                       needles: int = 1, samples: int = 8, digits: int = 5, template: str = "paper",
                       normalize: str = "l1", text: Optional[str] = None, data=None, seed: int = 0,
                       batch_size: Optional[int] = None, progress: bool = False) -> dict:
    """Table 3: share of attention on the answer and on the noise context, per depth, per layer and averaged."""
    if normalize not in NORMALIZATIONS:
        raise ConfigError("normalize", f"must be one of {NORMALIZATIONS}, got {normalize!r}")
    depths, seed = check_depths(depths), check_seed(seed)
    samples = check_count("samples", samples)
    if batch_size is not None:
        batch_size = check_count("batch_size", batch_size)
    length = check_count("length", length) if length is not None else task_context(model)
    if hard_limit(model) is not None and length > hard_limit(model):
        raise ConfigError("length", f"{length} exceeds max_seq_len={hard_limit(model)} of a model with "
                                    f"{model.config.positions} positions")
    builder = NiahBuilder(tokenizer, text=text, data=data, template=template, digits=digits)
    builder.check_needles(needles)
    need = builder.min_length(needles, 1)
    if length < need:
        raise ConfigError("length", f"{length} tokens cannot hold {needles} needle(s) and a query ({need} tokens); "
                                    "pass a longer --length, fewer --needles or --template short")
    require_memory(model, samples, length, f"{samples:,} sample(s) of {length:,} tokens", "pass a shorter --length "
                   "or fewer --samples")
    by_depth = []
    for d in depths:  # a depth's samples, whatever other depths are asked for
        ss = [builder.sample(rng_for(seed, 0xA77, depth_key(d), k), length, needles, 1, d)
              for k in range(samples)]
        res = allocation(model, ss, normalize, batch_size)
        by_depth.append({"depth": float(d), **res})
        if progress:
            print(f"  attention depth {d:.2f}: answer {res['mean']['answer']:.3f} noise {res['mean']['noise']:.3f}",
                  flush=True)
    table = {name: [row["mean"][name] for row in by_depth] for name in REGION_NAMES}
    n_layers = len(by_depth[0]["by_layer"])
    layer_mean = [{"layer": by_depth[0]["by_layer"][i]["layer"],
                   **{k: sum(r["by_layer"][i][k] for r in by_depth) / len(by_depth) for k in (*REGION_NAMES, "row_mass")}}
                  for i in range(n_layers)]
    return {"normalize": normalize, "length": length, "needles": needles, "regions": list(REGION_NAMES),
            "depths": [float(d) for d in depths], "table": table, "by_depth": by_depth, "by_layer": layer_mean,
            "mean": {k: sum(v) / len(v) for k, v in table.items()}}


def plot_attention(result: dict, path) -> Optional[str]:
    from .common import depth_percent, pyplot
    from ..io import atomic_savefig

    plt = pyplot()
    if plt is None:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.3))
    xs = [depth_percent(d) for d in result["depths"]]
    for name in ("answer", "noise", "other_needles"):
        a1.plot(xs, result["table"][name], marker="o", label=name)
    a1.set_xlabel("answer depth")
    a1.set_ylabel(f"attention share ({result['normalize']})")
    a1.set_title("attention allocation (Table 3)")
    a1.legend(fontsize=8)
    layers = [r["layer"] for r in result["by_layer"]]
    for name in ("answer", "noise"):
        a2.plot(layers, [r[name] for r in result["by_layer"]], marker="o", label=name)
    a2.set_xticks(layers)
    a2.set_xlabel("layer")
    a2.set_title("by layer (mean over depths)")
    a2.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)
    return str(path)
