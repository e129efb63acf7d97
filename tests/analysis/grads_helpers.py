"""Shared by the analysis tests: relative-error check and float64 torch conversions."""

from __future__ import annotations

import numpy as np
import torch

RTOL = 1e-8  # the bar for reference-versus-autograd in float64


def rel_err(ours, theirs) -> float:
    """max |ours - theirs| / max |theirs| (the gradient's own scale)."""
    ours, theirs = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    scale = max(float(np.max(np.abs(theirs))), 1e-300)
    return float(np.max(np.abs(ours - theirs))) / scale


def assert_rel(ours, theirs, name: str = "", rtol: float = RTOL) -> None:
    err = rel_err(ours, theirs)
    assert err <= rtol, f"{name}: relative error {err:.3e} > {rtol:.0e}"


def leaf(a: np.ndarray) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float64, requires_grad=True)


def leaves(p: dict) -> dict:
    return {k: leaf(v) for k, v in p.items()}


def grads_of(t: dict) -> dict:
    return {k: v.grad.numpy() for k, v in t.items()}
