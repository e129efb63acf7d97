"""With one seed every comparison is measured but has no spread: the answers say so, not "not measured"."""

from difftx.compare import StudyConfig
from difftx.compare.results import questions, stat


def _arm(loss):
    return {"val_loss": stat([loss]), "throughput": stat([100.0]), "throughput_cpu": stat([None]),
            "memory": {"total_bytes": stat([1.0])}}


def test_one_seed_answer_is_no_verdict_not_not_measured():
    study = StudyConfig(arms=["transformer:adamw", "diff:adamw"], seeds=1, steps=4, retrieval="none")
    q = questions(study, {"transformer-adamw": _arm(2.0), "diff-adamw": _arm(1.5)}, None)
    d = q["diff_vs_transformer"]
    assert d["rows"][0]["delta"] == -0.5 and d["rows"][0]["verdict"].startswith("no verdict")
    assert d["answer"].startswith("no verdict"), d["answer"]


def test_nothing_measured_is_still_not_measured():
    study = StudyConfig(arms=["transformer:adamw", "diff:adamw"], seeds=1, steps=4, retrieval="none")
    none = {**_arm(0.0), "val_loss": None}
    q = questions(study, {"transformer-adamw": none, "diff-adamw": none}, None)
    assert q["diff_vs_transformer"]["answer"] == "not measured"


def test_lr_source_names_the_sweep_only_for_swept_optimisers():
    from difftx.compare.results import lr_source

    study = StudyConfig(arms=["transformer:adamw", "transformer:sgd"], seeds=1, steps=4, retrieval="none",
                        lr_sweep={"adamw": [1e-3, 2e-3]})
    arms = {a.id: a for a in study.arm_list()}
    lrs = {"transformer-adamw": 2e-3, "transformer-sgd": 0.3}  # choose_lrs picks for every arm of the sweep plan
    assert lr_source(study, arms["transformer-adamw"], lrs) == "--lr-sweep"
    assert lr_source(study, arms["transformer-sgd"], lrs) == "default"


def test_an_arm_whose_every_seed_diverged_reads_diverged_in_the_retrieval_tables():
    from difftx.compare.report import attention_section, retrieval_section
    from difftx.compare.results import retrieval_arm

    ok = [{"job": {"seed": s}, "final": {"val_loss": 1.0 + s}, "retrieval": {"cells": {"n=1": 0.5 + s / 10},
           "overall": 0.5}, "attention": {"mean": {"answer": 0.2, "noise": 0.1}}} for s in (0, 1)]
    lost = [{"job": {"seed": s}, "diverged": True} for s in (0, 1)]
    res = {"arms": {"a": {"label": "A"}, "b": {"label": "B"}},
           "retrieval": {"cells": ["n=1"], "arms": {"a": retrieval_arm(ok), "b": retrieval_arm(lost)}}}
    for section in (retrieval_section(res), attention_section(res)):
        b_row = [line for line in section.splitlines() if line.startswith("| B |")][0]
        cells = [c.strip() for c in b_row.strip("|").split("|")][1:]
        assert cells and all(c == "diverged" for c in cells), section
        assert "| A | 0.5" in section or "| A | 0.2" in section


def test_both_arms_losing_runs_is_not_comparable_not_not_measured():
    """A diverged run in each arm makes the comparison "not comparable": the DNT question's answer said so, the
    DIFF question's "Not measured." (both measured, every finished run has its value)."""
    study = StudyConfig(arms=["transformer:adamw", "diff:adamw"], seeds=2, steps=4, retrieval="none")
    lost_one = {**_arm(0.0), "val_loss": stat([2.0, None], [False, True])}
    q = questions(study, {"transformer-adamw": lost_one, "diff-adamw": lost_one}, None)
    d = q["diff_vs_transformer"]
    assert d["rows"][0]["verdict"].startswith("not comparable")
    assert d["answer"] == d["rows"][0]["verdict"], d["answer"]
