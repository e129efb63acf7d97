"""The tail study's gradient sampling and bookkeeping on tiny models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import difftx
from difftx.analysis import common, tail_study

BASE = difftx.ModelConfig.from_preset("nano", d_model=32, n_layers=2, max_seq_len=32)


@pytest.fixture(scope="module")
def batches():
    return common.Batches(common.tokenize(common.load_text(max_bytes=50_000), 256), seq_len=16, batch_size=2, seed=0)


def test_sampled_gradients_are_the_per_batch_gradients(batches):
    model = common.build(common.setting_config(BASE, "diff"), seed=0)
    means, samples, subsets = tail_study.sample_gradients(model, batches, start=3, n_batches=3, max_entries=50,
                                                          seed=1)
    assert list(samples) == ["W_q", "W_k", "W_v", "W_o", "W_g", "W_1", "W_2"]
    assert samples["W_q"].shape == (3, 50)
    # the mean gradient is the gradient of the mean loss over the same batches (linearity)
    model.zero_grad()
    losses = []
    for b in range(3):
        x, y = batches.batch(3 + b)
        losses.append(model(x, targets=y).loss)
    (sum(losses) / 3).backward()
    np.testing.assert_allclose(means[(1, "W_k")], model.layers[1].attn.k_proj.weight.grad.double().numpy(),
                               rtol=1e-5, atol=1e-9)
    # each sampled row is one batch's gradient at fixed coordinates: their mean is the mean gradient there
    flat = np.concatenate([means[(i, "W_k")].reshape(-1) for i in range(2)])
    np.testing.assert_allclose(samples["W_k"].mean(axis=0), flat[subsets["W_k"]], rtol=1e-5, atol=1e-9)


def test_measure_reports_every_kind_and_gelu_has_no_gate(batches):
    gelu = common.build(BASE.replace(ffn="gelu"), seed=0)
    m = tail_study.measure(gelu, batches, start=0, n_batches=3, max_entries=64)
    assert m["kinds"] == ["W_q", "W_k", "W_v", "W_o", "W_1", "W_2"]
    for k in m["kinds"] + ["all"]:
        assert m["entries"][k]["n"] > 0 and np.isfinite(m["entries"][k]["q99_9_over_q50"])
        assert m["noise"][k]["n"] > 0
    assert len(m["entries"]["W_q"]["by_layer"]) == 2


def test_run_tail_study_rows_and_zero_steps(batches):
    cands = [(s, (lambda c=common.setting_config(BASE, s): common.build(c, 0))) for s in ("S1", "diff")]
    res = tail_study.run_tail_study(cands, batches, ["adamw", "msgdw"], steps=2, noise_batches=2, max_noise_entries=32)
    assert [(r["setting"], r["optimizer"]) for r in res["rows"]] == [
        ("S1", "adamw"), ("S1", "msgdw"), ("diff", "adamw"), ("diff", "msgdw")]
    assert all(not r["diverged"] and "entries" in r for r in res["rows"])
    # the optimiser matters: same init, same batches, different weights after two steps
    assert res["rows"][0]["entries"]["W_q"]["rms"] != res["rows"][1]["entries"]["W_q"]["rms"]
    at_init = tail_study.run_tail_study(cands[:1], batches, ["adamw", "msgdw"], steps=0, noise_batches=2,
                                        max_noise_entries=32)
    assert [r["optimizer"] for r in at_init["rows"]] == ["none"]
    table = tail_study.tails_table(res, "alpha_mohammadi", "noise")
    assert table.count("\n") == 5 and "| diff | msgdw |" in table


def test_divergence_is_recorded_not_raised(batches):
    cands = [("S1", lambda: common.build(BASE, 0))]
    res = tail_study.run_tail_study(cands, batches, ["msgdw"], steps=3, lrs={"msgdw": 1e30}, clip=0.0,
                                    noise_batches=2, max_noise_entries=32)
    row = res["rows"][0]
    assert row["diverged"] and "entries" not in row
    assert "diverged" in tail_study.tails_table(res)


def test_tables_merge_seeds_into_mean_and_sd():
    rows = [{"setting": "S1", "optimizer": "adamw", "loss_last": v, "entries": {"W_q": {"hill": v}}}
            for v in (1.0, 3.0)]
    table = tail_study.tails_table({"rows": rows}, "hill")
    assert "2 ± 1.4" in table


def test_sampling_leaves_no_gradients_behind(batches):
    model = common.build(BASE, 0)
    tail_study.sample_gradients(model, batches, 0, 2, 16)
    assert all(p.grad is None for p in model.parameters())
    assert torch.is_grad_enabled()


def test_nonfinite_gradients_at_the_measurement_are_recorded_as_diverged(batches):
    """Weights that give NaN gradients at the measurement batches: a diverged row, no statistics, no crash."""
    def broken():
        model = common.build(BASE, 0)
        with torch.no_grad():
            model.layers[0].attn.q_proj.weight[0, 0] = float("nan")
        return model

    assert tail_study.measure(broken(), batches, 0, 2, 32)["nonfinite_gradients"]
    res = tail_study.run_tail_study([("S1", broken), ("ok", lambda: common.build(BASE, 0))], batches, ["adamw"],
                                    steps=0, noise_batches=2, max_noise_entries=32)
    bad, good = res["rows"]
    assert bad["diverged"] and bad["nonfinite_gradients"] and "entries" not in bad and "noise" not in bad
    assert not good.get("diverged") and np.isfinite(good["noise"]["W_q"]["alpha_mohammadi"])
    assert "| S1 | none | - (1 diverged) |" in tail_study.tails_table(res)
