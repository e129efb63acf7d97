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
