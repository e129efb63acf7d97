"""``difftx grads`` end to end at tiny settings: JSON, PNGs, report; checkpoints; bad input exits 2."""

from __future__ import annotations

import json

import pytest
import torch

import difftx
from difftx.cli import main

BASE = ["--set", "d_model=32", "--set", "n_layers=1", "--seq-len", "16", "--batch-size", "2"]
FLOW = ["--steps", "2"]  # the options of one study only: refused with --only for the other
TAILS = ["--tail-steps", "2", "--noise-batches", "2", "--max-noise-entries", "64"]
TINY = BASE + FLOW + TAILS


def tiny(argv) -> list[str]:
    """TINY less what argv's --only skips."""
    only = argv[argv.index("--only") + 1] if "--only" in argv else None
    return BASE + (FLOW if only != "tails" else []) + (TAILS if only != "flow" else [])


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_grads_writes_json_pngs_and_report(tmp_path, capsys, keep_threads):
    pytest.importorskip("matplotlib")
    out = tmp_path / "g"
    rc = main(["grads", "--out", str(out), *TINY, "--settings", "S1,S5,diff"])
    stdout = capsys.readouterr().out
    assert rc == 0
    assert "gradient flow" in stdout and "heavy tails" in stdout
    strict = dict(parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    flow = json.loads((out / "flow.json").read_text(), **strict)
    assert set(flow["models"]) == {"diff", "transformer"} and flow["paired"]
    assert set(flow["ratio"]["init"]["all"]) == {"W_Q", "W_K", "W_V", "W_O", "FFN", "norms"}
    assert len(flow["models"]["diff"]["grad_norms"]) == 3
    tails = json.loads((out / "tails.json").read_text(), **strict)
    assert [(row["setting"], row["optimizer"]) for row in tails["rows"]] == [
        (s, o) for s in ("S1", "S5", "diff") for o in ("adamw", "msgdw")]
    assert tails["rows"][0]["noise"]["all"]["alpha_mohammadi"] > 0
    for png in ("flow.png", "tails_hist_adamw.png", "tails_hist_msgdw.png", "tails_summary.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    report = (out / "report.md").read_text()
    assert "Gradient flow" in report and "Mohammadi" in report


def test_grads_on_checkpoints(tmp_path, capsys, keep_threads):
    cfg = difftx.ModelConfig.from_preset("nano", d_model=32, n_layers=1)
    for name, c in (("transformer", cfg), ("diff", cfg.twin("diff"))):
        difftx.save_model(difftx.build_model(c), tmp_path / name)
    out = tmp_path / "out"
    rc = main(["grads", "--out", str(out), "--checkpoint", str(tmp_path / "diff"), "--checkpoint",
               str(tmp_path / "transformer"), "--seq-len", "16", "--batch-size", "2", "--steps", "1",
               "--noise-batches", "2", "--max-noise-entries", "64", "--no-plots"])
    assert rc == 0, capsys.readouterr().err
    flow = json.loads((out / "flow.json").read_text())
    assert "ratio" in flow and not flow["paired"]
    tails = json.loads((out / "tails.json").read_text())
    assert [(r["setting"], r["optimizer"]) for r in tails["rows"]] == [("diff", "none"), ("transformer", "none")]
    capsys.readouterr()
    err = _grads_error(capsys, tmp_path / "out2", "--checkpoint", tmp_path / "diff")  # TINY's --set: not applied
    assert "--set" in err and "as saved" in err and not (tmp_path / "out2" / "flow.json").exists()
    assert not list(out.glob("*.png"))


@pytest.mark.parametrize("argv, needle", [
    (["--unpaired"], "--unpaired: initialises fresh twins; a --checkpoint is analysed as saved"),
    (["--settings", "S1"], "--settings: builds fresh models; a --checkpoint is analysed as saved"),
    (["--optimizers", "msgdw"], "--optimizers: trains the tail study's models, and a --checkpoint is measured"),
    (["--only", "tails", "--lr-adamw", "1e-3"], "--lr-adamw: no study here uses adamw"),
])
def test_grads_fresh_model_options_with_a_checkpoint_are_refused(tmp_path, capsys, keep_threads, argv, needle):
    """--unpaired and --settings shape fresh models, --optimizers the tail study's training (none for a checkpoint
    unless --tail-steps N): they were accepted and ignored; now one line, exit 2, nothing written."""
    difftx.save_model(difftx.build_model(difftx.ModelConfig.from_preset("nano", d_model=32, n_layers=1)),
                      tmp_path / "m")
    rc = main(["grads", "--out", str(tmp_path / "o"), "--checkpoint", str(tmp_path / "m"), "--seq-len", "16",
               "--batch-size", "2", "--noise-batches", "2", "--max-noise-entries", "64", "--no-plots",
               *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("difftx grads: error:") and needle in err and "\n" not in err, err
    assert not (tmp_path / "o").exists()


def test_grads_on_diff2_and_softmax_checkpoints_gives_flow_ratios(tmp_path, capsys, keep_threads):
    """A DIFF V2 checkpoint with a softmax one is a flow pair, as a fresh diff2 base is (it got no ratio)."""
    cfg = difftx.ModelConfig.from_preset("nano", d_model=32, n_layers=1)
    for name, c in (("transformer", cfg), ("v2", cfg.twin("diff2"))):
        difftx.save_model(difftx.build_model(c), tmp_path / name)
    out = tmp_path / "out"
    rc = main(["grads", "--out", str(out), "--checkpoint", str(tmp_path / "v2"), "--checkpoint",
               str(tmp_path / "transformer"), "--only", "flow", "--seq-len", "16", "--batch-size", "2", "--steps",
               "1", "--no-plots"])
    assert rc == 0, capsys.readouterr().err
    flow = json.loads((out / "flow.json").read_text())
    assert "ratio" in flow and flow["models"]["diff"]["attention"] == "diff2"
    assert flow["models"]["transformer"]["attention"] == "softmax"


@pytest.mark.parametrize("argv,needle", [
    (["--settings", "S9"], "S9"),
    (["--seq-len", "1"], "--seq-len"),
    (["--optimizers", "adamw,lion"], "lion"),
    (["--checkpoint", "/nonexistent/model"], "/nonexistent/model"),
    (["--preset", "vit-tiny"], "vision"),
    (["--preset", "no-such-preset"], "no-such-preset"),
    (["--data", "/nonexistent.txt"], "/nonexistent.txt"),
    (["--device", "nonsense"], "--device"),
    (["--seq-len", "100", "--preset", "nanogpt"], "max_seq_len"),
    (["--lr-adamw", "nan"], "--lr-adamw"),
    (["--lr-msgdw", "inf"], "--lr-msgdw"),
    (["--lr-adamw", "0"], "--lr-adamw"),
    (["--clip", "-1"], "--clip"),
    (["--lr-sgd", "nan", "--flow-optimizer", "sgd"], "--lr-sgd"),
    (["--lr-sgd", "0.1"], "--lr-sgd: no study here uses sgd"),  # was accepted and ignored
    (["--only", "flow", "--lr-msgdw", "0.5"], "--lr-msgdw: no study here uses msgdw"),
    (["--only", "tails", "--optimizers", "msgdw", "--lr-adamw", "1e-3"], "--lr-adamw: no study here uses adamw"),
    (["--flow-optimizer", "bogus"], "--flow-optimizer"),
    (["--settings", ""], "--settings"),
    (["--settings", " , "], "--settings"),
    # the same row run twice read as two seeds agreeing exactly (mean +- 0) in the tables
    (["--settings", "S1,diff,S1"], "--settings: names S1 more than once"),
    (["--optimizers", "adamw,adamw"], "--optimizers: names adamw more than once"),
    # two names of one model (a preset and its alias, a kind with and without the base's placement) ran it twice
    (["--settings", "dnt,S5"], "--settings: dnt and S5 are the same model"),
    (["--settings", "pre,diff,S1"], "--settings: pre and S1 are the same model"),
    (["--settings", "diff,diff-S1"], "--settings: diff and diff-S1 are the same model"),
    # an option of a study this run skips was accepted and ignored
    (["--only", "flow", "--tail-steps", "2"], "--tail-steps: is an option of the tail study, and --only flow skips"),
    (["--only", "flow", "--settings", "S1"], "--settings: is an option of the tail study"),
    (["--only", "flow", "--optimizers", "adamw"], "--optimizers: is an option of the tail study"),
    (["--only", "flow", "--noise-batches", "4"], "--noise-batches: is an option of the tail study"),
    (["--only", "flow", "--seeds", "2"], "--seeds: is an option of the tail study"),
    (["--only", "tails", "--steps", "2"], "--steps: is an option of the gradient flow, and --only tails skips"),
    (["--only", "tails", "--flow-optimizer", "sgd"], "--flow-optimizer: is an option of the gradient flow"),
    (["--only", "tails", "--unpaired"], "--unpaired: is an option of the gradient flow"),
    (["--tail-steps", "0", "--only", "tails", "--optimizers", "msgdw"], "--optimizers: trains the tail study's"),
    (["--tail-steps", "0", "--only", "tails", "--clip", "0.5"], "--clip: clips the training steps"),
    (["--tail-steps", "0", "--only", "tails", "--lr-msgdw", "0.5"], "tails: none (--tail-steps 0)"),
    # --steps 0 measures the flow at step 0 only: its optimiser, rate and clip never act
    (["--steps", "0", "--only", "flow", "--flow-optimizer", "msgdw"], "--flow-optimizer: steps the gradient-flow"),
    (["--steps", "0", "--only", "flow", "--clip", "0.5"], "--clip: clips the training steps, and --steps 0"),
    (["--steps", "0", "--tail-steps", "0", "--clip", "0.5"], "nor does the tail study: --tail-steps 0"),
    (["--steps", "0", "--only", "flow", "--lr-adamw", "1e-2"], "gradient flow: none (--steps 0)"),
    # numpy's 745 GiB allocation error as a traceback, after --out was made
    (["--batch-size", str(10 ** 11)], "not enough memory: the largest model's training step"),
    (["--seed", "-1"], "--seed: must be >= 0"),  # numpy's ValueError traceback, after --out was made
    # the sampled gradient entries grew with every noise batch until the process ran out of memory
    (["--noise-batches", str(10 ** 11)], "not enough memory: 100,000,000,000 noise batches"),
])
def test_grads_bad_input_is_one_line_and_exit_2(tmp_path, capsys, keep_threads, argv, needle):
    rc = main(["grads", "--out", str(tmp_path / "o"), *tiny(argv), *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("difftx grads: error:") and needle in err and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_grads_command_line_rejects_a_bad_setting(cli, tmp_path):
    """The real ``python -m difftx grads``: a bad setting fails fast, one line, exit 2, nothing written."""
    r = cli("grads", "--out", tmp_path / "o", "--settings", "S1,S9", timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("difftx grads: error:") and "S9" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o" / "flow.json").exists()


def _grads_error(capsys, out, *argv) -> str:
    rc = main(["grads", "--out", str(out), *tiny(argv), *map(str, argv)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("difftx grads: error:") and "\n" not in err, err
    return err


def test_grads_data_must_be_utf8_text_as_for_train(tmp_path, capsys, keep_threads):
    """The checks of `difftx train --data`: a binary file and a Latin-1 file are refused by name."""
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\u00e9 au lait, d\u00e9j\u00e0 vu\n".encode("latin-1") * 100)
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    late = tmp_path / "late.txt"  # valid UTF-8 for the first 8 KiB, then a Latin-1 byte
    late.write_bytes(b"plain text line\n" * 1000 + "\u00e9\n".encode("latin-1"))
    for path in (latin, binary, late):
        assert str(path) in _grads_error(capsys, tmp_path / "o", "--data", path)
    assert not (tmp_path / "o").exists()


def test_grads_unusable_out_is_one_line(tmp_path, capsys, keep_threads):
    (tmp_path / "file").write_text("keep")
    assert "--out" in _grads_error(capsys, tmp_path / "file" / "sub", "--only", "flow", "--no-plots")
    assert (tmp_path / "file").read_text() == "keep"


def test_grads_keeps_earlier_results_unless_force(tmp_path, capsys, keep_threads):
    out = tmp_path / "g"
    out.mkdir()
    (out / "report.md").write_text("earlier")
    assert "--force" in _grads_error(capsys, out, "--only", "flow", "--no-plots")
    assert (out / "report.md").read_text() == "earlier" and not (out / "flow.json").exists()
    rc = main(["grads", "--out", str(out), *tiny(["--only", "flow"]), "--only", "flow", "--no-plots", "--force"])
    assert rc == 0, capsys.readouterr().err
    assert "Gradient flow" in (out / "report.md").read_text() and (out / "flow.json").is_file()


def test_grads_force_removes_the_earlier_runs_figures_it_does_not_redraw(tmp_path, capsys, keep_threads):
    """--force --no-plots (or fewer --optimizers) wrote this run's JSON beside the earlier run's flow.png and
    tails_*.png, figures of another result; they are removed now (a study --only skips keeps its figures)."""
    out = tmp_path / "g"
    out.mkdir()
    earlier = ("report.md", "flow.png", "tails_hist_adamw.png", "tails_hist_msgdw.png", "tails_summary.png")
    for name in earlier:
        (out / name).write_bytes(b"an earlier run's")
    rc = main(["grads", "--out", str(out), *tiny(["--only", "tails"]), "--only", "tails", "--settings", "S1",
               "--optimizers", "adamw", "--no-plots", "--force"])
    assert rc == 0, capsys.readouterr().err
    assert "tails_hist_msgdw.png" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("*.png")) == ["flow.png"]  # the flow study did not run: left as it was
    assert (out / "flow.png").read_bytes() == b"an earlier run's"
    assert main(["grads", "--out", str(out), *tiny(["--only", "flow"]), "--only", "flow", "--no-plots", "--force"]) == 0
    assert not list(out.glob("*.png")) and "flow.png" in capsys.readouterr().out


def test_grads_data_shorter_than_seq_len_writes_nothing(tmp_path, capsys, keep_threads):
    """RoPE models have no max_seq_len to check; the data length is checked before --out is made."""
    short = tmp_path / "short.txt"
    short.write_text("a" * 1200)
    err = _grads_error(capsys, tmp_path / "o", "--data", short, "--seq-len", 5000)
    assert "--seq-len" in err and "1200" in err
    assert not (tmp_path / "o").exists()


def test_grads_with_every_tail_row_diverged_still_reports(tmp_path, capsys, keep_threads):
    """Divergence is recorded, not raised: no figure without rows (a note says so), report.md is written."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "g"
    argv = [*BASE, *TAILS, "--only", "tails", "--settings", "S1", "--optimizers", "msgdw", "--lr-msgdw", "1e30",
            "--clip", "0", "--tail-steps", "3"]
    rc = main(["grads", "--out", str(out), *argv])
    stdout = capsys.readouterr().out
    assert rc == 0
    assert "(1 diverged)" in (out / "report.md").read_text()
    assert json.loads((out / "tails.json").read_text())["rows"][0]["diverged"]
    assert not list(out.glob("*.png"))
    assert "no tails_hist_msgdw.png" in stdout and "no tails_summary.png" in stdout
    (out / "tails_summary.png").write_bytes(b"an earlier run's figure")  # rerun with --force: no stale figure
    assert main(["grads", "--out", str(out), *argv, "--force"]) == 0
    assert not list(out.glob("*.png"))
    assert "tails_summary.png: every tail row it would show diverged; the earlier run's" in capsys.readouterr().out


@pytest.mark.parametrize("argv, lr", [
    (["--flow-optimizer", "sgd"], 0.3),                        # mSGDW's default: was AdamW's 3e-3
    (["--flow-optimizer", "sgd", "--lr-msgdw", "0.2"], 0.2),
    (["--flow-optimizer", "sgd", "--lr-sgd", "0.05"], 0.05),
    (["--flow-optimizer", "muon", "--lr-adamw", "1e-3"], 1e-3),  # Muon's update is AdamW-matched
    (["--flow-optimizer", "muon", "--lr-muon", "0.02"], 0.02),
])
def test_grads_flow_learning_rate_of_sgd_and_muon(tmp_path, capsys, keep_threads, argv, lr):
    """The gradient flow of sgd ran at --lr-adamw (and --lr-msgdw was ignored); muon had no option of its own."""
    if "muon" in argv and not hasattr(torch.optim, "Muon"):
        pytest.skip("muon needs torch >= 2.9")
    out = tmp_path / "g"
    assert main(["grads", "--out", str(out), *BASE, *FLOW, "--only", "flow", "--no-plots", *argv]) == 0
    assert json.loads((out / "flow.json").read_text())["lr"] == pytest.approx(lr)


def test_grads_many_seeds_are_not_listed_up_front(tmp_path, capsys, keep_threads, monkeypatch):
    """--seeds 10^11 built the list of 10^11 seeds first: a MemoryError traceback after --out was made.  Many seeds
    take long (one tail study each), and the first one starts at once."""
    from difftx.analysis import tail_study

    class Started(Exception):
        pass

    def first(*a, seed, **k):
        raise Started(seed)

    monkeypatch.setattr(tail_study, "run_tail_study", first)
    with pytest.raises(Started, match="^5$"):
        main(["grads", "--out", str(tmp_path / "o"), *tiny(["--only", "tails"]), "--only", "tails", "--seed", "5",
              "--seeds", str(10 ** 11)])


def test_grads_on_a_checkpoint_with_dropout_is_a_function_of_seed(tmp_path, capsys, keep_threads):
    """A checkpoint's dropout masks came from whatever state torch's RNG was in (fresh models are built seeded):
    the same --seed gave other numbers, and seed 1 of --seeds 2 was not the run of --seed 1."""
    difftx.save_model(difftx.build_model(difftx.ModelConfig.from_preset("nano", d_model=32, n_layers=1, dropout=0.3)),
                      tmp_path / "m")
    argv = ["--checkpoint", str(tmp_path / "m"), "--seq-len", "16", "--batch-size", "2", "--steps", "2",
            "--noise-batches", "2", "--max-noise-entries", "64", "--no-plots"]

    def run(name, rng_state, *extra):
        torch.manual_seed(rng_state)  # what earlier work in the process (or another process) left behind
        assert main(["grads", "--out", str(tmp_path / name), *argv, *extra]) == 0, capsys.readouterr().err
        flow, tails = (json.loads((tmp_path / name / f).read_text()) for f in ("flow.json", "tails.json"))
        return flow["models"]["m"]["loss"], [(r["seed"], r["noise"]["all"], r["entries"]["all"]["rms"])
                                             for r in tails["rows"]]

    a, b = run("a", 1, "--seed", "1"), run("b", 2, "--seed", "1")
    assert a == b
    two = run("c", 3, "--seeds", "2")
    assert two[1][1] == a[1][0] and two[1][0] != two[1][1]


def test_grads_vision_domain_from_set_names_set_not_preset(tmp_path, capsys, keep_threads):
    """--set domain=vision was reported as '--preset: None is a vision model', naming a flag not given."""
    err = _grads_error(capsys, tmp_path / "o", "--set", "domain=vision")
    assert err.startswith("difftx grads: error: --set: domain=vision") and "None" not in err, err
    assert not (tmp_path / "o").exists()


def _char_model(path, text: str = "abcdefghij klmnopqrstuvwxyz\n"):
    """A byte-sized model (vocab 256) saved with a char tokenizer: byte ids fit it too, so only the ids differ."""
    from difftx.data.tokenizers import CharTokenizer

    difftx.save_model(difftx.build_model(difftx.ModelConfig.from_preset("nano", d_model=32, n_layers=1)), path)
    CharTokenizer(text).save(path)
    return path


def test_grads_reads_the_tokenizer_beside_a_safetensors_checkpoint(tmp_path, capsys, keep_threads):
    """--checkpoint DIR/model.safetensors (which load_model takes) read the weights file as the tokenizer, failed,
    and studied the model on byte ids instead of its own tokenizer's, silently."""
    model = _char_model(tmp_path / "m")
    argv = ["--only", "flow", "--seq-len", "16", "--batch-size", "2", "--steps", "1", "--no-plots"]
    losses = []
    for name, ckpt in (("dir", model), ("file", model / "model.safetensors")):
        assert main(["grads", "--out", str(tmp_path / name), "--checkpoint", str(ckpt), *argv]) == 0
        (only,) = json.loads((tmp_path / name / "flow.json").read_text())["models"].values()
        losses.append(only["loss"])
    assert losses[0] == losses[1]


def test_grads_damaged_tokenizer_is_one_line_not_byte_tokens(tmp_path, capsys, keep_threads):
    """A tokenizer.json that does not parse was taken as 'no tokenizer': the model was studied on byte ids."""
    model = _char_model(tmp_path / "m")
    (model / "tokenizer.json").write_text("{not json")
    rc = main(["grads", "--out", str(tmp_path / "o"), "--checkpoint", str(model), "--only", "flow", "--seq-len", "16",
               "--batch-size", "2", "--steps", "1", "--no-plots"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("difftx grads: error:") and "\n" not in err, err
    assert "tokenizer.json" in err and "not valid JSON" in err, err
    assert not (tmp_path / "o").exists()


def test_grads_checkpoints_with_different_tokenizers_are_refused(tmp_path, capsys, keep_threads):
    """Every model sees the same token ids, and they came from the first checkpoint's tokenizer: a second model
    with another tokenizer was studied on ids that mean other text to it, silently."""
    char = _char_model(tmp_path / "char")
    byte = tmp_path / "byte"
    difftx.save_model(difftx.build_model(difftx.ModelConfig.from_preset("nano", d_model=32, n_layers=1)), byte)
    for first, second in ((byte, char), (char, byte)):
        rc = main(["grads", "--out", str(tmp_path / "o"), "--checkpoint", str(first), "--checkpoint", str(second),
                   "--only", "flow", "--seq-len", "16", "--batch-size", "2", "--steps", "1", "--no-plots"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err.startswith("difftx grads: error: --checkpoint:") and "\n" not in err, err
        assert "tokenizer" in err and str(char) in err and str(byte) in err, err
        assert not (tmp_path / "o").exists()


def _pair(tmp_path, diff=None, transformer=None):
    """A DIFF and a softmax checkpoint (nano at 1 x 32 unless given): their directories."""
    cfg = difftx.ModelConfig.from_preset("nano", d_model=32, n_layers=1)
    paths = []
    for name, c in (("diff", diff or cfg.twin("diff")), ("transformer", transformer or cfg)):
        difftx.save_model(difftx.build_model(c), tmp_path / name)
        paths.append(tmp_path / name)
    return paths


def _flow_on(tmp_path, capsys, paths, *argv):
    out = tmp_path / "out"
    ckpts = [a for p in paths for a in ("--checkpoint", str(p))]
    rc = main(["grads", "--out", str(out), *ckpts, "--only", "flow", "--seq-len", "16", "--batch-size", "2",
               "--steps", "1", "--no-plots", *argv])
    cap = capsys.readouterr()
    return rc, cap, out


def test_grads_flow_on_checkpoints_is_labelled_as_saved_not_at_init(tmp_path, capsys, keep_threads):
    """Step 0 of a checkpoint is its saved (trained) weights: the table said "Transformer at init"."""
    rc, cap, out = _flow_on(tmp_path, capsys, _pair(tmp_path))
    assert rc == 0, cap.err
    report = (out / "report.md").read_text()
    for text in (cap.out, report):
        assert "at init" not in text and "Transformer as saved" in text and "ratio as saved" in text, text
    assert "checkpoints as saved" in report
    assert json.loads((out / "flow.json").read_text())["start"] == "saved"


def test_grads_flow_pair_of_different_depths_is_refused(tmp_path, capsys, keep_threads):
    """Per-layer ratios zipped layer i of a 2-layer DIFF with layer i of a 1-layer Transformer, silently."""
    deep = difftx.ModelConfig.from_preset("nano", d_model=32, n_layers=2).twin("diff")
    rc, cap, out = _flow_on(tmp_path, capsys, _pair(tmp_path, diff=deep))
    err = cap.err.strip()
    assert rc == 2 and err.startswith("difftx grads: error: --checkpoint:") and "\n" not in err, err
    assert "2 layers" in err and "--only tails" in err and not out.exists()


def test_grads_flow_pair_not_matched_parameter_warns(tmp_path, capsys, keep_threads):
    """A wider DIFF against a Transformer: ratios printed with no word that the sizes differ."""
    wide = difftx.ModelConfig.from_preset("nano", d_model=64, n_layers=1).twin("diff")
    rc, cap, out = _flow_on(tmp_path, capsys, _pair(tmp_path, diff=wide))
    assert rc == 0, cap.err
    warning = [line for line in cap.err.splitlines() if line.startswith("difftx grads: warning:")]
    assert len(warning) == 1 and "not a matched-parameter pair" in warning[0] and "d_model 64 and 32" in warning[0]
    assert "Not matched" in (out / "report.md").read_text()
    flow = json.loads((out / "flow.json").read_text())
    assert flow["matched"] is False and "d_model" in flow["mismatch"]


def test_grads_matched_checkpoint_pair_has_no_warning(tmp_path, capsys, keep_threads):
    rc, cap, out = _flow_on(tmp_path, capsys, _pair(tmp_path))
    assert rc == 0 and "warning" not in cap.err, cap.err
    assert json.loads((out / "flow.json").read_text())["matched"] is True


def test_grads_help_and_meta_say_checkpoints_read_data_with_their_tokenizer(tmp_path, capsys, keep_threads):
    """--help said --data was byte-tokenised, and flow.json's meta said "byte tokens", for a checkpoint read with
    its own (here char) tokenizer."""
    with pytest.raises(SystemExit):
        main(["grads", "--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert "byte-tokenise (" not in helptext and "saved tokenizer" in helptext, helptext
    model = _char_model(tmp_path / "m")
    assert main(["grads", "--out", str(tmp_path / "o"), "--checkpoint", str(model), "--only", "flow", "--seq-len",
                 "16", "--batch-size", "2", "--steps", "1", "--no-plots"]) == 0
    meta = json.loads((tmp_path / "o" / "flow.json").read_text())["meta"]
    assert meta["tokenizer"] == "char" and "byte" not in meta["data"], meta
    assert "char tokens (the checkpoints' tokenizer)" in (tmp_path / "o" / "report.md").read_text()


def test_grads_tails_on_checkpoints_as_saved_says_so(tmp_path, capsys, keep_threads):
    """A checkpoint's tail study measures the saved weights: the report said "After 0 training steps per
    optimiser" (there is no optimiser), and the run printed "heavy tails (0 steps, ...)"."""
    out = tmp_path / "out"
    ckpts = [a for p in _pair(tmp_path) for a in ("--checkpoint", str(p))]
    rc = main(["grads", "--out", str(out), *ckpts, "--only", "tails", "--seq-len", "16", "--batch-size", "2",
               "--noise-batches", "2", "--max-noise-entries", "64", "--no-plots"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    report = (out / "report.md").read_text()
    assert "After 0 training steps" not in report and "Measured as saved" in report, report
    assert "heavy tails (as saved," in cap.out

    fresh = tmp_path / "fresh"  # --tail-steps 0 on fresh models measures them at initialisation, not "as saved"
    assert main(["grads", "--out", str(fresh), *tiny(["--only", "tails"]), "--only", "tails", "--tail-steps", "0",
                 "--settings", "S1", "--no-plots"]) == 0
    assert "Measured at initialisation" in (fresh / "report.md").read_text()
    assert "heavy tails (at initialisation," in capsys.readouterr().out


def test_grads_tail_histogram_title_says_as_saved_not_after_0_none_steps(tmp_path, monkeypatch):
    """The DNT Fig. 1 figure of checkpoints measured as saved was titled "after 0 none steps"."""
    pytest.importorskip("matplotlib")
    from difftx.analysis import plots

    titles = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: titles.append(fig._suptitle.get_text()) or path)
    hist = {"log10_edges": [-3.0, -2.0, -1.0], "fraction": [0.5, 0.5]}
    row = {"setting": "m", "optimizer": "none", "entries": {"W_q": {"histogram": hist}}}
    for start, steps, expect in (("saved", 0, "as saved"), ("init", 0, "at initialisation"),
                                 ("saved", 3, "after 3 none steps from the saved weights")):
        plots.plot_tail_histograms({"rows": [row], "steps": steps, "start": start}, "none", tmp_path / "h.png")
        assert expect in titles[-1] and "after 0" not in titles[-1], titles[-1]


def test_grads_checkpoint_help_names_the_flow_pair_conditions(capsys):
    """--help said any DIFF and softmax checkpoints give flow ratios; different depths are refused, sizes flagged."""
    with pytest.raises(SystemExit):
        main(["grads", "--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert "checkpoint of one depth together give flow ratios" in helptext and "matched-parameter" in helptext


def test_grads_force_interrupted_midway_leaves_no_earlier_report_beside_new_results(tmp_path, capsys, keep_threads,
                                                                                   monkeypatch):
    """--force over an earlier study, Ctrl-C during the tail study: this run's flow.json sat beside the earlier run's
    report.md, whose flow tables then contradicted it.  The earlier report goes once this run writes its first
    result (the earlier tails.json, a whole result of its own, stays until this run replaces it)."""
    from difftx.cli import grads

    out = tmp_path / "g"
    out.mkdir()
    for name in ("report.md", "flow.json", "tails.json"):
        (out / name).write_text("an earlier run's")

    def interrupted(st):
        raise KeyboardInterrupt

    monkeypatch.setattr(grads, "_tails_section", interrupted)
    rc = main(["grads", "--out", str(out), *TINY, "--no-plots", "--force"])
    assert rc == 130 and capsys.readouterr().err.strip().endswith("difftx grads: interrupted")
    assert json.loads((out / "flow.json").read_text())  # this run's
    assert (out / "tails.json").read_text() == "an earlier run's"
    assert not (out / "report.md").exists()


def test_grads_restores_the_callers_thread_count(tmp_path, monkeypatch):
    """grads set torch's thread count (--threads, or one for a small model) and left it in a process that called
    main(["grads", ...]); the study runs on its count and the caller's comes back after it."""
    from difftx.cli import grads

    seen = []
    monkeypatch.setattr(grads, "_flow_section", lambda st: seen.append(torch.get_num_threads()))
    torch.set_num_threads(2)  # the caller's (the autouse fixture restores the test process's own)
    assert main(["grads", "--out", str(tmp_path / "g"), *tiny(["--only", "flow"]), "--only", "flow",
                 "--threads", "1"]) == 0
    assert seen == [1] and torch.get_num_threads() == 2
