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
