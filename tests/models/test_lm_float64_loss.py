"""Regression: a float64 language model computes its loss in float64.

The loss used to be taken on ``logits.float()``, so a ``.double()`` model
rounded its loss (and every gradient through it) to float32: relative errors
~1e-7 against the float64 reference backward of ``difftx.analysis.reference``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import difftx


def test_float64_lm_loss_is_float64_and_exact():
    cfg = difftx.ModelConfig(attention="diff", d_model=16, n_layers=2, n_heads=2, vocab_size=31, max_seq_len=8)
    model = difftx.build_model(cfg).double()
    ids = torch.randint(0, 31, (2, 8), generator=torch.Generator().manual_seed(0))
    out = model(ids, targets=ids)
    assert out.loss.dtype == torch.float64
    ref = F.cross_entropy(out.logits.detach().reshape(-1, 31), ids.reshape(-1))
    assert abs(float(out.loss.detach()) - float(ref)) < 1e-14


def test_bfloat16_lm_loss_still_in_float32():
    cfg = difftx.ModelConfig(d_model=16, n_layers=1, n_heads=2, vocab_size=31, max_seq_len=8)
    model = difftx.build_model(cfg).to(torch.bfloat16)
    ids = torch.randint(0, 31, (2, 8), generator=torch.Generator().manual_seed(0))
    assert model(ids, targets=ids).loss.dtype == torch.float32
