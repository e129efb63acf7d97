"""A job continued after an interruption: its CPU rate counts only the steps its last process trained."""

from __future__ import annotations

import json

from difftx.compare import StudyConfig
from difftx.compare.jobs import plan, train_config
from difftx.compare.report import _jobs_cpu
from difftx.compare.results import _per_cpu_s, continued_jobs
from difftx.compare.worker import run_job
from difftx.train import train


def test_a_resumed_job_counts_only_the_steps_it_trained(tmp_path, corpus):
    study = StudyConfig(arms=["transformer:adamw"], seeds=1, steps=8, retrieval="none", data=str(corpus),
                        model={"n_layers": 1, "d_model": 32}, batch_size=4, seq_len=16, eval_points=2,
                        eval_batches=2, tail_batches=2, tail_entries=256, outlier_tokens=256, device="cpu",
                        cache_dir=str(tmp_path / "cache"))
    job = plan(study)[0]
    run_dir = job.run_dir(tmp_path / "out")
    # the study was interrupted after step 6 of 8 (a checkpoint there), then resumed
    train(train_config(study, job).replace(stop_at=6), study.model_config(job.arm), run_dir, announce=None,
          memory_check=False)
    res = run_job(study, job, tmp_path / "out")
    assert res["train"]["steps"] == 2
    tps = res["curve"]["tokens_per_step"]
    assert _per_cpu_s(res) == tps * 2 / res["train"]["cpu_s"]
    fresh = run_job(study, job, tmp_path / "fresh")
    assert fresh["train"]["steps"] == 8
    assert _per_cpu_s(fresh) == tps * 8 / fresh["train"]["cpu_s"]
    # the study's header: its CPU total misses the interrupted process's time, and says so
    assert continued_jobs({"a": res, "b": fresh}) == 1 and continued_jobs({"b": fresh}) == 0
    total = res["train"]["cpu_s"] + fresh["train"]["cpu_s"]
    assert _jobs_cpu({"jobs_cpu_s": total, "jobs_continued": 1}).startswith(f"at least {total:.0f} s (1 job continued")
    assert _jobs_cpu({"jobs_cpu_s": total}) == f"{total:.0f} s"  # a results.json of an older version


def test_a_v2_arm_records_its_lambdas(tmp_path, corpus):
    """DIFF V2's lambdas are per token, known only after a forward pass: results.json recorded [None, None]."""
    study = StudyConfig(arms=["diff2:adamw"], seeds=1, steps=2, retrieval="none", data=str(corpus),
                        model={"n_layers": 2, "d_model": 32}, batch_size=2, seq_len=16, eval_points=1,
                        eval_batches=1, tail_batches=2, tail_entries=64, outlier_tokens=64, device="cpu",
                        cache_dir=str(tmp_path / "cache"))
    res = run_job(study, plan(study)[0], tmp_path / "out")
    assert len(res["lambdas"]) == 2 and all(isinstance(v, float) and 0.0 < v < 1.0 for v in res["lambdas"])


def test_an_interrupted_job_resumes_with_the_studys_new_runtime_settings(tmp_path, corpus):
    """``difftx compare --resume`` may change --threads, --device, --cache-dir and --activation-checkpointing; an
    interrupted job (continued by ``train(..., resume="auto")``) kept the ones its run had saved: it trained on the
    old thread count, read the old cache directory and (since a resumed run keeps its device) would have gone back
    to the old device; and with the corpus moved (a resume may name it by another path: its contents are checked)
    it read the old, missing path."""
    import dataclasses
    import shutil

    import torch

    data = tmp_path / "a.txt"
    shutil.copy(corpus, data)
    study = StudyConfig(arms=["transformer:adamw"], seeds=1, steps=4, retrieval="none", data=str(data),
                        model={"n_layers": 1, "d_model": 32}, batch_size=2, seq_len=16, eval_points=1,
                        eval_batches=1, tail_batches=2, tail_entries=64, outlier_tokens=64, device="cpu", threads=1,
                        cache_dir=str(tmp_path / "cache"))
    job = plan(study)[0]
    run_dir = job.run_dir(tmp_path / "out")
    train(train_config(study, job).replace(stop_at=2), study.model_config(job.arm), run_dir, announce=None,
          memory_check=False)
    moved = data.rename(tmp_path / "b.txt")
    resumed = dataclasses.replace(study, threads=2, device="auto", cache_dir=str(tmp_path / "cache2"), data=str(moved),
                                  activation_checkpointing=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the study process's own count: the job trains and is measured on its 2
        res = run_job(resumed, job, tmp_path / "out")
    finally:
        torch.set_num_threads(before)
    assert res["train"]["threads"] == 2 and res["train"]["steps"] == 2
    assert (tmp_path / "cache2" / "shards").is_dir()
    saved = json.loads((run_dir / "config.json").read_text())["train"]
    assert saved["device"] == "auto" and saved["data"] == str(moved) and saved["activation_checkpointing"] == 1


def test_a_retrieval_job_of_a_study_with_a_cache_dir_trains(tmp_path):
    """The trainer refuses an explicit --cache-dir where its run reads none (a --task); a study's retrieval jobs,
    which generate their data, must not pass the study's --cache-dir on as one (the study's corpus jobs read it)."""
    study = StudyConfig(arms=["transformer:adamw"], seeds=1, steps=2, retrieval="mqar", retrieval_steps=2,
                        retrieval_seq_len=32, retrieval_batch_size=2, retrieval_samples=2,
                        model={"n_layers": 1, "d_model": 32}, batch_size=2, seq_len=16, eval_points=1,
                        eval_batches=1, tail_batches=2, tail_entries=64, outlier_tokens=64, device="cpu", threads=1,
                        cache_dir=str(tmp_path / "cache"))
    job = next(j for j in plan(study) if j.task == "retrieval")
    res = run_job(study, job, tmp_path / "out")
    assert res["train"]["steps"] == 2 and not res["diverged"]
