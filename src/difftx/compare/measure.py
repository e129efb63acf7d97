"""What a study measures on a finished run, besides its loss curves.

* :func:`throughput` -- tokens (images) per second, the median over the run's
  steps after the first 10% (the trainer logs each step's rate).
* :func:`peak_step_memory` -- bytes one training step needs at the run's
  micro-batch: parameters and optimiser state held between steps, plus the
  high-water mark of the tensors the step allocates (activations, gradients,
  temporaries).  CUDA reads the allocator's peak; the CPU allocator keeps no
  statistics and process RSS is no measure (freed memory stays mapped), so on
  a CPU the profiler's memory events (every allocation and free with its size,
  in order) are replayed and the running sum's maximum taken.
* :func:`gradient_tails` -- heavy-tail statistics of the gradients at the
  trained weights (:func:`difftx.analysis.tail_study.measure`) on fresh batches
  of the run's own training data.
* :func:`mqar_allocation` -- attention allocation (DIFF Table 3) on MQAR
  sequences: the share of the attention of the row that predicts a value on
  that value (``answer``), its key (``answer_needle``), the other pairs
  (``other_needles``), earlier queries (``query``) and the random filler
  (``noise``), with the same probe and normalisation as ``difftx eval attention``.
"""

from __future__ import annotations

import statistics
from typing import Optional

import numpy as np

from ..benchmarking.memory import held_bytes, peak_live_bytes


# ----------------------------------------------------------------------------- speed
def throughput(rows: list[dict]) -> Optional[float]:
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    if not rates:
        return None
    return float(statistics.median(rates[len(rates) // 10:]))


# ----------------------------------------------------------------------------- memory
def peak_step_memory(model, optimizer, loss_fn, autocast) -> dict:
    """Bytes: ``state`` (parameters + optimiser state), ``step`` (the step's own peak), ``total``.

    ``loss_fn(model)`` returns the loss of one micro-batch; ``autocast`` is a
    context factory.  One unmeasured step first creates the optimiser state.
    """
    def step():
        with autocast():
            loss = loss_fn(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    state = held_bytes(model, optimizer)
    peak, method = peak_live_bytes(step, next(model.parameters()).device)
    return {"state_bytes": int(state), "step_bytes": int(peak), "total_bytes": int(state + peak), "method": method}


# ----------------------------------------------------------------------------- gradients
class DomainBatches:
    """``batch(step) -> (x, y)`` from a prepared training domain (the run's own data), as the analysis expects;
    ``model_kwargs(x)``: the document ids when the run trains with document masking, so the gradients measured
    are those of the loss it trains."""

    def __init__(self, domain, device):
        self.domain, self.device = domain, device

    def model_kwargs(self, x: torch.Tensor) -> dict:
        if not getattr(self.domain.cfg, "document_masking", False):
            return {}
        from ..nn.mask import document_ids

        return {"document_ids": document_ids(x, self.domain.tokenizer.eos_id)}

    def batch(self, step: int):
        b = self.domain.train_batches(step, 1)[0]
        x = b["input_ids"] if "input_ids" in b else b.get("images")
        y = b["targets"] if "targets" in b else b.get("labels")
        return x.to(self.device), y.to(self.device)


def gradient_tails(model, batches, n_batches: int, max_entries: int, seed: int = 0) -> dict:
    """Entry and noise statistics per matrix kind (see :mod:`difftx.analysis.tail_study`); no per-layer detail."""
    from ..analysis.tail_study import measure

    res = measure(model, batches, start=1 << 30, n_batches=n_batches, max_entries=max_entries, seed=seed)
    model.zero_grad(set_to_none=True)
    keep = ("q99_9_over_q50", "max_over_rms", "excess_kurtosis", "hill", "rms")
    return {
        "kinds": res["kinds"],
        "entries": {k: {**{s: v[s] for s in keep if s in v}, "histogram": v["histogram"]}
                    for k, v in res["entries"].items()},
        "noise": {k: {s: v[s] for s in ("alpha_mohammadi", "hill", "q99_9_over_q50")} for k, v in res["noise"].items()},
    }


# ----------------------------------------------------------------------------- retrieval attention
def mqar_samples(n: int, seq_len: int, vocab: int, pairs: int, seed: int = 0):
    """MQAR sequences as retrieval samples with token regions (one scored query each, drawn at random)."""
    from ..evals.common import rng_for
    from ..evals.mqar import mqar_example
    from ..evals.niah import ANSWER, ANSWER_NEEDLE, NOISE, OTHER_NEEDLE, QUERY, NiahSample

    out = []
    for i in range(n):
        rng = rng_for(seed, seq_len, pairs, i, 0xA77)
        x, y = mqar_example(rng, seq_len, pairs, vocab)
        queries = np.flatnonzero(y != -100)
        q = int(queries[rng.integers(len(queries))])
        ctx = 2 * pairs
        j = int(np.flatnonzero(x[:ctx:2] == x[q])[0]) * 2  # the key's position in the context
        regions = [NOISE] * seq_len
        for p in range(ctx):
            regions[p] = OTHER_NEEDLE
        regions[j], regions[j + 1] = ANSWER_NEEDLE, ANSWER
        for p in queries:
            if p <= q:
                regions[int(p)] = QUERY
        # answers: the value is predicted at row q (as a needle's number would be at the row before it)
        out.append(NiahSample(ids=x.tolist(), regions=regions, answers=[(q + 1, q + 2)], numbers=[str(int(y[q]))],
                              cities=[], depth=q / seq_len, needles=pairs))
    return out


def mqar_allocation(model, seq_len: int, vocab: int, pairs: int, samples: int, seed: int = 0) -> dict:
    from ..evals.attention import allocation

    return allocation(model, mqar_samples(samples, seq_len, vocab, pairs, seed))
