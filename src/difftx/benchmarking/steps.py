"""Training steps as the trainer runs them, timed in interleaved repeats: the pieces the side-by-side scripts under
``benchmarks/`` (document masking, sliding windows) share."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def trainer_model(cfg, bf16: bool, seq_len: int, seed: int = 0):
    """(model, AdamW) for ``cfg`` on the CPU as ``difftx train`` builds them: weights from ``seed``, the attention
    backend the trainer picks for the dtype (bf16: autocast's), AdamW at lr 1e-4, weight decay 0.1."""
    from ..models import build_model
    from ..optim import build_optimizer
    from ..train.trainer import training_attention_backend

    torch.manual_seed(seed)
    model = build_model(cfg)
    backend = training_attention_backend(cfg, torch.device("cpu"), torch.bfloat16 if bf16 else None, seq_len)
    if backend is not None:
        model.set_attention_backend(backend)
    return model, build_optimizer(model, "adamw", lr=1e-4, weight_decay=0.1)


def adamw_step(model, opt, x: torch.Tensor, y: torch.Tensor, bf16: bool, **model_kwargs) -> float:
    """Seconds (wall clock) of one training step: forward (under bf16 autocast when ``bf16``), backward, optimizer."""
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(x, targets=y, **model_kwargs).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def interleaved_medians(arms: dict, repeats: int) -> dict:
    """Median seconds of each arm (name -> a callable returning its seconds): one untimed run each, then ``repeats``
    rounds in alternating order (A B C, C B A, ...), so that a drift of the machine reaches every arm alike."""
    order = list(arms)
    for name in order:  # warm-up
        arms[name]()
    times: dict[str, list] = {name: [] for name in order}
    for r in range(repeats):
        for name in (order if r % 2 == 0 else order[::-1]):
            times[name].append(arms[name]())
    return {name: statistics.median(t) for name, t in times.items()}


def switched(fn: Callable[[], float], obj, name: str, value) -> Callable[[], float]:
    """``fn`` run with ``obj.name`` set to ``value`` (put back afterwards, also on an error): an arm that takes
    another code path."""
    def run() -> float:
        old = getattr(obj, name)
        setattr(obj, name, value)
        try:
            return fn()
        finally:
            setattr(obj, name, old)

    return run
