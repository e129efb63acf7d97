"""Attention-logit quantization (DIFF paper section 3.7, Fig. 8), usable under any evaluation.

Dynamic absmax post-training quantization: each attention-logit tensor is
scaled by its own absolute maximum at run time, rounded to a signed ``bits``-bit
integer grid and scaled back (fake quantization) before the softmax:

    s = max|x| / (2**(bits-1) - 1),   x_q = round(x / s) * s

The absmax is taken over the logits a query may attend to (the causal
triangle, real tokens only), so neither future positions nor left padding ever
set a scale.  ``granularity`` picks what shares one scale:

* ``head`` (default): one scale per (sequence, head) attention map, causal: a
  query row's scale is the maximum over its own visible logits and those of the
  rows before it in the same forward call -- a single outlier logit coarsens the
  rest of that map, which is what Fig. 8 probes, and no prediction depends on a
  later token;
* ``row``: one scale per query row (milder);
* ``tensor``: one scale per layer call, causal as ``head``, over all sequences
  and heads of the batch (so it depends on what else is in the batch).

With a KV cache, ``head`` and ``tensor`` rows of a later call do not see the
maxima of earlier calls' rows (the cache keeps keys and values, not scales):
cached generation under them can differ slightly from one uncached forward.
``row`` is exact either way (a row's scale depends on its visible keys only).

``bits=16`` is a real 16-bit grid, not a no-op: the worst-case error of a logit
is max|x| / 65534 (for logits of size 10: 1.5e-4), so 16 bits matches the
unquantized model to about 1e-4 in the loss (tested).  DIFF quantizes both maps.

    with quantized_logits(model, bits=6):
        evaluate_lm(model, tokens)            # any evaluation, quantized

``evaluate_quant`` sweeps bits and reports one metric per setting: LM loss by
default, or the headline number of another evaluation (niah, mqar, icl).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch

from ..errors import ConfigError
from ..nn.probe import AttentionProbe
from .common import attach

GRANULARITIES = ("head", "row", "tensor")
DEFAULT_BITS = (16, 8, 6, 4)


def scale_entries(mask, n_q: int, n_k: int, device) -> Optional[torch.Tensor]:
    """(B|1, 1, Nq, Nk) True where a logit may set a scale: the query may see the key (causally, if ``mask``
    is causal; the queries are the last Nq of Nk positions without a mask) and both are real tokens (a padding
    query after a cached prefix sees the prefix: its row set the scale of the real rows after it)."""
    causal = mask is None or mask.causal
    q_start = n_k - n_q if mask is None else mask.q_start
    valid = None
    if causal:
        q = torch.arange(q_start, q_start + n_q, device=device)[:, None]
        valid = (torch.arange(n_k, device=device)[None, :] <= q)[None, None]
    if mask is not None and mask.key_valid is not None:
        kv = mask.key_valid.to(device)
        keys = kv[:, None, None, :] & kv[:, None, mask.q_start:mask.q_start + n_q, None]
        valid = keys if valid is None else valid & keys
    if mask is not None and mask.windowed:  # and those of keys outside its sliding window
        q = torch.arange(q_start, q_start + n_q, device=device)[:, None]
        k = torch.arange(n_k, device=device)[None, :]
        near = mask.in_window(q, k)[None, None]
        valid = near if valid is None else valid & near
    if mask is not None and mask.doc_ids is not None:  # a query's logits over other documents' keys are masked
        same = mask.same_document(0, n_q, n_k, device)[:, None]
        valid = same if valid is None else valid & same
    return valid


def absmax_quantize(x: torch.Tensor, bits: int, granularity: str = "head",
                    valid: Optional[torch.Tensor] = None, causal: bool = True) -> torch.Tensor:
    """Fake-quantize ``x`` (B, H, Nq, Nk) to ``bits`` with dynamic absmax scales.

    ``valid`` (broadcastable bool) marks the entries that set the scale (others
    are still quantized, with the same scale, but cannot inflate it).  ``causal``:
    ``head`` and ``tensor`` scales grow row by row (row i's covers rows <= i).
    """
    if bits < 2:
        raise ConfigError("bits", f"need at least 2 bits, got {bits}")
    if granularity not in GRANULARITIES:
        raise ConfigError("granularity", f"must be one of {GRANULARITIES}, got {granularity!r}")
    a = x.abs()
    if valid is not None:
        a = a.masked_fill(~valid, 0.0)
    amax = a.amax(dim=-1, keepdim=True)  # (B, H, Nq, 1): each row's
    if granularity != "row":
        if granularity == "tensor":
            amax = amax.amax(dim=(0, 1), keepdim=True)
        amax = amax.cummax(dim=-2).values if causal else amax.amax(dim=-2, keepdim=True)
    qmax = 2 ** (bits - 1) - 1
    scale = (amax / qmax).clamp_min(torch.finfo(x.dtype).tiny)
    return torch.clamp(torch.round(x / scale), -qmax, qmax) * scale


class LogitQuantizer(AttentionProbe):
    """A probe that quantizes every attention-logit map it sees."""

    def __init__(self, bits: int, granularity: str = "head"):
        if granularity not in GRANULARITIES:
            raise ConfigError("quant_granularity", f"must be one of {GRANULARITIES}, got {granularity!r}")
        if not 2 <= int(bits) <= 32:
            raise ConfigError("quant_bits", f"must be between 2 and 32, got {bits}")
        self.bits, self.granularity = int(bits), granularity

    def transform_logits(self, layer, index, logits, mask=None):
        valid = scale_entries(mask, logits.shape[-2], logits.shape[-1], logits.device)
        return absmax_quantize(logits, self.bits, self.granularity, valid, causal=mask is None or mask.causal)

    def describe(self) -> dict:
        return {"bits": self.bits, "granularity": self.granularity, "method": "dynamic absmax (fake quantization)"}


@contextlib.contextmanager
def quantized_logits(model, bits: Optional[int], granularity: str = "head"):
    """Run everything inside with attention logits quantized to ``bits`` (None or 0: unchanged).

    Forces the eager attention path (the only one that materialises logits);
    probes attached inside (attention allocation, outliers) see quantized logits.
    """
    if not bits:
        yield None
        return
    q = LogitQuantizer(bits, granularity)
    with attach(model, q):
        yield q


# ----------------------------------------------------------------------------- the sweep
def _metric_fn(metric: str) -> Callable:
    """metric name -> fn(model, tokenizer, **opts) -> (metric label, value, higher_is_better)."""
    if metric == "lm":
        from .lm import evaluate_lm_text

        def fn(model, tok, **o):
            r = evaluate_lm_text(model, tok, **o)
            return "val_loss", r["loss"], False
    elif metric == "niah":
        from .niah import evaluate_niah

        def fn(model, tok, **o):
            r = evaluate_niah(model, tok, **o)
            return "niah_accuracy_teacher_forced", r["overall"]["teacher_forced"], True
    elif metric == "mqar":
        from .mqar import evaluate_mqar

        def fn(model, tok, **o):
            r = evaluate_mqar(model, **o)
            return "mqar_accuracy", r["overall_accuracy"], True
    elif metric == "icl":
        from .icl import evaluate_icl

        def fn(model, tok, **o):
            r = evaluate_icl(model, tok, **o)
            return "icl_accuracy", r["overall_accuracy"], True
    else:
        raise ConfigError("metric", f"must be one of lm, niah, mqar, icl; got {metric!r}")
    return fn


def evaluate_quant(model, tokenizer, bits: Sequence[int] = DEFAULT_BITS, granularity: str = "head",
                   metric: str = "lm", metric_options: Optional[dict] = None, progress: bool = False) -> dict:
    """The metric unquantized and with the logits quantized to each of ``bits`` (Fig. 8)."""
    bad = [b for b in bits if isinstance(b, bool) or not isinstance(b, int) or not 2 <= b <= 32]
    if bad or not bits:
        raise ConfigError("bits", f"each width must be an integer between 2 and 32, got {bad[0] if bad else 'none'!r}")
    if granularity not in GRANULARITIES:  # before the unquantized run, not after it
        raise ConfigError("granularity", f"must be one of {GRANULARITIES}, got {granularity!r}")
    fn = _metric_fn(metric)
    opts = dict(metric_options or {})
    rows = []
    for b in [None, *bits]:
        with quantized_logits(model, b, granularity):
            try:
                label, value, higher = fn(model, tokenizer, **opts)
            except TypeError as e:
                if "keyword argument" not in str(e):
                    raise
                raise ConfigError("metric_options", f"the {metric} evaluation rejected an option ({e})") from None
        rows.append({"bits": b, "value": value})
        if progress:
            print(f"  quant {('none' if b is None else f'{b}-bit'):>7}: {label} = {value:.4f}", flush=True)
    base = rows[0]["value"]
    for r in rows:
        r["delta"] = None if base is None or r["value"] is None else r["value"] - base
    return {"metric": label, "higher_is_better": higher, "granularity": granularity, "rows": rows}


def plot_quant(result: dict, path) -> Optional[str]:
    from .common import pyplot
    from ..io import atomic_savefig

    plt = pyplot()
    if plt is None:
        return None
    rows = result["rows"]
    labels = ["none" if r["bits"] is None else str(r["bits"]) for r in rows]
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    ax.plot(labels, [r["value"] for r in rows], marker="o")
    ax.set_xlabel("attention-logit bits")
    ax.set_ylabel(result["metric"])
    ax.set_title(f"absmax logit quantization ({result['granularity']})")
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)
    return str(path)
