"""Gradient-flow bookkeeping and the shared pieces: groups, twins, settings, data, norms, ratios."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import difftx
from difftx.analysis import common, flow
from difftx.errors import ConfigError, DataError

BASE = difftx.ModelConfig.from_preset("nano", d_model=32, n_layers=2, max_seq_len=32)


@pytest.fixture(scope="module")
def batches():
    return common.Batches(common.tokenize(common.load_text(max_bytes=50_000), 256), seq_len=16, batch_size=2, seed=0)


def test_every_block_parameter_has_a_flow_group():
    for setting in ("S1", "S5", "diff", "diff-S5", "diff2"):
        model = difftx.build_model(common.setting_config(BASE, setting))
        groups = {}
        for name, _ in model.named_parameters():
            layer, g = common.flow_group(name)
            if layer is not None:
                assert g in common.FLOW_GROUPS, (setting, name, g)
                groups.setdefault(g, []).append(name)
        assert ("lambda" in groups) == setting.startswith("diff"), setting
        assert {"W_Q", "W_K", "W_V", "W_O", "FFN", "norms"} <= set(groups)


def test_matrix_kinds():
    assert common.matrix_kind("layers.3.attn.q_proj.weight") == (3, "W_q")
    assert common.matrix_kind("layers.0.ffn.w_down.weight") == (0, "W_2")
    assert common.matrix_kind("layers.0.attn.q_proj.bias") is None
    assert common.matrix_kind("lm_head.weight") is None


def test_setting_configs_follow_the_dnt_table():
    s = {name: common.setting_config(BASE, name) for name in ("S1", "S2", "S3", "S4", "S5", "diff", "diff-S5")}
    flags = lambda c: (c.input_norm, c.pre_norm_attn, c.pre_norm_ffn, c.qk_norm, c.mid_norm_attn,  # noqa: E731
                       c.mid_norm_ffn)
    assert flags(s["S1"]) == (False, True, True, False, False, False)
    assert flags(s["S2"]) == (False, True, True, True, False, False)
    assert flags(s["S3"]) == (True, True, True, True, False, False)
    assert flags(s["S4"]) == (True, True, True, True, True, True)
    assert flags(s["S5"]) == (True, True, False, True, True, True)
    assert s["diff"].attention == "diff" and s["diff"].n_heads == BASE.n_heads // 2 and s["diff"].norms == "S1"
    assert flags(s["diff-S5"]) == flags(s["S5"]) and s["diff-S5"].attention == "diff"
    with pytest.raises(ConfigError, match="S9"):
        common.setting_config(BASE, "S9")


def test_every_setting_the_docs_and_help_name_is_accepted_and_a_bare_dash_is_not():
    """--help and gradients.md named only diff-S5; diff-S1..diff-S4, diff2, post and KIND-PLACEMENT are accepted too.
    "diff-" was taken as "diff" (its rows named "diff-")."""
    from pathlib import Path

    from difftx.cli.grads import SETTINGS_ACCEPTED

    assert SETTINGS_ACCEPTED == common.SETTINGS_ACCEPTED  # the CLI's copy (it parses without torch)
    docs = (Path(__file__).resolve().parents[2] / "docs" / "gradients.md").read_text()
    assert "diff-S1..diff-S5" in SETTINGS_ACCEPTED and "`diff-S1`..`diff-S5`" in docs
    for name, attention, norms in (("diff-S1", "diff", "S1"), ("diff-S4", "diff", "S4"), ("diff2-S5", "diff2", "S5"),
                                   ("softmax-post", "softmax", "post"), ("dnt", "softmax", "dnt"),
                                   ("pre", "softmax", "pre"), ("diff2", "diff2", "S1")):
        cfg = common.setting_config(BASE, name)
        assert (cfg.attention, cfg.norms) == (attention, norms), name
        if name != "diff-S4":  # in diff-S1..diff-S5
            assert name in SETTINGS_ACCEPTED and f"`{name}`" in docs, name
    for bad in ("diff-", "softmax-", "diff2-"):
        with pytest.raises(ConfigError, match=f"'{bad}'.*diff-S1..diff-S5"):
            common.setting_config(BASE, bad)


def test_twins_are_matched_and_paired():
    models = flow.twin_models(BASE, seed=0, paired=True)
    t, d = models["transformer"], models["diff"]
    cfg = d.config
    extra = cfg.n_layers * (4 * cfg.head_dim + 2 * cfg.head_dim)  # lambda vectors + the per-head norm gain
    assert d.num_parameters() - t.num_parameters() == extra
    dp = dict(d.named_parameters())
    shared = [n for n, p in t.named_parameters() if n in dp and dp[n].shape == p.shape]
    assert "layers.0.attn.q_proj.weight" in shared and "embed.weight" in shared
    for n in shared:
        assert torch.equal(dict(t.named_parameters())[n], dp[n]), n
    unpaired = flow.twin_models(BASE, seed=0, paired=False)
    assert not torch.equal(unpaired["diff"].layers[0].attn.q_proj.weight, t.layers[0].attn.q_proj.weight)


def test_a_diff2_base_is_compared_as_itself(batches):
    """A DIFF V2 base gets its softmax baseline as twin, not a DIFF V1 model in its place."""
    models = flow.twin_models(BASE.twin("diff2"), seed=0)
    assert models["diff"].config.attention == "diff2" and models["transformer"].config.attention == "softmax"
    assert models["transformer"].config.n_heads == models["diff"].config.n_heads  # diff2 keeps the baseline's heads
    assert torch.equal(models["diff"].layers[0].attn.k_proj.weight, models["transformer"].layers[0].attn.k_proj.weight)
    res = flow.run_flow(models, batches, steps=1)
    assert res["models"]["diff"]["attention"] == "diff2" and len(res["models"]["diff"]["lambdas"]) == 2
    assert set(res["ratio"]["init"]["all"]) == {"W_Q", "W_K", "W_V", "W_O", "FFN", "norms"}


def test_group_grad_norms_match_direct_computation(batches):
    model = difftx.build_model(common.setting_config(BASE, "diff"))
    x, y = batches.batch(0)
    common.loss_backward(model, x, y)
    g = common.group_grad_norms(model, 2)
    a = model.layers[1].attn
    lam = math.sqrt(sum(float(getattr(a, n).grad.double().pow(2).sum())
                        for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")))
    assert g["layers"][1]["lambda"] == pytest.approx(lam, rel=1e-12)
    assert g["layers"][0]["W_Q"] == pytest.approx(float(model.layers[0].attn.q_proj.weight.grad.norm()), rel=1e-6)
    total = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    assert g["total"] == pytest.approx(total, rel=1e-12)
    assert g["all"]["W_O"] == pytest.approx(math.hypot(g["layers"][0]["W_O"], g["layers"][1]["W_O"]), rel=1e-12)


def test_run_flow_ratios_are_diff_over_transformer(batches):
    res = flow.run_flow(flow.twin_models(BASE, seed=1), batches, steps=2, lr=1e-3)
    json.dumps(res)  # serialisable as written by the CLI
    d, t = res["models"]["diff"]["grad_norms"], res["models"]["transformer"]["grad_norms"]
    assert len(d) == len(t) == 3
    for step in range(3):
        for g in ("W_Q", "W_K", "W_V", "W_O", "FFN"):
            assert res["ratio"]["per_step"][step]["all"][g] == pytest.approx(d[step]["all"][g] / t[step]["all"][g])
    assert "lambda" in d[0]["all"] and "lambda" not in t[0]["all"] and "lambda" not in res["ratio"]["init"]["all"]
    early = res["ratio"]["early"]["all"]["W_V"]
    vals = sorted(r["all"]["W_V"] for r in res["ratio"]["per_step"][1:])
    assert early == pytest.approx(sum(vals) / 2)  # median of two
    table = flow.flow_table(res)
    assert "| W_Q |" in table and "| lambda |" in table and "L2 at init" in table


def test_batches_are_a_function_of_seed_and_step():
    toks = np.arange(1000) % 256
    b = common.Batches(toks, 8, 3, seed=5)
    x1, y1 = b.batch(7)
    x2, y2 = common.Batches(toks, 8, 3, seed=5).batch(7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # next-token targets
    assert not torch.equal(b.batch(8)[0], x1)


def test_batches_draw_every_window_the_last_one_too():
    # 10 tokens, seq_len 8: windows of 9 tokens start at 0 or 1, and both must be drawn
    toks = np.arange(10)
    b = common.Batches(toks, 8, 4, seed=0)
    starts = {int(b.batch(s)[0][i, 0]) for s in range(20) for i in range(4)}
    assert starts == {0, 1}
    one = common.Batches(np.arange(9), 8, 2, seed=0).batch(0)  # exactly one window
    assert one[1][0].tolist() == list(range(1, 9))
    with pytest.raises(DataError, match="fewer than seq_len"):
        common.Batches(np.arange(8), 8, 2)


def test_tokenize_checks_the_vocabulary():
    from difftx.data.tokenizers import CharTokenizer

    assert common.tokenize("héllo", 256).tolist() == list("héllo".encode())
    tok = CharTokenizer("helo ")
    assert common.tokenize("hello, world", tok.vocab_size, tok).tolist() == tok.encode("hello ol")
    with pytest.raises(DataError, match="vocabulary"):
        common.tokenize("hello", 100)
    with pytest.raises(DataError, match="not found"):
        common.load_text("/nonexistent/file.txt")


def test_median_ratios_skip_a_diverged_steps_nan():
    """The step a run diverged at gives NaN ratios; statistics.median sorted them in anywhere, so the 'early' ratio
    depended on where the NaN stood (1.0 or 2.0 for the same three values)."""
    def step(v):
        return {"all": {"W_Q": v}, "layers": [{"W_Q": v}], "total": v}

    for order in ([1.0, 2.0, math.nan], [math.nan, 1.0, 2.0], [2.0, math.nan, 1.0]):
        med = flow._median_ratios([step(v) for v in order])
        assert med["all"]["W_Q"] == med["layers"][0]["W_Q"] == med["total"] == 1.5, (order, med)


def test_flow_table_of_a_diverged_run_does_not_label_its_last_norms_as_the_last_step(batches):
    res = flow.run_flow({"m": common.build(BASE, 0)}, batches, steps=4, optimizer="msgdw", lr=1e30, clip=0.0)
    m = res["models"]["m"]
    assert m["diverged"] and len(m["grad_norms"]) < 5
    row = next(line for line in flow.flow_table(res).splitlines() if line.startswith("| m | W_Q |"))
    assert f"diverged at step {len(m['grad_norms']) - 1}" in row, row


def test_the_pair_table_names_the_steps_its_early_ratio_covers(batches):
    """A pair where one model diverged: the early ratio is a median over the steps both reached, which the header
    said were steps 1-K whatever happened."""
    diff = BASE.replace(attention="diff", n_heads=BASE.n_heads // 2)
    models = {"diff": common.build(diff, 0), "transformer": common.build(BASE, 0)}
    res = flow.run_flow(models, batches, steps=4, optimizer="msgdw", lr=1e30, clip=0.0)
    k = len(res["ratio"]["per_step"]) - 1
    assert k < 4
    header = flow.flow_table(res).splitlines()[0]
    assert f"ratio steps 1-{k} (of 4: a model diverged)" in header, header
