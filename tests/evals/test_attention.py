"""Attention allocation: shares of hand-set maps, and of real models whose maps are known (uniform)."""

import pytest
import torch

from difftx.data import ByteTokenizer
from difftx.evals.attention import allocation, evaluate_attention, normalize_rows, region_shares
from difftx.evals.common import rng_for
from difftx.evals.niah import REGION_NAMES, NiahBuilder
from evals_helpers import haystack_text, tiny_model

TOK = ByteTokenizer()


def test_region_shares_of_a_hand_set_map():
    eff = torch.zeros(1, 2, 4, 4)
    eff[0, 0, 3] = torch.tensor([0.1, 0.2, 0.3, 0.4])  # a softmax row
    eff[0, 1, 3] = torch.tensor([0.5, -0.1, 0.4, 0.0])  # a differential row: L1 mass 1.0, signed mass 0.8
    regions = torch.tensor([[0, 1, 1, 4]])
    idx, w = torch.tensor([[3]]), torch.tensor([[1]])
    s, mass = region_shares(eff, idx, w, regions, 5, "l1")
    assert torch.allclose(s[0], torch.tensor([0.3, 0.4, 0.0, 0.0, 0.2]))
    assert torch.allclose(mass, torch.tensor([0.9]))
    s, _ = region_shares(eff, idx, w, regions, 5, "rowsum")
    assert torch.allclose(s[0], torch.tensor([(0.1 + 0.5 / 0.8) / 2, (0.5 + 0.3 / 0.8) / 2, 0, 0, 0.2]))
    s, _ = region_shares(eff, idx, w, regions, 5, "positive")
    assert torch.allclose(s[0], torch.tensor([(0.1 + 0.5 / 0.9) / 2, (0.5 + 0.4 / 0.9) / 2, 0, 0, 0.2]))
    # a padded query row (weight 0) changes nothing
    s2, _ = region_shares(eff, torch.tensor([[3, 0]]), torch.tensor([[1, 0]]), regions, 5, "positive")
    assert torch.allclose(s2, s)


def test_normalize_rows_softmax_unchanged():
    rows = torch.softmax(torch.randn(3, 7), -1)
    for how in ("l1", "rowsum", "positive"):
        assert torch.allclose(normalize_rows(rows, how), rows, atol=1e-6)


def _uniform_attention_model(kind):
    model = tiny_model(kind)
    with torch.no_grad():
        for m in model.attention_modules():
            m.q_proj.weight.zero_()  # all logits 0: every query attends uniformly to its causal prefix
    return model


@pytest.mark.parametrize("kind", ["softmax", "diff", "diff2"])
def test_allocation_of_uniform_attention_is_known(kind):
    model = _uniform_attention_model(kind)
    b = NiahBuilder(TOK, text=haystack_text())
    samples = [b.sample(rng_for(9, k), 200 + 10 * k, 2, 1, depth=0.5) for k in range(3)]  # unequal lengths: padding
    res = allocation(model, samples, "l1", batch_size=2)
    expect = torch.zeros(len(REGION_NAMES))
    for s in samples:
        a, e = s.answers[0]
        lead = 1 if TOK.decode([s.ids[a]]).isspace() else 0  # the rows predict the number, not the space before it
        assert lead == 1  # a byte tokenizer's answer ' 12345' starts with its lone ' '
        reg = torch.tensor(s.regions)
        per_row = [torch.bincount(reg[:p + 1], minlength=len(REGION_NAMES)).float() / (p + 1)
                   for p in range(a - 1 + lead, e - 1)]
        expect += torch.stack(per_row).mean(0) / len(samples)
    for layer in res["by_layer"]:
        got = torch.tensor([layer[name] for name in REGION_NAMES])
        assert torch.allclose(got, expect, atol=1e-5), (kind, layer)
        if kind == "softmax":
            assert abs(layer["row_mass"] - 1.0) < 1e-5
    if kind == "diff":
        lams = model.lambdas()
        for layer, lam in zip(res["by_layer"], lams):
            assert abs(layer["row_mass"] - (1 - lam)) < 1e-5


def test_evaluate_attention_reports_every_depth_and_layer():
    r = evaluate_attention(tiny_model("diff"), TOK, depths=[0.0, 1.0], length=160, samples=2, text=haystack_text())
    assert r["depths"] == [0.0, 1.0] and len(r["table"]["answer"]) == 2
    assert [x["layer"] for x in r["by_layer"]] == [1, 2]
    assert set(r["mean"]) == set(REGION_NAMES)
    # the summaries are the means they are said to be: a depth's over its layers, the table's row per depth, a
    # layer's over the depths, the overall over the depths
    approx = lambda v: pytest.approx(v, rel=1e-9, abs=1e-12)  # noqa: E731
    for name in (*REGION_NAMES, "row_mass"):
        per = [[row["by_layer"][i][name] for i in range(2)] for row in r["by_depth"]]  # [depth][layer]
        if name != "row_mass":
            assert [row["mean"][name] for row in r["by_depth"]] == approx([sum(p) / 2 for p in per])
            assert r["table"][name] == [row["mean"][name] for row in r["by_depth"]]
            assert r["mean"][name] == approx(sum(r["table"][name]) / 2)
        assert [x[name] for x in r["by_layer"]] == approx([(per[0][i] + per[1][i]) / 2 for i in range(2)])
    # with teeth: the layers and the depths differ
    per = [[row["by_layer"][i]["answer"] for i in range(2)] for row in r["by_depth"]]
    assert per[0][0] != per[0][1] and per[0][0] != per[1][0] and r["table"]["answer"][0] != r["table"]["answer"][1]


def test_a_depths_samples_do_not_depend_on_the_other_depths_asked_for():
    """The samples of a depth were drawn from its position in --depths: 50% alone and 50% beside 0% were measured
    on different needles and haystacks (neither run reproduced the other's 50% column)."""
    model, text = tiny_model("diff"), haystack_text()
    alone = evaluate_attention(model, TOK, depths=[0.5], length=160, samples=2, text=text, seed=3)
    both = evaluate_attention(model, TOK, depths=[0.0, 0.5], length=160, samples=2, text=text, seed=3)
    assert both["by_depth"][1]["mean"] == alone["by_depth"][0]["mean"]
