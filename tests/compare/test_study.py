"""The miniature study end to end: outputs, report numbers = results.json, matched arms, seeds, reproducibility."""

from __future__ import annotations

import json
import re
import statistics

import pytest
import torch

from difftx.compare import StudyConfig
from difftx.compare.jobs import Job, plan, train_config
from difftx.compare.report import ms, num, render
from difftx.compare.results import compare, stat


def _row(report: str, label: str, after: str) -> str:
    """The table row of ``label`` in the first table after the heading ``after``."""
    section = report[report.index(after):]
    return next(line for line in section.splitlines() if line.startswith(f"| {label} |"))


def test_outputs_are_self_contained(mini_study):
    out, res, p = mini_study
    for name in ("study.json", "results.json", "report.md", "loss_curves.png", "retrieval.png", "attention.png",
                 "grad_hist.png"):
        assert (out / name).is_file(), name
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = sorted((out / "runs").glob("*/*/*"))
    assert len(runs) == 2 * 3 * 2  # tasks x arms x seeds
    for run in runs:  # every job is an ordinary training run dir with its config, metrics and measurements
        assert {"config.json", "metrics.jsonl", "job.json", "tokenizer.json"} <= {f.name for f in run.iterdir()}
    assert "report.md" in p.stdout


def test_report_is_a_function_of_results_json(mini_study):
    out, _, _ = mini_study
    res = json.loads((out / "results.json").read_text(encoding="utf-8"))  # as on disk (a resume rewrites it)
    pictures = tuple(f.name for f in out.glob("*.png"))
    assert render(res, pictures) == (out / "report.md").read_text(encoding="utf-8")


def test_report_numbers_equal_results_json(mini_study):
    out, _, _ = mini_study
    res = json.loads((out / "results.json").read_text(encoding="utf-8"))
    report = (out / "report.md").read_text(encoding="utf-8")
    for arm, info in res["arms"].items():
        label = info["label"]
        c = res["corpus"][arm]
        row = _row(report, label, "## Arms")
        assert f"{info['params']:,}" in row and f"{info['lr']:g}" in row
        assert c["val_loss"]["n"] == 2
        assert _row(report, label, "## Validation loss").split(" | ")[1] == \
            f"{num(c['val_loss']['mean'])} ± {num(c['val_loss']['sd'])}"
        r = res["retrieval"]["arms"][arm]
        cells = _row(report, label, "## Retrieval").strip("| ").split(" | ")
        assert cells[1:1 + len(res["retrieval"]["cells"])] == \
            [ms(r["cells"][k], lambda v: num(v, 3)) for k in res["retrieval"]["cells"]]
        assert cells[-2] == ms(r["overall"], lambda v: num(v, 3))
        att = _row(report, label, "## Attention allocation")
        assert ms(r["attention"]["answer"], lambda v: num(v, 3)) in att
        speed = _row(report, label, "## Speed and memory")
        assert f"{c['memory']['total_bytes']['mean'] / 2 ** 20:.2f}" in speed
    # the verdicts quoted in the answers are results.json's
    d = res["questions"]["diff_vs_transformer"]
    assert f"Does DIFF beat the Transformer here? {d['answer'].capitalize()}." in report
    assert "3B" in report and "350B tokens" in report  # the papers' scale beside ours


def test_statistics_over_seeds(mini_study):
    _, res, _ = mini_study
    for arm, c in res["corpus"].items():
        v = c["val_loss"]
        assert len(v["values"]) == 2 and v["mean"] == pytest.approx(sum(v["values"]) / 2)
        assert v["min"] <= v["mean"] <= v["max"]
    # a verdict is "clear" only beyond the seed spread
    for q in res["questions"].values():
        for row in q.get("rows", []):
            if row.get("spread") is not None and abs(row["delta"]) <= row["spread"]:
                assert row["verdict"] == "no clear difference"


def test_arms_are_matched_and_see_the_same_data(mini_study):
    out, res, _ = mini_study
    params = [a["params"] for a in res["arms"].values()]
    assert max(params) / min(params) < 1.01
    seed0 = [json.loads(p.read_text())["train"] for p in sorted((out / "runs" / "corpus").glob("*/seed0-*/config.json"))]
    assert len(seed0) == 3
    for key in ("seed", "steps", "batch_size", "seq_len", "data"):
        assert len({json.dumps(c[key]) for c in seed0}) == 1, key
    toks = {res["scale"]["corpus"]["tokens_per_run"]}
    assert toks == {12 * 16 * 64}


def test_rerun_reproduces_a_job(mini_study, tmp_path):
    """The same job (seed, arm, lr) trained again gives the same losses and measurements."""
    from difftx.compare.worker import run_job

    out, res, _ = mini_study
    study = StudyConfig.from_dict(json.loads((out / "study.json").read_text())["study"])
    job = next(j for j in plan(study) if j.task == "corpus" and j.arm.id == "diff-adamw" and j.seed == 1)
    first = json.loads((job.run_dir(out) / "job.json").read_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(first["train"]["threads"])  # CPU kernels may reduce in a thread-dependent order
    try:
        again = run_job(study, job, tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert again["final"] == first["final"]
    assert again["curve"]["val"] == first["curve"]["val"]
    assert again["outliers"] == first["outliers"]
    assert again["memory"]["state_bytes"] == first["memory"]["state_bytes"]


def test_compare_verdicts():
    a, b = stat([1.0, 1.1]), stat([1.5, 1.6])
    assert compare(a, b, higher_is_better=False)["verdict"] == "better"
    # two seeds: a difference must clear 2.5 seed spreads (0.45 against a spread of 0.2 was "better")
    assert compare(stat([1.0, 1.2]), b, higher_is_better=False)["verdict"] == "no clear difference"
    assert compare(stat([1.0, 1.2, 1.1]), stat([1.5, 1.6, 1.55]), higher_is_better=False)["verdict"] == "better"
    assert compare(stat([1.0, 1.6]), b, higher_is_better=False)["verdict"] == "no clear difference"
    assert "one seed" in compare(stat([1.0]), stat([2.0]), False)["verdict"]
    # a diverged run (None) is a result: its arm is the worse one, whatever the other seeds say
    assert compare(stat([None, None]), b, False)["verdict"] == "worse (2 of 2 runs of a diverged or were not measured)"
    assert compare(stat([1.0, None]), b, False)["verdict"].startswith("worse (1 of 2 runs of a")
    assert compare(b, stat([1.0, float("nan")]), False)["verdict"].startswith("better (1 of 2 runs of b")
    assert compare(stat([None, 1.0]), stat([1.0, None]), False)["verdict"].startswith("not comparable")
    from difftx.compare.results import _summary

    assert _summary([compare(stat([None, None]), b, False)["verdict"], "no clear difference"]) == "no"


def test_budget_is_the_same_for_every_arm():
    study = StudyConfig(tokens=100_000, retrieval_tokens=50_000)
    jobs = plan(study)
    assert {j.steps for j in jobs if j.task == "corpus"} == {98}  # ceil(100000 / (16 * 64))
    tcfgs = [train_config(study, j) for j in jobs if j.task == "corpus" and j.seed == 0]
    assert len({(t.seed, t.steps, t.batch_size, t.seq_len) for t in tcfgs}) == 1
    assert {t.optimizer for t in tcfgs} == {"adamw", "msgdw"}
    assert isinstance(jobs[0], Job) and re.fullmatch(r"corpus/[a-z-]+/seed0-lr[0-9.e-]+", jobs[0].key)


@pytest.mark.parametrize("domain,preset", [("lm", "nano"), ("lm", "gpt2-124m"), ("vision", "vit-tiny")])
def test_arms_differ_only_in_what_they_name(domain, preset):
    """Every arm keeps the base's initialisation: the DNT arms set Xavier on their own before, so on a base
    with GPT-2's normal init, DNT against the Transformer compared two inits as well as two norm placements
    (DNT Table 5 trains both with one)."""
    from difftx.compare.arms import MODELS, Arm

    study = StudyConfig(domain=domain, preset=preset)
    base = study.base_config().twin("softmax")
    named = {"norms", "norm", "input_norm", "pre_norm_ffn", "pre_norm_attn", "qk_norm", "mid_norm_attn",
             "mid_norm_ffn"}
    for name, model in MODELS[domain].items():
        cfg = study.model_config(Arm(name, "adamw", domain))
        same_attention = base.twin(model.attention).to_dict()
        differ = {k for k, v in cfg.to_dict().items() if v != same_attention[k]}
        assert differ <= named, (name, differ)
        assert cfg.init == base.init


def test_lambdas_of_seeds_that_recorded_none():
    """DIFF V2's lambda is None until a forward pass records it: a study with a diff2 arm builds its results
    (the mean per layer over the seeds that have one) instead of failing on fmean(None)."""
    from difftx.compare.results import corpus_arm

    runs = [{"job": {"seed": 0}, "lambdas": [None, None]}, {"job": {"seed": 1}, "lambdas": [None, None]}]
    assert corpus_arm(runs, "lm")["lambdas"] == [None, None]
    runs = [{"job": {"seed": 0}, "lambdas": [0.2, None]}, {"job": {"seed": 1}, "lambdas": [0.4, 0.5]}]
    assert corpus_arm(runs, "lm")["lambdas"] == pytest.approx([0.3, 0.5])


def test_lr_sweep_never_chooses_a_non_finite_loss():
    """A sweep run whose final validation loss is NaN (the last update broke the weights after the trainer's
    finiteness check) loses: it was kept as the best lr when it came first, since NaN < x is False.  Read back
    from job.json (a resumed study) the same NaN is null and lost, so resuming changed the chosen lr."""
    from difftx.compare.jobs import sweep_plan
    from difftx.compare.results import choose_lrs

    study = StudyConfig(arms=["transformer:adamw"], steps=4, retrieval="none", lr_sweep={"adamw": [1e-3, 2e-3, 4e-3]})
    jobs = sweep_plan(study)
    losses = [float("nan"), 2.5, 2.0]
    results = {j.key: {"final": {"val_loss": v}, "diverged": False} for j, v in zip(jobs, losses)}
    assert choose_lrs(study, jobs, results) == {"transformer-adamw": 4e-3}
    results[jobs[2].key]["final"]["val_loss"] = float("inf")
    assert choose_lrs(study, jobs, results) == {"transformer-adamw": 2e-3}


def test_a_value_a_finished_run_did_not_measure_is_not_called_diverged():
    """A GPU run has no CPU rate and a job resumed after its last step trained none in its last process: the
    report called such seeds "diverged" (every arm's tok/CPU-s of a GPU study read "diverged")."""
    from difftx.compare.results import corpus_arm

    def run(seed, diverged=False, cuda=False, steps=8):
        r = {"job": {"seed": seed, "steps": 8}, "diverged": diverged,
             "curve": {"tokens_per_step": 64.0, "train": [], "val": [[8, 2.0, None]]},
             "train": {"cpu_s": 2.0, "steps": steps}, "throughput": {"per_s": 100.0, "unit": "tok"},
             "memory": {"state_bytes": 1, "step_bytes": 1, "total_bytes": 2,
                        "method": "torch.cuda.max_memory_allocated" if cuda else "profiler"}}
        if not diverged:
            r["final"] = {"val_loss": 2.0 + seed / 10}
        return r

    gpu = corpus_arm([run(0, cuda=True), run(1, cuda=True)], "lm")
    assert gpu["throughput_cpu"]["n"] == 0 and ms(gpu["throughput_cpu"]) == "-"
    resumed = corpus_arm([run(0), run(1, steps=0)], "lm")
    assert ms(resumed["throughput_cpu"]) == f"{num(256.0)} (1 not measured)"
    # the resumed run's CPU time is its last process's only: not the run's (it read 2.0 s for the whole run)
    assert ms(resumed["train_cpu_s"]) == f"{num(2.0)} (1 not measured)"
    assert ms(corpus_arm([run(0), run(1, steps=3)], "lm")["train_cpu_s"]) == f"{num(2.0)} (1 not measured)"
    assert ms(resumed["val_loss"]) == f"{num(2.05)} ± {num(statistics.stdev([2.0, 2.1]))}"
    lost = corpus_arm([run(0), run(1, diverged=True)], "lm")
    assert ms(lost["val_loss"]) == f"{num(2.0)} (1 diverged)"
    assert ms(corpus_arm([run(0, diverged=True), run(1, diverged=True)], "lm")["val_loss"]) == "diverged"
    assert ms(stat([1.0, None])) == f"{num(1.0)} (1 diverged)"  # results.json of older versions: as before


def test_an_arm_whose_runs_all_diverged_stays_in_the_outlier_and_tail_tables():
    """Its runs have no measurements: the arm was left out of the activation-outlier and gradient-tail tables
    without a word (docs/compare.md: a diverged run is reported as diverged, not dropped)."""
    from difftx.compare.report import outliers_section, tails_section
    from difftx.compare.results import corpus_arm

    def run(seed, diverged):
        r = {"job": {"seed": seed, "steps": 8}, "diverged": diverged}
        if not diverged:
            r["outliers"] = {k: {"top1": 9.0, "top10": 5.0, "median": 1.0}
                             for k in ("attention_logits", "hidden_states")}
            r["tails"] = {"entries": {"all": {"q99_9_over_q50": 20.0, "hill": 2.0}},
                          "noise": {"all": {"alpha_mohammadi": 1.7}}}
        return r

    res = {"arms": {"transformer-adamw": {"label": "T"}, "dnt-adamw": {"label": "D"}},
           "corpus": {"transformer-adamw": corpus_arm([run(0, False), run(1, False)], "lm"),
                      "dnt-adamw": corpus_arm([run(0, True), run(1, True)], "lm")}}
    tables = (outliers_section(res), tails_section(res, "entries_q99_9_over_q50"), tails_section(res, "noise_alpha"))
    for table in tables:
        assert "| T | 9" in table or "| T | 20" in table or "| T | 1.7" in table, table
        assert any(line.startswith("| D | diverged |") for line in table.splitlines()), table
    res["corpus"]["dnt-adamw"]["diverged"] = 0  # a vision study measures no outliers: still no table
    res["corpus"]["transformer-adamw"].pop("outliers")
    assert outliers_section(res) is None


def test_an_arm_whose_runs_all_diverged_is_the_worse_one_in_every_comparison():
    """One diverged run of two made DIFF the worse arm on attention and outliers; both diverged, and those comparisons
    vanished from the answers and the verdicts (the arm has no entry for a metric none of its runs measured), though
    docs/compare.md says an arm that lost runs is the worse one in every comparison of that metric."""
    from difftx.compare.results import corpus_arm, questions, retrieval_arm

    def run(seed, diverged, task):
        r = {"job": {"seed": seed, "steps": 8}, "diverged": diverged}
        if not diverged and task == "corpus":
            r["final"] = {"val_loss": 2.0 + seed / 10}
            r["outliers"] = {k: {"top1": 9.0 + seed, "top10": 5.0, "median": 1.0}
                             for k in ("attention_logits", "hidden_states")}
        elif not diverged:
            r["final"] = {"val_loss": 1.0}
            r["retrieval"] = {"cells": {"N2@64": 0.5}, "overall": 0.5 + seed / 10}
            r["attention"] = {"mean": {"answer": 0.2 + seed / 10, "noise": 0.1}}
        return r

    study = StudyConfig(arms=["transformer:adamw", "diff:adamw"], steps=8)
    verdicts = {}
    for lost in (1, 2):
        diff = [s >= 2 - lost for s in range(2)]
        corpus = {"transformer-adamw": corpus_arm([run(s, False, "corpus") for s in range(2)], "lm"),
                  "diff-adamw": corpus_arm([run(s, d, "corpus") for s, d in enumerate(diff)], "lm")}
        retrieval = {"arms": {"transformer-adamw": retrieval_arm([run(s, False, "retrieval") for s in range(2)]),
                              "diff-adamw": retrieval_arm([run(s, d, "retrieval") for s, d in enumerate(diff)])}}
        rows = questions(study, corpus, retrieval)["diff_vs_transformer"]["rows"]
        verdicts[lost] = {r["metric"]: r["verdict"] for r in rows}
    assert set(verdicts[2]) == set(verdicts[1]) == {"val_loss", "retrieval", "attention_answer", "attention_noise",
                                                    "outliers_attention_logits_top1", "outliers_hidden_states_top1"}
    assert all(v == "worse (2 of 2 runs of a diverged or were not measured)" for v in verdicts[2].values())
    # a vision study measures no outliers and trains no retrieval task: still no such rows
    vision = StudyConfig(domain="vision", arms=["vit:adamw", "diff-vit:adamw"], steps=8)
    corpus = {"vit-adamw": corpus_arm([run(s, False, "corpus") for s in range(2)], "vision"),
              "diff-vit-adamw": corpus_arm([run(s, True, "corpus") for s in range(2)], "vision")}
    for c in corpus.values():
        c.pop("outliers", None)
    assert [r["metric"] for r in questions(vision, corpus, None)["diff_vs_transformer"]["rows"]] == ["test_acc"]


@pytest.mark.parametrize("domain", ["lm", "vision"])
def test_a_run_whose_last_update_broke_the_weights_is_a_diverged_run(domain, tmp_path, monkeypatch):
    """The trainer checks a step's loss before applying its update, so the last update can leave NaN weights: the run
    finished with a NaN validation loss, read as "not measured", and a vision run's NaN logits (argmax 0) scored a
    finite test accuracy of about chance, averaged into its arm's mean as a result; it is a diverged run."""
    import difftx.train
    from difftx.compare import worker
    from difftx.compare.report import ms
    from difftx.compare.results import corpus_arm

    def train(tcfg, mcfg, run_dir, **kw):
        run_dir.mkdir(parents=True, exist_ok=True)
        nan = float("nan")
        return {"val_loss": nan, "stopped_by": None, **({"val_acc": 0.1, "test_acc": 0.1, "test_loss": nan}
                                                        if domain == "vision" else {})}

    measured = []
    monkeypatch.setattr(difftx.train, "train", train)
    monkeypatch.setattr(worker, "measurements", lambda *args: measured.append(args) or {})
    study = StudyConfig(domain=domain, arms=["vit:adamw" if domain == "vision" else "transformer:adamw"], steps=4,
                        retrieval="none", device="cpu", seeds=1)
    job = plan(study)[0]
    r = worker.run_job(study, job, tmp_path)
    assert r["diverged"] and "final" not in r and "non-finite val_loss" in r["message"]
    assert not measured  # NaN weights: no outliers, tails or memory of them
    assert worker.read_job(job.run_dir(tmp_path))["diverged"] is True
    arm = corpus_arm([r], domain)
    assert ms(arm["val_loss"]) == "diverged" and arm["diverged"] == 1
    if domain == "vision":
        assert ms(arm["test_acc"]) == "diverged"


@pytest.mark.parametrize("seeds", [2, 3, 4])
def test_equal_arms_are_rarely_called_different(seeds):
    """Two arms of equal performance with normal seed noise: compare() calls a difference clear at most ~5% of the
    time (the bare seed spread at two seeds: 22%)."""
    import numpy as np

    rng = np.random.default_rng(seeds)
    calls = [compare(stat(list(a)), stat(list(b)), False)["verdict"] != "no clear difference"
             for a, b in rng.standard_normal((4000, 2, seeds))]
    assert np.mean(calls) < 0.065


@pytest.mark.parametrize("s1_msgdw, answer", [
    ([2.0, 2.1], "yes"),  # mSGDW clearly worse with the Transformer's norms, matched with DNT's
    ([1.0, 1.1], "not DNT's doing (mSGDW matches AdamW without DNT too)"),  # was "yes"
])
def test_dnt_is_credited_only_when_msgdw_needs_it(s1_msgdw, answer):
    from difftx.compare.results import PAPER_NUMBERS, questions

    study = StudyConfig(arms=["transformer:adamw", "transformer:msgdw", "dnt:adamw", "dnt:msgdw"], seeds=2)
    loss = {"transformer-adamw": [1.0, 1.1], "transformer-msgdw": s1_msgdw, "dnt-adamw": [1.0, 1.1],
            "dnt-msgdw": [1.02, 1.12]}
    corpus = {arm: {"val_loss": stat(v), "throughput": stat([1.0, 1.0]), "throughput_cpu": stat([1.0, 1.0]),
                    "memory": {"total_bytes": stat([1.0, 1.0])}} for arm, v in loss.items()}
    q = questions(study, corpus, None)
    assert q["dnt_msgdw_matches_adamw"]["answer"] == answer
    from difftx.compare.report import answers

    line = next(a for a in answers({"questions": q, "domain": "lm", "arms": {a: {"label": a} for a in loss},
                                    "papers": PAPER_NUMBERS}) if "mSGDW match" in a)
    assert f"AdamW? {answer[0].upper()}{answer[1:]}.**" in line  # names kept (str.capitalize lowered "DNT", "mSGDW")


@pytest.mark.parametrize("grid", [[1e-3, 1e-3], [1e-3, 1.0000001e-3]])
def test_an_lr_sweep_grid_naming_one_run_twice_is_refused(grid):
    """A job's directory is named by its lr (``seed0-lr0.001``): a grid with the same lr twice (or two that read
    the same there) planned two jobs into one run directory, trained side by side by the pool."""
    from difftx.compare.jobs import sweep_plan
    from difftx.errors import ConfigError

    with pytest.raises(ConfigError, match="twice"):
        StudyConfig(arms=["transformer:adamw"], steps=3, lr_sweep={"adamw": grid})
    study = StudyConfig(arms=["transformer:adamw"], steps=3, lr_sweep={"adamw": [1e-3, 2e-3]})
    keys = [j.key for j in sweep_plan(study)]
    assert len(set(keys)) == len(keys) == 2


@pytest.mark.parametrize("lr", [{"adamw": 1e-2}, {"transformer-adamw": 1e-2}])
def test_an_lr_the_sweep_replaces_is_refused(lr):
    """Every arm of a swept optimiser trains at its grid's lrs and keeps the best: an --lr for that optimiser (or one
    of its arms) was never read, and the report named the sweep as the arm's lr source."""
    from difftx.errors import ConfigError

    with pytest.raises(ConfigError, match="lr"):
        StudyConfig(arms=["transformer:adamw", "transformer:msgdw"], steps=3, lr=lr, lr_sweep={"adamw": [1e-3, 2e-3]})
    # an --lr for an optimiser the sweep leaves alone is read: its arms run at it
    study = StudyConfig(arms=["transformer:adamw", "transformer:msgdw"], steps=3, lr={"msgdw": 0.5},
                        lr_sweep={"adamw": [1e-3, 2e-3]})
    from difftx.compare.jobs import sweep_plan

    assert {j.lr for j in sweep_plan(study) if j.arm.optimizer == "msgdw"} == {0.5}


def test_retrieval_niah_does_not_get_mqars_default_options():
    """The default retrieval options (2-6 pairs, 64 keys) are MQAR's: --retrieval niah was given them too and refused
    ("the niah task has no option 'pairs'") unless every option was given by hand."""
    from difftx.compare.jobs import retrieval_task_options
    from difftx.compare.runner import check_inputs

    study = StudyConfig(retrieval="niah", retrieval_seq_len=128, steps=3)  # 4 needles need 118 tokens
    check_inputs(study)
    assert "pairs" not in retrieval_task_options(study) and "vocab" not in retrieval_task_options(study)
    assert StudyConfig(steps=3).retrieval_options == {"pairs": "2-6", "vocab": 64}  # MQAR keeps them
    assert StudyConfig(retrieval="mqar", steps=3).retrieval_options == {"pairs": "2-6", "vocab": 64}


def test_jobs_cpu_time_counts_the_sweeps_other_runs_once():
    """"Training CPU time of all jobs" summed the study's own jobs only: the sweep's runs at the lrs not chosen were
    left out (the chosen one is the study's first seed, counted once)."""
    from difftx.compare.jobs import sweep_plan
    from difftx.compare.results import build_results

    study = StudyConfig(arms=["transformer:adamw"], seeds=2, steps=4, retrieval="none",
                        lr_sweep={"adamw": [1e-3, 2e-3]})
    sweep = sweep_plan(study)
    main = plan(study, {"transformer-adamw": 2e-3})

    def run(job, cpu):
        return {"job": job.to_dict(), "diverged": False, "train": {"cpu_s": cpu, "steps": job.steps}}

    sweep_results = {j.key: run(j, cpu) for j, cpu in zip(sweep, (1.0, 2.0))}
    results = {j.key: sweep_results.get(j.key) or run(j, 4.0) for j in main}
    res = build_results(study, main, results, sweep, sweep_results, {"transformer-adamw": 2e-3},
                        {"wall_s": 1.0, "workers": 1}, "difftx compare")
    assert res["timing"]["jobs_cpu_s"] == 7.0 and res["timing"]["jobs_continued"] == 0


def test_retrieval_heat_map_draws_an_accuracy_of_zero(tmp_path, monkeypatch):
    """A cell whose seed mean is 0.0 (nothing retrieved: common at this scale) was drawn as missing (``or nan``):
    a blank square without its number, like a cell that was not measured."""
    pytest.importorskip("matplotlib")
    from difftx.compare import plots

    saved = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.append(fig))
    cell = lambda m: {"mean": m, "sd": 0.0, "min": m, "max": m, "n": 2, "missing": 0, "values": [m, m]}  # noqa: E731
    res = {"arms": {"a": {"label": "A"}, "b": {"label": "B"}},
           "retrieval": {"task": "mqar", "cells": ["N2@64"], "arms": {"a": {"cells": {"N2@64": cell(0.0)}},
                                                                     "b": {"cells": {"N2@64": cell(0.5)}}}}}
    assert plots.retrieval(res, tmp_path / "r.png")
    ax = saved[0].axes[0]
    assert sorted(t.get_text() for t in ax.texts) == ["0.00", "0.50"]
    assert ax.images[0].get_array()[0, 0] == 0.0


def test_retrieval_opt_adds_to_the_default_tasks_options(tmp_path):
    """--retrieval-opt pairs=2-8 replaced MQAR's default options: the default 64 keys were dropped and MQAR silently
    drew its keys from the model's whole vocabulary.  Like --set, it adds to the defaults of the same task."""
    from difftx.cli import build_parser
    from difftx.cli.compare import explicit_fields
    from difftx.compare.jobs import retrieval_task_options
    from difftx.compare.runner import resume_config

    parse = build_parser("compare").parse_args
    for argv in (["--retrieval-opt", "pairs=2-8"], ["--retrieval", "mqar", "--retrieval-opt", "pairs=2-8"]):
        study = StudyConfig(**explicit_fields(parse(["compare", *argv, "--steps", "3"])))
        assert retrieval_task_options(study) == {"pairs": "2-8", "vocab": 64}
    assert StudyConfig(steps=3, retrieval_options={"vocab": 32}).retrieval_options == {"pairs": "2-6", "vocab": 32}
    # another task gets none of MQAR's options; a stored study reads back the same
    assert StudyConfig(steps=3, retrieval="niah", retrieval_options={"digits": 3}).retrieval_options == {"digits": 3}
    study = StudyConfig(steps=3, retrieval_options={"pairs": "2-8"})
    assert StudyConfig.from_dict(study.to_dict()).retrieval_options == study.retrieval_options
    out = tmp_path / "out"
    out.mkdir()
    (out / "study.json").write_text(json.dumps({"difftx_compare": 1, "study": study.to_dict()}))
    argv = ["compare", "--retrieval-opt", "pairs=2-8", "--steps", "3"]
    assert resume_config(out, explicit_fields(parse(argv))).retrieval_options == {"pairs": "2-8", "vocab": 64}


@pytest.mark.parametrize("content", ["[]", "null", "5", '"done"', "{}", '{"diverged": false}', '{"job": []}',
                                     '{"job": {"seed": 0}}', '{"job": {"seed": "0", "steps": 3}}',
                                     '{"job": {"seed": 0, "steps": 3}, "final": []}',
                                     '{"job": {"seed": 0, "steps": 3}, "curve": {"val": 5, "train": []}}'])
def test_a_job_json_of_the_wrong_shape_is_not_a_finished_job(tmp_path, content):
    """Valid JSON of the wrong shape ([], null, a dict missing keys) was taken as a finished job's result, and building
    the results crashed with a traceback; like a damaged file it is not done, and the job runs again."""
    from difftx.compare.worker import read_job

    (tmp_path / "job.json").write_text(content)
    assert read_job(tmp_path) is None
    good = {"job": {"seed": 0, "steps": 3, "key": "corpus/a/seed0-lr0.004"}, "diverged": False,
            "final": {"val_loss": 1.5},
            "curve": {"tokens_per_step": 1024.0, "train": [[1, 2.0]], "val": [[3, 1.5, None]]}}
    (tmp_path / "job.json").write_text(json.dumps(good))
    assert read_job(tmp_path) == good


@pytest.mark.parametrize("fit,jobs_cap", [(1, None), (4, 1)])
def test_cores_of_jobs_that_do_not_run_go_to_the_jobs_that_do(fit, jobs_cap, tmp_path, monkeypatch):
    """Threads per job are the CPUs shared among the jobs that run at once: when memory fits fewer jobs than CPUs
    (fit 1), or the study has fewer jobs (one arm, one seed, one task), each gets the idle cores' share instead of
    the one thread that CPUs / (one job per CPU) gave it."""
    from difftx.compare import runner

    monkeypatch.setattr(runner, "cpu_count", lambda: 4)
    monkeypatch.setattr(runner, "fit_in_memory", lambda study, workers, world: (min(workers, fit), fit < 4, None))
    seen = []

    class Stop(Exception):
        pass

    class Recorder:
        def __init__(self, study, out, workers, threads, is_main):
            seen.append((workers, threads))
            raise Stop

    monkeypatch.setattr(runner, "Executor", Recorder)
    if jobs_cap:  # one job
        study = StudyConfig(arms=["transformer:adamw"], seeds=1, retrieval="none", steps=3)
    else:
        study = StudyConfig(arms=["transformer:adamw", "diff:adamw"], seeds=2, steps=3, retrieval_steps=3)
    with pytest.raises(Stop):
        runner.run_study(study, tmp_path / "out", progress=False)
    assert seen == [(1, 4)]


@pytest.mark.parametrize("domain, tps, label", [("vision", 32, "images"), ("lm", 512, "tokens"), ("lm", None, "step")])
def test_loss_curve_x_axis_names_what_it_counts(domain, tps, label, tmp_path, monkeypatch):
    """A vision study's validation curve is drawn against images seen (steps x images per step, its curve's
    "tokens"), and its axis said "step"."""
    pytest.importorskip("matplotlib")
    from difftx.compare import plots

    saved = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.append(fig))
    steps = [10, 20]
    curve = {"steps": steps, "tokens": [s * tps if tps else None for s in steps], "mean": [2.0, 1.5],
             "min": [1.9, 1.4], "max": [2.1, 1.6], "train": [[[10, 2.0], [20, 1.5]]]}
    res = {"domain": domain, "arms": {"a": {"label": "A"}}, "corpus": {"a": {"curve": curve}}}
    assert plots.loss_curves(res, tmp_path / "l.png")
    ax = saved[0].axes[0]
    assert ax.get_xlabel() == label
    assert list(ax.lines[0].get_xdata()) == ([s * tps for s in steps] if tps else steps)


def test_grad_hist_draws_every_tabulated_matrix_kind(tmp_path, monkeypatch):
    """The report's tail tables have a W_g (SwiGLU gate) column; grad_hist.png left its panel out."""
    pytest.importorskip("matplotlib")
    from difftx.compare import plots

    saved = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.append(fig))
    h = {"log10_edges": [-3.0, -2.0, -1.0], "fraction": [0.5, 0.5]}
    kinds = ("W_q", "W_k", "W_v", "W_o", "W_g", "W_1", "W_2", "all")
    res = {"arms": {"a": {"label": "A"}}, "corpus": {"a": {"tails": {"histograms": {k: h for k in kinds}}}}}
    assert plots.grad_hist(res, tmp_path / "g.png")
    assert [ax.get_title() for ax in saved[0].axes if ax.get_visible()] == list(kinds)


def test_document_masking_reaches_the_corpus_runs_only():
    """--document-masking: every corpus run masks its documents; the retrieval task's runs (sequences the task
    makes whole) do not, and TrainConfig would refuse it there."""
    study = StudyConfig(tokens=100_000, retrieval_tokens=50_000, tokenizer="bpe", document_masking=True)
    tcfgs = [(j.task, train_config(study, j)) for j in plan(study)]
    assert {t.document_masking for task, t in tcfgs if task == "corpus"} == {True}
    assert {t.document_masking for task, t in tcfgs if task != "corpus"} == {False}
    assert not any(t.document_masking for _, t in ((j.task, train_config(StudyConfig(tokens=100_000), j))
                                                    for j in plan(StudyConfig(tokens=100_000))))
