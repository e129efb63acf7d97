"""`difftx info`: listing, JSON, and bad input as one line with exit code 2."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch


def test_info_list(cli):
    r = cli("info", "--list")
    assert r.returncode == 0
    for name in ("diff-3b", "transformer-3b", "ldnt-small", "vdnt-large", "gpt2-124m", "small"):
        assert name in r.stdout


def test_info_json(cli):
    r = cli("info", "diff-1.4b", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert {"params", "flops_per_token", "kv_cache_bytes_per_token", "config"} <= set(info)
    assert info["config"]["attention"] == "diff" and info["config"]["n_heads"] == 8
    twin = json.loads(cli("info", "transformer-1.4b", "--json").stdout)
    assert abs(info["params"] - twin["params"]) / twin["params"] < 1e-3
    assert info["kv_cache_bytes_per_token"] == twin["kv_cache_bytes_per_token"]
    assert info["flops_per_token"] == twin["flops_per_token"]  # the paper's "same parameter count and FLOPs"
    mem = info["train_memory_floor"]  # AdamW fp32: 4 bytes of weight + 8 of moments per parameter, 4 of gradient
    assert mem["state_bytes"] == 12 * info["params"] and mem["gradient_bytes"] == 4 * info["params"]
    assert mem["activation_bytes_per_sequence"] == 4 * 2048 * (24 * (6 * 2048 + 2 * 5461) + 2 * 100288)
    # every block recomputed: each keeps its 2048-wide input; the logits and their gradient stay
    assert mem["activation_bytes_per_sequence_recomputing"] == 4 * 2048 * (24 * 2048 + 2 * 100288)


def test_info_twin_and_overrides(cli):
    r = cli("info", "small", "--attention", "diff", "--norms", "dnt", "--set", "n_layers=2", "--json")
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)["config"]
    assert (cfg["attention"], cfg["n_heads"], cfg["n_layers"], cfg["mid_norm_ffn"]) == ("diff", 4, 2, True)


def _one_line_error(r):
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_info_bad_input(cli, capsys):
    """Through the real command line twice (exit code 2, one line, no traceback), the rest in-process."""
    from difftx.cli import main

    def run(*argv):
        try:
            rc = main(list(argv))
        except SystemExit as e:  # argparse's own errors
            rc = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(argv, rc, out, err)

    assert "unknown preset" in _one_line_error(cli("info", "diff-999b"))
    assert "invalid choice" in _one_line_error(cli("frobnicate"))
    assert "d_model" in _one_line_error(run("info", "small", "--set", "d_model=-3"))
    assert "n_kv_heads" in _one_line_error(run("info", "small", "--set", "n_kv_heads=3"))
    assert "--attention" in _one_line_error(run("info", "small", "--attention", "linear"))
    assert "unrecognized" in _one_line_error(run("info", "small", "--bogus"))


@pytest.mark.parametrize("argv, flag", [(["small"], "PRESET"), (["--attention", "diff"], "--attention"),
                                        (["--norms", "S5"], "--norms"), (["--seq-len", "64"], "--seq-len"),
                                        (["--set", "n_layers=3", "--json"], "--set")])
def test_info_list_refuses_what_it_would_ignore(capsys, argv, flag):
    """--list printed the preset names whatever PRESET, --attention, --norms, --seq-len or --set said; now one
    line, exit 2, nothing printed on stdout."""
    from difftx.cli import main

    rc = main(["info", "--list", *argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1, (out, err)
    assert lines[0].startswith("difftx info: error: --list") and f"reads no {flag}" in lines[0]


def test_info_bad_config_file_and_preset_override(capsys, tmp_path):
    from difftx.cli import main

    def one_line(*argv):
        assert main(["info", *map(str, argv)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("difftx info: error:") and "\n" not in err, err
        return err

    for text in ('{"model": null}', "[1, 2]", '{"model": [1]}', '{"d_model": ', "\xff"):
        (tmp_path / "c.json").write_bytes(text.encode("latin-1"))
        assert str(tmp_path / "c.json") in one_line(tmp_path / "c.json")
    assert "preset" in one_line("nano", "--set", "preset=5")
    (tmp_path / "c.json").write_text(json.dumps({"model": {"preset": 5}}))
    assert "preset" in one_line(tmp_path / "c.json")
    assert "config file not found" in one_line(tmp_path / "missing.json")
    assert "tie_embeddings: must be true or false" in one_line("nano", "--set", "tie_embeddings=no")
    assert "norms: unknown placement preset" in one_line("nano", "--set", 'norms=["S1"]')
    (tmp_path / "c.json").write_text(json.dumps({"norms": ["S1"]}))
    assert "norms: unknown placement preset" in one_line(tmp_path / "c.json")


def test_cli_start_does_not_import_dynamo():
    """`import difftx`, a parameter count on the meta device, an eager forward and backward through the fused
    kernel, and `difftx info` leave torch._dynamo unimported: importing it took 2.4 of the 6.1 s `difftx info`
    needed (torch.compile, which does import it, still finds the fused kernel an eager island:
    tests/nn/test_fast_paths.py::test_models_trace_under_torch_compile)."""
    import sys

    from .conftest import cli_env

    code = """
import contextlib, io, sys, torch
print("torch._dynamo" in sys.modules)
import difftx
from difftx.cli import main
from difftx.models import build_model
cfg = difftx.ModelConfig(attention="diff", d_model=32, n_heads=2, n_layers=1, vocab_size=40, max_seq_len=16)
assert build_model(cfg, device="meta").num_parameters() == build_model(cfg).num_parameters()
model = build_model(cfg)
ids = torch.randint(0, 40, (2, 16))
model(ids, targets=ids).loss.backward()
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["info", "small"]) == 0
print("torch._dynamo" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    after_torch, after_difftx = r.stdout.split()
    if after_torch == "True":
        pytest.skip("this torch imports torch._dynamo itself")
    assert after_difftx == "False"


def test_info_config_file_attention_with_n_heads_is_kept(capsys, tmp_path):
    """--attention with --set n_heads on a config file (or model directory) sets the kind, as for a preset; it
    was dropped, and the softmax model described."""
    from difftx.cli import main

    (tmp_path / "c.json").write_text('{"d_model": 64, "n_heads": 4, "vocab_size": 256, "max_seq_len": 64}')
    assert main(["info", str(tmp_path / "c.json"), "--attention", "diff", "--set", "n_heads=2", "--json"]) == 0
    cfg = json.loads(capsys.readouterr().out)["config"]
    assert (cfg["attention"], cfg["n_heads"]) == ("diff", 2)
    assert main(["info", str(tmp_path / "c.json"), "--set", "attention=diff2", "--set", "n_heads=4", "--json"]) == 0
    cfg = json.loads(capsys.readouterr().out)["config"]
    assert (cfg["attention"], cfg["n_heads"]) == ("diff2", 4)


def test_info_counts_a_deep_model_without_building_every_block(monkeypatch, capsys):
    """`difftx info --set n_layers=100000` built the meta model block by block five times (~20 ms a block: 116 s at
    5000 layers); the counts now come from builds of one and two blocks."""
    import difftx.accounting as accounting
    from difftx.cli import main

    built, build = [], accounting.build_model

    def spy(cfg, *args, **kwargs):
        built.append(cfg.n_layers)
        assert cfg.n_layers <= 2, f"built all {cfg.n_layers} blocks"
        return build(cfg, *args, **kwargs)

    monkeypatch.setattr(accounting, "build_model", spy)
    assert main(["info", "nano", "--set", "n_layers=100000", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    block = 4 * 128 * 128 + 3 * 128 * 384 + 2 * 128  # q, k, v, out; SwiGLU; the two RMSNorms
    assert info["params"] == 2 * 256 * 128 + 128 + 100000 * block  # embedding, LM head, final norm
    assert max(built) <= 2


@pytest.mark.parametrize("preset,overrides", [
    ("nano", {"attention": "diff"}), ("nano", {"attention": "diff2", "n_kv_heads": 2}), ("nanogpt", {}),
    ("nano", {"norms": "dnt"}), ("vdnt-tiny", {"attention": "diff"}), ("gpt2-124m", {"n_layers": 3}),
])
def test_counts_equal_those_of_the_whole_built_model(preset, overrides):
    from difftx import ModelConfig
    from difftx.accounting import count_parameters, matmul_parameters
    from difftx.models import build_model

    cfg = ModelConfig.from_preset(preset, **overrides).replace(n_layers=5)
    model = build_model(cfg, device="meta")
    assert count_parameters(cfg) == model.num_parameters()
    assert count_parameters(cfg, non_embedding=True) == model.num_parameters(non_embedding=True)
    tied = cfg.vocab_size * cfg.d_model if cfg.domain == "lm" and cfg.tie_embeddings else 0
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_parameters(cfg) == linear + tied


def test_info_refuses_lengths_the_model_cannot_run(capsys):
    """FLOPs were reported at any --seq-len: past max_seq_len for learned positions (the model raises there), and
    at any length for a vision model, which always runs its patches (+ CLS)."""
    from difftx.cli import main

    for argv, needle in ((["gpt2-124m", "--seq-len", "4096"], "max_seq_len 1024"),
                         (["nanogpt", "--seq-len", "65"], "max_seq_len 64"),
                         (["vit-tiny", "--seq-len", "1000"], "17 tokens")):
        assert main(["info", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "--seq-len" in err and needle in err and "\n" not in err, err
    for argv in (["gpt2-124m", "--seq-len", "1024"], ["vit-tiny", "--seq-len", "17"], ["nano", "--seq-len", "4096"]):
        assert main(["info", *argv, "--json"]) == 0, argv  # rotary positions have no table to run past
        assert json.loads(capsys.readouterr().out)["seq_len"] == int(argv[-1])


def test_info_header_names_norm_flags_set_apart_from_the_preset(capsys):
    """The header named the placement preset only: `--set post_norm=true` on S1 read "norms S1"."""
    from difftx.cli import main

    for argv, header in ((["--set", "post_norm=true"], "norms S1 + post_norm"),
                         (["--norms", "post"], "norms post"),
                         (["--norms", "dnt", "--set", "pre_norm_ffn=true", "--set", "qk_norm=false"],
                          "norms dnt + pre_norm_ffn - qk_norm")):
        assert main(["info", "nano", *argv]) == 0
        assert capsys.readouterr().out.splitlines()[0] == f"nano: softmax attention, lm, {header}"


@pytest.mark.parametrize("argv", [["info", "nano", "--set", "n_layers=2", "--set", "n_layers=3"],
                                  ["info", "nano", "--set", "dropout=0.1", "--set", " dropout =0.2", "--json"]])
def test_a_field_set_twice_is_refused_not_overridden(capsys, argv):
    """--set n_layers=2 --set n_layers=3 described 3 layers and dropped the first value (the same parser reads
    grads' and compare's --set, eval quant's --metric-opt and train's --task-opt); now one line, exit 2."""
    from difftx.cli import main

    rc = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1, (out, err)
    assert lines[0].startswith("difftx info: error: --set sets ") and "twice" in lines[0] and "give it once" in lines[0]


@pytest.mark.parametrize("argv,field", [(["--set", "attention=diff", "--attention", "diff2"], "attention"),
                                        (["--norms", "S2", "--set", "norms=dnt"], "norms")])
def test_a_field_set_by_its_flag_and_by_set_is_refused(capsys, argv, field):
    """--set attention=diff --attention diff2 described DIFF V2 and dropped the --set value (norms alike); now one
    line, exit 2, as a field --set twice is."""
    from difftx.cli import main

    rc = main(["info", "nano", *argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1, (out, err)
    assert f"--{field}" in lines[0] and f"--set {field}=" in lines[0] and "give it once" in lines[0], lines[0]


@pytest.mark.parametrize("value", ["100000000000000000", "9223372036854775808"])
def test_info_of_sizes_past_torchs_64_bit_count_is_one_line(capsys, value):
    """A weight of 2^63 elements or more was torch's RuntimeError / TypeError traceback from the meta build."""
    from difftx.cli import main

    assert main(["info", "small", "--set", f"vocab_size={value}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "more elements than torch can count" in err and value in err


def test_a_config_error_names_the_option_the_user_typed(capsys, tmp_path):
    """A ConfigError names its config field (``seq_len``); on the command line the user typed ``--seq-len`` or
    ``--set n_layers=0``, so the printed line names that (it printed ``seq_len: ...`` and ``n_layers: ...``).  A
    field the user did not give keeps its field name."""
    from difftx.cli import main

    def err(*argv):
        assert main([str(a) for a in argv]) == 2
        text = capsys.readouterr().err
        assert text.count("\n") == 1, text
        return text

    assert err("info", "nano", "--set", "n_layers=0").startswith("difftx info: error: --set n_layers: must be a ")
    assert err("info", "nano", "--set", " dropout = 2").startswith("difftx info: error: --set dropout: must be in ")
    out = tmp_path / "run"
    for typed, shown in ((["--seq-len", "0"], "--seq-len"), (["--seq", "0"], "--seq-len"), (["--lr=-1"], "--lr"),
                         (["--device", "bogus"], "--device")):
        line = err("train", "--steps", 1, *typed, "--out", out)
        assert line.startswith(f"difftx train: error: {shown}: "), line
    assert err("train", "--steps", 1, "--task-opt", "x=1", "--out", out).startswith(
        "difftx train: error: --task-opt: are options of a synthetic --task")
    # --set n_heads=7 is at fault, but the field named is d_model, which the user did not give: kept as it is
    assert err("info", "small", "--set", "n_heads=7").startswith("difftx info: error: d_model: ")
    assert not out.exists()


def test_an_in_process_command_leaves_the_callers_sigterm_handling_as_it_was(monkeypatch, capsys):
    """``difftx.cli.main`` handles SIGTERM as Ctrl-C while a command runs (exit 143), then gives the process its
    SIGTERM handling back: the default (a later SIGTERM ends a notebook or a server that called it, not a stray
    KeyboardInterrupt), or a handler of the caller's own, which keeps getting SIGTERM during the command."""
    import signal

    import difftx.cli.info as info
    from difftx.cli import main

    real = info.run
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    monkeypatch.setattr(info, "run", lambda args: signal.raise_signal(signal.SIGTERM))
    assert main(["info", "small"]) == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    monkeypatch.setattr(info, "run", real)
    assert main(["info", "small", "--json"]) == 0
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

    got = []

    def own(signum, frame):
        got.append(signum)

    old = signal.signal(signal.SIGTERM, own)
    try:
        monkeypatch.setattr(info, "run", lambda args: signal.raise_signal(signal.SIGTERM))
        assert main(["info", "small"]) == 0
        assert got == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, old)
    capsys.readouterr()


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="lists open descriptors in /proc")
def test_a_reader_that_left_costs_no_descriptor(tmp_path, monkeypatch, capsys):
    """`difftx info small | head`: stdout's pipe closed under a print.  main points stdout at /dev/null (Python's
    exit-time flush must not raise again) and returns 0, but it kept the /dev/null descriptor it opened for that
    open: one leaked descriptor per call in a process that calls main in-process."""
    import os
    import sys

    from difftx.cli import main

    target = open(tmp_path / "stdout", "w")  # stands in for the pipe's descriptor: dup2 replaces this one

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

        def fileno(self):
            return target.fileno()

    try:
        before = sorted(os.listdir("/proc/self/fd"))
        monkeypatch.setattr(sys, "stdout", ClosedPipe())
        assert main(["info", "small"]) == 0
        monkeypatch.undo()
        assert sorted(os.listdir("/proc/self/fd")) == before
        assert os.path.samefile(f"/proc/self/fd/{target.fileno()}", os.devnull)  # the pipe's descriptor is /dev/null
    finally:
        target.close()
    assert capsys.readouterr().err == ""
