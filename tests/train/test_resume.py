"""Exact resume, and the run directory contract (each checkpoint is a loadable model dir)."""

import json

import pytest
import torch

import difftx
from difftx.data import load_tokenizer

from ..conftest import needs_muon
from ._helpers import losses


def _weights(path):
    return difftx.load_model(path).state_dict()


def test_exact_resume_matches_one_run(tmp_path, train_cli):
    common = ["--steps", 8, "--eval-every", 4, "--diag-every", 4, "--lr", 3e-3, "--attention", "diff"]
    assert train_cli(*common, "--out", tmp_path / "full") == 0
    assert train_cli(*common, "--out", tmp_path / "half", "--stop-at", 4) == 0
    assert (tmp_path / "half" / "checkpoints" / "step_00000004").is_dir()
    assert train_cli(*common, "--out", tmp_path / "half", "--resume", "auto") == 0
    assert losses(tmp_path / "half") == losses(tmp_path / "full")
    assert losses(tmp_path / "half", "val_loss") == losses(tmp_path / "full", "val_loss")
    assert losses(tmp_path / "half", "lambdas") == losses(tmp_path / "full", "lambdas")
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "half")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    state = json.loads((tmp_path / "half/checkpoints/step_00000008/trainer_state.json").read_text())
    assert state["step"] == 8 and state["tokens_seen"] == 8 * 4 * 16


def _rows(run):
    """metrics.jsonl without its timing fields."""
    return [{k: v for k, v in json.loads(line).items() if k not in ("tokens_per_s", "elapsed")}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_stop_off_the_log_interval_leaves_the_metrics_of_one_run(tmp_path, train_cli):
    """--stop-at 4 with --log-every 3 also logged step 4's training row, which the run in one go does not have (nor
    a run stopped at step 4 by SIGTERM): the resumed metrics.jsonl had a row too many."""
    common = ["--steps", 8, "--log-every", 3, "--eval-every", 4, "--diag-every", 0]
    assert train_cli(*common, "--out", tmp_path / "full") == 0
    assert train_cli(*common, "--out", tmp_path / "half", "--stop-at", 4) == 0
    assert train_cli(*common, "--out", tmp_path / "half", "--resume", "auto") == 0
    assert [r["step"] for r in _rows(tmp_path / "full") if "loss" in r] == [3, 6, 8]  # the interval and the end
    assert _rows(tmp_path / "half") == _rows(tmp_path / "full")


def _optimizer_state(run):
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    return torch.load(ckpt / "optimizer.pt", weights_only=True)


def _same(a, b, where="optimizer"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


@pytest.mark.parametrize("flags, how", [
    (["--optimizer", "msgdw", "--lr", 0.05, "--norms", "dnt"], "stop"),
    (["--optimizer", "sgd", "--nesterov", "--lr", 0.05, "--attention", "diff2", "--log-every", 4], "stop"),
    pytest.param(["--optimizer", "muon", "--lr", 0.02, "--schedule", "linear", "--warmup", 3, "--min-lr", 1e-4], "stop",
                 marks=needs_muon),
    (["--dtype", "bf16", "--grad-accum", 2, "--set", "dropout=0.1", "--grad-clip", 0.1], "stop"),
    (["--set", "dropout=0.1", "--checkpoint-every", 2, "--keep-last", 2], "older checkpoint into a new --out"),
], ids=["msgdw-dnt", "sgd-nesterov-diff2-log4", "muon-linear-stop-in-warmup", "bf16-accum-dropout-clip", "fork"])
def test_exact_resume_across_optimizers_precision_accumulation_and_forks(tmp_path, train_cli, flags, how):
    """Stopped at step 2 (or resumed from the one-go run's older step-4 checkpoint into a new directory), a run ends
    as it does in one go: metrics rows, weights and optimizer state (momentum buffers, Muon's and AdamW's state, the RNG
    of dropout across micro-batches)."""
    common = ["--steps", 5, "--eval-every", 3, "--diag-every", 3, *flags]
    full, other = tmp_path / "full", tmp_path / "other"
    assert train_cli(*common, "--out", full) == 0
    if how == "stop":
        assert train_cli(*common, "--out", other, "--stop-at", 2) == 0
        assert train_cli(*common, "--out", other, "--resume", "auto") == 0
    else:
        assert train_cli(*common, "--out", other, "--resume", full / "checkpoints" / "step_00000004") == 0
    assert _rows(other) == _rows(full)
    a, b = _weights(full), _weights(other)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _same(_optimizer_state(full), _optimizer_state(other))


def test_run_directory_contract(tmp_path, train_cli):
    out = tmp_path / "run"
    assert train_cli("--steps", 4, "--checkpoint-every", 1, "--keep-last", 2, "--eval-every", 2, "--out", out) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["difftx_format"] == 1 and cfg["model"]["d_model"] == 32 and cfg["train"]["steps"] == 4
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_00000003", "step_00000004"]  # keep the last 2
    newest = out / "checkpoints" / "step_00000004"
    for path in (out, newest):  # the run dir resolves to its newest checkpoint
        model = difftx.load_model(path)
        assert model.config.vocab_size == load_tokenizer(path).vocab_size
    for k, v in difftx.load_model(out).state_dict().items():
        assert torch.equal(v, _weights(newest)[k])
    assert not any(k.startswith(("_orig_mod", "module")) for k in _weights(newest))
    tok = load_tokenizer(out)
    assert tok.decode(tok.encode("the cat")) == "the cat"


def test_resume_keeps_config_and_rejects_changes(tmp_path, train_cli, capsys):
    out = tmp_path / "run"
    assert train_cli("--steps", 4, "--stop-at", 2, "--out", out) == 0
    before = (out / "config.json").read_text()
    assert train_cli("--steps", 4, "--lr", 0.5, "--out", out, "--resume", "auto") == 2
    err = capsys.readouterr().err
    assert "lr" in err and "resumed" in err and err.count("\n") == 1
    assert (out / "config.json").read_text() == before
    # a new run into a directory that holds one is refused, nothing overwritten
    assert train_cli("--steps", 4, "--out", out) == 2
    assert "already holds a training run" in capsys.readouterr().err
    assert (out / "config.json").read_text() == before


def _steps(out):
    return [p.name for p in sorted((out / "checkpoints").iterdir())]


def test_resuming_an_earlier_step_of_the_run_drops_the_abandoned_checkpoints(tmp_path, train_cli):
    """Resumed from step 4 of its own directory, a run's later checkpoints (8, 12) are another history: they are
    removed as it starts, so --keep-last never prunes the checkpoint just written and --resume auto never picks them."""
    out, common = tmp_path / "fork", ["--steps", 12, "--eval-every", 0, "--checkpoint-every", 4]
    assert train_cli(*common, "--out", out) == 0
    assert _steps(out) == ["step_00000004", "step_00000008", "step_00000012"]
    assert train_cli(*common, "--out", out, "--resume", out / "checkpoints" / "step_00000004", "--stop-at", 6,
                     "--keep-last", 1) == 0
    assert _steps(out) == ["step_00000006"]
    assert train_cli(*common, "--out", out, "--resume", "auto") == 0
    assert _steps(out)[-1] == "step_00000012"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 13))  # one history, no gap at 7-12


def test_a_resave_killed_between_its_two_renames_keeps_the_old_copy(tmp_path, train_cli, capsys):
    """Re-saving step 4 moves the old copy aside before the new one takes its name; a process killed between the
    two leaves only ``.step_00000004.old`` (and maybe a partial ``.tmp``): the next start puts it back."""
    out = tmp_path / "run"
    assert train_cli("--steps", 4, "--eval-every", 0, "--out", out) == 0
    ckpts = out / "checkpoints"
    (ckpts / "step_00000004").rename(ckpts / ".step_00000004.old")
    (ckpts / ".step_00000004.tmp").mkdir()
    metrics = (out / "metrics.jsonl").read_text()
    # under torchrun only rank 0 puts it back (then a barrier): the other ranks resolve without touching it
    from difftx.train.checkpoint import resolve_resume

    assert resolve_resume("auto", out, restore=False) is None and (ckpts / ".step_00000004.old").is_dir()
    capsys.readouterr()
    assert train_cli("--steps", 4, "--eval-every", 0, "--out", out, "--resume", "auto") == 0
    assert "resum" in capsys.readouterr().out  # from step 4, not a fresh start over the old run
    assert _steps(out) == ["step_00000004"] and (out / "metrics.jsonl").read_text() == metrics


def test_a_resave_killed_between_its_two_renames_is_put_back_for_resume_path_too(tmp_path, train_cli, capsys):
    """--resume RUN_DIR (the path form) skipped what --resume auto does first: put back a step whose re-save a
    crash interrupted.  It said 'no checkpoint in it' (or took an older step)."""
    out = tmp_path / "run"
    assert train_cli("--steps", 4, "--eval-every", 0, "--out", out) == 0
    ckpts = out / "checkpoints"
    (ckpts / "step_00000004").rename(ckpts / ".step_00000004.old")
    capsys.readouterr()
    assert train_cli("--steps", 6, "--eval-every", 0, "--out", tmp_path / "fork", "--resume", out) == 0
    assert "resum" in capsys.readouterr().out
    assert _steps(out) == ["step_00000004"] and _steps(tmp_path / "fork")[-1] == "step_00000006"


def test_resuming_on_another_process_count_keeps_the_global_batch_or_is_refused(tmp_path, train_cli, capsys):
    """A checkpoint of 2 processes x 1 micro-batch (its trainer state says so) resumed on 1 process: with
    --grad-accum 1 a step would take half the sequences, so it is refused with the --global-batch that keeps
    them; with that, it resumes."""
    out = tmp_path / "run"
    assert train_cli("--steps", 4, "--stop-at", 2, "--eval-every", 0, "--out", out) == 0
    state_file = out / "checkpoints" / "step_00000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert (state["world_size"], state["micro_batches"]) == (1, 1)
    state_file.write_text(json.dumps({**state, "world_size": 2}))
    rng = state_file.parent / "rng"  # each of the 2 processes saved its RNG state
    (rng / "rank_1.json").write_bytes((rng / "rank_0.json").read_bytes())
    capsys.readouterr()
    assert train_cli("--steps", 4, "--eval-every", 0, "--out", out, "--resume", "auto") == 2
    err = capsys.readouterr().err
    assert "took 8 sequences a step" in err and "--global-batch 8" in err and err.count("\n") == 1
    assert train_cli("--steps", 4, "--eval-every", 0, "--out", out, "--resume", "auto", "--global-batch", 8) == 0
    assert json.loads((out / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())["micro_batches"] == 2


def test_resuming_on_a_changed_corpus_is_refused(tmp_path, corpus, train_cli, capsys):
    """The same --data path with other contents is not the run's corpus: the resume is refused in one line before
    anything is written (it used to continue on the new text and rewrite config.json's corpus fingerprint), as a
    vision run's resume on other images is."""
    out = tmp_path / "run"
    assert train_cli("--steps", 4, "--stop-at", 2, "--eval-every", 0, "--out", out) == 0
    original, config = corpus.read_text(), (out / "config.json").read_text()
    corpus.write_text(original + "The cat sat.\n")
    capsys.readouterr()
    assert train_cli("--steps", 4, "--eval-every", 0, "--out", out, "--resume", "auto") == 2
    err = capsys.readouterr().err
    assert "not the corpus of the run being resumed" in err and err.count("\n") == 1
    assert _steps(out) == ["step_00000002"] and (out / "config.json").read_text() == config
    corpus.write_text(original)
    assert train_cli("--steps", 4, "--eval-every", 0, "--out", out, "--resume", "auto") == 0
    assert _steps(out)[-1] == "step_00000004"


def test_a_run_started_on_a_relative_data_path_resumes_from_another_directory(tmp_path, corpus, cache, monkeypatch,
                                                                           capsys):
    """A run keeps --data as given: started with a relative path, it could be resumed only from the directory it started
    in (elsewhere "no such file"), and passing the same corpus by another path was refused as a changed --data.  Another
    path to the same corpus is accepted (its contents are checked); another corpus is still refused."""
    from difftx.cli import main

    base = ["train", "--cache-dir", str(cache), "--tokenizer", "char", "--d-model", "32", "--n-layers", "1",
            "--n-heads", "2", "--seq-len", "16", "--batch-size", "4", "--warmup", "1", "--dtype", "fp32",
            "--eval-every", "0", "--no-progress", "--steps", "4", "--out", str(tmp_path / "run")]
    monkeypatch.chdir(corpus.parent)
    assert main([*base, "--data", corpus.name, "--stop-at", "2"]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main([*base, "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "pass --data" in err and err.count("\n") == 1
    other = elsewhere / "other.txt"
    other.write_text(corpus.read_text() + "The cat sat.\n")
    assert main([*base, "--resume", "auto", "--data", str(other)]) == 2
    assert "not the corpus of the run being resumed" in capsys.readouterr().err
    assert _steps(tmp_path / "run") == ["step_00000002"]
    assert main([*base, "--resume", "auto", "--data", str(corpus)]) == 0
    assert _steps(tmp_path / "run")[-1] == "step_00000004"
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["data"] == str(corpus)


def test_resume_with_a_stop_at_already_passed_is_refused(tmp_path, train_cli, capsys):
    """--stop-at at or below the step the resumed run stands at trained nothing and exited 0; now one line, exit 2."""
    out = tmp_path / "run"
    assert train_cli("--steps", 6, "--stop-at", 4, "--eval-every", 0, "--out", out) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    for stop in (2, 4):
        assert train_cli("--steps", 6, "--stop-at", stop, "--eval-every", 0, "--out", out, "--resume", "auto") == 2
        lines = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and "--stop-at" in lines[0] and "step 4" in lines[0] and "nothing" in lines[0], lines
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing touched
    assert train_cli("--steps", 6, "--stop-at", 5, "--eval-every", 0, "--out", out, "--resume", "auto") == 0
    assert (out / "checkpoints" / "step_00000005").is_dir()


def test_resume_auto_with_a_checkpoint_as_out_is_refused(tmp_path, train_cli, capsys):
    """``--out RUN/checkpoints/step_2 --resume auto`` found no checkpoints below it, took the checkpoint's
    config.json for a run's and trained a new run from step 0 inside the checkpoint (its config.json rewritten, a
    checkpoints/ nested in it). Now refused in one line that says how to continue it; nothing is touched."""
    out = tmp_path / "run"
    assert train_cli("--steps", 4, "--stop-at", 2, "--eval-every", 0, "--out", out) == 0
    ckpt = out / "checkpoints" / "step_00000002"
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert train_cli("--steps", 4, "--eval-every", 0, "--out", ckpt, "--resume", "auto") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{ckpt} is a checkpoint" in lines[0] and f"--resume {ckpt}" in lines[0], lines
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert train_cli("--steps", 4, "--eval-every", 0, "--out", out, "--resume", ckpt) == 0  # the way it names
    assert _steps(out) == ["step_00000002", "step_00000004"]


def test_a_stopped_run_resumed_with_steps_at_its_stop_ends_with_the_final_evaluation(tmp_path, train_cli):
    """--stop-at 4 of --steps 8, resumed with --steps 4: the run ends where it stands, and its end is evaluated
    as a run of 4 steps is (a val_loss row at step 4). The resume trained nothing and wrote no final val_loss."""
    common = ["--log-every", 1, "--eval-every", 0, "--diag-every", 0]
    assert train_cli("--steps", 4, *common, "--out", tmp_path / "four") == 0
    assert train_cli("--steps", 8, *common, "--out", tmp_path / "half", "--stop-at", 4) == 0
    assert not any("val_loss" in r for r in _rows(tmp_path / "half"))
    assert train_cli("--steps", 4, *common, "--out", tmp_path / "half", "--resume", "auto") == 0
    final = [r for r in _rows(tmp_path / "half") if "val_loss" in r]
    assert [r["step"] for r in final] == [4]
    assert final[0]["val_loss"] == pytest.approx(next(r for r in _rows(tmp_path / "four") if "val_loss" in r)
                                                 ["val_loss"], abs=0.2)  # another schedule: a close loss
    assert train_cli("--steps", 4, *common, "--out", tmp_path / "half", "--resume", "auto") == 0  # once only
    assert [r["step"] for r in _rows(tmp_path / "half") if "val_loss" in r] == [4]


def test_python_resume_applies_only_the_fields_named_in_explicit_train(tmp_path, corpus, cache):
    """As docs/training.md says: train(..., resume="auto") keeps the saved configs; explicit_train names the
    fields of tcfg to apply (the CLI's flags)."""
    from difftx.train import train

    from ._helpers import tiny

    tcfg, mcfg = tiny(corpus, cache, steps=4)
    train(tcfg, mcfg, tmp_path / "run", announce=None)
    more = tcfg.replace(steps=6)
    assert train(more, mcfg, tmp_path / "run", resume="auto", announce=None)["step"] == 4  # the saved steps
    assert train(more, mcfg, tmp_path / "run", resume="auto", explicit_train={"steps"}, announce=None)["step"] == 6


def test_a_checkpoint_deletion_cut_by_a_crash_leaves_no_partial_checkpoint(tmp_path, train_cli, monkeypatch):
    """Removing a checkpoint (the abandoned later ones of a resume from an earlier step, or --keep-last pruning)
    was an rmtree of ``step_XXXXXXXX`` itself: a crash in the middle left a partial directory under a complete
    checkpoint's name, which --resume auto picked as the newest and refused.  Now it is renamed out of sight
    first, and what is left of it goes on the next start."""
    import shutil

    from difftx.io import list_checkpoints

    out, common = tmp_path / "run", ["--steps", 12, "--eval-every", 0, "--checkpoint-every", 4]
    assert train_cli(*common, "--out", out) == 0
    real_rmtree = shutil.rmtree

    class Killed(BaseException):
        pass

    def rmtree_killed_midway(path, *args, **kwargs):
        if "00000012" in str(path) and path.is_dir():  # the newest abandoned checkpoint: a file gone, then death
            (path / "model.safetensors").unlink()
            raise Killed
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree_killed_midway)
    with pytest.raises(Killed):
        train_cli(*common, "--out", out, "--resume", out / "checkpoints" / "step_00000004", "--stop-at", 6)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    for ckpt in list_checkpoints(out):  # every checkpoint --resume auto may pick is whole
        assert (ckpt / "model.safetensors").is_file() and (ckpt / "trainer_state.json").is_file(), ckpt
    assert train_cli(*common, "--out", out, "--resume", "auto") == 0
    assert _steps(out)[-1] == "step_00000012" and len(_steps(out)) == 3  # --keep-last 3, all of them visible
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # the leftover went
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 13))


def test_a_resume_from_an_earlier_step_that_dies_before_its_first_save_keeps_metrics_and_checkpoints_one_history(
        tmp_path, train_cli, monkeypatch):
    """Resumed from step 4 of its own directory, a run dropped metrics rows 5-12 at once but its checkpoints 8 and
    12 only at its first save: killed before it, --resume auto then took step 12, whose rows were gone.  Now the
    later checkpoints go (after every input check) before the rows do."""
    from difftx.io import list_checkpoints
    from difftx.train.trainer import Trainer

    out, common = tmp_path / "run", ["--steps", 12, "--eval-every", 0, "--checkpoint-every", 4]
    assert train_cli(*common, "--out", out) == 0

    class Killed(BaseException):
        pass

    def killed(self):
        raise Killed

    monkeypatch.setattr(Trainer, "train_step", killed)
    with pytest.raises(Killed):
        train_cli(*common, "--out", out, "--resume", out / "checkpoints" / "step_00000004")
    monkeypatch.undo()
    logged = {json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()}
    for ckpt in list_checkpoints(out):  # every checkpoint --resume auto may pick has the rows of its steps
        step = int(ckpt.name.split("_")[1])
        assert set(range(1, step + 1)) <= logged, (ckpt.name, sorted(logged))
    assert train_cli(*common, "--out", out, "--resume", "auto") == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 13))


def test_a_refused_resume_from_an_earlier_step_leaves_the_later_checkpoints_and_metrics(tmp_path, train_cli):
    """The later checkpoints of a resume from an earlier step go only once every input check passed."""
    out, common = tmp_path / "run", ["--steps", 12, "--eval-every", 0, "--checkpoint-every", 4]
    assert train_cli(*common, "--out", out) == 0
    metrics = (out / "metrics.jsonl").read_text()
    assert train_cli(*common, "--out", out, "--resume", out / "checkpoints" / "step_00000004", "--stop-at", 3) == 2
    assert _steps(out) == ["step_00000004", "step_00000008", "step_00000012"]
    assert (out / "metrics.jsonl").read_text() == metrics


def test_a_resumed_run_keeps_its_device_unless_given(tmp_path, train_cli, monkeypatch):
    """A run started with --device cpu and resumed without --device ran on the default, auto (a GPU where there is
    one: another device and, with --dtype auto, bf16 instead of fp32), while its config.json still said cpu: the
    process's device came from the command's flags, not from the run's saved config."""
    import difftx.train.run as run

    asked, real = [], run.init_world
    monkeypatch.setattr(run, "init_world", lambda device="auto": asked.append(device) or real(device))
    out = tmp_path / "run"
    assert train_cli("--steps", 6, "--stop-at", 2, "--eval-every", 0, "--device", "cpu", "--out", out) == 0
    assert train_cli("--steps", 6, "--stop-at", 4, "--eval-every", 0, "--out", out, "--resume", "auto") == 0
    assert train_cli("--steps", 6, "--eval-every", 0, "--out", tmp_path / "fork",
                     "--resume", out / "checkpoints" / "step_00000002") == 0
    assert train_cli("--steps", 6, "--eval-every", 0, "--out", out, "--resume", "auto", "--device", "auto") == 0
    assert asked == ["cpu", "cpu", "cpu", "auto"]
    assert json.loads((out / "config.json").read_text())["train"]["device"] == "auto"


def test_a_run_saved_on_a_gpu_resumed_without_one_names_the_saved_device(tmp_path, train_cli, monkeypatch, capsys):
    """A run saved with --device cuda, resumed without --device where torch sees no GPU: one line saying the run was
    saved so (not "cuda was asked for", which the user did not), and how to resume; the run is left as it was."""
    out = tmp_path / "run"
    assert train_cli("--steps", 4, "--stop-at", 2, "--eval-every", 0, "--device", "cpu", "--out", out) == 0
    cfg = json.loads((out / "config.json").read_text())
    cfg["train"]["device"] = "cuda"
    (out / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    capsys.readouterr()
    assert train_cli("--steps", 4, "--eval-every", 0, "--out", out, "--resume", "auto") == 2
    err = capsys.readouterr().err
    assert "saved with --device cuda" in err and "--device cpu" in err and err.count("\n") == 1, err
    assert json.loads((out / "config.json").read_text())["train"]["device"] == "cuda"
    assert train_cli("--steps", 4, "--eval-every", 0, "--out", out, "--resume", "auto", "--device", "cpu") == 0
