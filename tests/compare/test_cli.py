"""``difftx compare`` argument handling: bad input is one line and exit 2, nothing clobbered; resume; --force."""

from __future__ import annotations

import json

import pytest

from difftx.cli.compare import explicit_fields, parse_lr, parse_sweep
from difftx.compare import StudyConfig
from difftx.errors import ConfigError


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def compare(capsys):
    """``difftx compare ARGS`` in this process (the dispatcher's error handling included): a Result."""
    from difftx.cli import main

    def run(*args):
        capsys.readouterr()
        try:
            code = main(["compare", *map(str, args)])
        except SystemExit as e:  # argparse errors
            code = e.code
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run


def _one_line_error(p) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "error:" in lines[0]
    return lines[0]


@pytest.mark.parametrize("args, needle", [
    (["--arms", "transformer:adam"], "unknown optimizer 'adam'"),
    (["--arms", "gpt:adamw"], "unknown lm model 'gpt'"),
    (["--arms", "diff:adamw,diff:adamw"], "listed twice"),
    (["--seeds", "0"], "seeds"),
    (["--lr", "adamw"], "KEY=LR"),
    (["--lr", "lion=1e-3"], "neither an optimiser"),
    (["--lr-sweep", "adamw=1e-3:x"], "expects a number"),
    # "" (or only commas) read as "not given": the default rates ran, or no sweep at all
    (["--lr", ""], "KEY=LR"),
    (["--lr", ","], "KEY=LR"),
    (["--lr", "=3e-3"], "KEY=LR"),
    (["--lr-sweep", ""], "OPT=LR:LR"),
    (["--lr-sweep", " , "], "OPT=LR:LR"),
    (["--lr-sweep", "=1e-3"], "OPT=LR:LR"),
    (["--preset", "vit-tiny"], "vision model"),
    (["--preset", "no-such-preset"], "preset"),
    (["--set", "d_model=-3"], "d_model"),
    (["--data", "/nonexistent/corpus.txt"], "corpus.txt"),
    (["--domain", "vision", "--retrieval", "mqar"], "retrieval"),
    (["--retrieval-opt", "pairs=9-2"], "pairs"),
    (["--tokens", "x"], "invalid int"),
    (["--activation-checkpointing", "-1"], "--activation-checkpointing: must be a non-negative integer"),
    (["--document-masking"], "--document-masking: needs the documents separated by an end-of-text token, and the "
                             "byte tokenizer has none"),
    (["--domain", "vision", "--document-masking"], "--document-masking: keeps a language corpus's documents apart"),
    # an option the study would not read is refused, not ignored
    (["--tokens", "1000", "--steps", "3"], "--tokens/--steps: are two budgets"),
    (["--retrieval-tokens", "1000", "--retrieval-steps", "3"], "--retrieval-tokens/--retrieval-steps"),
    (["--retrieval", "none", "--retrieval-tokens", "1000"], "--retrieval-tokens: is an option of the retrieval"),
    (["--retrieval", "none", "--retrieval-opt", "pairs=2-4"], "--retrieval-opt: is an option of the retrieval"),
    (["--retrieval", "none", "--retrieval-samples", "8"], "--retrieval none trains none"),
    (["--domain", "vision", "--retrieval-seq-len", "32"], "a vision study trains no retrieval task"),
    (["--domain", "vision", "--outlier-tokens", "512"], "--outlier-tokens: a language-study option"),
    (["--domain", "vision", "--eval-batches", "2"], "--eval-batches: a vision study evaluates its whole"),
    (["--domain", "vision", "--cache-dir", "unread-cache"], "--cache-dir: a language-study option"),
    (["--schedule", "constant", "--min-lr-ratio", "0.05"], "--min-lr-ratio: sets the rate a cosine or linear"),
])
def test_bad_input_is_one_line_exit_2(compare, tmp_path, args, needle):
    p = compare( "--out", tmp_path / "out", *args, "--no-progress")
    assert needle in _one_line_error(p)
    assert not (tmp_path / "out").exists()


def test_bad_input_through_the_real_cli(cli, tmp_path):
    p = cli("compare", "--out", tmp_path / "out", "--arms", "transformer:adam")
    assert "unknown optimizer" in _one_line_error(p) and p.stderr.startswith("difftx compare: error:")


def test_refuses_a_foreign_non_empty_dir(compare, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    for extra in ([], ["--force"], ["--resume"]):
        p = compare("--out", out, "--steps", "1", "--no-progress", *extra)
        _one_line_error(p)
    assert (out / "notes.txt").read_text() == "precious" and sorted(f.name for f in out.iterdir()) == ["notes.txt"]


def test_resume_keeps_finished_jobs_and_refuses_changes(compare, mini_study):
    out, res, _ = mini_study
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("job.json")}
    p = compare("--out", out)  # a study is there: refused, nothing changed
    assert "--resume" in _one_line_error(p)
    p = compare("--out", out, "--resume", "--seeds", "3", "--no-progress")
    assert "seeds" in _one_line_error(p)
    p = compare("--out", out, "--resume", "--no-progress", "--workers", "1")
    assert p.returncode == 0, p.stderr[-2000:]
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("job.json")} == stamps  # no job ran again
    again = json.loads((out / "results.json").read_text())
    assert again["command"] == res["command"]  # the study's own command, to reproduce it
    assert again["study"] == {**res["study"], "workers": 1}  # only runtime fields may change on resume
    strip = lambda r: {k: v for k, v in r.items() if k not in ("timing", "study")}  # noqa: E731
    assert strip(again) == strip(res)


def test_a_resume_with_nothing_left_to_run_keeps_the_studys_timing(compare, mini_study, tmp_path):
    """--resume on a finished study rewrote results.json and report.md with the resume's own cost: "Wall time: 0 s"
    and no CPU time of the whole study, for a study that had taken a minute."""
    import shutil

    src, res, _ = mini_study
    out = tmp_path / "out"
    shutil.copytree(src, out)
    before = json.loads((out / "results.json").read_text())
    report = (out / "report.md").read_text()
    p = compare("--out", out, "--resume", "--no-progress")
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads((out / "results.json").read_text())["timing"] == before["timing"]
    assert (out / "report.md").read_text() == report
    assert f"({before['timing']['wall_s']:.0f} s)" in p.stdout


def test_a_study_resumes_with_its_corpus_at_another_path(compare, mini_study, corpus, tmp_path, monkeypatch):
    """A study started with a relative --data could not be resumed from another directory: its path was missing
    there, and --data with the corpus's path was refused as a changed setting.  The same contents (the fingerprint
    its corpus runs recorded) at another path are accepted; other contents are still refused."""
    import shutil

    src, res, _ = mini_study
    out = tmp_path / "out"
    shutil.copytree(src, out)
    saved = json.loads((out / "study.json").read_text())
    saved["study"]["data"] = "corpus.txt"  # as started from corpus's directory with a relative path
    (out / "study.json").write_text(json.dumps(saved))
    monkeypatch.chdir(tmp_path)  # another directory: no corpus.txt here
    report = (out / "report.md").read_text()
    err = _one_line_error(compare("--out", out, "--resume", "--no-progress"))
    assert "a relative path is read from the current directory" in err and "pass --data" in err
    other = tmp_path / "other.txt"
    other.write_text(corpus.read_text() + "more")
    err = _one_line_error(compare("--out", out, "--resume", "--no-progress", "--data", other))
    assert "data: is 'corpus.txt' in the study being resumed" in err and "other contents" in err
    assert (out / "report.md").read_text() == report
    moved = tmp_path / "moved.txt"
    shutil.copyfile(corpus, moved)
    p = compare("--out", out, "--resume", "--no-progress", "--data", moved)
    assert p.returncode == 0, p.stderr[-2000:]
    again = json.loads((out / "results.json").read_text())
    assert again["arms"] == res["arms"] and again["questions"] == res["questions"]  # nothing retrained or remeasured


def test_flag_parsing():
    assert parse_lr(["adamw=3e-3", "dnt-msgdw=0.5,msgdw=1"]) == {"adamw": 3e-3, "dnt-msgdw": 0.5, "msgdw": 1.0}
    assert parse_sweep("adamw=1e-3:2e-3,msgdw=0.3") == {"adamw": [1e-3, 2e-3], "msgdw": [0.3]}
    assert set(parse_sweep("default")) == {"adamw", "msgdw"}
    with pytest.raises(ConfigError):
        parse_sweep("adamw")
    from difftx.cli import build_parser

    args = build_parser("compare").parse_args(["compare", "--seeds", "3", "--lr", "adamw=1e-3", "--set", "n_layers=1"])
    fields = explicit_fields(args)
    assert fields == {"seeds": 3, "lr": {"adamw": 1e-3}, "model": {"n_layers": 1}}
    study = StudyConfig(**fields)
    assert study.seed_list() == [0, 1, 2] and study.base_config().n_layers == 1


def test_the_default_bases_changes_belong_to_its_preset():
    """The default base is nano at 2 layers with Xavier init.  --set adds to it (--set init=normal kept the 2
    layers? it dropped them: a 4-layer study); a --preset is taken as it is, plus --set (--preset gpt2-124m
    trained a 2-layer GPT-2)."""
    from difftx.cli import build_parser

    parse = build_parser("compare").parse_args

    def base(*argv):
        return StudyConfig(**explicit_fields(parse(["compare", *argv]))).base_config()

    assert (base().n_layers, base().init) == (2, "xavier")
    assert (base("--set", "init=normal").n_layers, base("--set", "init=normal").init) == (2, "normal")
    assert (base("--preset", "gpt2-124m").n_layers, base("--preset", "gpt2-124m").init) == (12, "xavier")
    assert (base("--preset", "nano").n_layers, base("--preset", "nano").init) == (4, "normal")
    assert base("--preset", "small", "--set", "n_layers=3").n_layers == 3


def test_list_arms(compare):
    p = compare("--list-arms")
    assert p.returncode == 0 and "diff-dnt" in p.stdout and "vdnt" in p.stdout


def test_lr_sweep_picks_each_arms_best_lr_and_reuses_its_run(compare, corpus, tmp_path):
    """--lr-sweep trains every arm at every lr of the grid (first seed), keeps the lr with the lowest
    final validation loss per arm, and reports the sweep."""
    out = tmp_path / "sweep"
    p = compare("--out", out, "--arms", "transformer:adamw,diff:adamw", "--seeds", "2", "--set", "n_layers=1",
                "--set", "d_model=32", "--steps", "6", "--retrieval", "none", "--eval-points", "1",
                "--eval-batches", "1", "--outlier-tokens", "256", "--tail-batches", "2", "--no-progress",
                "--data", corpus, "--cache-dir", tmp_path / "cache", "--lr-sweep", "adamw=1e-3:1e-2")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    sweep = res["lr_sweep"]
    assert sweep["grid"] == {"adamw": [1e-3, 1e-2]} and len(sweep["rows"]) == 4
    for arm in ("transformer-adamw", "diff-adamw"):
        rows = [r for r in sweep["rows"] if r["arm"] == arm]
        best = min(rows, key=lambda r: r["val_loss"])
        assert sweep["chosen"][arm] == best["lr"]
    assert "## Learning-rate sweep" in (out / "report.md").read_text()
    # the chosen run is reused as seed 0: its loss is the grid's best on the same data, and the report says so
    assert "biased in its favour" in (out / "report.md").read_text()
    assert (out / "lr_sweep.png").exists()


@pytest.mark.parametrize("native", [True, False])
def test_bf16_without_bf16_hardware_is_warned(compare, tmp_path, monkeypatch, native):
    """``--dtype bf16`` on a CPU without bf16 matmul hardware says so in one line before the study runs."""
    import difftx.compare as compare_pkg
    import difftx.runtime as runtime

    monkeypatch.setattr(runtime, "native_bf16_matmul", lambda device: native)
    monkeypatch.setattr(compare_pkg, "run_study", lambda *a, **kw: None)  # the study itself is not the point
    for dtype in ("bf16", "fp32"):
        p = compare("--out", tmp_path / dtype, "--dtype", dtype)
        assert p.returncode == 0, p.stderr
        assert p.stderr.count("no bf16 matrix hardware") == (1 if (dtype == "bf16" and not native) else 0)


def test_compare_warns_in_one_line_when_a_native_kernel_setting_kept_them_off(compare, tmp_path, monkeypatch):
    """As train, eval and grads do (the parent checks the kernels its workers will load): one stderr line."""
    import difftx.compare as compare_pkg
    from difftx.nn import native

    monkeypatch.setattr(compare_pkg, "run_study", lambda *a, **kw: None)  # the study itself is not the point
    monkeypatch.setenv("DIFFTX_NATIVE", "of")
    native.reset()
    try:
        p = compare("--out", tmp_path / "s", "--device", "cpu", "--dtype", "fp32")
        assert p.returncode == 0, p.stderr
        assert [x for x in p.stderr.splitlines() if "native CPU kernels" in x] == [
            "difftx compare: warning: native CPU kernels: off (DIFFTX_NATIVE='of' is neither 1/on nor 0/off; "
            "pure torch)"], p.stderr
    finally:
        monkeypatch.undo()
        native.reset()


@pytest.mark.parametrize("args, needle", [
    (["--device", "tpu"], "device"),
    (["--tokenizer", "nope"], "--tokenizer 'nope'"),
    (["--retrieval", "mqar", "--retrieval-opt", "bogus=1"], "valid options: pairs, vocab, power_a, random_non_queries"),
    (["--retrieval", "mqar", "--retrieval-opt", "power_a=NaN"], "power_a"),
    (["--retrieval", "mqar", "--retrieval-opt", "vocab=x"], "--retrieval-opt"),  # was a ValueError traceback
    (["--data", "{tiny}"], "give more --data or a smaller --seq-len"),
])
def test_bad_input_writes_no_study(compare, tmp_path, args, needle):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("too little text\n" * 20)
    out = tmp_path / "out"
    p = compare("--out", out, *[a.replace("{tiny}", str(tiny)) for a in args], "--steps", "1", "--no-progress")
    line = _one_line_error(p)
    assert needle in line and "--val-fraction" not in line
    assert not out.exists() or not any(out.iterdir())  # a rerun with the input fixed is not refused


def test_bad_input_found_by_a_job_takes_back_the_new_study(compare, tmp_path):
    """Too little text for the char tokenizer (2-byte characters pass the size pre-check): the job fails."""
    data = tmp_path / "e.txt"
    data.write_text(("é" * 50 + "\n") * 10, encoding="utf-8")
    out = tmp_path / "out"
    p = compare("--out", out, "--arms", "transformer:adamw", "--seeds", "1", "--steps", "1", "--retrieval", "none",
                "--workers", "1", "--data", data, "--tokenizer", "char", "--cache-dir", tmp_path / "cache",
                "--no-progress")
    line = _one_line_error(p)
    assert "--seq-len" in line and "--val-fraction" not in line
    assert out.is_dir() and not any(out.iterdir())


@pytest.mark.parametrize("where, needle", [("file", "is not a directory"),
                                           ("under-file", "part of the path is a file")])
def test_unusable_out_is_one_line(compare, tmp_path, where, needle):
    (tmp_path / "f").write_text("keep me")
    out = tmp_path / "f" if where == "file" else tmp_path / "f" / "x"
    assert needle in _one_line_error(compare("--out", out, "--steps", "1", "--no-progress"))
    assert (tmp_path / "f").read_text() == "keep me"


@pytest.mark.parametrize("content", ['{"difftx_compare": 1}', '[1, 2]', '{"study": []}', '{"study": {"seed": "x"}}',
                                     '{"study": {"min_lr_ratio": "x"}}', '{"study": {"lr": 5}}',
                                     '{"study": {"arms": 5}}', '{"study": {"lr_sweep": {"adamw": 5}}}',
                                     '{"study": {"seeds": "x"}}'])
def test_resume_of_a_corrupt_study_json_is_one_line(tmp_path, compare, content):
    out = tmp_path / "out"
    out.mkdir()
    (out / "study.json").write_text(content)
    err = _one_line_error(compare("--out", out, "--resume", "--no-progress"))
    assert "study.json" in err and "corrupt" in err, err
    assert (out / "study.json").read_text() == content


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    import os

    kids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                if d.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    return kids


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc")
def test_sigterm_stops_the_pool_at_a_checkpoint(corpus, tmp_path):
    """``kill`` of the study's process stops it as Ctrl-C does: exit 130 naming --resume, each running job
    checkpointed at its current step, the pool's processes gone.  The parent used to die at once and leave its
    workers training their jobs to the end into the study's directory."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import cli_env

    out = tmp_path / "out"
    args = ["--arms", "transformer:adamw,diff:adamw", "--seeds", "1", "--retrieval", "none", "--set", "n_layers=1",
            "--set", "d_model=32", "--steps", "100000", "--workers", "2", "--threads", "1", "--data", str(corpus),
            "--cache-dir", str(tmp_path / "cache")]
    p = subprocess.Popen([sys.executable, "-m", "difftx", "compare", "--out", str(out), *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    try:
        deadline = time.monotonic() + 240
        metrics = [out / "runs" / "corpus" / a / "seed0-lr0.004" / "metrics.jsonl" for a in ("transformer-adamw",
                                                                                          "diff-adamw")]
        while not all(m.is_file() and m.stat().st_size > 0 for m in metrics):  # both jobs are training
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-2000:]
            time.sleep(0.5)
        workers = _children(p.pid)
        assert workers
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err[-2000:]
    assert "--resume" in err.strip().splitlines()[-1] and "Traceback" not in err
    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    end = time.monotonic() + 20  # the pool was waited for (multiprocessing's resource tracker exits on its own)
    while any(map(alive, workers)) and time.monotonic() < end:
        time.sleep(0.2)
    assert not any(map(alive, workers)), [w for w in workers if alive(w)]
    for arm in ("transformer-adamw", "diff-adamw"):
        ckpts = list((out / "runs" / "corpus" / arm / "seed0-lr0.004" / "checkpoints").glob("step_*"))
        assert len(ckpts) == 1 and 0 < int(ckpts[0].name.split("_")[1]) < 100000


def test_resume_with_the_same_set_flags_is_not_a_change(tmp_path):
    """--set adds to the default base's changes (nano at 2 layers, Xavier): the study was stored with them, so the
    same --set given again on --resume is the same study, not "a changed flag"."""
    from difftx.cli import build_parser
    from difftx.compare.runner import resume_config

    parse = build_parser("compare").parse_args
    argv = ["compare", "--set", "n_layers=1", "--set", "d_model=64", "--steps", "3"]
    study = StudyConfig(**explicit_fields(parse(argv)))
    out = tmp_path / "out"
    out.mkdir()
    (out / "study.json").write_text(json.dumps({"difftx_compare": 1, "study": study.to_dict()}))
    assert resume_config(out, explicit_fields(parse(argv + ["--workers", "1"]))).model == study.model
    with pytest.raises(ConfigError, match="model"):  # a changed --set is still refused
        resume_config(out, explicit_fields(parse(["compare", "--set", "n_layers=3", "--steps", "3"])))
    with pytest.raises(ConfigError, match="model"):  # and so is the default's own change, given differently
        resume_config(out, explicit_fields(parse(["compare", "--set", "init=normal", "--steps", "3"])))


def test_run_study_resume_checks_the_stored_study_as_the_cli_does(tmp_path):
    """run_study(resume=True) is the Python form of --resume: it wrote a study.json into a directory of other files,
    and resumed a stored study with changed settings (its jobs and results then disagreed with study.json)."""
    from difftx.compare import run_study
    from difftx.compare.runner import prepare_out

    study = StudyConfig(arms=["transformer:adamw"], seeds=2, steps=2, retrieval="none", model={"n_layers": 1})
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(ConfigError, match="no study"):
        run_study(study, mine, resume=True, progress=False)
    assert sorted(f.name for f in mine.iterdir()) == ["notes.txt"]
    out = tmp_path / "out"
    prepare_out(out, study, force=False, resume=False, command="difftx compare")
    stored = (out / "study.json").read_text()
    changed = StudyConfig(**{**study.to_dict(), "seeds": 3})
    with pytest.raises(ConfigError, match="seeds"):
        run_study(changed, out, resume=True, progress=False)
    assert (out / "study.json").read_text() == stored and sorted(f.name for f in out.iterdir()) == ["study.json"]
    # runtime settings may differ, as on the command line
    assert prepare_out(out, StudyConfig(**{**study.to_dict(), "workers": 1}), force=False, resume=True,
                       command="difftx compare") is False


@pytest.mark.parametrize("args, needle", [
    (["--seeds", "100000000000"], "seeds: at most 1000"),  # was a MemoryError traceback (the list of seeds)
    (["--seeds", str(2 ** 62)], "seeds: at most 1000"),
    (["--seed", str(2 ** 63 - 1), "--seeds", "2"], "seed: the last seed"),  # 2^63: a seed the trainer refuses
    (["--seed", "-1"], "seed: must be >= 0"),
])
def test_absurd_seeds_are_one_line_at_validation(compare, tmp_path, args, needle):
    from difftx.cli import build_parser

    with pytest.raises(ConfigError, match=needle):  # at the study's validation, before any job is planned
        StudyConfig(**explicit_fields(build_parser("compare").parse_args(["compare", *args, "--steps", "1"])))
    line = _one_line_error(compare("--out", tmp_path / "out", *args, "--steps", "1", "--no-progress"))
    assert needle in line, line
    assert not (tmp_path / "out").exists()


def test_niah_too_long_for_the_retrieval_length_names_the_compare_flag(compare, tmp_path):
    """--retrieval niah at the default --retrieval-seq-len (64) is refused, and the line said "raise --seq-len": in a
    study that flag sets the corpus length, and raising it changed nothing for the retrieval task."""
    out = tmp_path / "out"
    line = _one_line_error(compare("--out", out, "--retrieval", "niah", "--steps", "1", "--no-progress"))
    assert "--retrieval-seq-len" in line and "needs 118" in line, line
    assert "--seq-len" not in line.replace("--retrieval-seq-len", ""), line
    assert not out.exists()
    from difftx.compare.runner import check_inputs

    check_inputs(StudyConfig(retrieval="niah", retrieval_seq_len=118, steps=1))  # the length it names is enough



def test_resume_on_another_number_of_processes_is_refused(tmp_path):
    """A run's steps (and its global batch) depend on the number of processes, which a job's key does not name: a
    study run under torchrun on 2 processes and resumed on 1 reused the finished 2-process jobs silently beside
    1-process ones.  It is refused in one line, nothing changed."""
    from difftx.compare import run_study
    from difftx.compare.jobs import plan
    from difftx.compare.runner import prepare_out

    study = StudyConfig(arms=["transformer:adamw"], seeds=1, tokens=4096, retrieval="none",
                        model={"n_layers": 1, "d_model": 32})
    assert plan(study, world_size=2)[0].steps != plan(study, world_size=1)[0].steps
    out = tmp_path / "out"
    out.mkdir()  # the study.json of a study of before, which named no number of processes
    (out / "study.json").write_text(json.dumps({"difftx_compare": 1, "command": "difftx compare",
                                                "study": study.to_dict()}))
    job = plan(study, world_size=2)[0]
    run_dir = job.run_dir(out)
    run_dir.mkdir(parents=True)
    done = {"job": job.to_dict(), "label": job.arm.label, "diverged": False, "train": {"world_size": 2, "steps": 0}}
    (run_dir / "job.json").write_text(json.dumps(done))
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    with pytest.raises(ConfigError, match="2 processes.*this resume has 1"):
        run_study(study, out, resume=True, progress=False)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == files
    # a study records its number of processes in study.json (a new one, with no job finished)
    new = tmp_path / "new"
    prepare_out(new, study, force=False, resume=False, command="difftx compare", world_size=2)
    assert json.loads((new / "study.json").read_text())["world_size"] == 2
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 2"):
        run_study(study, new, resume=True, progress=False)


def test_mqar_too_long_for_the_retrieval_length_names_the_compare_flag(compare, tmp_path):
    """--retrieval mqar with --retrieval-seq-len 16 was refused under --retrieval-opt ("mqar: mqar: seq_len 16, pairs
    up to 6: ..."), naming no flag: it names --retrieval-seq-len and the length needed; vocab stays an option."""
    out = tmp_path / "out"
    line = _one_line_error(compare("--out", out, "--retrieval-seq-len", "16", "--steps", "1", "--no-progress"))
    assert "--retrieval-seq-len" in line and "to 24" in line and "--retrieval-opt" not in line, line
    assert "--seq-len" not in line.replace("--retrieval-seq-len", ""), line
    line = _one_line_error(compare("--out", out, "--retrieval-opt", "vocab=8", "--steps", "1", "--no-progress"))
    assert "--retrieval-opt" in line and "vocab to 14" in line and "mqar: mqar" not in line, line
    assert not out.exists()
    from difftx.compare.runner import check_inputs

    check_inputs(StudyConfig(retrieval="mqar", retrieval_seq_len=24, steps=1))  # the length it names is enough


def test_run_study_restores_the_callers_thread_count(tmp_path, monkeypatch):
    """run_study with --threads and one worker set torch's thread count in the calling process and left it: a
    notebook that ran a study with threads=1 went on with one thread.  The study's jobs run on its count and the
    caller's comes back after it, returned or raised."""
    import torch

    from difftx.compare import run_study
    from difftx.compare.runner import Executor
    from difftx.errors import DataError

    seen = []

    def run(self, jobs, progress):
        seen.append(torch.get_num_threads())
        raise DataError("stop here")

    monkeypatch.setattr(Executor, "run", run)
    torch.set_num_threads(2)  # the caller's (the autouse fixture restores the test process's own)
    study = StudyConfig(arms=["transformer:adamw"], seeds=1, steps=2, retrieval="none", model={"n_layers": 1},
                        workers=1, threads=1, device="cpu")
    with pytest.raises(DataError, match="stop here"):
        run_study(study, tmp_path / "out", progress=False)
    assert seen == [1] and torch.get_num_threads() == 2
