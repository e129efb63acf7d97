"""MQAR: the generator's structure (Zoology's), an oracle scores 1, the training task is pure."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from difftx.data import ByteTokenizer
from difftx.data.tasks import get_task
from difftx.errors import ConfigError
from difftx.evals.common import rng_for
from difftx.evals.mqar import check_shape, evaluate_mqar, mqar_accuracy, mqar_batch, mqar_example


@pytest.mark.parametrize("random_fill", [True, False])
def test_example_structure(random_fill):
    V, L, D = 256, 128, 16
    for k in range(20):
        x, y = mqar_example(rng_for(k), L, D, V, random_non_queries=random_fill)
        keys, values = x[0:2 * D:2], x[1:2 * D:2]
        assert len(set(keys)) == D and len(set(values)) == D
        assert ((1 <= keys) & (keys < V // 2)).all() and ((V // 2 <= values) & (values < V)).all()
        q = np.nonzero(y != -100)[0]
        assert len(q) == D and (q >= 2 * D).all() and ((q - 2 * D) % 2 == 0).all()
        lookup = dict(zip(keys.tolist(), values.tolist()))
        assert sorted(x[q].tolist()) == sorted(keys.tolist())  # every key queried once
        assert all(lookup[int(x[p])] == int(y[p]) for p in q)
        if not random_fill:
            others = np.setdiff1d(np.arange(2 * D, L), q)
            assert (x[others] == 0).all()


def test_power_law_puts_queries_near_the_context():
    near = np.mean([np.nonzero(mqar_example(rng_for(k), 256, 8, 256, power_a=0.01)[1] != -100)[0].mean()
                    for k in range(30)])
    flat = np.mean([np.nonzero(mqar_example(rng_for(k), 256, 8, 256, power_a=1.0)[1] != -100)[0].mean()
                    for k in range(30)])
    assert near < flat - 20


def test_shape_checks():
    assert check_shape(64, 16, 256) is None
    assert "exceeds" in check_shape(64, 17, 256)
    assert "vocabulary" in check_shape(1024, 200, 256)
    with pytest.raises(ConfigError):
        mqar_example(rng_for(0), 64, 17, 256)


class RecallOracle(torch.nn.Module):
    """Reads the 2D-token context of key-value pairs and predicts a key's value wherever the key recurs."""

    def __init__(self, pairs: int):
        super().__init__()
        self.pairs = pairs
        self.config = SimpleNamespace(vocab_size=256, max_seq_len=4096, positions="rope")
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids, **kw):
        logits = torch.zeros(*ids.shape, 256)
        for b, row in enumerate(ids.tolist()):
            lookup = dict(zip(row[0:2 * self.pairs:2], row[1:2 * self.pairs:2]))
            for t in range(2 * self.pairs, len(row)):
                if row[t] in lookup:
                    logits[b, t, lookup[row[t]]] = 1
        return SimpleNamespace(logits=logits)


def test_oracle_scores_one_and_tiny_model_sweep():
    x, y = mqar_batch(rng_for(1), 8, 64, 8, 256, random_non_queries=False)
    c, t = mqar_accuracy(RecallOracle(8), x, y)
    assert c == t == 64
    from evals_helpers import tiny_model

    r = evaluate_mqar(tiny_model("softmax"), lengths=[32, 64], pairs=[4, 16], samples=4)
    assert [(c["seq_len"], c["pairs"]) for c in r["cells"]] == [(32, 4), (64, 4), (64, 16)]
    assert r["skipped"][0]["seq_len"] == 32 and r["skipped"][0]["pairs"] == 16
    assert 0.0 <= r["overall_accuracy"] <= 1.0


def test_a_cells_accuracy_and_the_overall_one_weigh_each_query_once(monkeypatch):
    """A cell's accuracy is correct / queries; the overall accuracy is over all queries (cells of more queries weigh
    more), not the mean of the cells' accuracies (counts set by hand: a tiny model's are near 0)."""
    from difftx.evals import mqar
    from evals_helpers import tiny_model

    counts = iter([(8, 8), (8, 32)])
    monkeypatch.setattr(mqar, "mqar_accuracy", lambda *a, **k: next(counts))
    r = evaluate_mqar(tiny_model("softmax"), lengths=[64], pairs=[4, 16], samples=2)
    assert [(c["pairs"], c["accuracy"], c["queries"]) for c in r["cells"]] == [(4, 1.0, 8), (16, 0.25, 32)]
    assert r["overall_accuracy"] == pytest.approx(16 / 40)


def test_training_task_is_pure():
    task = get_task("mqar")(ByteTokenizer(), 65, seed=2, pairs="4-8")
    x, y = task.batch(3, step=5, rank=0)
    assert x.shape == y.shape == (3, 65)
    assert torch.equal(x, task.batch(3, step=5, rank=0)[0])
    assert not torch.equal(x, task.batch(3, step=6, rank=0)[0])
    assert not torch.equal(x, task.batch(3, step=5, rank=1)[0])
    assert ((y == -100) | (y >= 128)).all()


def test_mqar_task_names_the_flag_its_caller_gives():
    """The too-short refusal ("seq_len 64, pairs up to 16: ...") named no flag: it names the caller's, with the length
    needed (an odd length uses one token less), and that length is enough."""
    with pytest.raises(ConfigError, match=r"raise --seq-len to 64 or lower pairs") as e:  # difftx train --task mqar
        get_task("mqar")(ByteTokenizer(), 63, 0)
    assert e.value.field == "seq_len"
    with pytest.raises(ConfigError, match=r"raise --retrieval-seq-len to 24 or lower pairs"):
        get_task("mqar")(ByteTokenizer(), 16, 0, pairs="2-6", vocab=64, seq_len_flag="--retrieval-seq-len")
    with pytest.raises(ConfigError, match="needs a sequence length \\(--retrieval-seq-len\\)"):
        get_task("mqar")(ByteTokenizer(), 0, 0, seq_len_flag="--retrieval-seq-len")
    get_task("mqar")(ByteTokenizer(), 64, 0)
    get_task("mqar")(ByteTokenizer(), 24, 0, pairs="2-6", vocab=64, seq_len_flag="--retrieval-seq-len")
    with pytest.raises(ConfigError, match=r"raise vocab to 14 or lower pairs") as e:  # a vocabulary problem: no length
        get_task("mqar")(ByteTokenizer(), 64, 0, pairs="2-6", vocab=8, seq_len_flag="--retrieval-seq-len")
    assert e.value.field == "vocab" and "seq-len" not in str(e.value)
    get_task("mqar")(ByteTokenizer(), 64, 0, pairs="2-6", vocab=14)


@pytest.mark.parametrize("overrides, args, fix, fixed", [
    ({}, dict(lengths=[8, 12], pairs=[4, 8]), "pass --lengths of at least 16 (4 x pairs) or fewer --pairs",
     dict(lengths=[16], pairs=[4])),
    ({}, dict(lengths=[64], pairs=[4], vocab=8), "pass --pairs up to 3 or a larger --vocab",
     dict(lengths=[64], pairs=[3], vocab=8)),
    ({"positions": "learned", "max_seq_len": 64}, dict(lengths=[128], pairs=[4]), "pass --lengths up to 64",
     dict(lengths=[64], pairs=[4])),
])
def test_no_shape_fits_names_the_fix(overrides, args, fix, fixed):
    """'no (length, pairs) shape fits: longer than max_seq_len=64' named the problem and no fix (niah's refusal names
    one); the fix it names now runs."""
    from evals_helpers import tiny_model

    model = tiny_model("diff", **overrides)
    with pytest.raises(ConfigError, match="no \\(length, pairs\\) shape fits") as e:
        evaluate_mqar(model, samples=1, **args)
    assert str(e.value).endswith(fix)
    assert evaluate_mqar(model, samples=1, **fixed)["cells"]
