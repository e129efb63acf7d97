"""Faults: a kill mid-checkpoint, corrupt checkpoints, a non-finite loss, pickled code in a checkpoint."""

import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import difftx
from difftx.errors import CheckpointError

from ._helpers import cli_env, losses

TINY = ["--tokenizer", "char", "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "16",
        "--batch-size", "4", "--warmup", "1", "--dtype", "fp32", "--eval-batches", "2", "--no-progress", "--seed", "7"]

DYING = textwrap.dedent("""
    import os, signal, sys
    import difftx.train.checkpoint as ck
    real = ck.atomic_write_bytes
    def dying(path, data):
        if path.name == "optimizer.pt" and "step_00000004" in str(path):
            with open(path, "wb") as f:   # half the file reaches the disk, then the process dies
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, data)
    ck.atomic_write_bytes = dying
    from difftx.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def _cli(*args, script=None):
    cmd = [sys.executable, *(["-c", script] if script else ["-m", "difftx"]), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), timeout=300)


def test_sigkill_mid_checkpoint_then_resume(tmp_path, corpus, cache, capsys):
    common = ["train", "--data", corpus, "--cache-dir", cache, *TINY, "--steps", 6, "--checkpoint-every", 2,
              "--eval-every", 3]
    run = tmp_path / "run"
    died = _cli(*common, "--out", run, script=DYING)
    assert died.returncode == -9, died.stderr[-2000:]
    ckroot = run / "checkpoints"
    assert sorted(p.name for p in ckroot.iterdir()) == [".step_00000004.tmp", "step_00000002"]
    assert difftx.load_model(run).config.d_model == 32  # the previous checkpoint loads
    from difftx.cli import main

    assert main([str(a) for a in common] + ["--out", str(run), "--resume", "auto"]) == 0
    assert "resuming from" in capsys.readouterr().out
    assert sorted(p.name for p in ckroot.iterdir()) == ["step_00000002", "step_00000004", "step_00000006"]
    # ... and it ends exactly where an uninterrupted run ends
    assert main([str(a) for a in common] + ["--out", str(tmp_path / "clean")]) == 0
    assert losses(run) == losses(tmp_path / "clean")
    a, b = difftx.load_model(run).state_dict(), difftx.load_model(tmp_path / "clean").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def two_checkpoints(tmp_path, train_cli):
    run = tmp_path / "run"
    assert train_cli("--steps", 4, "--checkpoint-every", 2, "--eval-every", 0, "--out", run) == 0
    return run


@pytest.mark.parametrize("victim, how", [("model.safetensors", "truncate"), ("optimizer.pt", "truncate"),
                                         ("optimizer.pt", "garbage"), ("trainer_state.json", "garbage"),
                                         ("model.safetensors", "nan")])
def test_corrupt_checkpoint_names_the_file(two_checkpoints, train_cli, capsys, victim, how):
    """A complete step directory with a corrupt file is refused, not passed over (difftx never leaves one: its files
    are renamed into place whole): one line naming the file and how to resume the checkpoint before it; nothing
    is changed."""
    path = two_checkpoints / "checkpoints" / "step_00000004" / victim
    if how == "nan":  # a well-formed file whose weights are not finite
        from safetensors.torch import save_file
        from tests.conftest import load_owned

        sd = load_owned(path)
        sd["final_norm.weight"][0] = float("nan")
        save_file(sd, path)
    else:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 3] if how == "truncate" else b"\x00garbage" * 10)
    before = _files(two_checkpoints)
    assert train_cli("--steps", 6, "--out", two_checkpoints, "--resume", "auto") == 2
    err = capsys.readouterr().err
    assert str(path) in err and err.count("\n") == 1, err
    ckpts = two_checkpoints / "checkpoints"
    assert err.rstrip().endswith(f"rename {ckpts / 'step_00000004'} to step_00000004.corrupt (kept, and no longer a "
                                 f"checkpoint): --resume auto then takes {ckpts / 'step_00000002'}"), err
    assert _files(two_checkpoints) == before
    if how == "nan":
        assert "'final_norm.weight' holds 1 non-finite value" in err, err
    if victim == "model.safetensors":
        with pytest.raises(CheckpointError, match=victim) as e:
            difftx.load_model(two_checkpoints)
        assert str(e.value).endswith(f"load the one before it, {ckpts / 'step_00000002'}, by its path")
        assert "\n" not in str(e.value)


def _files(root):
    return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_the_way_a_corrupt_checkpoint_error_names_resumes_the_checkpoint_before_it(two_checkpoints, train_cli,
                                                                                   capsys, tmp_path):
    """The fix the error names works: renamed as it says, the corrupt directory is kept as it was and --resume auto
    continues from the step before; a run directory resumed into another --out gets --resume of that step, which
    leaves the source run as it was."""
    ckpts = two_checkpoints / "checkpoints"
    path = ckpts / "step_00000004" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:300])
    source, corrupt = _files(two_checkpoints), _files(ckpts / "step_00000004")
    capsys.readouterr()
    assert train_cli("--steps", 6, "--eval-every", 0, "--out", tmp_path / "fork", "--resume", two_checkpoints) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err, err
    assert err.rstrip().endswith(f"the checkpoint before it is complete: --resume {ckpts / 'step_00000002'}"), err
    assert train_cli("--steps", 6, "--eval-every", 0, "--out", tmp_path / "fork", "--resume",
                     ckpts / "step_00000002") == 0
    assert f"resuming from {ckpts / 'step_00000002'}" in capsys.readouterr().out
    assert _files(two_checkpoints) == source
    (ckpts / "step_00000004").rename(ckpts / "step_00000004.corrupt")
    assert train_cli("--steps", 6, "--checkpoint-every", 2, "--eval-every", 0, "--out", two_checkpoints,
                     "--resume", "auto") == 0
    assert f"resuming from {ckpts / 'step_00000002'}" in capsys.readouterr().out
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002", "step_00000004", "step_00000004.corrupt",
                                                       "step_00000006"]
    assert _files(ckpts / "step_00000004.corrupt") == corrupt


def test_pickled_code_in_a_checkpoint_is_never_run(two_checkpoints, train_cli, capsys, tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"state": Evil()}, two_checkpoints / "checkpoints" / "step_00000004" / "optimizer.pt")
    assert train_cli("--steps", 6, "--out", two_checkpoints, "--resume", "auto") == 2
    assert "weights_only" in capsys.readouterr().err
    assert not marker.exists()


def test_dcp_metadata_is_read_with_an_allow_list(tmp_path):
    import torch.distributed.checkpoint as dcp

    from difftx.train.checkpoint import _safe_dcp_reader

    with warnings.catch_warnings():  # no process group: dcp saves in one process, and says so
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save({"w": torch.randn(3, 4), "opt": {"step": torch.tensor(2.0)}},
                 storage_writer=dcp.FileSystemWriter(str(tmp_path / "ok")))
    meta = _safe_dcp_reader(tmp_path / "ok").read_metadata()
    assert "w" in meta.state_dict_metadata
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / "ok" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        _safe_dcp_reader(tmp_path / "ok").read_metadata()
    assert not marker.exists()


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, train_cli, capsys, monkeypatch):
    from difftx.train.domain import LMDomain

    real, calls = LMDomain.loss, {"n": 0}

    def poisoned(self, model, batch):
        calls["n"] += 1
        loss = real(self, model, batch)
        return loss * float("nan") if calls["n"] == 5 else loss  # the 5th micro-batch = step 5

    monkeypatch.setattr(LMDomain, "loss", poisoned)
    run = tmp_path / "run"
    assert train_cli("--steps", 8, "--checkpoint-every", 2, "--eval-every", 0, "--out", run) == 2
    err = capsys.readouterr().err
    assert "non-finite loss at step 5" in err and "step_00000004" in err and err.count("\n") == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    model = difftx.load_model(run)
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert max(r for r in losses(run, "step")) == 4


def test_an_update_that_makes_the_weights_non_finite_is_not_saved(tmp_path, train_cli, capsys, monkeypatch):
    """A step with a finite loss and gradient norm whose update overflowed the weights (an absurd --lr, weights near
    the float limit) was noticed only at the next step's loss: a checkpoint of that step was saved first, holding
    the inf, and the error named it as the last good checkpoint (which --resume auto then refused to load)."""
    from difftx.train import trainer as trainer_mod

    real, steps = trainer_mod.build_optimizer, {"n": 0}

    def overflowing(model, *args, **kwargs):
        opt = real(model, *args, **kwargs)
        step = opt.step

        def poisoned_step(*a, **k):
            out = step(*a, **k)
            steps["n"] += 1
            if steps["n"] == 4:  # step 4's update overflows one weight
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] = float("inf")
            return out

        opt.step = poisoned_step
        return opt

    monkeypatch.setattr(trainer_mod, "build_optimizer", overflowing)
    run = tmp_path / "run"
    assert train_cli("--steps", 8, "--checkpoint-every", 2, "--eval-every", 0, "--out", run) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "non-finite weights after the update of step 4" in err, err
    assert f"Last good checkpoint: {run / 'checkpoints' / 'step_00000002'}." in err, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]
    model = difftx.load_model(run)
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


def _damage(ckpt, how):
    """A step directory that lacks files, as a partial copy or sync (or a hand) leaves it; returns what is left."""
    import shutil

    if how == "emptied":
        shutil.rmtree(ckpt)
        ckpt.mkdir()
    elif how == "zero-length optimizer.pt":
        (ckpt / "optimizer.pt").write_bytes(b"")
    else:
        (shutil.rmtree if (ckpt / how).is_dir() else os.unlink)(ckpt / how)
    return {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}


@pytest.mark.parametrize("how", ["model.safetensors", "trainer_state.json", "config.json", "rng", "emptied",
                                 "zero-length optimizer.pt"])
def test_resume_auto_skips_an_incomplete_newest_checkpoint_keeps_it_and_resumes_exactly(
        two_checkpoints, train_cli, capsys, tmp_path, how):
    """A ``step_*`` directory missing files (never one difftx leaves: it renames a checkpoint into place whole) was
    picked by --resume auto as the newest and refused.  Now it is passed over with one warning line naming it, kept
    (renamed out of the list of checkpoints, nothing deleted), and the run resumes exactly from the one before."""
    ckpts = two_checkpoints / "checkpoints"
    left = _damage(ckpts / "step_00000004", how)
    capsys.readouterr()
    assert train_cli("--steps", 6, "--checkpoint-every", 2, "--eval-every", 0, "--out", two_checkpoints,
                     "--resume", "auto") == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "warning" in err and str(ckpts / "step_00000004") in err, err
    assert (how.split()[-1] if how != "emptied" else "model.safetensors") in err, err
    assert f"resuming from {ckpts / 'step_00000002'}" in out
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002", "step_00000004", "step_00000004.incomplete",
                                                       "step_00000006"]
    kept = ckpts / "step_00000004.incomplete"
    assert {p.relative_to(kept): p.read_bytes() for p in kept.rglob("*") if p.is_file()} == left
    assert train_cli("--steps", 6, "--checkpoint-every", 2, "--eval-every", 0, "--out", tmp_path / "clean") == 0
    assert losses(two_checkpoints) == losses(tmp_path / "clean")
    a, b = difftx.load_model(two_checkpoints).state_dict(), difftx.load_model(tmp_path / "clean").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("how", ["model.safetensors", "emptied"])
def test_explicit_resume_of_an_incomplete_checkpoint_fails_with_one_line(two_checkpoints, train_cli, capsys, how):
    """--resume PATH names the checkpoint to take: an incomplete one is refused (exit 2, one line naming it and what
    it lacks), and nothing is renamed or deleted.  An emptied one was called 'no checkpoint in it' before."""
    ckpts = two_checkpoints / "checkpoints"
    target = ckpts / "step_00000004"
    left = _damage(target, how)
    before = sorted(p.name for p in ckpts.iterdir())
    capsys.readouterr()
    assert train_cli("--steps", 6, "--out", two_checkpoints, "--resume", target) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert str(target) in err and "incomplete" in err and "model.safetensors" in err, err
    assert sorted(p.name for p in ckpts.iterdir()) == before
    assert {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()} == left


def test_resume_auto_with_every_checkpoint_incomplete_is_refused_and_changes_nothing(two_checkpoints, train_cli,
                                                                                       capsys):
    """No complete checkpoint left: --resume auto refuses (one line naming what each one lacks) rather than start
    the run over in place of them."""
    ckpts = two_checkpoints / "checkpoints"
    left = {step: _damage(ckpts / step, "optimizer.pt") for step in ("step_00000002", "step_00000004")}
    metrics = (two_checkpoints / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert train_cli("--steps", 6, "--checkpoint-every", 2, "--eval-every", 0, "--out", two_checkpoints,
                     "--resume", "auto") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no complete checkpoint" in err, err
    assert str(ckpts / "step_00000002" / "optimizer.pt") in err and str(ckpts / "step_00000004" / "optimizer.pt") in err
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002", "step_00000004"]
    assert all({p.relative_to(ckpts / s): p.read_bytes() for p in (ckpts / s).rglob("*") if p.is_file()} == left[s]
               for s in left)
    assert (two_checkpoints / "metrics.jsonl").read_bytes() == metrics


def test_a_resume_from_an_earlier_step_keeps_an_incomplete_later_directory(tmp_path, train_cli):
    """The later checkpoints of a resume from an earlier step go (another history); a later directory that lacks
    files is no checkpoint of it and is kept, renamed out of the list."""
    out, common = tmp_path / "run", ["--steps", 12, "--eval-every", 0, "--checkpoint-every", 4]
    assert train_cli(*common, "--out", out) == 0
    left = _damage(out / "checkpoints" / "step_00000012", "model.safetensors")
    assert train_cli(*common, "--out", out, "--resume", out / "checkpoints" / "step_00000004", "--stop-at", 6) == 0
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000004", "step_00000006", "step_00000012.incomplete"]
    kept = ckpts / "step_00000012.incomplete"
    assert {p.relative_to(kept): p.read_bytes() for p in kept.rglob("*") if p.is_file()} == left


def test_resume_of_a_run_directory_into_a_new_out_skips_its_incomplete_checkpoint_and_leaves_it(
        two_checkpoints, train_cli, capsys, tmp_path):
    """--resume RUN_DIR takes that run's newest complete checkpoint, as --resume auto does its own; continued into
    another --out, the source run is left exactly as it was (its incomplete directory not renamed)."""
    ckpts = two_checkpoints / "checkpoints"
    left = _damage(ckpts / "step_00000004", "model.safetensors")
    capsys.readouterr()
    assert train_cli("--steps", 6, "--checkpoint-every", 2, "--eval-every", 0, "--out", tmp_path / "fork",
                     "--resume", two_checkpoints) == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and str(ckpts / "step_00000004") in err and "renamed" not in err, err
    assert f"resuming from {ckpts / 'step_00000002'}" in out
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002", "step_00000004"]
    assert {p.relative_to(ckpts / "step_00000004"): p.read_bytes() for p in (ckpts / "step_00000004").rglob("*")
            if p.is_file()} == left
    assert train_cli("--steps", 6, "--checkpoint-every", 2, "--eval-every", 0, "--out", tmp_path / "clean") == 0
    a, b = difftx.load_model(tmp_path / "fork").state_dict(), difftx.load_model(tmp_path / "clean").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_corrupt_checkpoint_named_before_the_newest_names_the_one_before_it(tmp_path, train_cli, capsys):
    """--resume of a corrupt step_4 when step_6 is the run's newest: renaming step_4 would not make --resume auto
    take step_2 (it takes step_6), so the error names --resume of step_2."""
    run = tmp_path / "run"
    assert train_cli("--steps", 6, "--checkpoint-every", 2, "--eval-every", 0, "--out", run) == 0
    ckpts = run / "checkpoints"
    path = ckpts / "step_00000004" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:300])
    capsys.readouterr()
    assert train_cli("--steps", 6, "--eval-every", 0, "--out", run, "--resume", ckpts / "step_00000004") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "rename" not in err, err
    assert err.rstrip().endswith(f"the checkpoint before it is complete: --resume {ckpts / 'step_00000002'}"), err

def _same_weights(a, b):
    a, b = a.state_dict(), b.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("how", ["optimizer.pt", "rng", "model.safetensors"])
def test_load_model_of_a_run_takes_its_newest_complete_checkpoint(two_checkpoints, how):
    """difftx.load_model(RUN) took the newest step_* directory whatever it lacked: the weights of a checkpoint
    --resume auto passes over (its optimizer state or RNG state missing), or 'no difftx model here' (its weights
    missing).  Now it loads the checkpoint --resume auto takes, with a warning naming the one passed over."""
    ckpts = two_checkpoints / "checkpoints"
    _damage(ckpts / "step_00000004", how)
    with pytest.warns(UserWarning, match="skipped incomplete checkpoint") as caught:
        model = difftx.load_model(two_checkpoints)
    message = str(caught[0].message)
    assert str(ckpts / "step_00000004") in message and f"loading {ckpts / 'step_00000002'}" in message, message
    assert _same_weights(model, difftx.load_model(ckpts / "step_00000002"))
    if how != "model.safetensors":  # not step 4's weights, which it could read
        assert not _same_weights(model, difftx.load_model(ckpts / "step_00000004"))


def test_load_model_of_a_run_with_no_complete_checkpoint_is_one_error(two_checkpoints):
    """Every step_* directory incomplete: one CheckpointError naming the run, what each lacks and the fix (a
    step directory named directly still loads: it needs only its config and weights)."""
    ckpts = two_checkpoints / "checkpoints"
    for step in ("step_00000002", "step_00000004"):
        _damage(ckpts / step, "optimizer.pt")
    with pytest.raises(CheckpointError) as e:
        difftx.load_model(two_checkpoints)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{two_checkpoints}: no complete checkpoint"), msg
    assert all(str(ckpts / s / "optimizer.pt") in msg for s in ("step_00000002", "step_00000004")), msg
    assert "restore those files, or load one of them by its path" in msg, msg
    assert difftx.load_model(ckpts / "step_00000004").config.d_model == 32  # the way it names


def test_non_finite_loss_names_the_newest_complete_checkpoint_as_last_good(tmp_path, train_cli, capsys, monkeypatch):
    """The divergence error's 'Last good checkpoint' was the newest step_* directory, complete or not; now the one
    --resume auto would take (and load_model(RUN) loads)."""
    from difftx.train.domain import LMDomain

    real, calls, run = LMDomain.loss, {"n": 0}, tmp_path / "run"

    def poisoned(self, model, batch):
        calls["n"] += 1
        loss = real(self, model, batch)
        if calls["n"] == 5:  # step 5: step 4's checkpoint damaged in the meantime (a file deleted), then a NaN
            (run / "checkpoints" / "step_00000004" / "optimizer.pt").unlink()
            return loss * float("nan")
        return loss

    monkeypatch.setattr(LMDomain, "loss", poisoned)
    assert train_cli("--steps", 8, "--checkpoint-every", 2, "--eval-every", 0, "--out", run) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "non-finite loss at step 5" in err, err
    assert f"Last good checkpoint: {run / 'checkpoints' / 'step_00000002'}." in err, err


def _as_if_saved_by_two_processes(ckpt, rank_1=True):
    """Checkpoint ``ckpt`` as a run of 2 processes leaves it: world_size 2 in its trainer state, and (``rank_1``)
    the RNG state file of rank 1 beside rank 0's."""
    import json

    state = json.loads((ckpt / "trainer_state.json").read_text())
    (ckpt / "trainer_state.json").write_text(json.dumps({**state, "world_size": 2}))
    if rank_1:
        (ckpt / "rng" / "rank_1.json").write_bytes((ckpt / "rng" / "rank_0.json").read_bytes())


def test_a_checkpoint_of_several_processes_is_complete_only_with_the_rng_state_of_each(two_checkpoints):
    """Each process of a run writes rng/rank_N.json; the completeness check asked for rank_0.json only.  The
    number of processes comes from the checkpoint's trainer_state.json (a corrupt value: rank 0 only, as
    load_checkpoint reads it and reports it; a huge one does not list every rank)."""
    import json

    from difftx.train.checkpoint import missing_parts

    ckpt = two_checkpoints / "checkpoints" / "step_00000004"
    assert missing_parts(ckpt) == []
    _as_if_saved_by_two_processes(ckpt, rank_1=False)
    assert missing_parts(ckpt) == ["rng/rank_1.json"]
    (ckpt / "rng" / "rank_1.json").write_bytes(b"")  # empty: missing, as any other file
    assert missing_parts(ckpt) == ["rng/rank_1.json"]
    (ckpt / "rng" / "rank_1.json").write_bytes((ckpt / "rng" / "rank_0.json").read_bytes())
    assert missing_parts(ckpt) == []
    state = json.loads((ckpt / "trainer_state.json").read_text())
    (ckpt / "trainer_state.json").write_text(json.dumps({**state, "world_size": 10 ** 15}))
    assert missing_parts(ckpt) == ["rng/rank_2.json", "rng/rank_3.json", "rng/rank_4.json",
                                   f"rng/rank_N.json of {10 ** 15 - 5} more of the {10 ** 15} processes that saved it"]
    for bad in ("two", 0, None, True):
        (ckpt / "trainer_state.json").write_text(json.dumps({**state, "world_size": bad}))
        assert missing_parts(ckpt) == [], bad
    (ckpt / "rng" / "rank_0.json").unlink()
    assert missing_parts(ckpt) == ["rng/rank_0.json"]


def test_resume_passes_over_a_checkpoint_of_two_processes_that_lacks_one_rng_state(two_checkpoints, train_cli,
                                                                                    capsys):
    """A checkpoint of 2 processes without rng/rank_1.json was taken by --resume auto as complete (on one process
    nothing read rank 1's file; under torchrun rank 1 failed alone).  Now it is incomplete as a checkpoint lacking
    any other file: --resume auto passes over it (kept, renamed) for the one before, load_model(RUN) too, and a
    --resume naming it is refused in one line."""
    ckpts = two_checkpoints / "checkpoints"
    _as_if_saved_by_two_processes(ckpts / "step_00000002")
    _as_if_saved_by_two_processes(ckpts / "step_00000004", rank_1=False)
    with pytest.warns(UserWarning, match="rank_1.json"):
        assert _same_weights(difftx.load_model(two_checkpoints), difftx.load_model(ckpts / "step_00000002"))
    common = ["--steps", 6, "--checkpoint-every", 2, "--eval-every", 0, "--global-batch", 8, "--out", two_checkpoints]
    capsys.readouterr()
    assert train_cli(*common, "--resume", ckpts / "step_00000004") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "incomplete checkpoint" in err, err
    assert str(ckpts / "step_00000004" / "rng" / "rank_1.json") in err, err
    assert train_cli(*common, "--resume", "auto") == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and str(ckpts / "step_00000004") in err and "rng/rank_1.json" in err, err
    assert f"resuming from {ckpts / 'step_00000002'}" in out, out
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002", "step_00000004", "step_00000004.incomplete",
                                                       "step_00000006"]


def test_dcp_metadata_written_on_python_3_13_reads_on_any_python():
    """Python 3.13 pickles paths as pathlib._local.PosixPath: the allow-list refused them there (every FSDP resume
    failed on 3.13: "refusing to load pathlib._local.PosixPath"), and Python 3.10-3.12 have no such module.  The
    unpickler reads them as pathlib's classes on every version."""
    import io
    from pathlib import PurePosixPath

    from difftx.train.checkpoint import _AllowListUnpickler

    for module in (b"pathlib._local", b"pathlib"):  # protocol 2: PurePosixPath("a/b") as 3.13 and 3.12 write it
        data = b"\x80\x02c" + module + b"\nPurePosixPath\nX\x03\x00\x00\x00a/b\x85R."
        assert _AllowListUnpickler(io.BytesIO(data)).load() == PurePosixPath("a/b")
    with pytest.raises(pickle.UnpicklingError, match="refusing to load pathlib.Path "):  # not on the list
        _AllowListUnpickler(io.BytesIO(b"\x80\x02cpathlib._local\nPath\nX\x01\x00\x00\x00a\x85R.")).load()
