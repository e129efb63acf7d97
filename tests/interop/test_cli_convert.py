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
    from safetensors.torch import save_file
    from tests.conftest import load_owned

    _, src = llama_dir
    sd = load_owned(src / "model.safetensors")
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
    assert rc == 1 and sum("verification failed" in line for line in err.splitlines()) == 1, err
    assert float(re.search(r"max \|logit difference\| (\S+)", out).group(1)) > 1e-3
    assert "over the tolerance" in out and (tmp_path / "bad" / "config.json").is_file()  # kept for inspection
    # rounding the weights or changing the function: the numbers are printed, not judged
    rc, out, err = run_main(capsys, src, tmp_path / "bf16", "--verify", "--dtype", "bfloat16")
    assert rc == 0 and "not judged (--dtype bfloat16 rounds the weights)" in out, err


def test_corrupt_config_json_of_a_hugging_face_dir_is_named(capsys, llama_dir, tmp_path):
    _, src = llama_dir
    (src / "config.json").write_text('{"model_type": "llama", ')
    rc, _, err = run_main(capsys, src, tmp_path / "out")
    _one_error_line(rc, err, "config.json", "not valid JSON", "corrupt")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type", [["llama"], {"llama": 1}])
def test_a_model_type_that_is_not_a_string_is_one_error_line(capsys, llama_dir, tmp_path, model_type):
    """A list or object as model_type was a TypeError traceback (unhashable) from convert and load_model."""
    _, src = llama_dir
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = model_type
    (src / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run_main(capsys, src, tmp_path / "out")
    _one_error_line(rc, err, "config.json", "model_type")
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="model_type"):
        difftx.load_model(src)


def test_unusable_dst_is_one_line(capsys, llama_dir, tmp_path):
    """A DST that cannot be a directory: one line for every kind of output, nothing created."""
    _, src = llama_dir
    difftx.save_model(difftx_model(attention="softmax", n_heads=4), tmp_path / "m")
    unilm = tmp_path / "unilm.safetensors"
    from safetensors.torch import save_file

    save_file({"q_proj.weight": torch.zeros(4, 4)}, unilm)
    (tmp_path / "file").write_text("keep")
    for argv in ([src], [tmp_path / "m", "--to", "hf-llama"], [unilm, "--from", "unilm"]):
        for dst in (tmp_path / "file", tmp_path / "file" / "sub"):
            rc, _, err = run_main(capsys, argv[0], dst, *argv[1:])
            _one_error_line(rc, err, str(dst))
    assert (tmp_path / "file").read_text() == "keep"


def test_unusable_dst_is_one_line_when_only_the_write_fails(tmp_path):
    """The library's writers name DST in one DifftxError (the CLI's early check aside)."""
    from difftx.interop.hf_io import write_hf_dir

    (tmp_path / "file").write_text("keep")
    model = difftx_model(attention="softmax", n_heads=4)
    difftx.save_model(model, tmp_path / "m")
    for fn in (lambda d: write_hf_dir(d, {}, {}), lambda d: convert(tmp_path / "m", d, rope_style="interleaved"),
               lambda d: convert(tmp_path / "m", d, dst_format="hf-llama")):
        with pytest.raises(difftx.DifftxError, match="DST"):
            fn(tmp_path / "file" / "sub")


def _fake_run(path, model):
    """The layout of a difftx training run: config.json with a train section and checkpoints/step_*/."""
    run_config = {"difftx_format": 1, "model": model.config.to_dict(), "train": {"steps": 2}}
    ckpt = path / "checkpoints" / "step_00000002"
    difftx.save_model(model, ckpt)
    (ckpt / "config.json").write_text(json.dumps(run_config))
    (path / "config.json").write_text(json.dumps(run_config))
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_force_refuses_to_overwrite_what_convert_did_not_write(capsys, llama_dir, tmp_path):
    _, src = llama_dir
    before = _fake_run(tmp_path / "run", difftx_model(attention="softmax", n_heads=4))
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "study.json").write_text("{}")
    for dst in (tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_00000002", tmp_path / "study"):
        rc, _, err = run_main(capsys, src, dst, "--force")
        _one_error_line(rc, err, str(dst), "--force")
    assert {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()} == before
    assert [p.name for p in (tmp_path / "study").iterdir()] == ["study.json"]
    rc, _, err = run_main(capsys, src, tmp_path / "dx")  # a model directory convert wrote: --force may replace it
    assert rc == 0, err
    rc, _, err = run_main(capsys, src, tmp_path / "dx", "--force")
    assert rc == 0, err


def test_force_replaces_the_model_only_once_the_conversion_succeeded(capsys, llama_dir, tmp_path):
    """A failing --force conversion leaves DST byte for byte as it was (a sharded model's index included); a
    successful one leaves exactly the new model (no stale index shadowing its weights), and nothing beside it."""
    from safetensors.torch import load_file, save_file

    model, src = llama_dir
    dst = tmp_path / "sharded"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = load_file(src / "model.safetensors")
    names = sorted(state)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, dst / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    rc, _, err = run_main(capsys, src, dst, "--from", "difftx", "--force")  # the source is a Llama: refused
    _one_error_line(rc, err, "--from difftx")
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "sharded"]  # no staging directory left

    rc, _, err = run_main(capsys, src, dst, "--force")
    assert rc == 0, err
    assert "model.safetensors.index.json" not in {p.name for p in dst.iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "sharded"]
    x = tokens(model.config.vocab_size)
    with torch.no_grad():
        assert max_diff(difftx.load_model(dst)(x).logits, model(x).logits) < 1e-5


def test_difftx_source_weights_are_checked_against_its_config(capsys, tmp_path):
    """A config saying d_model 32 over 64-wide weights is refused before anything is written."""
    model = difftx_model(attention="softmax", n_heads=4, d_model=64)
    difftx.save_model(model, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["model"].update(d_model=32, head_dim=None, ffn_dim=None)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    for to in ("hf-llama", "hf-difftx"):
        rc, _, err = run_main(capsys, tmp_path / "m", tmp_path / to, "--to", to)
        _one_error_line(rc, err, "embed.weight", "shape")
        assert not (tmp_path / to).exists()


def test_refused_pickles_give_only_the_one_line(capsys, llama_dir, tmp_path):
    """torch's warning about the refused pickle is not printed on top of our error (and nothing runs)."""
    import pickle
    import warnings

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    _, src = llama_dir
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text((src / "config.json").read_text())
    # plain pickles (not torch.save's zip), protocol 4: torch's weights-only reader warns about the protocol
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": Payload()}, 4))
    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"q_proj.weight": Payload()}, 4))
    for argv in ([tmp_path / "hf"], [tmp_path / "evil.pt", "--from", "unilm"]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rc, _, err = run_main(capsys, argv[0], tmp_path / "out", *argv[1:])
        _one_error_line(rc, err, "weights-only")
        assert not caught, [str(w.message) for w in caught]
    assert not marker.exists()


def test_an_integer_weight_tensor_is_refused(capsys, llama_dir, tmp_path):
    """load_state_dict would cast an int tensor into a float parameter without a word: a corrupt file."""
    from safetensors.torch import save_file
    from tests.conftest import load_owned

    _, src = llama_dir
    sd = load_owned(src / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    sd[name] = sd[name].round().to(torch.int32)
    save_file(sd, src / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"'{re.escape(name)}' is int32, not floating point"):
        difftx.load_model(src)
    rc, _, err = run_main(capsys, src, tmp_path / "out")
    _one_error_line(rc, err, name, "int32")
    model = difftx_model(attention="softmax", n_heads=4)
    difftx.save_model(model, tmp_path / "m")
    sd = load_owned(tmp_path / "m" / "model.safetensors")
    sd["final_norm.weight"] = sd["final_norm.weight"].to(torch.int64)
    save_file(sd, tmp_path / "m" / "model.safetensors")
    with pytest.raises(CheckpointError, match="'final_norm.weight' is int64"):
        difftx.load_model(tmp_path / "m")


def test_a_non_finite_weight_is_refused(capsys, llama_dir, tmp_path):
    """A NaN or inf weight (a corrupt file, a diverged export) is refused by name, not loaded."""
    from safetensors.torch import save_file
    from tests.conftest import load_owned

    _, src = llama_dir
    sd = load_owned(src / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    sd[name][0, :3] = float("nan")
    save_file(sd, src / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"'{re.escape(name)}' holds 3 non-finite values"):
        difftx.load_model(src)
    rc, _, err = run_main(capsys, src, tmp_path / "out")
    _one_error_line(rc, err, name, "non-finite")
    assert not (tmp_path / "out").exists()
    model = difftx_model(attention="diff", n_heads=2)
    difftx.save_model(model, tmp_path / "m")
    sd = load_owned(tmp_path / "m" / "model.safetensors")
    sd["final_norm.weight"][1] = float("-inf")
    save_file(sd, tmp_path / "m" / "model.safetensors")
    with pytest.raises(CheckpointError, match="'final_norm.weight' holds 1 non-finite value "):
        difftx.load_model(tmp_path / "m")
    rc, _, err = run_main(capsys, tmp_path / "m", tmp_path / "out2", "--to", "hf-difftx")
    _one_error_line(rc, err, "final_norm.weight", "non-finite")


def test_a_bf16_conversion_loads_back_in_bf16(capsys, llama_dir, tmp_path):
    """config.json names the weights' dtype and load_model gives the model back in it (a float32 model, as
    every training checkpoint, stays float32); an explicit dtype still wins."""
    _, src = llama_dir
    rc, _, err = run_main(capsys, src, tmp_path / "bf", "--dtype", "bfloat16")
    assert rc == 0, err
    assert json.loads((tmp_path / "bf" / "config.json").read_text())["dtype"] == "bfloat16"
    assert {p.dtype for p in difftx.load_model(tmp_path / "bf").parameters()} == {torch.bfloat16}
    assert {p.dtype for p in difftx.load_model(tmp_path / "bf", dtype=torch.float32).parameters()} == {torch.float32}
    assert {p.dtype for p in difftx.load_model(tmp_path / "bf", dtype="float32").parameters()} == {torch.float32}
    with pytest.raises(difftx.ConfigError, match="dtype: must be a torch dtype or one of"):
        difftx.load_model(tmp_path / "bf", dtype="fp8")
    rc, _, err = run_main(capsys, src, tmp_path / "fp")
    assert rc == 0, err
    assert {p.dtype for p in difftx.load_model(tmp_path / "fp").parameters()} == {torch.float32}


def test_diffllama_attention_bias_is_refused_naming_diffllama(capsys, tmp_path):
    model = difftx_model(attention="diff", n_heads=2, head_norm_weight=False, pairing="halves")
    save_hf(model, tmp_path / "dl", "hf-diffllama")
    cfg = json.loads((tmp_path / "dl" / "config.json").read_text())
    cfg["attention_bias"] = True
    (tmp_path / "dl" / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run_main(capsys, tmp_path / "dl", tmp_path / "out")
    _one_error_line(rc, err, "attention_bias=True is not supported for DiffLlama")
    assert "mlp_bias" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("content,needle", [
    ([torch.zeros(2)], "holds a list"),
    (torch.zeros(2), "holds a Tensor"),
    ({"model.embed_tokens.weight": 3}, "'model.embed_tokens.weight' is a int"),
    ({1: torch.zeros(2)}, "key 1 is a int"),
])
def test_a_pytorch_model_bin_that_is_not_a_dict_of_named_tensors_is_one_error_line(capsys, llama_dir, tmp_path,
                                                                                    content, needle):
    """torch.load(weights_only=True) reads lists, bare tensors and ints too: not a state dict, one clear line."""
    _, src = llama_dir
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text((src / "config.json").read_text())
    torch.save(content, tmp_path / "hf" / "pytorch_model.bin")
    rc, _, err = run_main(capsys, tmp_path / "hf", tmp_path / "out")
    _one_error_line(rc, err, "pytorch_model.bin", needle)


@pytest.mark.parametrize("shard", [["model.safetensors"], 3])
def test_a_weight_index_naming_no_shard_file_is_one_error_line(capsys, llama_dir, tmp_path, shard):
    _, src = llama_dir
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text((src / "config.json").read_text())
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": shard}}))
    rc, _, err = run_main(capsys, tmp_path / "hf", tmp_path / "out")
    _one_error_line(rc, err, "model.safetensors.index.json", "the index is corrupt")


@pytest.mark.parametrize("change,needle", [
    ({"num_attention_heads": 0, "head_dim": None}, "'num_attention_heads' must be a positive integer"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}}, "'rope_theta' must be a number"),
    ({"rms_norm_eps": "x"}, "'rms_norm_eps' must be a number"),
])
def test_a_bad_number_in_a_hugging_face_config_is_one_error_line(capsys, llama_dir, tmp_path, change, needle):
    """0 heads was a ZeroDivisionError, a non-numeric rope_theta / rms_norm_eps a ValueError traceback."""
    _, src = llama_dir
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(change)
    (src / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run_main(capsys, src, tmp_path / "out")
    _one_error_line(rc, err, "config.json", needle)


def test_hugging_face_tokenizer_files_survive_a_difftx_to_difftx_step(llama_dir, tmp_path):
    """HF -> difftx -> difftx (a relayout or --diff-init) -> HF: the Hugging Face source's tokenizer files
    (a SentencePiece tokenizer.model, tokenizer_config.json) went missing in the difftx -> difftx step, while
    its token ids travelled on."""
    _, src = llama_dir
    (src / "tokenizer.model").write_bytes(b"\x0a\x05a sentencepiece model, as bytes")
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    convert(src, tmp_path / "dx")
    convert(tmp_path / "dx", tmp_path / "dx2", rope_style="interleaved")
    convert(tmp_path / "dx", tmp_path / "diff", diff_init="twin-zero")
    for out in ("dx2", "diff"):
        for name in ("tokenizer.model", "tokenizer_config.json"):
            assert (tmp_path / out / name).read_bytes() == (src / name).read_bytes(), (out, name)
    convert(tmp_path / "dx2", tmp_path / "hf2", dst_format="hf-llama")
    assert (tmp_path / "hf2" / "tokenizer.model").read_bytes() == (src / "tokenizer.model").read_bytes()


def test_a_sharded_model_in_a_hugging_face_hub_cache_snapshot_loads(llama_dir, tmp_path):
    """The hub cache keeps a snapshot's files as symlinks into ../../blobs: the shards were refused as lying
    outside the model directory (the check resolved the symlinks); a shard name with a path is still refused."""
    import os

    from safetensors.torch import load_file, save_file

    model, src = llama_dir
    sd = load_file(src / "model.safetensors")
    keys = sorted(sd)
    repo = tmp_path / "hub" / "models--someone--llama"
    snap, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, blobs / f"sha{i}")
        os.symlink(f"../../blobs/sha{i}", snap / name)
        weight_map.update({k: name for k in part})
    (blobs / "index").write_text(json.dumps({"weight_map": weight_map}))
    os.symlink("../../blobs/index", snap / "model.safetensors.index.json")
    (blobs / "config").write_text((src / "config.json").read_text())
    os.symlink("../../blobs/config", snap / "config.json")
    x = torch.randint(0, 97, (1, 7))
    with torch.no_grad():
        assert torch.equal(difftx.load_model(snap)(x).logits, model(x).logits)
    for bad in ("../sha0", str(blobs / "sha0"), "sub/model.safetensors"):
        (snap / "model.safetensors.index.json").unlink()
        (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {keys[0]: bad}}))
        with pytest.raises(CheckpointError, match="lies outside the model directory"):
            difftx.load_model(snap)


def test_a_model_directorys_weights_file_is_not_taken_for_unilm_modules(capsys, tmp_path):
    """load_model accepts DIR/model.safetensors; convert read any file as official unilm modules, so a difftx
    DIFF model's weights file (per-head norm without gain) converted without a word into attention modules with
    the unilm conventions (interleaved RoPE), another function."""
    model = difftx_model(attention="diff", n_heads=2, head_norm_weight=False)
    difftx.save_model(model, tmp_path / "m")
    rc, _, err = run_main(capsys, tmp_path / "m" / "model.safetensors", tmp_path / "out")
    _one_error_line(rc, err, "give the directory")
    assert not (tmp_path / "out").exists()


LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def _is_lambda(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LAMBDAS


def test_a_lower_dtype_conversion_writes_diff_lambdas_in_float32(capsys, tmp_path):
    """convert --dtype bfloat16 wrote DIFF's lambda vectors in bf16 (rounded on disk), unlike a bf16
    DifftxForCausalLM's save_pretrained; now every destination keeps them in float32 with the source's values,
    config.json still names bfloat16, and difftx and transformers read the exact values back."""
    from safetensors.torch import load_file

    model = difftx_model(attention="diff", n_heads=2, head_norm_weight=False, pairing="halves")
    src = difftx.save_model(model, tmp_path / "m")
    want = {n: p.detach() for n, p in model.named_parameters() if _is_lambda(n)}
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in want.values())  # bf16 would round them
    x = tokens(97)
    for fmt in ("difftx", "hf-difftx", "hf-diffllama"):
        rc, _, err = run_main(capsys, src, tmp_path / fmt, "--to", fmt, "--dtype", "bfloat16")
        assert rc == 0, err
        stored = load_file(tmp_path / fmt / "model.safetensors")
        assert {k for k, v in stored.items() if v.dtype == torch.float32} == {k for k in stored if _is_lambda(k)}
        assert {v.dtype for k, v in stored.items() if not _is_lambda(k)} == {torch.bfloat16}, fmt
        for k, v in stored.items():
            if _is_lambda(k):
                assert torch.equal(v, want["layers." + k.split("layers.", 1)[1].replace("self_attn.", "attn.")]), k
        assert json.loads((tmp_path / fmt / "config.json").read_text())["dtype"] == "bfloat16", fmt
        loaded = difftx.load_model(tmp_path / fmt, dtype=torch.bfloat16)
        assert loaded.embed.weight.dtype == torch.bfloat16
        for n, p in loaded.named_parameters():
            if _is_lambda(n):
                assert p.dtype == torch.float32 and torch.equal(p, want[n]), (fmt, n)
    # the bf16 result converted on without --dtype stays bf16 with its float32 lambdas (it was written float32)
    rc, _, err = run_main(capsys, tmp_path / "difftx", tmp_path / "again", "--to", "hf-difftx")
    assert rc == 0, err
    assert json.loads((tmp_path / "again" / "config.json").read_text())["dtype"] == "bfloat16"
    again = load_file(tmp_path / "again" / "model.safetensors")
    for k, v in again.items():
        assert v.dtype == (torch.float32 if _is_lambda(k) else torch.bfloat16), k
    pytest.importorskip("transformers")
    from transformers import DiffLlamaForCausalLM

    from difftx.interop.hf import DifftxForCausalLM

    dx = difftx.load_model(tmp_path / "difftx")
    for d in ("hf-difftx", "again"):  # the transformers wrapper reads the same model: dtypes and logits
        hf = DifftxForCausalLM.from_pretrained(tmp_path / d, dtype=torch.bfloat16).eval()
        assert {n: p.dtype for n, p in hf.model.named_parameters()} == {n: p.dtype for n, p in dx.named_parameters()}
        with torch.no_grad():
            assert torch.equal(hf(x).logits, dx(x).logits), d
    # transformers' DiffLlama keeps its lambdas in the model dtype: it rounds them on loading a bf16 model (as it
    # would the bf16 file it used to get), and a float32 load now gets the exact values
    for dtype in (torch.bfloat16, torch.float32):
        dl = DiffLlamaForCausalLM.from_pretrained(tmp_path / "hf-diffllama", dtype=dtype)
        for i, layer in enumerate(dl.model.layers):
            for name in LAMBDAS:
                assert torch.equal(getattr(layer.self_attn, name), want[f"layers.{i}.attn.{name}"].to(dtype))


@pytest.fixture
def unilm_file(tmp_path):
    """Official unilm attention modules (layers 0 and 1) in bfloat16."""
    from safetensors.torch import save_file

    from .test_unilm import official_state

    state = {f"layers.{i}.self_attn.{k}": v.to(torch.bfloat16) for i in (0, 1)
             for k, v in official_state(seed=i).items()}
    save_file(state, tmp_path / "unilm.safetensors")
    return tmp_path / "unilm.safetensors"


@pytest.mark.parametrize("src, argv, needles", [
    ("unilm", ["--diff-init", "twin"], ["--diff-init", "DIFF attention already"]),
    ("unilm", ["--verify"], ["--verify", "attention modules"]),  # was refused after DST was written
    ("unilm", ["--depth", "0"], ["'layers.0.self_attn.' -> 0", "--depth is for a module whose prefix has none"]),
    ("diff", ["--to", "hf-llama", "--depth", "2"], ["--depth applies to a unilm weights file"]),
    ("diff", ["--to", "hf-difftx", "--unilm-variant", "naive"], ["--unilm-variant applies to a unilm"]),
    ("diff", ["--to", "hf-diffllama", "--pairing", "adjacent"], ["--pairing: --to hf-diffllama has a fixed layout"]),
    ("diff", ["--to", "hf-diffllama", "--rope-style", "interleaved"], ["--rope-style: --to hf-diffllama"]),
    ("softmax", ["--to", "hf-llama", "--rope-style", "interleaved"], ["--rope-style: --to hf-llama"]),
    ("softmax", ["--to", "hf-diffllama", "--diff-init", "exact", "--pairing", "halves"], ["fixed layout"]),
    ("softmax", ["--pairing", "halves"], ["--pairing lays out DIFF heads", "softmax", "--diff-init"]),
])
def test_an_option_the_conversion_does_not_use_is_refused(capsys, tmp_path, unilm_file, src, argv, needles):
    """--diff-init of a unilm source, --depth / --unilm-variant of any other, and --pairing / --rope-style with a
    Hugging Face format that fixes its layout (or a result with nothing to lay out) were accepted and ignored; now
    one line, exit 2, nothing written."""
    if src != "unilm":
        difftx.save_model(difftx_model(attention=src, n_heads=2, head_norm_weight=False), tmp_path / src)
    rc, _, err = run_main(capsys, unilm_file if src == "unilm" else tmp_path / src, tmp_path / "out", *argv)
    _one_error_line(rc, err, *needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--to", "hf-llama", "--pairing", "halves"], "--pairing: --to hf-llama has a fixed layout"),
    (["--to", "hf-diffllama", "--rope-style", "half"], "--rope-style: --to hf-diffllama"),
    (["--to", "hf-diffllama", "--diff-init", "exact"], "--diff-init exact turns the per-head norm off"),
])
def test_a_contradictory_option_is_named_before_a_full_dst(capsys, tmp_path, argv, needle):
    """A non-empty DST was reported ("directory is not empty") before --pairing with --to hf-llama, so fixing the
    path only led to the next refusal: options that contradict one another come first; DST is left as it was."""
    difftx.save_model(difftx_model(attention="diff", n_heads=2, head_norm_weight=False), tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    rc, _, err = run_main(capsys, tmp_path / "src", tmp_path / "out", *argv)
    _one_error_line(rc, err, needle)
    assert "not empty" not in err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_a_unilm_source_is_stored_in_its_dtype_or_in_dtype(capsys, tmp_path, unilm_file):
    """--dtype was ignored for unilm modules, and they were always stored in float32 (not as the source)."""
    from safetensors.torch import load_file

    from difftx.interop.unilm import load_attention_modules
    from .test_unilm import official_state, reference_forward, run_difftx

    for name, argv, dtype in (("same", [], torch.bfloat16), ("half", ["--dtype", "float16"], torch.float16)):
        rc, _, err = run_main(capsys, unilm_file, tmp_path / name, *argv)
        assert rc == 0, err
        stored = load_file(tmp_path / name / "attention.safetensors")  # DIFF's lambdas stay float32
        assert {k for k, t in stored.items() if t.dtype == torch.float32} == {k for k in stored if _is_lambda(k)}
        assert {t.dtype for k, t in stored.items() if not _is_lambda(k)} == {dtype}
        module = load_attention_modules(tmp_path / name)["layers.1.self_attn."]
        x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(0))
        sd = {k: v.to(torch.bfloat16).float() for k, v in official_state(seed=1).items()}
        with torch.no_grad():
            assert max_diff(run_difftx(module, x), reference_forward(sd, x, 1)) < 0.05


def test_an_hf_difftx_result_keeps_the_layout_asked_for(capsys, llama_dir, tmp_path):
    """--pairing / --rope-style were ignored with --to hf-difftx (and --rope-style with --diff-init too); the
    result now has the layout asked for and the same function."""
    _, src = llama_dir
    difftx.save_model(difftx_model(attention="diff", n_heads=2), tmp_path / "diff")
    rc, _, err = run_main(capsys, tmp_path / "diff", tmp_path / "hf", "--to", "hf-difftx", "--pairing", "halves",
                          "--rope-style", "interleaved")
    assert rc == 0, err
    a, b = difftx.load_model(tmp_path / "diff"), difftx.load_model(tmp_path / "hf")
    assert (b.config.pairing, b.config.rope_style) == ("halves", "interleaved")
    x = tokens(a.config.vocab_size)
    with torch.no_grad():
        assert max_diff(a(x).logits, b(x).logits) < 1e-5
    for name, extra in (("plain", []), ("relaid", ["--rope-style", "interleaved"])):
        rc, _, err = run_main(capsys, src, tmp_path / name, "--to", "hf-difftx", "--diff-init", "twin-zero", *extra)
        assert rc == 0, err
    a, b = difftx.load_model(tmp_path / "plain"), difftx.load_model(tmp_path / "relaid")
    assert (a.config.rope_style, b.config.rope_style) == ("half", "interleaved")
    with torch.no_grad():
        assert max_diff(a(x).logits, b(x).logits) < 1e-5


def test_load_model_gives_a_hugging_face_directory_back_in_its_stored_dtype(capsys, tmp_path):
    """load_model of a bf16 hf-difftx / hf-llama export ignored config.json's dtype and loaded float32, while a
    difftx directory loads in the dtype it was saved in; now both do (config.json's dtype, or transformers' older
    torch_dtype; each tensor's stored dtype when it names none), and an explicit dtype still wins."""
    from safetensors.torch import load_file

    model = difftx_model(attention="diff", n_heads=2)
    src = difftx.save_model(model, tmp_path / "m")
    for fmt in ("difftx", "hf-difftx"):
        rc, _, err = run_main(capsys, src, tmp_path / fmt, "--to", fmt, "--dtype", "bfloat16")
        assert rc == 0, err
    dx = difftx.load_model(tmp_path / "difftx")
    hf = difftx.load_model(tmp_path / "hf-difftx")
    assert {n: p.dtype for n, p in hf.named_parameters()} == {n: p.dtype for n, p in dx.named_parameters()}
    assert hf.embed.weight.dtype == torch.bfloat16 and hf.layers[0].attn.lambda_q1.dtype == torch.float32
    for k, v in dx.state_dict().items():
        assert torch.equal(hf.state_dict()[k], v), k
    x = tokens(97)
    with torch.no_grad():
        assert torch.equal(hf(x).logits, dx(x).logits)
    assert {p.dtype for p in difftx.load_model(tmp_path / "hf-difftx", dtype="float32").parameters()} == {
        torch.float32}
    cfg_path = tmp_path / "hf-difftx" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = cfg.pop("dtype")  # transformers < 5 wrote it so
    cfg_path.write_text(json.dumps(cfg))
    assert difftx.load_model(tmp_path / "hf-difftx").embed.weight.dtype == torch.bfloat16
    del cfg["torch_dtype"]  # no note: each tensor in its stored dtype, as for a difftx directory
    cfg_path.write_text(json.dumps(cfg))
    stored = load_file(tmp_path / "hf-difftx" / "model.safetensors")
    loaded = difftx.load_model(tmp_path / "hf-difftx").state_dict()
    assert {k: v.dtype for k, v in loaded.items()} == {k[len("model."):]: v.dtype for k, v in stored.items()}
    pytest.importorskip("transformers")
    from difftx.interop.hf import DifftxForCausalLM

    wrapped = DifftxForCausalLM.from_pretrained(tmp_path / "hf-difftx", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.equal(wrapped(x).logits, dx(x).logits)


def test_load_model_gives_a_bf16_llama_directory_back_in_bf16(capsys, llama_dir, tmp_path):
    model, src = llama_dir
    rc, _, err = run_main(capsys, difftx.save_model(model, tmp_path / "m"), tmp_path / "bf", "--to", "hf-llama",
                          "--dtype", "bfloat16")
    assert rc == 0, err
    assert {p.dtype for p in difftx.load_model(tmp_path / "bf").parameters()} == {torch.bfloat16}
    assert {p.dtype for p in difftx.load_model(src).parameters()} == {torch.float32}  # a float32 one stays so


@pytest.mark.parametrize("fmt", ["hf-llama", "hf-difftx"])
def test_a_mixed_dtype_model_exported_to_hugging_face_names_no_dtype(capsys, tmp_path, fmt):
    """bf16 weights with float32 norm gains (a mixed model: no one dtype) exported to hf-llama: config.json said
    "dtype": "float32", so load_model upcast every tensor where the difftx source (and an hf-difftx export) keep
    each tensor's stored dtype."""
    from safetensors.torch import save_file
    from tests.conftest import load_owned

    src = difftx.save_model(difftx_model(attention="softmax", n_heads=4, n_kv_heads=2), tmp_path / "m")
    state = {k: v if "norm" in k else v.to(torch.bfloat16) for k, v in load_owned(src / "model.safetensors").items()}
    save_file(state, src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["dtype"]  # as save_model writes a mixed model's
    (src / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run_main(capsys, src, tmp_path / fmt, "--to", fmt)
    assert rc == 0, err
    assert "dtype" not in json.loads((tmp_path / fmt / "config.json").read_text())
    want = {k: v.dtype for k, v in difftx.load_model(src).state_dict().items()}
    assert {k: v.dtype for k, v in difftx.load_model(tmp_path / fmt).state_dict().items()} == want


@pytest.mark.parametrize("key,value", [("tie_word_embeddings", "false"), ("attention_bias", "false"),
                                       ("mlp_bias", 1), ("tie_word_embeddings", [])])
def test_a_flag_that_is_not_a_boolean_in_a_hugging_face_config_is_one_error_line(capsys, llama_dir, tmp_path, key,
                                                                                  value):
    """bool(value) read the JSON string "false" as True: a silently tied model, or a refusal naming attention_bias
    and mlp_bias as if they differed (transformers refuses such a config as well)."""
    _, src = llama_dir
    cfg = json.loads((src / "config.json").read_text())
    cfg[key] = value
    (src / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run_main(capsys, src, tmp_path / "out")
    _one_error_line(rc, err, "config.json", f"'{key}' must be true or false", repr(value))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["tie_word_embeddings", "attention_bias", "mlp_bias"])
def test_a_null_flag_in_a_hugging_face_config_is_its_default(capsys, llama_dir, tmp_path, key):
    model, src = llama_dir
    cfg = json.loads((src / "config.json").read_text())
    cfg[key] = None
    (src / "config.json").write_text(json.dumps(cfg))
    loaded = difftx.load_model(src)
    assert not loaded.config.tie_embeddings and not loaded.config.bias
    x = tokens(97)
    with torch.no_grad():
        assert max_diff(loaded(x).logits, model(x).logits) < 1e-5


def test_a_null_dtype_beside_torch_dtype_loads_in_torch_dtype(llama_dir):
    """{"dtype": null, "torch_dtype": "bfloat16"}: transformers keeps torch_dtype when dtype is null; load_model
    read the null and loaded the float32 weights as stored."""
    _, src = llama_dir
    cfg = json.loads((src / "config.json").read_text())
    cfg["dtype"], cfg["torch_dtype"] = None, "bfloat16"
    (src / "config.json").write_text(json.dumps(cfg))
    assert {p.dtype for p in difftx.load_model(src).parameters()} == {torch.bfloat16}
    cfg["dtype"] = "float32"  # both named: dtype wins, as in transformers
    (src / "config.json").write_text(json.dumps(cfg))
    assert {p.dtype for p in difftx.load_model(src).parameters()} == {torch.float32}


def test_a_llama_converts_to_a_twin_diffllama(capsys, tmp_path):
    """--diff-init twin --to hf-diffllama was always refused: twin's per-head norm had eps 1e-5 and DiffLlama's
    uses rms_norm_eps (1e-6 here, transformers' Llama default), and no option changes it.  DiffLlama's norm takes
    the model's norm_eps; the weights are twin's."""
    from difftx.interop.layouts import relayout
    from difftx.interop.llama_to_diff import llama_to_diff

    model = difftx_model(attention="softmax", n_heads=4, n_kv_heads=2, norm_eps=1e-6)
    save_hf(model, tmp_path / "llama", "hf-llama")
    rc, _, err = run_main(capsys, tmp_path / "llama", tmp_path / "diff", "--diff-init", "twin", "--to", "hf-diffllama")
    assert rc == 0, err
    assert json.loads((tmp_path / "diff" / "config.json").read_text())["rms_norm_eps"] == 1e-6
    loaded = difftx.load_model(tmp_path / "diff")
    assert loaded.config.head_norm_eps == loaded.config.norm_eps == 1e-6 and loaded.config.head_norm
    cfg, state = llama_to_diff(model.config, model.state_dict(), mode="twin", head_norm_eps=1e-6)
    want = difftx.build_model(cfg.replace(pairing="halves")).eval()
    want.load_state_dict(relayout(state, cfg, pairing="halves")[1])
    x = tokens(97)
    with torch.no_grad():
        assert max_diff(loaded(x).logits, want(x).logits) < 1e-5
    transformers = pytest.importorskip("transformers")
    hf = transformers.DiffLlamaForCausalLM.from_pretrained(tmp_path / "diff", attn_implementation="eager").eval()
    with torch.no_grad():
        assert max_diff(hf(x).logits, want(x).logits) < 1e-5


@pytest.mark.parametrize("mode", ["exact", "twin-zero"])
def test_a_diff_init_without_a_per_head_norm_to_diffllama_names_the_fix(capsys, llama_dir, tmp_path, mode):
    """exact / twin-zero turn the per-head norm off, which DiffLlama always applies: the refusal said so
    ("head_norm ... got False") without naming an option that works; nothing is written."""
    _, src = llama_dir
    rc, _, err = run_main(capsys, src, tmp_path / "out", "--diff-init", mode, "--to", "hf-diffllama")
    _one_error_line(rc, err, f"--diff-init {mode}", "--diff-init twin", "--to difftx", "hf-difftx")
    assert not (tmp_path / "out").exists()


def test_verify_when_transformers_cannot_read_the_source_is_one_error_line(capsys, llama_dir, tmp_path):
    """A config difftx reads but transformers refuses ("tie_word_embeddings": null, which transformers 5 validates
    as a bool): --verify was a traceback out of from_pretrained.  Now one line naming the source (exit 2), and the
    converted model stays in DST."""
    pytest.importorskip("transformers")
    model, src = llama_dir
    cfg = json.loads((src / "config.json").read_text())
    cfg["tie_word_embeddings"] = None
    (src / "config.json").write_text(json.dumps(cfg))
    try:
        import transformers

        transformers.LlamaForCausalLM.from_pretrained(str(src), local_files_only=True)
    except Exception:
        pass
    else:
        pytest.skip("this transformers version reads a null tie_word_embeddings")
    rc, out, err = run_main(capsys, src, tmp_path / "out", "--verify")
    _one_error_line(rc, err, "--verify", "transformers cannot read", str(src), "tie_word_embeddings", "drop --verify")
    assert difftx.load_model(tmp_path / "out").config.vocab_size == model.config.vocab_size  # kept


def test_verify_when_transformers_cannot_read_the_result_fails_in_one_line(capsys, llama_dir, tmp_path,
                                                                           monkeypatch):
    """transformers refusing the converted result is a failed verification (exit 1, one line), not a traceback."""
    transformers = pytest.importorskip("transformers")
    _, src = llama_dir
    model = difftx.save_model(difftx.load_model(src), tmp_path / "m")
    real = transformers.LlamaForCausalLM.from_pretrained

    def refuse(path, *args, **kwargs):
        if "out" in str(path):
            raise ValueError("something transformers does not like\nover two lines")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "from_pretrained", refuse)
    rc, out, err = run_main(capsys, model, tmp_path / "out", "--to", "hf-llama", "--verify")
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "verification failed" in lines[0] and "transformers cannot read" in lines[0], err
    assert "something transformers does not like over two lines" in lines[0]
    assert (tmp_path / "out" / "model.safetensors").is_file()  # kept for inspection


def _hf_tokenizer_json() -> str:
    from difftx.data.tokenizers import train_bpe

    return train_bpe(["the quick brown fox jumps over the lazy dog. " * 20], vocab_size=300)._json


def test_a_hugging_face_tokenizer_beside_a_difftx_one_survives_a_round_trip(capsys, llama_dir, tmp_path):
    """A Hugging Face directory holding tokenizer.json (a Hugging Face tokenizer) and difftx_tokenizer.json (a
    byte one): converting it to difftx kept only the difftx tokenizer (as tokenizer.json), so the Hugging Face
    tokenizer.json, the one difftx reads first in that directory, was gone on the way back."""
    from difftx.data.tokenizers import ByteTokenizer
    from difftx.evals.common import saved_tokenizer

    _, src = llama_dir
    (src / "tokenizer.json").write_text(_hf_tokenizer_json())
    ByteTokenizer().save(tmp_path / "byte")
    (src / "difftx_tokenizer.json").write_bytes((tmp_path / "byte" / "tokenizer.json").read_bytes())
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    names = ["tokenizer.json", "difftx_tokenizer.json", "tokenizer_config.json"]
    rc, _, err = run_main(capsys, src, tmp_path / "dx")
    assert rc == 0, err
    rc, _, err = run_main(capsys, tmp_path / "dx", tmp_path / "hf2", "--to", "hf-llama")
    assert rc == 0, err
    convert(tmp_path / "dx", tmp_path / "dx2", rope_style="interleaved")  # difftx -> difftx
    convert(tmp_path / "dx2", tmp_path / "hf3", dst_format="hf-difftx")
    for out in ("dx", "hf2", "dx2", "hf3"):
        for name in names:
            assert (tmp_path / out / name).read_bytes() == (src / name).read_bytes(), (out, name)
    # the difftx directory's tokenizer is the one difftx reads in the source
    assert saved_tokenizer(tmp_path / "dx").kind == saved_tokenizer(src).kind != "byte"


def test_a_difftx_tokenizer_beside_a_difftx_tokenizer_json_is_refused_for_hugging_face(capsys, tmp_path):
    """A difftx directory whose tokenizer.json is a byte tokenizer and which also holds difftx_tokenizer.json: the
    export to Hugging Face would write both to difftx_tokenizer.json; it is one error line, before anything is
    written (an existing DST under --force stays as it was)."""
    from difftx.data.tokenizers import ByteTokenizer, CharTokenizer

    difftx.save_model(difftx_model(attention="softmax", n_heads=4, vocab_size=256), tmp_path / "m")
    ByteTokenizer().save(tmp_path / "m")
    CharTokenizer.from_text("abc").save(tmp_path / "char")
    (tmp_path / "m" / "difftx_tokenizer.json").write_bytes((tmp_path / "char" / "tokenizer.json").read_bytes())
    rc, _, err = run_main(capsys, tmp_path / "m", tmp_path / "hf", "--to", "hf-llama")
    _one_error_line(rc, err, "difftx_tokenizer.json", "remove or rename")
    assert not (tmp_path / "hf").exists()
    rc, _, err = run_main(capsys, tmp_path / "m", tmp_path / "dx", "--rope-style", "interleaved")  # both kept
    assert rc == 0, err
    rc, _, err = run_main(capsys, tmp_path / "m", tmp_path / "dx", "--force", "--to", "hf-llama")
    _one_error_line(rc, err, "difftx_tokenizer.json")
    for name in ("tokenizer.json", "difftx_tokenizer.json"):
        assert (tmp_path / "dx" / name).read_bytes() == (tmp_path / "m" / name).read_bytes()


def test_a_vision_model_to_hf_difftx_is_one_error_line(capsys, tmp_path):
    """A difftx vision model (domain='vision') converted --to hf-difftx was written as a DifftxForCausalLM
    directory that transformers then refused ("DifftxConfig holds language models"); now one line before anything
    is written, as --to hf-llama / hf-diffllama refuse it."""
    from difftx.errors import ConfigError

    model = difftx.build_model(difftx.ModelConfig(domain="vision", d_model=64, n_layers=2, n_heads=2))
    difftx.save_model(model, tmp_path / "vit")
    rc, _, err = run_main(capsys, tmp_path / "vit", tmp_path / "out", "--to", "hf-difftx")
    _one_error_line(rc, err, "domain", "cannot export to hf-difftx", "language models")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="domain"):
        save_hf(model, tmp_path / "out", "hf-difftx")
    assert not (tmp_path / "out").exists()


def test_force_refuses_a_dst_that_holds_the_source(capsys, llama_dir, tmp_path):
    """--force over a model directory that holds SRC (a difftx copy kept inside the Hugging Face directory it came
    from) converted, then replaced DST as a whole: the source was deleted with it.  Now one line, nothing changed."""
    model, dst = llama_dir
    difftx.save_model(model, dst / "dx")
    before = sorted(p.relative_to(dst) for p in dst.rglob("*"))
    rc, _, err = run_main(capsys, dst / "dx", dst, "--to", "hf-llama", "--force")
    _one_error_line(rc, err, "holds the source", "--force", "pick another DST")
    assert sorted(p.relative_to(dst) for p in dst.rglob("*")) == before
    assert difftx.load_model(dst / "dx") is not None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_hugging_face_write_that_fails_midway_leaves_the_earlier_directory_as_it_was(tmp_path, full_disk):
    """write_hf_dir renamed the new model.safetensors into place before writing config.json: a config write that
    failed (disk full) left the new weights beside the earlier config.  Now both files or neither."""
    from difftx.interop.hf_io import write_hf_dir

    d = write_hf_dir(tmp_path / "hf", {"model_type": "llama", "vocab_size": 8}, {"w": torch.zeros(2, 3)})
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    restore = full_disk()  # the second file written (the config) hits a full disk
    with pytest.raises(OSError, match="No space"):
        write_hf_dir(d, {"model_type": "llama", "vocab_size": 16}, {"w": torch.ones(4, 3)})
    restore()
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # no temporary files, nothing replaced


@pytest.mark.parametrize("failure", ["interrupt", "full-disk"])
@pytest.mark.parametrize("dst_exists", [False, True, "under_new_parents"])
def test_a_convert_that_stops_while_copying_the_tokenizer_leaves_no_half_model(failure, dst_exists, tmp_path,
                                                                              capsys, monkeypatch):
    """The model files were written atomically straight into DST, then the tokenizer copied with shutil.copyfile:
    Ctrl-C (or a full disk) during that copy left a complete-looking model with a truncated tokenizer.json (or
    none), and a rerun was refused as 'directory is not empty'.  Now a convert that fails leaves DST as it found
    it (no DST, or the empty directory), so the same command simply runs again; a DST under directories that the
    convert made goes with them."""
    import errno
    import shutil

    from difftx.data import ByteTokenizer

    src = tmp_path / "src"
    difftx.save_model(difftx_model(), src)
    ByteTokenizer().save(src)
    dst = tmp_path / "new" / "deeper" / "dst" if dst_exists == "under_new_parents" else tmp_path / "dst"
    dst_exists = dst_exists is True
    if dst_exists:
        dst.mkdir()
    copyfile = shutil.copyfile

    def copy_that_stops(a, b, *args, **kwargs):
        with open(b, "wb") as f:
            f.write(open(a, "rb").read()[:10])
        if failure == "interrupt":
            raise KeyboardInterrupt
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", copy_that_stops)
    rc, _, err = run_main(capsys, src, dst, "--to", "hf-difftx")
    assert rc == (130 if failure == "interrupt" else 2) and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert (sorted(dst.iterdir()) == [] if dst_exists else not dst.exists())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["src"] + ["dst"] * dst_exists)
    monkeypatch.setattr(shutil, "copyfile", copyfile)
    rc, _, err = run_main(capsys, src, dst, "--to", "hf-difftx")  # the same command again: no --force needed
    assert rc == 0, err
    assert json.loads((dst / "difftx_tokenizer.json").read_text()) == json.loads((src / "tokenizer.json").read_text())


def test_a_tokenizer_copy_that_stops_midway_leaves_no_truncated_file_under_its_name(tmp_path, monkeypatch):
    """convert() copied the tokenizer files with shutil.copyfile straight onto their names: a process stopped
    midway (Ctrl-C in the library, SIGTERM / SIGKILL past the CLI's clean-up) left a truncated tokenizer.json that
    loads as a broken tokenizer.  Each is copied to a temporary name and renamed now."""
    import shutil

    from difftx.data import ByteTokenizer

    src = tmp_path / "src"
    difftx.save_model(difftx_model(), src)
    ByteTokenizer().save(src)
    copyfile = shutil.copyfile

    def copy_that_stops(a, b, *args, **kwargs):
        with open(b, "wb") as f:
            f.write(open(a, "rb").read()[:10])
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "copyfile", copy_that_stops)
    for to, name in (("difftx", "tokenizer.json"), ("hf-difftx", "difftx_tokenizer.json")):
        with pytest.raises(KeyboardInterrupt):
            convert(src, tmp_path / to, dst_format=to)
        assert not (tmp_path / to / name).exists()
        assert not [p.name for p in (tmp_path / to).iterdir() if p.name.startswith(".")]  # no temporary file
    monkeypatch.setattr(shutil, "copyfile", copyfile)
    convert(src, tmp_path / "back", dst_format="difftx")
    assert oct((tmp_path / "back" / "tokenizer.json").stat().st_mode & 0o777) == \
        oct((src / "tokenizer.json").stat().st_mode & 0o777)


def test_ctrl_c_while_force_swaps_the_new_model_in_never_leaves_dst_missing(tmp_path, capsys, monkeypatch,
                                                                             sigint_default):
    """--force converts beside DST, then renames DST away and the result into place: Ctrl-C between the two renames
    left no DST at all (the earlier model hidden as .DST.replaced-PID).  The swap now finishes first."""
    import os
    import signal

    src = tmp_path / "src"
    difftx.save_model(difftx_model(), src)
    dst = tmp_path / "dst"
    assert run_main(capsys, src, dst, "--to", "hf-difftx")[0] == 0
    rename, calls = os.rename, []

    def rename_then_ctrl_c(a, b):
        rename(a, b)
        calls.append(b)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(os, "rename", rename_then_ctrl_c)
    rc, _, err = run_main(capsys, src, dst, "--to", "hf-difftx", "--force")
    monkeypatch.undo()
    assert rc == 130 and err.strip() == "difftx convert: interrupted", err
    assert difftx.load_model(dst) is not None and (dst / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]  # nothing hidden left behind either


def test_sigterm_midway_through_a_convert_cleans_up_as_ctrl_c_does(tmp_path):
    """SIGTERM (a job scheduler's stop, `timeout`, `kill`) killed 'difftx convert' where it stood: a new DST was left
    holding a model without its tokenizer, which the same command then refused as 'not empty'.  It is handled as
    Ctrl-C is now: the convert's clean-up runs, one line says so, exit code 143 (128 + SIGTERM)."""
    import subprocess
    import sys

    from difftx.data import ByteTokenizer

    from ..conftest import SRC, cli_env

    src, dst = tmp_path / "src", tmp_path / "dst"
    difftx.save_model(difftx_model(), src)
    ByteTokenizer().save(src)
    script = (
        "import os, shutil, signal, sys\n"
        "def copy_then_sigterm(a, b, *args, **kwargs):\n"
        "    open(b, 'wb').write(open(a, 'rb').read()[:10])\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    open(b, 'ab').write(open(a, 'rb').read()[10:])\n"
        "shutil.copyfile = copy_then_sigterm\n"
        "from difftx.cli import entry\n"
        f"sys.argv = ['difftx', 'convert', {str(src)!r}, {str(dst)!r}, '--to', 'hf-difftx']\n"
        "sys.exit(entry())\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=cli_env(),
                       cwd=str(SRC.parent))
    assert r.returncode == 143 and r.stderr.strip() == "difftx convert: terminated", (r.returncode, r.stderr)
    assert not dst.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
