"""Bad flags, output paths and checkpoints: one line, exit 2, and nothing of an existing run is touched."""

import hashlib
import json
import os
import pickle
import warnings

import pytest
import torch

from difftx.errors import DifftxError


def _snapshot(run):
    return {p.relative_to(run): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.rglob("*"))
            if p.is_file()}


def _one_line(capsys):
    err = capsys.readouterr().err
    assert err.startswith("difftx train: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def run4(tmp_path, train_cli):
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    run = tmp_path / "run"
    assert train_cli("--steps", 4, "--checkpoint-every", 2, "--eval-every", 0, "--out", run) == 0
    return run


@pytest.mark.parametrize("where", ["file", "under a file", "proc"])
def test_unusable_out_names_the_flag(tmp_path, train_cli, corpus, cache, capsys, where):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    out = {"file": afile, "under a file": afile / "run", "proc": "/proc/difftx-run"}[where]
    assert train_cli("--steps", 1, "--eval-every", 0, "--out", out) == 2
    err = _one_line(capsys)
    assert f"--out {out}:" in err and "pick" in err, err
    assert afile.read_text() == "keep me"
    # the library says the same (an OSError traceback before)
    from difftx.train import resolve_configs, train

    tcfg, mcfg = resolve_configs(train=dict(data=str(corpus), cache_dir=str(cache), tokenizer="char", seq_len=16,
                                            batch_size=2, steps=1, eval_every=0, progress=False),
                                 model=dict(d_model=32, n_layers=2, n_heads=2))
    with pytest.raises(DifftxError, match="--out"):
        train(tcfg, mcfg, out, announce=None)


def test_log_every_zero_refused_and_zero_intervals_mean_off(tmp_path, train_cli, capsys):
    assert train_cli("--steps", 3, "--log-every", 0, "--out", tmp_path / "a") == 2
    assert "--log-every: must be a positive integer" in _one_line(capsys)
    assert not (tmp_path / "a").exists()
    run = tmp_path / "b"  # the intervals documented as "0: off / only at the end" train fine
    assert train_cli("--steps", 3, "--eval-every", 0, "--diag-every", 0, "--checkpoint-every", 0, "--out", run) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [3] and not any("lambdas" in r for r in rows)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003"]


@pytest.mark.parametrize("flags, message", [
    (["--epochs", "nan"], "epochs: must be a finite number > 0; got nan"),
    (["--epochs", "inf"], "epochs: must be a finite number > 0; got inf"),
    (["--epochs", "0"], "epochs: must be a finite number > 0; got 0"),
    (["--epochs", "1", "--warmup-epochs", "nan"], "--warmup-epochs: must be a finite number >= 0; got nan"),
    (["--steps", "3", "--warmup-epochs", "1"], "--warmup-epochs: needs --epochs"),
    (["--epochs", "1", "--warmup-epochs", "0.5"], "warmup: give the warmup in steps"),  # beside train_cli's --warmup 1
    (["--epochs", "1e308"], "epochs: 1e+308 epochs of"),  # finite, but not as a count of steps (a traceback before)
    (["--steps", "3", "--domain-opt", "bogus=1"], "the lm domain takes no options (got bogus)"),
    # accepted and ignored before: the tokenizer here is char, the corpus a .txt file
    (["--steps", "3", "--bpe-vocab-size", "300"], "--bpe-vocab-size: sizes the vocabulary of --tokenizer bpe"),
    (["--steps", "3", "--text-field", "body"], "--text-field: names the field of JSONL records or a dataset column"),
    (["--steps", "3", "--optimizer", "muon", "--momentum", "0.5"], "momentum: Muon keeps its own momentum"),
    (["--steps", "3", "--optimizer", "muon", "--nesterov"], "nesterov: Muon keeps its own momentum"),
])
def test_epochs_and_domain_options_checked(tmp_path, train_cli, capsys, flags, message):
    assert train_cli(*flags, "--out", tmp_path / "new") == 2
    assert message in _one_line(capsys)
    assert not (tmp_path / "new").exists()


def test_a_recipes_bpe_vocab_size_is_not_refused_under_another_tokenizer():
    """--bpe-vocab-size is refused when the tokenizer is not bpe, but a recipe's own value, kept when --tokenizer
    overrides the recipe's bpe, is not the user's to drop."""
    from difftx.train import resolve_configs
    from difftx.train.run import _check_unread

    tcfg, _ = resolve_configs("diff-3b", dict(tokenizer="byte"))
    _check_unread(tcfg, {"tokenizer", "bpe_vocab_size"})  # the recipe's fields count as explicit
    with pytest.raises(DifftxError, match="bpe_vocab_size: sizes the vocabulary of --tokenizer bpe"):
        _check_unread(tcfg.replace(bpe_vocab_size=512), {"tokenizer", "bpe_vocab_size"})


def test_min_lr_with_a_constant_schedule_is_refused_not_ignored(tmp_path, train_cli, capsys):
    """--min-lr is where a cosine or linear schedule decays to; with --schedule constant no step reads it, and the
    run trained at --lr throughout, silently.  A recipe's own min_lr under --schedule constant is not the user's."""
    from difftx.train import resolve_configs
    from difftx.train.run import _check_unread

    out = tmp_path / "run"
    assert train_cli("--steps", 2, "--schedule", "constant", "--min-lr", 1e-5, "--out", out) == 2
    err = capsys.readouterr().err
    assert err.startswith("difftx train: error: --min-lr: ") and "drop --min-lr" in err and err.count("\n") == 1, err
    assert not out.exists()
    tcfg, _ = resolve_configs("nanogpt-char", dict(schedule="constant"))
    _check_unread(tcfg, {"schedule", "min_lr"})  # the recipe's fields count as explicit
    _check_unread(tcfg.replace(schedule="cosine", min_lr=1e-5), {"min_lr"})
    assert train_cli("--steps", 2, "--schedule", "constant", "--eval-every", 0, "--out", out) == 0


def test_a_constant_schedule_takes_an_lr_below_the_default_min_lr(tmp_path, train_cli, capsys):
    """min_lr is unread under --schedule constant, so its default (1e-4) must not refuse a smaller --lr: --min-lr,
    the only way around that check, is itself refused there.  Under a decay the check stays, one line."""
    from difftx.train import TrainConfig

    assert TrainConfig(schedule="constant", lr=1e-5).min_lr == 1e-4
    out = tmp_path / "run"
    assert train_cli("--steps", 1, "--schedule", "constant", "--lr", 5e-5, "--eval-every", 0, "--out", out) == 0
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["lr"] == 5e-5
    capsys.readouterr()
    assert train_cli("--steps", 1, "--lr", 5e-5, "--out", tmp_path / "cosine") == 2
    assert "min_lr: (0.0001) must not exceed lr" in _one_line(capsys)


def test_recipe_epochs_give_way_to_steps_and_warmup():
    """--steps and --warmup beat a recipe's epochs and warmup_epochs (both dropped, not half-kept); --warmup alone
    beats its warmup_epochs (it was ignored, and the run's own command then could not resume it)."""
    from difftx.train import resolve_configs

    tcfg, _ = resolve_configs("vit-tiny-adamw", train=dict(steps=10, warmup=2))
    assert (tcfg.steps, tcfg.warmup, tcfg.epochs, tcfg.warmup_epochs) == (10, 2, None, None)
    tcfg, _ = resolve_configs("vit-tiny-adamw", train=dict(steps=40))
    assert tcfg.epochs is None and tcfg.warmup_epochs is None and tcfg.warmup == 3  # 3 of 40 epochs -> 3 of 40 steps
    tcfg, _ = resolve_configs("vit-tiny-adamw", train=dict(warmup=2))  # --warmup beats its warmup epochs too
    assert (tcfg.epochs, tcfg.warmup, tcfg.warmup_epochs) == (40, 2, None)


def test_steps_beside_epochs_is_refused_not_ignored(tmp_path, train_cli, capsys):
    """--epochs sets the run's step count from the data, so --steps beside it was accepted and ignored (--steps 2
    --epochs 1 ran 416 steps).  A recipe's epochs still give way to an explicit --steps (the test above)."""
    from difftx.train import resolve_configs

    out = tmp_path / "run"
    assert train_cli("--steps", 2, "--epochs", 1, "--out", out) == 2
    err = capsys.readouterr().err
    assert err.startswith("difftx train: error: --steps: ") and "not both" in err and err.count("\n") == 1, err
    assert not out.exists()
    with pytest.raises(DifftxError, match="steps"):
        resolve_configs(None, train=dict(steps=10, epochs=2))
    assert resolve_configs(None, train=dict(epochs=2))[0].epochs == 2


def test_a_stop_step_past_the_last_step_is_refused(tmp_path, train_cli, capsys):
    """--stop-at beyond --steps never stopped the run: it trained to --steps and ended there, silently, where a
    --stop-at at or before the resumed step is refused.  At --steps it is the run's own end, and allowed."""
    out = tmp_path / "run"
    assert train_cli("--steps", 2, "--stop-at", 5, "--out", out) == 2
    err = capsys.readouterr().err
    assert err.startswith("difftx train: error: --stop-at: 5 is past the run's last step, 2") and err.count("\n") == 1
    assert not out.exists()
    assert train_cli("--steps", 2, "--stop-at", 2, "--eval-every", 0, "--out", out) == 0


def test_a_saved_config_with_the_old_ignored_warmup_epochs_still_loads():
    """Runs saved before --warmup-epochs without --epochs was refused (a recipe's, kept beside --steps and
    --warmup) still resume: the field was ignored then and is dropped on loading; a new config is refused."""
    from difftx.train.config import TrainConfig

    saved = {**TrainConfig(steps=10, warmup=2).to_dict(), "warmup_epochs": 3}
    assert TrainConfig.from_dict(saved) == TrainConfig(steps=10, warmup=2)
    with pytest.raises(DifftxError, match="warmup_epochs"):
        TrainConfig(steps=10, warmup_epochs=3)


@pytest.mark.parametrize("state", [{"step": "x"}, {"step": None}, {"tokens_seen": 3}, {"step": 4.5},
                                   {"step": 4, "tokens_seen": "many"}, {"step": 4, "last_eval": [1]},
                                   {"step": 4, "elapsed_s": float("nan")}, {"step": 4, "micro_batches": "x"},
                                   {"step": 4, "world_size": None}, {"step": 4, "world_size": 0},
                                   {"step": 4, "micro_batches": 1.5}])
def test_wrong_types_in_trainer_state(run4, train_cli, capsys, state):
    path = run4 / "checkpoints" / "step_00000004" / "trainer_state.json"
    path.write_text(json.dumps(state))
    before = _snapshot(run4)
    assert train_cli("--steps", 6, "--out", run4, "--resume", "auto") == 2
    err = _one_line(capsys)
    assert str(path) in err and "corrupt" in err, err
    assert _snapshot(run4) == before


def _evil(path, marker):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"state": Evil()}, path)


@pytest.mark.parametrize("victim, how", [("optimizer.pt", "garbage"), ("optimizer.pt", "missing"),
                                         ("optimizer.pt", "code"), ("model.safetensors", "garbage"),
                                         ("trainer_state.json", "bad step"), ("rng/rank_0.json", "bad state"),
                                         ("rng/rank_0.json", "missing")])
def test_failed_resume_changes_nothing(run4, train_cli, capsys, tmp_path, victim, how):
    """config.json (and every other file) stays as it was when the checkpoint cannot be resumed. A missing RNG
    state of a process the checkpoint was saved by is an incomplete checkpoint (it resumed with fresh RNGs: dropout
    drew other masks than the run in one go)."""
    path = run4 / "checkpoints" / "step_00000004" / victim
    if how == "garbage":
        path.write_bytes(bytes(torch.randint(0, 256, (400,), generator=torch.Generator().manual_seed(1)).tolist()))
    elif how == "missing":
        path.unlink()
    elif how == "code":
        _evil(path, tmp_path / "pwned")
    elif how == "bad step":
        path.write_text('{"step": "x"}')
    else:
        path.write_text('{"torch": 1}')
    before = _snapshot(run4)
    # a checkpoint that lacks a file is passed over by --resume auto (test_faults.py); named, it is refused
    resume = run4 / "checkpoints" / "step_00000004" if how == "missing" else "auto"
    assert train_cli("--steps", 6, "--out", run4, "--resume", resume) == 2  # --steps 6 would change config.json
    assert str(path) in _one_line(capsys)
    assert _snapshot(run4) == before
    assert not (tmp_path / "pwned").exists()


def test_resume_past_steps_refused(run4, train_cli, capsys):
    before = _snapshot(run4)
    assert train_cli("--steps", 3, "--out", run4, "--resume", "auto") == 2
    err = _one_line(capsys)
    assert "step_00000004" in err and "pass a larger --steps" in err, err
    assert _snapshot(run4) == before


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("content", ["random", "torch.save code", "pickle code"])
def test_unloadable_optimizer_state_whole_message_no_warning(run4, train_cli, capsys, tmp_path, content):
    path = run4 / "checkpoints" / "step_00000004" / "optimizer.pt"
    if content == "random":  # seeded: which error torch raises depends on the bytes
        path.write_bytes(bytes(torch.randint(0, 256, (400,), generator=torch.Generator().manual_seed(0)).tolist()))
    elif content == "torch.save code":
        _evil(path, tmp_path / "pwned")
    else:  # a plain pickle (protocol 4): torch also warns about the protocol before refusing it
        path.write_bytes(pickle.dumps(_Evil(tmp_path / "pwned")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train_cli("--steps", 6, "--out", run4, "--resume", "auto") == 2
    err = _one_line(capsys)
    refused = (f"{path}: not a weights-only torch file (torch.load(weights_only=True) refused it): corrupt, or "
               "unsafe pickled objects (nothing in it was run); use another checkpoint; ")
    unreadable = f"{path}: not a readable optimizer state ("  # random bytes may fail before the unpickler
    assert refused in err or (content == "random" and unreadable in err and
                              "the file is truncated or corrupt, use another checkpoint; " in err), err
    assert err.rstrip().endswith(f"--resume auto then takes {run4 / 'checkpoints' / 'step_00000002'}"), err  # the way
    assert not [w for w in caught if issubclass(w.category, UserWarning)], [str(w.message)[:200] for w in caught]
    assert not (tmp_path / "pwned").exists()


def test_a_seed_too_large_for_torch_is_one_line(tmp_path, train_cli, capsys):
    assert train_cli("--steps", 2, "--seed", 2 ** 64, "--out", tmp_path / "run") == 2
    assert "seed" in _one_line(capsys)
    assert not (tmp_path / "run").exists()


def test_nesterov_without_momentum_is_one_line(tmp_path, train_cli, capsys):
    assert train_cli("--steps", 2, "--optimizer", "sgd", "--nesterov", "--momentum", 0, "--out", tmp_path / "run") == 2
    assert "nesterov" in _one_line(capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("field, value", [("betas", 5), ("task_options", 5), ("domain_options", [1]), ("seed", "x"),
                                          ("steps", None)])
def test_a_corrupt_config_in_the_checkpoint_names_the_file(run4, train_cli, capsys, field, value):
    path = run4 / "checkpoints" / "step_00000004" / "config.json"
    config = json.loads(path.read_text())
    config["train"][field] = value
    path.write_text(json.dumps(config))
    before = _snapshot(run4)
    assert train_cli("--steps", 6, "--out", run4, "--resume", "auto") == 2
    err = _one_line(capsys)
    assert str(path) in err and "corrupt" in err, err
    assert _snapshot(run4) == before


def test_a_checkpoint_of_another_format_is_not_resumed(run4, train_cli, capsys):
    """A checkpoint whose config.json has another difftx_format (a newer difftx's) was resumed as if it were this
    one's, and the run rewritten in format 1; loading the same checkpoint (difftx eval, load_model) refuses it."""
    path = run4 / "checkpoints" / "step_00000004" / "config.json"
    config = json.loads(path.read_text())
    config["difftx_format"] = 99
    path.write_text(json.dumps(config))
    before = _snapshot(run4)
    assert train_cli("--steps", 6, "--out", run4, "--resume", "auto") == 2
    err = _one_line(capsys)
    assert f"{path}: difftx_format 99, but this difftx reads format 1" in err, err
    assert _snapshot(run4) == before


def _resume_in_a_subprocess(run, corpus, cache):
    """``difftx train --resume auto`` of ``run`` (the run4 flags) in its own process: a crash there is a result."""
    import subprocess
    import sys

    from ._helpers import cli_env

    args = ["train", "--data", corpus, "--cache-dir", cache, "--tokenizer", "char", "--d-model", 32, "--n-layers", 2,
            "--n-heads", 2, "--seq-len", 16, "--batch-size", 4, "--warmup", 1, "--dtype", "fp32", "--eval-batches", 2,
            "--no-progress", "--seed", 7, "--checkpoint-every", 2, "--eval-every", 0, "--steps", 6, "--out", run,
            "--resume", "auto"]
    return subprocess.run([sys.executable, "-m", "difftx", *map(str, args)], capture_output=True, text=True,
                          env=cli_env(), timeout=300)


@pytest.mark.parametrize("how", ["a tensor", "a smaller moment", "a transposed moment", "a step of many numbers",
                                 "a non-finite moment"])
def test_an_optimizer_state_that_does_not_fit_the_model_is_one_line(run4, corpus, cache, how):
    """torch's Optimizer.load_state_dict checks the groups' sizes, not the state's shapes: a moment smaller than its
    parameter made the fused AdamW step read and write past it (a segfault), a transposed one trained on silently, a
    tensor instead of a state dict or a step of 1000 numbers was a traceback. Now each is one line naming the file."""
    path = run4 / "checkpoints" / "step_00000004" / "optimizer.pt"
    sd = torch.load(path, weights_only=True)
    state = next(s for s in sd["state"].values() if s["exp_avg"].ndim == 2 and len(set(s["exp_avg"].shape)) == 2)
    if how == "a tensor":
        sd = torch.zeros(3)
    elif how == "a smaller moment":
        state["exp_avg"] = torch.zeros(3)
    elif how == "a transposed moment":
        state["exp_avg"] = state["exp_avg"].T.contiguous()
    elif how == "a step of many numbers":
        state["step"] = torch.zeros(1000)
    else:
        state["exp_avg_sq"] = state["exp_avg_sq"] * float("nan")
    torch.save(sd, path)
    before = _snapshot(run4)
    proc = _resume_in_a_subprocess(run4, corpus, cache)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"difftx train: error: {path}: ") and "corrupt" in lines[0], lines
    assert _snapshot(run4) == before


def test_a_resume_that_inherits_tensorboard_without_the_package_writes_nothing(run4, train_cli, capsys, monkeypatch):
    """The tensorboard check read the flags given, not the config being resumed: a run saved with --tensorboard,
    resumed where the package is missing, rewrote config.json (its --steps) before failing at the first log."""
    import sys

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    for path in (run4 / "config.json", *(run4 / "checkpoints").glob("step_*/config.json")):
        config = json.loads(path.read_text())
        config["train"]["tensorboard"] = True
        path.write_text(json.dumps(config))
    before = _snapshot(run4)
    assert train_cli("--steps", 6, "--out", run4, "--resume", "auto") == 2
    assert "pip install 'difftx[tensorboard]'" in _one_line(capsys)
    assert _snapshot(run4) == before


def test_no_tensorboard_turns_off_the_logging_a_resumed_run_inherits(run4, train_cli, capsys, monkeypatch):
    """A run saved with --tensorboard could not be resumed without it (no flag turned it off): where the package
    is missing, the resume was refused; --no-tensorboard now continues it without the tensorboard log."""
    import sys

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    for path in (run4 / "config.json", *(run4 / "checkpoints").glob("step_*/config.json")):
        config = json.loads(path.read_text())
        config["train"]["tensorboard"] = True
        path.write_text(json.dumps(config))
    assert train_cli("--steps", 6, "--out", run4, "--resume", "auto", "--no-tensorboard") == 0, capsys.readouterr().err
    assert json.loads((run4 / "config.json").read_text())["train"]["tensorboard"] is False
    assert not (run4 / "tensorboard").exists()
    assert train_cli("--tensorboard", "--no-tensorboard", "--steps", 1, "--out", run4 / "x") == 0  # the last wins


def test_a_failing_corpus_run_prints_its_error_alone_and_a_good_one_the_skipped_files(tmp_path, train_cli, corpus,
                                                                                      capsys):
    """The 'skipped N empty or binary file(s)' note went to stderr as the corpus was read, so a run that then failed
    (no text file left, a --seq-len the data cannot fill, --text-field on plain text) printed two lines; the error
    is the one line now, and the note comes once every input check has passed (as the vision domain's)."""
    books = tmp_path / "books"
    books.mkdir()
    (books / "cover.png").write_bytes(b"\x89PNG\x00\x00\x01")
    out = tmp_path / "run"
    assert train_cli("--data", books, "--steps", 1, "--out", out) == 2
    err = _one_line(capsys)
    assert "no text files found" in err and "cover.png" in err, err
    (books / "story.txt").write_text(corpus.read_text())
    assert train_cli("--data", books, "--steps", 1, "--seq-len", 100_000, "--out", out) == 2
    assert "fewer than seq_len + 1" in _one_line(capsys)
    assert train_cli("--data", books, "--steps", 1, "--text-field", "body", "--out", out) == 2
    assert "drop --text-field" in _one_line(capsys)
    assert not out.exists()
    assert train_cli("--data", books, "--steps", 1, "--eval-every", 0, "--out", out) == 0
    err = capsys.readouterr().err
    assert f"difftx: skipped 1 empty or binary file(s) in {books} (first: {books / 'cover.png'})" in err, err
    assert "error" not in err
