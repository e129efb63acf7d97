"""Helpers for the evaluation tests: tiny models and a deterministic haystack text."""

from __future__ import annotations

import torch

import difftx

KINDS = ("softmax", "diff", "diff2")


def tiny_model(kind: str = "diff", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    fields = dict(attention=kind, d_model=64, n_layers=2, n_heads=2, vocab_size=256, max_seq_len=256)
    cfg = difftx.ModelConfig(**{**fields, **overrides})
    return difftx.build_model(cfg).eval()


def haystack_text(n: int = 400) -> str:
    """Deterministic prose-like text with clear sentence boundaries."""
    words = ["river", "garden", "window", "lantern", "harbor", "meadow", "violin", "pebble", "thunder", "orchard"]
    out = []
    for i in range(n):
        a, b = words[i % len(words)], words[(i * 7 + 3) % len(words)]
        out.append(f"The {a} was near the {b} on day {i}.")
    return " ".join(out) + "\n"
