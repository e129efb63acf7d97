"""Language-model evaluation: loss, perplexity, NLL by position (Fig. 4) and the AR-Hit / Others split (Table 6).

The token stream is cut into windows of ``seq_len + 1`` tokens that start ``seq_len``
apart (a window's last token, a target, is the next one's first input), so the
``seq_len`` predictions of each never overlap; nothing crosses a window, so "the
context" of a prediction is its window.

* Cumulative average NLL by position (Fig. 4, after Reid et al. 2024): at
  position t (1-based), the mean NLL of all predictions at positions <= t,
  averaged over windows.  Falls with t when the model uses its context.
* AR-Hit (Zoology, Arora et al. 2023; DIFF Table 6): the prediction of token
  x[t+1] is an AR hit when the bigram (x[t], x[t+1]) already occurred earlier in
  the same window, i.e. at some (x[s], x[s+1]) with s < t: the token can be
  recalled from the context.  With ``ar_max_freq`` a hit also needs the bigram
  to be rare -- at most that many occurrences in the whole evaluated stream --
  so frequent bigrams the model knows anyway go to Others, as in the paper's
  "the tokens that cannot be recalled from the context or frequent tokens".
  Everything else is Others.

Memory is flat in the token budget (running sums per position), except that
``ar_max_freq`` first counts the bigrams of the evaluated stream.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import DataError
from ..nn.mask import document_ids
from .common import check_count, check_token_ids, logit_chunks, model_device, text_tokens, window_length


def ar_hit_mask(windows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, L+1) token windows -> (B, L) bool: is the prediction of windows[:, t+1] an AR hit.

    Hit iff the bigram (w[t], w[t+1]) equals (w[s], w[s+1]) for some s < t.
    """
    w = windows.long()
    b, n = w.shape[0], w.shape[1] - 1
    codes = w[:, :-1] * vocab_size + w[:, 1:]  # (B, L) bigram codes; the code at t is completed by w[t+1]
    codes = codes + torch.arange(b, device=w.device)[:, None] * (vocab_size * vocab_size)  # rows never match
    pos = torch.arange(n, device=w.device).expand(b, n).reshape(-1)
    uniq, inv = torch.unique(codes.reshape(-1), return_inverse=True)
    first = torch.full((uniq.numel(),), n, dtype=torch.long, device=w.device)
    first = first.scatter_reduce(0, inv, pos, reduce="amin")
    return (first[inv] < pos).view(b, n)


def bigram_counts(tokens: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique bigram codes of a 1-D stream and their counts."""
    t = tokens.long()
    return torch.unique(t[:-1] * vocab_size + t[1:], return_counts=True)


def _lookup_counts(codes: torch.Tensor, uniq: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    idx = torch.searchsorted(uniq, codes).clamp_max(uniq.numel() - 1)
    return torch.where(uniq[idx] == codes, counts[idx], torch.zeros_like(idx))


def _summary_positions(n: int, max_points: int = 64) -> list[int]:
    """1-based positions to report: all when few, else a log-spaced grid that ends at n."""
    if n <= max_points:
        return list(range(1, n + 1))
    pts = {int(round(math.exp(math.log(n) * i / (max_points - 1)))) for i in range(max_points)}
    return sorted(p for p in pts if 1 <= p <= n) + ([n] if n not in pts else [])


@torch.no_grad()
def evaluate_lm(model, tokens, seq_len: Optional[int] = None, max_tokens: int = 16384, batch_size: int = 8,
                ar_max_freq: Optional[int] = None, progress: bool = False,
                document_eos: Optional[int] = None) -> dict:
    """Loss, perplexity, cumulative NLL by position and AR-Hit / Others on a 1-D token stream.

    ``document_eos``: the end-of-text token id that ends each document of the stream; a window's documents then
    attend only to themselves (document masking, as ``difftx train --document-masking`` trains)."""
    tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    seq_len = window_length(model, seq_len)
    max_tokens, batch_size = check_count("max_tokens", max_tokens), check_count("batch_size", batch_size)
    if ar_max_freq is not None:
        ar_max_freq = check_count("ar_max_freq", ar_max_freq)
    n_windows = min((tokens.numel() - 1) // seq_len, max(1, max_tokens // seq_len))
    if n_windows < 1:
        raise DataError(f"need at least {seq_len + 1} tokens for one window of {seq_len}; got {tokens.numel()} "
                        "(pass more data or a smaller --seq-len)")
    vocab = int(model.config.vocab_size)
    check_token_ids(int(tokens.max()), vocab)
    device = model_device(model)
    used = tokens[: n_windows * seq_len + 1]
    freq = bigram_counts(used, vocab) if ar_max_freq is not None else None

    pos_sum = torch.zeros(seq_len, dtype=torch.float64)
    pos_cnt = torch.zeros(seq_len, dtype=torch.float64)
    hit_sum = hit_n = other_sum = other_n = 0.0
    for start in range(0, n_windows, batch_size):
        idx = torch.arange(start, min(n_windows, start + batch_size))
        win = torch.stack([used[i * seq_len: i * seq_len + seq_len + 1] for i in idx.tolist()])
        x, y = win[:, :-1].to(device), win[:, 1:].to(device)
        nll = torch.empty(y.shape, dtype=torch.float64)
        kw = {} if document_eos is None else {"document_ids": document_ids(x, document_eos)}
        for s, logits in logit_chunks(model, x, **kw):  # never all (B, N, V) logits at once
            k = logits.shape[1]
            nll[:, s:s + k] = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y[:, s:s + k].reshape(-1),
                                              reduction="none").view(-1, k).cpu()  # stored as float64
        pos_sum += nll.sum(0)
        pos_cnt += nll.shape[0]
        hit = ar_hit_mask(win, vocab)
        if freq is not None:
            codes = win[:, :-1] * vocab + win[:, 1:]
            hit &= _lookup_counts(codes, *freq) <= ar_max_freq
        hit_sum += float(nll[hit].sum())
        hit_n += int(hit.sum())
        other_sum += float(nll[~hit].sum())
        other_n += int((~hit).sum())
        if progress:
            print(f"  lm: {min(n_windows, start + batch_size)}/{n_windows} windows", flush=True)

    n = float(pos_cnt.sum())
    loss = float(pos_sum.sum()) / n
    cum = torch.cumsum(pos_sum, 0) / torch.cumsum(pos_cnt, 0)
    at = pos_sum / pos_cnt
    pts = _summary_positions(seq_len)
    return {
        "loss": loss, "perplexity": math.exp(min(loss, 700.0)), "bits_per_token": loss / math.log(2),
        "tokens": int(n), "windows": n_windows, "seq_len": seq_len,
        "ar_hit": {"loss": hit_sum / hit_n if hit_n else None, "tokens": int(hit_n), "fraction": hit_n / n,
                   "max_freq": ar_max_freq},
        "others": {"loss": other_sum / other_n if other_n else None, "tokens": int(other_n)},
        "by_position": {"position": pts, "cumulative_nll": [float(cum[p - 1]) for p in pts],
                        "nll": [float(at[p - 1]) for p in pts]},
    }


def evaluate_lm_text(model, tokenizer, text: Optional[str] = None, data=None, max_tokens: int = 16384,
                     **kwargs) -> dict:
    """:func:`evaluate_lm` on ``text``, a text file ``data``, or the built-in validation corpus."""
    tokens, max_tokens, _ = text_tokens(model, tokenizer, text, data, max_tokens, kwargs.get("seq_len"))
    if len(tokens) < 2:
        raise DataError("the evaluation text is too short (fewer than 2 tokens)")
    return evaluate_lm(model, tokens, max_tokens=max_tokens, **kwargs)


def plot_lm(result: dict, path) -> Optional[str]:
    from .common import pyplot
    from ..io import atomic_savefig

    plt = pyplot()
    if plt is None:
        return None
    bp = result["by_position"]
    fig, ax = plt.subplots(figsize=(4.8, 3.2))
    ax.plot(bp["position"], bp["cumulative_nll"], label="cumulative average NLL")
    ax.set_xscale("log")
    ax.set_xlabel("token position")
    ax.set_ylabel("NLL (nats)")
    ax.set_title(f"loss {result['loss']:.3f}, AR-Hit {result['ar_hit']['loss'] or float('nan'):.3f}, "
                 f"Others {result['others']['loss'] or float('nan'):.3f}", fontsize=9)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)
    return str(path)
