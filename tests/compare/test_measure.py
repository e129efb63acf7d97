"""The study's measurements see the run's own training function: under document masking the gradient tails and
the outliers are measured with each window's documents apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import difftx
from difftx.compare import measure
from difftx.nn.mask import document_ids


class _Domain:
    """The parts of a training domain DomainBatches reads: its config, tokenizer and batches."""

    def __init__(self, masking: bool):
        self.cfg = SimpleNamespace(document_masking=masking)
        self.tokenizer = SimpleNamespace(eos_id=0)

    def train_batches(self, step: int, n_micro: int) -> list:
        g = torch.Generator().manual_seed(step)
        x = torch.randint(1, 50, (2, 24), generator=g)
        x[:, [5, 13]] = 0  # end-of-text tokens: three documents a row
        return [{"input_ids": x, "targets": torch.roll(x, -1, 1)}]


@pytest.mark.parametrize("masking", [True, False])
def test_gradient_tails_take_the_document_ids_of_a_masked_run(masking, monkeypatch):
    import difftx.analysis.tail_study as tail_study

    cfg = difftx.ModelConfig(d_model=32, n_heads=2, n_layers=2, vocab_size=50, max_seq_len=32)
    torch.manual_seed(0)
    model = difftx.build_model(cfg)
    seen = []
    real = tail_study.loss_backward

    def spy(model, x, y, **kw):
        seen.append((x, kw))
        return real(model, x, y, **kw)

    monkeypatch.setattr(tail_study, "loss_backward", spy)
    out = measure.gradient_tails(model, measure.DomainBatches(_Domain(masking), "cpu"), 2, 256)
    assert len(seen) == 2 and out["kinds"]
    for x, kw in seen:
        if masking:
            assert torch.equal(kw["document_ids"], document_ids(x, 0))
        else:
            assert kw == {}


def test_a_masked_runs_gradients_differ_from_the_unmasked_ones():
    """Guard for the test above: the document ids change the gradients measured."""
    cfg = difftx.ModelConfig(d_model=32, n_heads=2, n_layers=2, vocab_size=50, max_seq_len=32)
    torch.manual_seed(0)
    model = difftx.build_model(cfg)
    a = measure.gradient_tails(model, measure.DomainBatches(_Domain(True), "cpu"), 1, 10**6)
    b = measure.gradient_tails(model, measure.DomainBatches(_Domain(False), "cpu"), 1, 10**6)
    assert any(abs(a["entries"][k]["rms"] - b["entries"][k]["rms"]) > 1e-6 * b["entries"][k]["rms"]
               for k in a["entries"])
