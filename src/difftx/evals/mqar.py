"""Multi-query associative recall (Zoology, Arora et al. 2023): a training task and test sweeps.

A sequence of ``seq_len`` tokens over a vocabulary of V ids:

    k1 v1 k2 v2 ... kD vD | . . k3 . . . k1 . . . . k2 . .
                            queries: each key once more; the model must say its value

* keys are D distinct ids from [1, V/2), values D distinct ids from [V/2, V);
* the query slots are the even offsets after the 2D context; each key's gap
  (in slots) is drawn without replacement with p(g) ~ g**(a-1), a = ``power_a``
  (0.01, Zoology's default, puts most queries close to the context);
* the target at a query position is the key's value; every other target is
  -100; the other positions hold 0 or, with ``random_non_queries`` (Zoology's
  default), uniform random ids.

Accuracy is the fraction of query positions whose argmax is the value.  The
vocabulary is the model's (a byte model: keys 1..127, values 128..255), so
4 D <= seq_len and D < V/2.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

from ..data.tasks import register_task
from ..errors import ConfigError
from .common import (batches, check_count, check_flag, check_list, check_options, check_seed, hard_limit, model_device,
                     parse_range, predictions, require_memory, rng_for)

DEFAULT_LENGTHS = (64, 128, 256)
DEFAULT_PAIRS = (4, 8, 16, 32)
TASK_OPTIONS = ("pairs", "vocab", "power_a", "random_non_queries")  # of the training task (--task-opt, --retrieval-opt)


def check_shape(seq_len: int, pairs: int, vocab: int) -> Optional[str]:
    """None when (seq_len, pairs, vocab) is a valid MQAR shape, else the reason."""
    if pairs < 1:
        return "needs at least one key-value pair"
    if 4 * pairs > seq_len:
        return f"4 x pairs ({4 * pairs}) exceeds the sequence length {seq_len}"
    if pairs > vocab // 2 - 1:
        return f"{pairs} distinct keys need a vocabulary of at least {2 * pairs + 2} (have {vocab})"
    return None


def check_power_a(power_a) -> float:
    """``power_a`` as a float: finite and > 0 (the gap law p(g) ~ g**(a-1) needs it), else ConfigError."""
    try:
        a = float(power_a)
    except (TypeError, ValueError):
        a = math.nan
    if not (math.isfinite(a) and 0 < a <= 10):
        raise ConfigError("power_a", f"must be a finite number in (0, 10] (default 0.01; 1: uniform gaps), "
                                     f"got {power_a!r}")
    return a


def mqar_example(rng: np.random.Generator, seq_len: int, pairs: int, vocab: int, power_a: float = 0.01,
                 random_non_queries: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """One (x, y) pair of int64 arrays of length ``seq_len``."""
    why = check_shape(seq_len, pairs, vocab)
    if why:
        raise ConfigError("mqar", why)
    half = vocab // 2
    keys = rng.choice(np.arange(1, half), size=pairs, replace=False)
    values = rng.choice(np.arange(half, vocab), size=pairs, replace=False)
    ctx = 2 * pairs
    space = (seq_len - ctx) // 2
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    gaps = rng.choice(space, size=pairs, replace=False, p=p / p.sum())
    x = rng.integers(0, vocab, size=seq_len) if random_non_queries else np.zeros(seq_len, dtype=np.int64)
    y = np.full(seq_len, -100, dtype=np.int64)
    x[0:ctx:2], x[1:ctx:2] = keys, values
    qpos = ctx + 2 * gaps
    x[qpos] = keys
    y[qpos] = values
    return x.astype(np.int64), y


def mqar_batch(rng: np.random.Generator, batch_size: int, seq_len: int, pairs: int, vocab: int,
               power_a: float = 0.01, random_non_queries: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(mqar_example(rng, seq_len, pairs, vocab, power_a, random_non_queries) for _ in range(batch_size)))
    return torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(ys))


@torch.no_grad()
def mqar_accuracy(model, x: torch.Tensor, y: torch.Tensor, batch_size: int = 32) -> tuple[int, int]:
    """(correct, total) query predictions of ``model`` on (x, y)."""
    device, correct, total = model_device(model), 0, 0
    for idx in batches(list(range(x.shape[0])), batch_size):
        xb, yb = x[idx].to(device), y[idx]
        pred = predictions(model, xb).cpu()
        m = yb != -100
        correct += int((pred[m] == yb[m]).sum())
        total += int(m.sum())
    return correct, total


def evaluate_mqar(model, lengths: Sequence[int] = DEFAULT_LENGTHS, pairs: Sequence[int] = DEFAULT_PAIRS,
                  samples: int = 64, vocab: Optional[int] = None, power_a: float = 0.01,
                  random_non_queries: bool = True, seed: int = 0, batch_size: int = 32,
                  progress: bool = False) -> dict:
    """Accuracy per (sequence length, number of pairs); shapes that do not fit are listed as skipped."""
    power_a = check_power_a(power_a)
    lengths, pairs = check_list("lengths", lengths), check_list("pairs", pairs)
    samples, batch_size = check_count("samples", samples), check_count("batch_size", batch_size)
    seed, random_non_queries = check_seed(seed), check_flag("random_non_queries", random_non_queries)
    vocab = check_count("vocab", vocab, 2) if vocab is not None else int(model.config.vocab_size)
    if vocab > model.config.vocab_size:
        raise ConfigError("vocab", f"{vocab} exceeds the model's vocabulary ({model.config.vocab_size})")
    limit = hard_limit(model)
    cells, skipped = [], []
    for li, L in enumerate(lengths):
        for di, D in enumerate(pairs):
            why = check_shape(L, D, vocab) or (f"longer than max_seq_len={limit}" if limit and L > limit else None)
            if why:
                skipped.append({"seq_len": L, "pairs": D, "reason": why})
                continue
            require_memory(model, samples, L, f"{samples:,} sequence(s) of {L:,} tokens", "pass shorter --lengths or "
                           "fewer --samples")
            x, y = mqar_batch(rng_for(seed, L, D, 0x3A5), samples, L, D, vocab, power_a, random_non_queries)
            c, t = mqar_accuracy(model, x, y, batch_size)
            cells.append({"seq_len": L, "pairs": D, "accuracy": c / t, "queries": t})
            if progress:
                print(f"  mqar len {L} pairs {D}: {c / t:.3f}", flush=True)
    if not cells:  # the fix too, as niah's refusal (the reason alone named no flag)
        d = min(pairs)
        if limit and min(lengths) > limit:
            fix = f"pass --lengths up to {limit}"
        elif check_shape(4 * d, d, vocab):
            larger = vocab < model.config.vocab_size  # --vocab below the model's
            fix = f"pass a --vocab of at least {2 * d + 2}" if vocab < 4 else \
                f"pass --pairs up to {vocab // 2 - 1}" + (" or a larger --vocab" if larger else "")
        else:
            fix = f"pass --lengths of at least {4 * d} (4 x pairs) or fewer --pairs"
        raise ConfigError("mqar", f"no (length, pairs) shape fits: {skipped[0]['reason']}; {fix}")
    total = sum(c["queries"] for c in cells)
    return {"vocab": vocab, "power_a": power_a, "cells": cells, "skipped": skipped,
            "overall_accuracy": sum(c["accuracy"] * c["queries"] for c in cells) / total}


def plot_mqar(result: dict, path) -> Optional[str]:
    from .common import pyplot
    from ..io import atomic_savefig

    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(4.8, 3.2))
    for L in sorted({c["seq_len"] for c in result["cells"]}):
        cs = sorted((c for c in result["cells"] if c["seq_len"] == L), key=lambda c: c["pairs"])
        ax.plot([c["pairs"] for c in cs], [c["accuracy"] for c in cs], marker="o", label=f"length {L}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("key-value pairs")
    ax.set_ylabel("accuracy")
    ax.set_title("MQAR")
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)
    return str(path)


class MqarTask:
    """Sampler for ``difftx train --task mqar``; pairs drawn per batch from the range, a pure function of (step, rank)."""

    def __init__(self, vocab: int, seq_len: int, seed: int = 0, pairs="4-16", power_a: float = 0.01,
                 random_non_queries: bool = True, seq_len_flag: str = "--seq-len"):
        # seq_len_flag: the caller's flag for seq_len, named in its errors (difftx compare: --retrieval-seq-len)
        if not seq_len:
            raise ConfigError("seq_len", f"the mqar task needs a sequence length ({seq_len_flag})")
        self.vocab, self.seq_len, self.seed = int(vocab), int(seq_len), int(seed)
        self.pairs = parse_range(pairs, "pairs")
        self.power_a, self.random_non_queries = check_power_a(power_a), bool(random_non_queries)
        d = self.pairs[1]
        if 4 * d > self.seq_len - self.seq_len % 2:  # an odd length drops its last token
            raise ConfigError("seq_len", f"{self.seq_len} is too short for {d} key-value pairs (needs {4 * d}); "
                                         f"raise {seq_len_flag} to {4 * d} or lower pairs")
        why = check_shape(4 * d, d, self.vocab)
        if why:
            raise ConfigError("vocab", f"{why}; raise vocab to {2 * d + 2} or lower pairs")

    def batch(self, batch_size: int, step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        rng = rng_for(self.seed, step, rank, 0x3A5)
        d = int(rng.integers(self.pairs[0], self.pairs[1] + 1))
        even = self.seq_len + self.seq_len % 2
        x, y = mqar_batch(rng, batch_size, even, d, self.vocab, self.power_a, self.random_non_queries)
        return x[:, :self.seq_len], y[:, :self.seq_len]


@register_task("mqar")
def mqar_task(tokenizer, seq_len: int, seed: int = 0, vocab: Optional[int] = None, *,
              seq_len_flag: str = "--seq-len", **options) -> MqarTask:
    """Zoology MQAR over the tokenizer's ids (options: pairs, vocab, power_a, random_non_queries).
    ``seq_len_flag``: the caller's flag for ``seq_len``, which its errors name (not a task option)."""
    check_options("mqar", options, TASK_OPTIONS)
    return MqarTask(int(vocab or tokenizer.vocab_size), seq_len, seed, seq_len_flag=seq_len_flag, **options)
