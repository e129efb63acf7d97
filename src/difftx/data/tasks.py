"""Synthetic training tasks, by name: ``difftx train --task NAME``.

A task is registered with :func:`register_task` as a factory
``factory(tokenizer, seq_len, seed, **options) -> TaskSampler``.  A sampler is
a pure function of (step, rank): ``sampler.batch(batch_size, step, rank)``
returns ``(x, y)`` LongTensors of shape (B, seq_len) where ``y`` holds the
targets aligned with ``x`` (position t predicts y[t]) and -100 marks positions
that are not scored.  Being a function of the step makes resumed runs exact
without saving any sampler state.  The trainer asks for a step's whole global
batch (rank 0) and each process takes its rows, so the data does not depend on
the number of processes or micro-batches.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

TASKS: dict[str, Callable] = {}


class TaskSampler(Protocol):
    def batch(self, batch_size: int, step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]: ...


def register_task(name: str):
    def deco(factory: Callable) -> Callable:
        TASKS[name] = factory
        return factory

    return deco


def get_task(name: str) -> Callable:
    from ..errors import DataError

    _load_builtin_tasks()
    if name not in TASKS:
        raise DataError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS)) or 'none'}")
    return TASKS[name]


def _load_builtin_tasks() -> None:
    """Import the modules that register built-in tasks (they may not all exist in every install)."""
    import importlib

    for module in ("difftx.evals.niah", "difftx.evals.mqar"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
                raise  # a missing dependency inside an existing module is a real error
