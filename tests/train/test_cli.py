"""Bad input gives one clear line and exit 2, and overwrites nothing; the default run's wiring."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from ._helpers import cli_env


def _snapshot(run):
    return {p.relative_to(run): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.rglob("*"))
            if p.is_file()}


@pytest.fixture
def existing_run(tmp_path, train_cli):
    run = tmp_path / "run"
    assert train_cli("--steps", 2, "--eval-every", 0, "--out", run) == 0
    return run


def _bad_inputs(tmp_path, corpus):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 40)
    saved_tok = tmp_path / "tok.json"
    from difftx.data.tokenizers import CharTokenizer

    CharTokenizer("abc \n").save(saved_tok)
    return {
        "missing": (["--data", tmp_path / "nope.txt"], "nope.txt: no such file"),
        "empty": (["--data", empty], "empty"),
        "binary": (["--data", binary], "binary"),
        "empty dir": (["--data", tmp_path / "emptydir"], "no text files"),
        "glob": (["--data", str(tmp_path / "*.nothing")], "matches no files"),
        "recipe": (["--recipe", "diff-4b"], "unknown recipe 'diff-4b'"),
        "preset": (["--preset", "gpt5"], "unknown preset"),
        "vocab": (["--vocab-size", "5"], "vocabulary (5) is smaller than the char tokenizer's"),
        "unservable tokenizer": (["--tokenizer", saved_tok], "is not in its vocabulary"),
        "tokenizer": (["--tokenizer", "sentencepiece"], "not byte, char, bpe"),
        "lr": (["--lr", "-1"], "lr: must be"),
        "task and data": (["--task", "nothing"], "either --task or --data"),
        "unhashable field": (["--set", 'norms=["S1"]'], "norms: unknown placement preset ['S1']"),
        "flag as a string": (["--set", "tie_embeddings=no"], "tie_embeddings: must be true or false"),
        "nan lambda": (["--set", "lambda_init=nan"], "lambda_init: must be 'schedule' or a finite number"),
        "null attention": (["--set", "attention=null"],  # was taken as "not given": trained the preset's kind
                           "attention: must be one of softmax, diff, diff2; got None"),
        "preset by --set": (["--set", "preset=5"], "preset: is the name of the preset"),
        "momentum with muon": (["--optimizer", "muon", "--momentum", "0.9"],  # 0.9 is the default: was ignored
                               "--momentum is read by msgdw and sgd, and this run trains with muon"),
        "betas with msgdw": (["--optimizer", "msgdw", "--betas", "0.9,0.95"],
                             "--betas is read by adamw and muon, and this run trains with msgdw"),
        "documents without an end-of-text token": (["--document-masking"],  # the char tokenizer has none
                                                   "--document-masking: needs the documents separated by an "
                                                   "end-of-text token, and the char tokenizer has none"),
    }


def test_bad_input_one_line_exit_2_nothing_overwritten(tmp_path, corpus, existing_run, train_cli, capsys):
    (tmp_path / "emptydir").mkdir()
    before = _snapshot(existing_run)
    for name, (args, message) in _bad_inputs(tmp_path, corpus).items():
        for resume in (False, True):
            out = ["--out", existing_run, "--resume", "auto"] if resume else ["--out", tmp_path / f"new-{name}"]
            code = train_cli(*args, *out)
            err = capsys.readouterr().err
            assert code == 2, (name, err)
            assert err.startswith("difftx train: error: ") and err.count("\n") == 1, (name, err)
            assert resume or message in err, (name, err)  # resuming may refuse the changed flag first
            assert not (tmp_path / f"new-{name}").exists(), name
    assert _snapshot(existing_run) == before


def test_a_recipes_optimizer_fields_do_not_refuse_another_optimizer(tmp_path, train_cli):
    """Only the user's own flags are checked against the optimiser: nanogpt-char's AdamW betas stay quiet when
    --optimizer msgdw replaces its AdamW."""
    assert train_cli("--recipe", "nanogpt-char", "--optimizer", "msgdw", "--steps", 1, "--eval-every", 0,
                     "--out", tmp_path / "run") == 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["optimizer"] == "msgdw"


def test_empty_out_is_refused_not_the_current_directory(tmp_path, corpus, train_cli, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SystemExit) as e:
        train_cli("--out", "")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == "difftx train: error: --out is empty; give a path (see --help)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("command, args", [
    ("train", ["--steps", "1"]), ("bench", ["--quick"]), ("grads", ["--only", "flow"]),
    ("compare", ["--steps", "1", "--seeds", "1", "--arms", "transformer:adamw", "--retrieval", "none"]),
])
def test_more_threads_than_cpus_is_one_line(tmp_path, capsys, command, args):
    """--threads 10^11 overflowed torch.set_num_threads (a ValueError traceback); 100000 crashed OpenMP (a
    segfault, after train had written its run directory).  More threads than this process's CPUs are refused
    before anything runs, by the dispatcher, for every command that has --threads."""
    import os

    from difftx.cli import main

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out = tmp_path / "out"
    for n in (10 ** 11, cpus + 1):
        with pytest.raises(SystemExit) as e:
            main([command, "--out", str(out), *args, "--threads", str(n)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err == (f"difftx {command}: error: --threads {n} is more than the {cpus} CPUs "
                                             f"this process can use; give at most {cpus} (see --help)\n"), err
    assert not out.exists()


@pytest.mark.parametrize("argv, flag", [
    (["train", "--steps", "1", "--preset", ""], "--preset"), (["train", "--steps", "1", "--recipe", ""], "--recipe"),
    (["grads", "--only", "flow", "--preset", ""], "--preset"), (["info", "nano", "--norms", ""], "--norms"),
])
def test_an_empty_name_is_refused_not_the_default(tmp_path, capsys, argv, flag):
    """--preset '', --recipe '' and --norms '' were taken as not given: train and grads ran the default preset (and
    no recipe), info described nano's own norms.  An empty name is a mistake, refused like an empty path."""
    from difftx.cli import main

    out = ["--out", str(tmp_path / "out")] if argv[0] != "info" else []
    with pytest.raises(SystemExit) as e:
        main(argv + out)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"difftx {argv[0]}: error: {flag} is empty; give a name (see --help)\n", err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, prog", [
    (["train", "--no-such-flag"], "difftx train"),
    (["eval", "lm", "--checkpoint", "c", "--out", "o", "--no-such-flag"], "difftx eval lm"),
    (["info", "small", "--no-such-flag"], "difftx info"),
    (["--no-such-flag"], "difftx"),
])
def test_unknown_flag(capsys, argv, prog):
    """named by the subcommand, as every other bad argument is (not "difftx: error:")"""
    from difftx.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"{prog}: error: unrecognized arguments: --no-such-flag (see --help)\n", err


def test_real_cli_bad_data_one_line(tmp_path):
    args = ["train", "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]
    r = subprocess.run([sys.executable, "-m", "difftx", *args], capture_output=True, text=True, env=cli_env())
    assert r.returncode == 2 and "missing.txt: no such file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_list_recipes(capsys):
    from difftx.cli import main

    assert main(["train", "--list-recipes"]) == 0
    out = capsys.readouterr().out
    for name in ("diff-3b", "diff-scaling", "dnt-adamw", "dnt-msgdw", "gpt2-adamw", "vit-adamw", "nanogpt-char"):
        assert name in out


def test_builtin_corpus_default_wiring(tmp_path, cache, capsys):
    """No --data: the standard-library corpus, byte tokenizer, nano preset; prints where it wrote."""
    from difftx.cli import main

    out = tmp_path / "run"
    assert main(["train", "--steps", "2", "--eval-every", "0", "--eval-batches", "1", "--no-progress",
                 "--cache-dir", str(cache), "--out", str(out), "--dtype", "fp32"]) == 0
    text = capsys.readouterr().out
    assert str(out) in text and "checkpoint:" in text and "nano" in text
    import json

    cfg = json.loads((out / "config.json").read_text())
    assert "standard library" in cfg["data"]["corpus"] and cfg["data"]["tokenizer"]["kind"] == "byte"
    assert cfg["model"]["d_model"] == 128 and cfg["model"]["vocab_size"] == 256


@pytest.mark.slow
def test_default_train_no_arguments(tmp_path):
    """`difftx train` with no arguments finishes and says where it wrote (about a minute on 2 cores)."""
    r = subprocess.run([sys.executable, "-m", "difftx", "train", "--no-progress"], cwd=tmp_path, capture_output=True,
                       text=True, env=cli_env(DIFFTX_CACHE=tmp_path / "cache"), timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "runs/" in r.stdout and "val_loss" in r.stdout
    assert len(list((tmp_path / "runs").iterdir())) == 1


@pytest.mark.parametrize("env", [{"DIFFTX_NATIVE_CFLAGS": "-mdifftx-no-such-flag"}, {"DIFFTX_NATIVE": "garbage"}])
def test_train_says_in_one_line_when_a_native_kernel_setting_kept_them_off(env, tmp_path, train_cli, capsys,
                                                                          monkeypatch):
    """A flag the compiler rejects (or a DIFFTX_NATIVE typo) trains on the torch path, as before, and says so
    in one warning line instead of nothing; no traceback."""
    import shutil

    from difftx.nn import native

    if "DIFFTX_NATIVE_CFLAGS" in env and not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler")
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "kernels"))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    native.reset()
    try:
        assert train_cli("--steps", 1, "--eval-every", 0, "--out", tmp_path / "run") == 0
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if "native CPU kernels" in line]
        assert len(lines) == 1 and lines[0].startswith("difftx train: warning: native CPU kernels: "), err
        assert "Traceback" not in err
    finally:
        monkeypatch.undo()
        native.reset()


def test_no_validation_split_writes_no_evaluation_rows(tmp_path, train_cli, capsys):
    """--val-fraction 0 leaves nothing to validate on: metrics.jsonl holds training rows only (it used to get a
    row {"step": N} at every evaluation, an evaluation row without a val_loss)."""
    import json

    out = tmp_path / "run"
    assert train_cli("--steps", 4, "--val-fraction", 0, "--eval-every", 2, "--out", out) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all("loss" in r for r in rows)


def test_a_val_fraction_that_rounds_to_no_token_is_refused(tmp_path, train_cli, capsys):
    """--val-fraction 1e-9 asks for a validation split and got none, silently: the run trained without one."""
    out = tmp_path / "run"
    assert train_cli("--steps", 2, "--val-fraction", 1e-9, "--out", out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the validation split has 0 tokens" in err[0] and "--val-fraction" in err[0], err
    assert not out.exists()


def test_the_summary_is_printed_by_rank_0_only(tmp_path, monkeypatch, capsys):
    """Under torchrun every process returns from train(); only rank 0 prints the summary (each of N processes
    printed it, so an 8-GPU run ended with 8 copies)."""
    import difftx.train
    from difftx.cli import main

    summary = {"run_dir": str(tmp_path), "step": 4, "steps": 4, "elapsed_s": 1.0, "checkpoint": None, "val_loss": 2.0}
    monkeypatch.setattr(difftx.train, "train", lambda *a, **k: summary)
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        assert main(["train", "--out", str(tmp_path / "run"), "--steps", "4"]) == 0
        assert ("difftx train: step 4/4" in capsys.readouterr().out) is printed


@pytest.mark.parametrize("argv, message", [
    (["train", "--steps", "1", "--out", " "], "--out is blank (' '); give a path"),
    (["grads", "--only", "flow", "--out", "  "], "--out is blank ('  '); give a path"),
    (["bench", "--quick", "--out", "\t"], "--out is blank ('\\t'); give a path"),
    (["eval", "mqar", "--checkpoint", "{ck}", "--out", " "], "--out is blank (' '); give a path"),
    (["convert", "{ck}", " ", "--to", "hf-difftx"], "DST is blank (' '); give a path"),
    (["train", "--steps", "1", "--preset", " ", "--out", "o"], "--preset is blank (' '); give a name"),
])
def test_a_blank_path_or_name_is_refused(tmp_path, capsys, monkeypatch, argv, message):
    """--out ' ' (and convert's DST ' ') made a directory named ' ' in the current directory and wrote the run
    there; a blank value is a mistake, refused like an empty one."""
    import difftx
    from difftx.cli import main

    (tmp_path / "ck").mkdir()
    cfg = difftx.ModelConfig.from_preset("nano", n_layers=1, d_model=32)
    difftx.save_model(difftx.build_model(cfg), tmp_path / "ck")
    monkeypatch.chdir(tmp_path)
    argv = [a.replace("{ck}", str(tmp_path / "ck")) for a in argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"difftx {argv[0]}: error: {message} (see --help)\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.parametrize("betas", ["0.9", "0.9,0.95,0.99", "a,b"])
def test_a_malformed_betas_says_what_it_expects(tmp_path, train_cli, capsys, betas):
    """--betas 0.9 said "invalid _betas value: '0.9'" (the name of a function, no fix): the message meant for it
    was dropped by argparse, which shows only an ArgumentTypeError's own."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train_cli("--betas", betas, "--out", out)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == (f"difftx train: error: argument --betas: expects two numbers like 0.9,0.95; "
                                         f"got {betas!r} (see --help)\n"), err
    assert not out.exists()


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "abc"}, "the environment variable WORLD_SIZE='abc' is not a whole number"),
    ({"RANK": "x1"}, "the environment variable RANK='x1' is not a whole number"),
    ({"LOCAL_RANK": "0.5"}, "the environment variable LOCAL_RANK='0.5' is not a whole number"),
    ({"RANK": "1"}, "WORLD_SIZE=1, RANK=1, LOCAL_RANK=0; torchrun sets 0 <= RANK < WORLD_SIZE"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0, RANK=0, LOCAL_RANK=0; torchrun sets 0 <= RANK < WORLD_SIZE"),
])
def test_a_malformed_torchrun_environment_is_one_line(tmp_path, existing_run, train_cli, capsys, monkeypatch, env,
                                                      message):
    """WORLD_SIZE=abc gave int()'s traceback; RANK=1 of one process (no rank 0 to prepare the data) an
    AttributeError deep in the token shards."""
    before = _snapshot(existing_run)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for out in (["--out", tmp_path / "new"], ["--out", existing_run, "--resume", "auto"]):
        assert train_cli("--steps", 2, "--eval-every", 0, *out) == 2
        err = capsys.readouterr().err
        assert err.startswith("difftx train: error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "new").exists() and _snapshot(existing_run) == before


def test_a_stale_validation_loss_in_the_summary_says_its_step(tmp_path, train_cli, capsys):
    """--stop-at between evaluations printed "step 3/4 ..., val_loss X" with step 2's val_loss, unlabelled."""
    run = tmp_path / "run"
    assert train_cli("--steps", 4, "--eval-every", 2, "--stop-at", 3, "--out", run) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("difftx train: step ")]
    assert line.startswith("difftx train: step 3/4 ") and line.endswith(" (evaluated at step 2)"), line
    assert train_cli("--steps", 4, "--eval-every", 2, "--out", run, "--resume", "auto") == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("difftx train: step ")]
    assert line.startswith("difftx train: step 4/4 ") and "val_loss" in line and "evaluated at" not in line, line


def test_a_warmup_as_long_as_the_run_is_a_warning(tmp_path, train_cli, capsys):
    """--steps 2 with the default --warmup 100 trained at 2% of --lr, never decaying, and said nothing."""
    assert train_cli("--steps", 2, "--warmup", 4, "--lr", "1e-3", "--eval-every", 0, "--out", tmp_path / "a") == 0
    err = capsys.readouterr().err
    assert ("difftx train: warning: the warmup (4 steps) is not shorter than the run (2 steps): the learning rate "
            "only reaches 0.0005 of --lr 0.001 and its cosine schedule never starts; give --warmup below 2\n") in err
    assert train_cli("--steps", 2, "--eval-every", 0, "--out", tmp_path / "b") == 0  # --warmup 1: no warning
    assert "warmup" not in capsys.readouterr().err


def test_the_command_skips_the_interpreter_teardown_only_after_ending_a_process_group(tmp_path, monkeypatch):
    """``difftx`` (cli.entry) ends with os._exit(main's code) in a process that started and ended a process group
    (torchrun: the teardown of gloo's threads killed finished workers), and returns normally otherwise."""
    import torch.distributed as dist

    from difftx import cli
    from difftx.train import distributed

    monkeypatch.setattr(distributed, "_ENDED_A_GROUP", False)
    monkeypatch.setattr(cli, "main", lambda: 3)
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    assert cli.entry() == 3 and exits == []
    distributed.shutdown_world(distributed.World(owns_group=True))  # no group to end: still the normal exit
    assert cli.entry() == 3 and exits == []
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    distributed.shutdown_world(distributed.World(owns_group=False))  # a caller's own group is left alone
    assert dist.is_initialized()
    distributed.shutdown_world(distributed.World(owns_group=True))
    assert not dist.is_initialized()
    cli.entry()
    assert exits == [3]
