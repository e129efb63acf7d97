"""Activation outliers (DIFF paper section 3.7, Table 5): the largest |attention logits| and |hidden states|.

Over a budget of tokens (the paper: 0.4M), report the top-1, 2, 3, 10 and 100
magnitudes and the median of

* attention logits: the pre-softmax q k^T / sqrt(d) of every head, only the
  entries a query may attend to (the causal triangle); DIFF contributes both
  maps' logits (Q1 K1^T and Q2 K2^T, as the unilm maintainers measure it);
* hidden states: every entry of every layer's output (the residual stream after
  each block).

Streaming: a running top-100 and a log-spaced histogram (relative error of the
median <= 0.58%, see :class:`~difftx.evals.common.LogHistogram`) per kind and
per layer, so memory does not grow with the budget -- the state is a few
hundred kB however many tokens pass (tested).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import DataError
from ..nn.mask import document_ids
from ..nn.probe import AttentionProbe
from .common import LogHistogram, TopK, attach, check_count, check_token_ids, map_batch_size, model_device, \
    text_tokens, valid_values, window_length

TOPS = (1, 2, 3, 10, 100)


class MagnitudeStats:
    """Top-k and median of |x| for a stream, overall and per layer."""

    def __init__(self, k: int = max(TOPS)):
        self.k = k
        self.top, self.hist = TopK(k), LogHistogram()
        self.layers: dict[int, tuple[TopK, LogHistogram]] = {}

    def update(self, layer: int, values: torch.Tensor) -> None:
        a = values.detach().abs().reshape(-1)
        self.top.update(a)
        self.hist.update(a)
        t, h = self.layers.setdefault(layer, (TopK(1), LogHistogram()))
        t.update(a)
        h.update(a)

    def summary(self) -> dict:
        return {
            **{f"top{i}": self.top.top(i) for i in TOPS}, "median": self.hist.median(), "count": self.hist.n,
            "median_rel_error": self.hist.rel_error,
            "by_layer": [{"layer": layer, "top1": t.top(1), "median": h.median()}
                         for layer, (t, h) in sorted(self.layers.items())],
        }

    def state_bytes(self) -> int:
        return self.top.state_bytes() + self.hist.state_bytes() + sum(
            t.state_bytes() + h.state_bytes() for t, h in self.layers.values())


class LogitProbe(AttentionProbe):
    def __init__(self, stats: MagnitudeStats):
        self.stats = stats

    def observe(self, layer, logits, effective, mask):
        for lg in logits:
            self.stats.update(layer, valid_values(lg, mask))


class OutlierCollector:
    """Attach to a model (context manager); every forward feeds the logit and hidden-state statistics."""

    def __init__(self, model):
        self.model = model
        self.logits, self.hidden = MagnitudeStats(), MagnitudeStats()
        self._hooks = []
        self._probe_ctx = None

    def __enter__(self):
        for i, block in enumerate(self.model.layers):
            self._hooks.append(block.register_forward_hook(
                lambda mod, inp, out, layer=i + 1: self.hidden.update(layer, out)))
        self._probe_ctx = attach(self.model, LogitProbe(self.logits))
        self._probe_ctx.__enter__()
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._probe_ctx.__exit__(*exc)

    def state_bytes(self) -> int:
        return self.logits.state_bytes() + self.hidden.state_bytes()


@torch.no_grad()
def evaluate_outliers(model, tokens, seq_len: Optional[int] = None, max_tokens: int = 16384,
                      batch_size: Optional[int] = None, progress: bool = False,
                      document_eos: Optional[int] = None) -> dict:
    """Table 5 statistics over ``max_tokens`` tokens of the 1-D stream ``tokens`` (windows of ``seq_len``).

    ``document_eos``: the end-of-text token id that ends each document of the stream; a window's documents then
    attend only to themselves (document masking, as ``difftx train --document-masking`` trains), and the logits
    counted are those a query may attend to under that mask."""
    tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    seq_len = window_length(model, seq_len)
    max_tokens = check_count("max_tokens", max_tokens)
    if batch_size is not None:
        batch_size = check_count("batch_size", batch_size)
    n_windows = min(tokens.numel() // seq_len, max(1, max_tokens // seq_len))
    if n_windows < 1:
        raise DataError(f"need at least {seq_len} tokens for one window of {seq_len}; got {tokens.numel()} "
                        "(pass more data or a smaller --seq-len)")
    check_token_ids(int(tokens.max()), int(model.config.vocab_size))  # an IndexError traceback mid-run
    bs = batch_size or map_batch_size(model.config.n_heads, seq_len, cap=16)
    device = model_device(model)
    with OutlierCollector(model) as col:
        for start in range(0, n_windows, bs):
            n = min(bs, n_windows - start)
            x = tokens[start * seq_len:(start + n) * seq_len].view(n, seq_len).to(device)
            kw = {} if document_eos is None else {"document_ids": document_ids(x, document_eos)}
            model.features(x, **kw)  # the blocks' hooks and probes see everything; the LM head is not needed
            if progress:
                print(f"  outliers: {(start + n) * seq_len} / {n_windows * seq_len} tokens", flush=True)
    return {"tokens": n_windows * seq_len, "seq_len": seq_len, "attention_logits": col.logits.summary(),
            "hidden_states": col.hidden.summary(), "state_bytes": col.state_bytes()}


def evaluate_outliers_text(model, tokenizer, text: Optional[str] = None, data=None, max_tokens: int = 16384,
                           **kwargs) -> dict:
    tokens, max_tokens, _ = text_tokens(model, tokenizer, text, data, max_tokens, kwargs.get("seq_len"))
    return evaluate_outliers(model, tokens, max_tokens=max_tokens, **kwargs)


def plot_outliers(result: dict, path) -> Optional[str]:
    from .common import pyplot
    from ..io import atomic_savefig

    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    labels = [f"top-{i}" for i in TOPS] + ["median"]
    for ax, key in zip(axes, ("attention_logits", "hidden_states")):
        s = result[key]
        vals = [s[f"top{i}"] or 0.0 for i in TOPS] + [s["median"] or 0.0]
        ax.bar(labels, vals)
        ax.set_yscale("log")
        ax.set_title(f"|{key.replace('_', ' ')}| (Table 5)")
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)
    return str(path)
