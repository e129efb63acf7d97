"""``difftx convert``: end to end, bad input as one line + exit 2, and loading never runs code from the files."""

from __future__ import annotations

import json
import re

import pytest
import torch

import difftx
from difftx.errors import CheckpointError
from difftx.interop.convert import convert, save_hf
from .hf_helpers import difftx_model, max_diff, tokens


@pytest.fixture
def llama_dir(tmp_path):
    model = difftx_model(attention="softmax", n_heads=4, n_kv_heads=2)
    save_hf(model, tmp_path / "llama", "hf-llama")  # written without transformers
    return model, tmp_path / "llama"


def _one_error_line(rc, stderr, *needles):
    assert rc == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("difftx convert: error:"), stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def run_main(capsys, *args):
    """The CLI in this process (the subprocess test below covers the real entry point)."""
    from difftx.cli import main

    rc = main(["convert", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_convert_verify_and_load(capsys, llama_dir, tmp_path):
    model, src = llama_dir
    rc, out, err = run_main(capsys, src, tmp_path / "dx", "--from", "hf-llama", "--verify")
    assert rc == 0, err
    assert float(re.search(r"max \|logit difference\| (\S+)", out).group(1)) < 1e-5
    rc, out, err = run_main(capsys, src, tmp_path / "diff", "--diff-init", "exact", "--pairing", "halves", "--verify")
    assert rc == 0, err
    assert float(re.search(r"KL\(source \|\| result\) (\S+)", out).group(1)) < 1e-6
    loaded = difftx.load_model(tmp_path / "diff")
    assert loaded.config.attention == "diff" and loaded.config.pairing == "halves"


def test_mismatched_weights_exit_2_with_one_line_naming_the_tensor(cli, llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    _, src = llama_dir
    sd = load_file(src / "model.safetensors")
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:, :10].contiguous()
    save_file(sd, src / "model.safetensors")
    r = cli("convert", src, tmp_path / "out")
    _one_error_line(r.returncode, r.stderr, "model.layers.0.mlp.up_proj.weight", "shape")
    assert not (tmp_path / "out" / "config.json").exists()


def test_other_bad_inputs(capsys, llama_dir, tmp_path):
    _, src = llama_dir
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("precious")
    rc, _, err = run_main(capsys, src, tmp_path / "busy")
    _one_error_line(rc, err, "not empty", "--force")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "precious"
    rc, _, err = run_main(capsys, tmp_path / "nowhere", tmp_path / "out2")
    _one_error_line(rc, err, "no such file")
    rc, _, err = run_main(capsys, src, tmp_path / "out3", "--diff-init", "twin", "--to", "hf-llama")
    _one_error_line(rc, err, "attention")
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_attention_heads"] = 3
    (src / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run_main(capsys, src, tmp_path / "out4")
    _one_error_line(rc, err, "config.json")


def test_difftx_source_needs_to(tmp_path):
    model = difftx_model(attention="softmax", n_heads=4)
    difftx.save_model(model, tmp_path / "m")
    with pytest.raises(difftx.DifftxError, match="--to"):
        convert(tmp_path / "m", tmp_path / "out")


def test_hf_difftx_format_round_trip_without_transformers(tmp_path):
    model = difftx_model(attention="diff2", n_heads=2, norms="S4")
    difftx.save_model(model, tmp_path / "m")
    convert(tmp_path / "m", tmp_path / "hf", dst_format="hf-difftx")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "difftx"
    convert(tmp_path / "hf", tmp_path / "back")
    x = tokens(97)
    with torch.no_grad():
        assert max_diff(difftx.load_model(tmp_path / "back")(x).logits, model(x).logits) == 0.0


def test_loading_never_executes_code_from_the_directory(tmp_path, llama_dir):
    _, src = llama_dir
    marker = tmp_path / "pwned"
    cfg = json.loads((src / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.Config", "AutoModelForCausalLM": "evil.Model"}
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    difftx.load_model(src)
    convert(src, tmp_path / "out")
    assert not marker.exists()

    class Payload:  # a pickle that would run code when unpickled without weights_only
        def __reduce__(self):
            return (open, (str(marker), "w"))

    bad = tmp_path / "bin"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(cfg))
    torch.save({"model.embed_tokens.weight": Payload()}, bad / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights-only"):
        difftx.load_model(bad)
    assert not marker.exists()


def test_verify_reads_a_hugging_face_source_with_transformers(capsys, llama_dir, tmp_path, monkeypatch):
    """--verify must not read source and result through the same converter: a conversion that changes the
    function is caught (here one weight is perturbed on its way through difftx's Llama reader)."""
    pytest.importorskip("transformers")
    import difftx.interop.convert as conv

    _, src = llama_dir
    rc, out, err = run_main(capsys, src, tmp_path / "ok", "--verify")
    assert rc == 0, err
    assert "source read by transformers, result by difftx" in out
    assert float(re.search(r"max \|logit difference\| (\S+)", out).group(1)) < 1e-5

    read = conv.read_hf_as_difftx

    def off_by_a_bit(path):
        cfg, state = read(path)
        state["final_norm.weight"] = state["final_norm.weight"] * 1.01
        return cfg, state

    monkeypatch.setattr(conv, "read_hf_as_difftx", off_by_a_bit)
    rc, out, err = run_main(capsys, src, tmp_path / "bad", "--verify")
    assert rc == 0, err
    assert float(re.search(r"max \|logit difference\| (\S+)", out).group(1)) > 1e-3


def test_corrupt_config_json_of_a_hugging_face_dir_is_named(capsys, llama_dir, tmp_path):
    _, src = llama_dir
    (src / "config.json").write_text('{"model_type": "llama", ')
    rc, _, err = run_main(capsys, src, tmp_path / "out")
    _one_error_line(rc, err, "config.json", "not valid JSON", "corrupt")
    assert not (tmp_path / "out").exists()
