"""`difftx eval NAME`: every evaluation writes NAME.json with the documented envelope; bad input exits 2 in one line."""

import importlib.util
import json

import pytest

import os
from pathlib import Path

from difftx.cli import main

SRC = Path(__file__).resolve().parents[2] / "src"

ENVELOPE = {"eval", "schema_version", "difftx_version", "checkpoint", "model", "settings", "quant", "seconds", "results"}
RESULT_KEYS = {
    "lm": {"loss", "perplexity", "bits_per_token", "tokens", "windows", "seq_len", "ar_hit", "others", "by_position"},
    "niah": {"cells", "table", "heatmaps", "overall", "skipped"},
    "mqar": {"vocab", "power_a", "cells", "skipped", "overall_accuracy"},
    "attention": {"normalize", "length", "needles", "regions", "depths", "table", "by_depth", "by_layer", "mean"},
    "outliers": {"tokens", "seq_len", "attention_logits", "hidden_states", "state_bytes"},
    "quant": {"metric", "higher_is_better", "granularity", "rows"},
    "icl": {"tasks", "overall_accuracy"},
}
SMALL = {
    "lm": ["--max-tokens", "512", "--seq-len", "64"],
    "niah": ["--grid", "N1R1,N2R2", "--lengths", "320", "--depths", "0,100", "--samples", "1", "--template", "paper"],
    "mqar": ["--lengths", "32,64", "--pairs", "4,8", "--samples", "2"],
    "attention": ["--length", "160", "--depths", "0,50,100", "--samples", "1"],
    "outliers": ["--max-tokens", "256", "--seq-len", "64"],
    "quant": ["--bits", "16,4", "--max-tokens", "128"],
    "icl": ["--shots", "1,2", "--seeds", "2", "--test-examples", "4", "--arrangements", "random,alternating"],
}


@pytest.mark.parametrize("name", list(SMALL))
def test_every_eval_writes_its_json(name, checkpoint, tmp_path, capsys):
    data = [] if name in ("mqar", "icl") else ["--data", str(checkpoint / "haystack.txt")]
    rc = main(["eval", name, "--checkpoint", str(checkpoint), "--out", str(tmp_path), "--quiet", *data, *SMALL[name]])
    assert rc == 0
    doc = json.loads((tmp_path / f"{name}.json").read_text())
    assert set(doc) == ENVELOPE and doc["eval"] == name
    assert set(doc["results"]) == RESULT_KEYS[name]
    assert doc["model"]["attention"] == "diff" and doc["seconds"] > 0
    pytest.importorskip("matplotlib")
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
    assert f"wrote {tmp_path / name}.json" in capsys.readouterr().out


def test_an_earlier_figure_alone_is_an_earlier_result(checkpoint, tmp_path, capsys):
    """lm.json deleted, lm.png left: a --no-plot run wrote its JSON beside the earlier run's figure."""
    (tmp_path / "lm.png").write_bytes(b"an earlier run's figure")
    argv = ["eval", "lm", "--checkpoint", str(checkpoint), "--out", str(tmp_path), "--quiet", "--no-plot",
            "--data", str(checkpoint / "haystack.txt"), "--max-tokens", "256", "--seq-len", "64"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lm.png" in err[0] and "--force" in err[0], err
    assert not (tmp_path / "lm.json").exists()
    assert main([*argv, "--force"]) == 0  # --force: the stale figure goes with the new result
    assert (tmp_path / "lm.json").exists() and not (tmp_path / "lm.png").exists()


def test_any_eval_runs_quantized(checkpoint, tmp_path):
    rc = main(["eval", "lm", "--checkpoint", str(checkpoint), "--out", str(tmp_path), "--quiet", "--no-plot",
               "--data", str(checkpoint / "haystack.txt"), "--max-tokens", "256", "--seq-len", "64",
               "--quant-bits", "6", "--quant-granularity", "row"])
    assert rc == 0
    doc = json.loads((tmp_path / "lm.json").read_text())
    assert doc["quant"]["bits"] == 6 and doc["quant"]["granularity"] == "row"


BAD = [
    (["lm", "--checkpoint", "{tmp}/missing"], "no such file or directory"),
    (["lm", "--data", "{tmp}/nope.txt"], "data file not found"),
    (["niah", "--lengths", "a,b"], "expected a comma-separated list"),
    (["niah", "--grid", "N2R3"], "1 <= R <= N"),
    (["niah", "--lengths", "40"], "no N x R cell fits"),
    (["lm", "--quant-bits", "1"], "--quant-bits"),
    (["lm", "--data", "{tmp}"], "a directory, not a text file"),
    (["lm", "--checkpoint", ""], "--checkpoint is empty"),
    (["niah", "--template", "{city} {number} {oops}"], "only '{city}' and '{number}'"),
    (["niah", "--template", "{city} is {number} {"], "only '{city}' and '{number}'"),
    (["niah", "--grid", "N1R1,N2R2,n1r1"], "'n1r1' given twice"),  # a duplicate row, as --depths 50,50
    # an option the evaluation does not read is refused, not ignored
    (["lm", "--quant-granularity", "row"], "--quant-granularity: sets how --quant-bits"),
    (["quant", "--metric", "mqar", "--bits", "8", "--max-tokens", "64", "--metric-opt", "lengths=[16]",
      "--metric-opt", "pairs=[2]", "--metric-opt", "samples=2"], "--max-tokens: is the token budget of --metric lm"),
    pytest.param(["lm-eval", "--tasks", "hellaswag"], "lm-eval",  # the message when the `eval` extra is missing
                 marks=pytest.mark.skipif(importlib.util.find_spec("lm_eval") is not None,
                                          reason="lm-eval is installed (it would fetch hellaswag)")),
]


def _bad_args(args, checkpoint, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--checkpoint" not in args:
        args += ["--checkpoint", str(checkpoint)]
    out = tmp_path / "out"
    out.mkdir()
    (out / "lm.json").write_text("keep me")
    return [*args, "--out", str(out)], out


@pytest.mark.parametrize("args, message", BAD)
def test_bad_input_exit_2_nothing_overwritten(args, message, checkpoint, tmp_path, capsys):
    argv, out = _bad_args(args, checkpoint, tmp_path)
    try:
        rc = main(["eval", *argv])
    except SystemExit as e:  # argparse errors
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("difftx eval")
    assert (out / "lm.json").read_text() == "keep me"


@pytest.mark.parametrize("case", [0, 4])
def test_bad_input_from_the_command_line(case, checkpoint, tmp_path, cli):
    argv, _ = _bad_args(BAD[case][0], checkpoint, tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = cli("eval", *argv, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("difftx eval: error:") and BAD[case][1] in r.stderr


def _eval(argv, capsys):
    """``difftx eval ARGV`` in this process: (exit code, the stderr lines)."""
    capsys.readouterr()
    try:
        rc = main(["eval", *map(str, argv)])
    except SystemExit as e:  # argparse errors
        rc = e.code
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("where, message", [("file", "a file of that name exists"),
                                            ("under-file", "part of the path is a file"),
                                            ("proc", "cannot create the directory")])
def test_unusable_out_is_one_line(where, message, checkpoint, tmp_path, capsys):
    (tmp_path / "f").write_text("keep me")
    out = {"file": tmp_path / "f", "under-file": tmp_path / "f" / "x", "proc": Path("/proc/difftx-nope")}[where]
    rc, err = _eval(["mqar", "--checkpoint", checkpoint, "--out", out, "--lengths", "32", "--pairs", "4",
                     "--samples", "1", "--no-plot", "--quiet"], capsys)
    assert rc == 2 and len(err) == 1 and f"--out {out}" in err[0] and message in err[0]
    assert (tmp_path / "f").read_text() == "keep me"


@pytest.mark.parametrize("args, flag", [
    (["mqar", "--power-a", "nan"], "--power-a"), (["mqar", "--power-a", "inf"], "--power-a"),
    (["mqar", "--power-a", "-1"], "--power-a"), (["mqar", "--power-a", "0"], "--power-a"),
    (["mqar", "--pairs", "0,4"], "--pairs"), (["mqar", "--lengths=-64"], "--lengths"),
    (["niah", "--lengths", "0"], "--lengths"), (["icl", "--shots=-1"], "--shots"),
    (["quant", "--bits", "0"], "--bits"), (["quant", "--bits", "16,40"], "--bits"),
    # a value given twice: a duplicate row or point (icl's overall accuracy counted the shots twice)
    (["quant", "--bits", "8,8"], "--bits"), (["icl", "--shots", "2,2"], "--shots"),
    (["niah", "--depths", "50,50"], "--depths"), (["mqar", "--pairs", "4,8,4"], "--pairs"),
])
def test_bad_numbers_are_refused_before_use(args, flag, checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    rc, err = _eval([*args, "--checkpoint", checkpoint, "--out", out, "--no-plot", "--quiet"], capsys)
    assert rc == 2 and len(err) == 1 and flag in err[0]
    assert not out.exists()


@pytest.mark.parametrize("args, flag", [
    (["attention", "--depths", ","], "--depths"), (["niah", "--depths", ","], "--depths"),
    (["niah", "--lengths", ","], "--lengths"), (["mqar", "--lengths", ","], "--lengths"),
    (["mqar", "--pairs", ","], "--pairs"), (["icl", "--tasks", ","], "--tasks"),
    (["icl", "--arrangements", ","], "--arrangements"), (["icl", "--shots", ","], "--shots"),
    (["quant", "--bits", ","], "--bits"),
])
def test_empty_lists_are_refused(args, flag, checkpoint, tmp_path, capsys):
    """An empty list (',') was an IndexError / ZeroDivisionError traceback (attention, mqar, icl), a misleading
    'no N x R cell fits the lengths' (niah --depths) or silently the default lengths (niah --lengths)."""
    out = tmp_path / "out"
    rc, err = _eval([*args, "--checkpoint", checkpoint, "--out", out, "--no-plot", "--quiet"], capsys)
    assert rc == 2 and len(err) == 1 and flag in err[0] and "non-empty" in err[0]
    assert not out.exists()


def test_library_refuses_bad_power_a_and_bits(checkpoint):
    from difftx.errors import ConfigError
    from difftx.evals.common import load_checkpoint
    from difftx.evals.mqar import evaluate_mqar, mqar_task
    from difftx.evals.quant import evaluate_quant

    model, tok = load_checkpoint(checkpoint)
    for a in (float("nan"), float("inf"), -0.5, 0.0):
        with pytest.raises(ConfigError, match="power_a"):
            evaluate_mqar(model, lengths=[32], pairs=[4], samples=1, power_a=a)
        with pytest.raises(ConfigError, match="power_a"):
            mqar_task(tok, 32, power_a=a)
    with pytest.raises(ConfigError, match="bits"):
        evaluate_quant(model, tok, bits=[0], metric="mqar", metric_options=dict(lengths=[32], pairs=[4], samples=1))


def test_unknown_task_options_list_the_valid_keys():
    from difftx.data import ByteTokenizer
    from difftx.errors import ConfigError
    from difftx.evals.mqar import mqar_task
    from difftx.evals.niah import niah_task

    with pytest.raises(ConfigError, match="no option 'bogus'; valid options: pairs, vocab, power_a"):
        mqar_task(ByteTokenizer(), 64, bogus=1)
    with pytest.raises(ConfigError, match="no option 'bogus'; valid options: needles, queries"):
        niah_task(ByteTokenizer(), 256, bogus=1)


def test_rerun_into_the_same_out_is_refused_unless_force(checkpoint, tmp_path, capsys):
    argv = ["mqar", "--checkpoint", checkpoint, "--out", tmp_path, "--lengths", "32", "--pairs", "4",
            "--samples", "1", "--quiet"]
    assert _eval(argv, capsys)[0] == 0
    first = (tmp_path / "mqar.json").read_text()
    rc, err = _eval([*argv, "--seed", "1"], capsys)
    assert rc == 2 and len(err) == 1 and "mqar.json already exists" in err[0] and "--force" in err[0]
    assert (tmp_path / "mqar.json").read_text() == first
    assert _eval([*argv, "--seed", "1", "--force"], capsys)[0] == 0
    assert json.loads((tmp_path / "mqar.json").read_text())["settings"]["seed"] == 1
    assert _eval(["lm", "--checkpoint", checkpoint, "--out", tmp_path, "--data", checkpoint / "haystack.txt",
                  "--max-tokens", "64", "--seq-len", "32", "--quiet"], capsys)[0] == 0  # another eval: its own file


def test_attention_too_short_names_its_own_flag(checkpoint, tmp_path, capsys):
    rc, err = _eval(["attention", "--checkpoint", checkpoint, "--out", tmp_path / "out", "--length", "16",
                     "--data", checkpoint / "haystack.txt", "--samples", "1", "--quiet"], capsys)
    assert rc == 2 and len(err) == 1 and "--length" in err[0] and "--lengths" not in err[0]


def test_vision_checkpoint_is_named_a_vision_model(tmp_path, capsys):
    import difftx

    vis = tmp_path / "vis"
    difftx.save_model(difftx.build_model(difftx.ModelConfig.from_preset("vit-tiny")), vis)
    rc, err = _eval(["lm", "--checkpoint", vis, "--out", tmp_path / "out", "--quiet"], capsys)
    assert rc == 2 and len(err) == 1 and "a vision model" in err[0] and "tokenizer" not in err[0]


def test_non_utf8_data_is_refused(checkpoint, tmp_path, capsys):
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café naïve text, ".encode("latin-1") * 40)
    rc, err = _eval(["lm", "--checkpoint", checkpoint, "--out", tmp_path / "out", "--data", latin,
                     "--max-tokens", "64", "--seq-len", "32", "--quiet"], capsys)
    assert rc == 2 and len(err) == 1 and "not UTF-8" in err[0]
    assert not (tmp_path / "out" / "lm.json").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(difftx_format=99), "difftx_format 99"),
    (lambda d: d.update(model=[]), "'model' must be an object"),
])
def test_checkpoint_config_of_another_format_or_shape_is_one_line(edit, message, checkpoint, tmp_path, capsys):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(checkpoint, ck)
    cfg = json.loads((ck / "config.json").read_text())
    edit(cfg)
    (ck / "config.json").write_text(json.dumps(cfg))
    rc = main(["eval", "lm", "--checkpoint", str(ck), "--out", str(tmp_path / "out"), "--quiet",
               "--data", str(ck / "haystack.txt"), "--max-tokens", "256", "--seq-len", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out" / "lm.json").exists()


def test_eval_warns_in_one_line_when_a_native_kernel_setting_kept_them_off(checkpoint, tmp_path, capsys,
                                                                           monkeypatch):
    """As `difftx train` does: a DIFFTX_NATIVE typo runs the torch path and says so once, on stderr."""
    from difftx.nn import native

    monkeypatch.setenv("DIFFTX_NATIVE", "of")
    native.reset()
    try:
        assert main(["eval", "lm", "--checkpoint", str(checkpoint), "--out", str(tmp_path), "--quiet", "--no-plot",
                     "--data", str(checkpoint / "haystack.txt"), "--max-tokens", "128", "--seq-len", "64"]) == 0
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if "native CPU kernels" in line]
        assert lines == ["difftx eval lm: warning: native CPU kernels: off (DIFFTX_NATIVE='of' is neither 1/on nor "
                         "0/off; pure torch)"], err
    finally:
        monkeypatch.undo()
        native.reset()


def test_icl_summary_shows_worst_and_best_not_mean_plus_minus_half_margin():
    """Accuracies 0.9, 0.9, 0.3 over three orders printed '0.700±0.300', i.e. 0.4..1.0 -- neither the worst (0.3)
    nor the best (0.9); elsewhere difftx's '±' is a standard deviation."""
    from difftx.cli.eval import _summary

    pt = {"shots": 4, "accuracies": [0.9, 0.9, 0.3], "mean": 0.7, "best": 0.9, "worst": 0.3, "margin": 0.6, "std": 0.28}
    (line,) = _summary("icl", {"tasks": [{"task": "synthetic-6", "curves": {"random": [pt]}}]})
    assert "±" not in line and "0.700" in line and "0.300" in line and "0.900" in line


def test_mqar_needs_no_tokenizer_and_text_evals_name_the_missing_one(tmp_path, capsys):
    """MQAR samples ids from the model's vocabulary, yet ``difftx eval mqar`` (and ``quant --metric mqar``) refused a
    model directory without a tokenizer.json; an evaluation that encodes text says which file it needs."""
    import difftx
    from evals_helpers import tiny_model

    model = difftx.save_model(tiny_model("diff"), tmp_path / "m")  # config.json + model.safetensors only
    rc, err = _eval(["mqar", "--checkpoint", model, "--out", tmp_path / "o1", "--quiet", "--no-plot",
                     *SMALL["mqar"]], capsys)
    assert rc == 0, err
    assert set(json.loads((tmp_path / "o1" / "mqar.json").read_text())["results"]) == RESULT_KEYS["mqar"]
    rc, err = _eval(["quant", "--checkpoint", model, "--out", tmp_path / "o2", "--quiet", "--no-plot", "--metric",
                     "mqar", "--bits", "8", "--metric-opt", "lengths=[32]", "--metric-opt", "samples=2"], capsys)
    assert rc == 0, err
    rc, err = _eval(["lm", "--checkpoint", model, "--out", tmp_path / "o3", "--quiet"], capsys)
    assert rc == 2 and len(err) == 1 and "tokenizer.json" in err[0] and "'difftx eval lm'" in err[0], err
    assert not (tmp_path / "o3" / "lm.json").exists()


def test_a_model_saved_with_its_tokenizer_runs_the_text_evals(tmp_path, capsys):
    """save_model wrote no tokenizer.json, so a model saved from Python could not run 'difftx eval lm' until one
    was copied in; save_model(..., tokenizer=) writes it, as a training run's checkpoints have it."""
    import difftx
    from difftx.data import ByteTokenizer
    from evals_helpers import haystack_text, tiny_model

    model = difftx.save_model(tiny_model("diff"), tmp_path / "m", tokenizer=ByteTokenizer())
    assert (model / "tokenizer.json").is_file()
    (tmp_path / "text.txt").write_text(haystack_text(), encoding="utf-8")
    rc, err = _eval(["lm", "--checkpoint", model, "--out", tmp_path / "o", "--quiet", "--no-plot",
                     "--data", tmp_path / "text.txt", "--max-tokens", "128", "--seq-len", "64"], capsys)
    assert rc == 0, err


def test_an_hf_export_of_a_byte_tokenizer_model_keeps_its_tokenizer_for_the_evals(checkpoint, tmp_path, capsys):
    """difftx convert exports a byte or char tokenizer as difftx_tokenizer.json (lm-eval reads it); difftx eval
    looked for tokenizer.json only and refused the export."""
    from difftx.data import ByteTokenizer
    from difftx.evals.common import load_checkpoint
    from difftx.interop import convert_checkpoint

    convert_checkpoint(checkpoint, tmp_path / "hf", dst_format="hf-difftx")
    assert (tmp_path / "hf" / "difftx_tokenizer.json").is_file() and not (tmp_path / "hf" / "tokenizer.json").exists()
    model, tok = load_checkpoint(tmp_path / "hf")
    assert isinstance(tok, ByteTokenizer)
    rc, err = _eval(["lm", "--checkpoint", tmp_path / "hf", "--out", tmp_path / "out", "--quiet", "--no-plot",
                     "--data", checkpoint / "haystack.txt", "--max-tokens", "128", "--seq-len", "64"], capsys)
    assert rc == 0, err


@pytest.mark.parametrize("metric, opt", [("mqar", "samples=2"), ("icl", "test_examples=2")])
def test_quant_data_with_a_metric_that_reads_none_is_refused(metric, opt, checkpoint, tmp_path, capsys):
    """--data was ignored by the mqar and icl metrics (they make their own data); now one line, exit 2."""
    out = tmp_path / "out"
    rc = main(["eval", "quant", "--checkpoint", str(checkpoint), "--out", str(out), "--metric", metric, "--bits", "8",
               "--data", str(checkpoint / "haystack.txt"), "--metric-opt", opt, "--quiet", "--no-plot"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--data" in err[0] and f"--metric {metric}" in err[0], err
    assert not (out / "quant.json").exists()


@pytest.mark.parametrize("name, needle", [("lm", "'eval lm'"), ("outliers", "'eval outliers'"),
                                          ("quant", "'eval quant --metric lm'")])
def test_a_seed_for_an_eval_that_samples_nothing_is_refused(name, needle, checkpoint, tmp_path, capsys):
    """--seed was accepted and ignored by lm, outliers and quant's lm metric (they read the text in order); now
    one line, exit 2, before the checkpoint loads; the evaluations that sample still take it (mqar above)."""
    out = tmp_path / "out"
    rc = main(["eval", name, "--checkpoint", str(checkpoint), "--out", str(out), "--data",
               str(checkpoint / "haystack.txt"), *SMALL[name], "--seed", "1", "--quiet", "--no-plot"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("difftx eval: error: --seed:") and needle in err[0], err
    assert "samples nothing" in err[0] and not out.exists()


@pytest.mark.parametrize("args, real", [
    (["mqar", "--lengths", str(10 ** 11), "--pairs", "4"], True),  # numpy's ArrayMemoryError traceback before
    (["icl", "--test-examples", "16", "--shots", "1", "--seeds", "1"], False),  # 10**11: now over its own limit
    (["mqar", "--lengths", "64", "--pairs", "4", "--samples", "2"], False),  # with 1 KiB free, as the next two
    (["niah", "--lengths", "320", "--grid", "N1R1", "--depths", "50", "--samples", "1"], False),
    (["attention", "--length", "160", "--depths", "50", "--samples", "1"], False),
])
def test_inputs_that_cannot_fit_are_refused_before_they_are_built(args, real, checkpoint, tmp_path, capsys,
                                                                  monkeypatch):
    """--lengths 10^11 grew niah's haystack (and attention's) until the machine ran out of memory, and crashed mqar
    (and icl's --test-examples) with numpy's ArrayMemoryError traceback: the inputs an evaluation builds at once,
    and one sequence's hidden states, are checked against the free memory first (DIFFTX_MEMORY_CHECK=0 skips it, as
    for training)."""
    from difftx.train import memory_check

    free_memory = memory_check.free_memory
    monkeypatch.setattr(memory_check, "free_memory", lambda device: free_memory(device) if real else 1024)
    data = ["--data", str(checkpoint / "haystack.txt")] if args[0] in ("niah", "attention") else []
    out = tmp_path / "out"
    rc = main(["eval", *args, "--checkpoint", str(checkpoint), "--out", str(out), "--quiet", "--no-plot", *data])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("difftx eval: error: not enough memory: ") and err.count("\n") == 1, err
    assert "DIFFTX_MEMORY_CHECK=0" in err and not (out / f"{args[0]}.json").exists()
    monkeypatch.setenv("DIFFTX_MEMORY_CHECK", "0")  # the way out the message names
    if not real:
        assert main(["eval", *args, "--checkpoint", str(checkpoint), "--out", str(out), "--quiet", "--no-plot",
                     *data]) == 0


@pytest.mark.parametrize("flag", ["--text-key", "--label-key"])
def test_jsonl_keys_with_only_synthetic_tasks_are_refused(flag, checkpoint, tmp_path, capsys):
    """--text-key and --label-key name the fields of a JSONL task; with synthetic tasks only they were accepted and
    ignored.  Now one line, exit 2, before the checkpoint loads (a JSONL task still reads them)."""
    out = tmp_path / "out"
    rc = main(["eval", "icl", "--checkpoint", str(checkpoint), "--out", str(out), *SMALL["icl"], flag, "body",
               "--quiet", "--no-plot"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"difftx eval: error: {flag}:") and "drop" in err[0], err
    assert not out.exists()
    tasks = tmp_path / "t.jsonl"
    tasks.write_text("".join(json.dumps({"body": f"w{i % 7} w{i}", "label": f"c{i % 2}", "tag": f"c{i % 2}"}) + "\n"
                             for i in range(40)))
    key = ["--text-key", "body"] if flag == "--text-key" else ["--text-key", "body", "--label-key", "tag"]
    assert main(["eval", "icl", "--checkpoint", str(checkpoint), "--out", str(out), "--tasks", str(tasks), *key,
                 "--shots", "1", "--seeds", "1", "--test-examples", "4", "--quiet", "--no-plot"]) == 0


@pytest.mark.parametrize("args", [
    ["niah", "--grid", "x", "--lengths", "320"], ["niah", "--lengths", "40"], ["niah", "--digits", "13"],
    ["attention", "--depths=-5", "--length", "160"], ["attention", "--template", "x", "--length", "160"],
    ["mqar", "--vocab", "100000", "--lengths", "64", "--pairs", "4"], ["mqar", "--pairs", "100", "--lengths", "64"],
    ["lm", "--seq-len", str(10 ** 11)], ["outliers", "--seq-len", str(10 ** 11)],
    ["quant", "--metric-opt", "x", "--bits", "8"], ["icl", "--arrangements", "x"], ["icl", "--tasks", "x"],
    pytest.param(["lm-eval", "--tasks", "hellaswag"], marks=pytest.mark.skipif(
        importlib.util.find_spec("lm_eval") is not None, reason="lm-eval is installed (it would fetch hellaswag)")),
])
def test_a_refused_evaluation_creates_no_out_directory(args, checkpoint, tmp_path, capsys):
    """An evaluation checks most of its options once it runs, after --out was claimed: a refused run left an empty
    --out directory (and its new parents) behind.  Now they are removed again; an existing --out stays."""
    data = ["--data", str(checkpoint / "haystack.txt")] if args[0] in ("lm", "niah", "attention", "outliers", "quant") \
        else []
    extra = [] if args[0] == "lm-eval" else ["--no-plot", "--quiet", *data]
    out = tmp_path / "new" / "out"
    rc, err = _eval([*args, "--checkpoint", checkpoint, "--out", out, *extra], capsys)
    assert rc == 2 and len(err) == 1 and err[0].startswith("difftx eval: error:"), err
    assert not (tmp_path / "new").exists()
    out.mkdir(parents=True)
    (out / "keep.txt").write_text("keep me")
    rc, err = _eval([*args, "--checkpoint", checkpoint, "--out", out, *extra], capsys)
    assert rc == 2 and len(err) == 1 and (out / "keep.txt").read_text() == "keep me"


def test_icl_shots_past_what_fits_name_the_most_that_fit(checkpoint, tmp_path, capsys):
    """--shots 1000 where a few demonstrations fit said 'not even one demonstration fits'; now it names how many fit
    and the fix.  Too short a --max-len for even one still says so, and names --max-len."""
    out = tmp_path / "out"
    common = ["icl", "--checkpoint", checkpoint, "--out", out, "--seeds", "1", "--test-examples", "2", "--quiet",
              "--no-plot"]
    rc, err = _eval([*common, "--shots", "1000"], capsys)
    assert rc == 2 and len(err) == 1 and "not even one" not in err[0], err
    fit = int(err[0].split("at most ")[1].split()[0])
    assert fit >= 1 and f"pass --shots up to {fit}" in err[0] and "--max-len" in err[0] and not out.exists()
    assert _eval([*common, "--shots", str(fit)], capsys)[0] == 0
    rc, err = _eval([*common, "--shots", "1", "--max-len", "8", "--out", tmp_path / "o2"], capsys)
    assert rc == 2 and len(err) == 1 and "not even one demonstration fits" in err[0] and "--max-len" in err[0]


def test_force_without_a_figure_removes_the_earlier_runs_figure(checkpoint, tmp_path, capsys):
    """--force --no-plot wrote the new NAME.json and kept the earlier run's NAME.png beside it, a figure of another
    result; it is removed now (and said so).  Without --force nothing of an earlier run is touched: the run is
    refused (it wrote its JSON beside the earlier figure)."""
    out = tmp_path / "out"
    args = ["mqar", "--checkpoint", checkpoint, "--out", out, *SMALL["mqar"], "--quiet"]
    out.mkdir()
    (out / "mqar.png").write_bytes(b"an earlier figure")
    assert _eval([*args, "--no-plot"], capsys)[0] == 2  # no --force: refused, the figure stays
    assert (out / "mqar.png").read_bytes() == b"an earlier figure" and not (out / "mqar.json").exists()
    capsys.readouterr()
    assert main(["eval", *map(str, args), "--no-plot", "--force"]) == 0
    assert not (out / "mqar.png").exists() and (out / "mqar.json").exists()
    assert f"removed {out / 'mqar.png'}" in capsys.readouterr().out


def test_depths_are_labelled_as_the_percentages_given(monkeypatch, tmp_path):
    """``--depths 29,12.5`` (0.29, 0.125) read "28%" and "12%": ``int(d * 100)`` truncates 28.999999999999996 and
    drops the half, in the attention summary and the attention and needle-in-a-haystack plots' depth axes."""
    from difftx.cli.eval import _summary

    depths = [0.0, 0.125, 0.29, 0.57, 1.0]
    table = {k: [0.1] * len(depths) for k in ("answer", "noise", "other_needles")}
    line = _summary("attention", {"depths": depths, "table": table})[0]
    assert line.split()[1:] == ["0%", "12.5%", "29%", "57%", "100%"]

    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from difftx.evals.attention import plot_attention
    from difftx.evals.niah import plot_niah

    figs = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figs.append(self), real(self, *a, **k))[1])
    plot_attention({"depths": depths, "table": table, "normalize": "l1",
                    "by_layer": [{"layer": 0, "answer": 0.1, "noise": 0.1}]}, tmp_path / "a.png")
    assert [t.get_text() for t in figs[-1].axes[0].get_xticklabels()] == ["0%", "12.5%", "29%", "57%", "100%"]
    hm = {"depths": depths, "lengths": [64], "teacher_forced": [[0.5]] * len(depths)}
    plot_niah({"table": {"N1R1": {"teacher_forced": 0.5}}, "heatmaps": {"N1R1": hm}}, tmp_path / "n.png")
    assert [t.get_text() for t in figs[-1].axes[1].get_yticklabels()] == ["0%", "12.5%", "29%", "57%", "100%"]


@pytest.mark.parametrize("failure", ["interrupt", "full-disk"])
def test_a_figure_write_that_fails_midway_leaves_no_half_written_png(failure, checkpoint, tmp_path, capsys,
                                                                     monkeypatch):
    """NAME.png was drawn straight onto its final name: Ctrl-C (or a full disk) while the PNG encoder wrote it left a
    truncated NAME.png beside NAME.json, which a rerun then took for an earlier result.  Figures are written like the
    JSON now (a temporary file renamed), so the figure is there whole or not at all, and an earlier one stays."""
    import errno

    PIL = pytest.importorskip("PIL.Image")
    pytest.importorskip("matplotlib")
    PIL.init()

    def encoder_that_stops(im, fp, filename, *args, **kwargs):
        fp.write(b"\x89PNG\r\n\x1a\n half a figure")
        if failure == "interrupt":
            raise KeyboardInterrupt
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    out = tmp_path / "out"
    out.mkdir()
    (out / "mqar.png").write_bytes(b"an earlier figure")
    monkeypatch.setitem(PIL.SAVE, "PNG", encoder_that_stops)
    args = ["mqar", "--checkpoint", checkpoint, "--out", out, *SMALL["mqar"], "--quiet"]
    rc, err = _eval([*args, "--out", tmp_path / "new"], capsys)
    assert rc == (130 if failure == "interrupt" else 2) and len(err) == 1, err
    assert (tmp_path / "new" / "mqar.json").exists() and not (tmp_path / "new" / "mqar.png").exists()
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["mqar.json"]  # no temporary file either
    # the earlier run's figure is never left half-overwritten
    from difftx.evals.mqar import plot_mqar

    doc = json.loads((tmp_path / "new" / "mqar.json").read_text())
    with pytest.raises(KeyboardInterrupt if failure == "interrupt" else OSError):
        plot_mqar(doc["results"], out / "mqar.png")
    assert (out / "mqar.png").read_bytes() == b"an earlier figure"
    assert sorted(p.name for p in out.iterdir()) == ["mqar.png"]
