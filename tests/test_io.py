"""difftx.io: save_model / load_model on bad input."""

from __future__ import annotations

import os

import pytest
import torch

import difftx
from difftx import ConfigError, ModelConfig, build_model


def tiny_model():
    return build_model(ModelConfig(attention="diff", d_model=32, n_layers=1, n_heads=2, vocab_size=61,
                                   max_seq_len=16)).eval()


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, 3, object()])
def test_load_model_refuses_a_dtype_that_is_not_a_float_dtype_in_one_error(tmp_path, dtype):
    d = difftx.save_model(tiny_model(), tmp_path / "m")
    with pytest.raises(ConfigError, match="dtype"):
        difftx.load_model(d, dtype=dtype)
    assert difftx.load_model(d, dtype=torch.float16).embed.weight.dtype == torch.float16


def test_save_model_refuses_a_model_without_a_difftx_config_and_writes_nothing(tmp_path):
    """A transformers wrapper's config is not a ModelConfig: saving it wrote a directory load_model refused."""
    pytest.importorskip("transformers")
    from difftx.interop.hf import DifftxForCausalLM

    model = tiny_model()
    for bad in (DifftxForCausalLM.from_difftx(model), torch.nn.Linear(2, 2)):
        with pytest.raises(ConfigError, match="not a difftx model"):
            difftx.save_model(bad, tmp_path / "w")
        assert not (tmp_path / "w").exists()
    x = torch.randint(0, 61, (1, 5))
    with torch.no_grad():  # the hint's way works
        assert torch.equal(difftx.load_model(difftx.save_model(model, tmp_path / "m"))(x).logits, model(x).logits)


def test_a_model_of_mixed_dtypes_loads_back_as_it_was_saved(tmp_path):
    """Built under a bf16 default dtype (as transformers' from_pretrained(dtype=bfloat16) builds the DecoderLM), a
    DIFF model keeps its lambdas in float32; load_model gave it back all float32, with other logits."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = tiny_model()
    finally:
        torch.set_default_dtype(old)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert set(dtypes.values()) == {torch.bfloat16, torch.float32}
    loaded = difftx.load_model(difftx.save_model(model, tmp_path / "m"))
    assert {n: p.dtype for n, p in loaded.named_parameters()} == dtypes
    x = torch.randint(0, 61, (2, 7))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    assert difftx.load_model(tmp_path / "m", dtype="float32").embed.weight.dtype == torch.float32  # still overrides


LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def test_a_model_loaded_in_bf16_keeps_diff_lambdas_in_float32_as_the_hf_wrapper(tmp_path):
    """load_model(dtype=bfloat16) cast DIFF's lambda vectors to bf16 (lambda 0.2135 where it is 0.2134), while
    DifftxForCausalLM.from_pretrained(dtype=bfloat16) keeps them, as the model builds them, in float32: the two
    gave other logits.  Now load_model keeps them in float32 below float32, and the round trip stays exact."""
    model = tiny_model()
    d = difftx.save_model(model, tmp_path / "m")
    for dtype in (torch.bfloat16, "bfloat16", torch.float16):
        loaded = difftx.load_model(d, dtype=dtype)
        for n, p in loaded.named_parameters():
            want = torch.float32 if n.rsplit(".", 1)[-1] in LAMBDAS else loaded.embed.weight.dtype
            assert p.dtype == want, (dtype, n, p.dtype)
    assert {p.dtype for p in difftx.load_model(d, dtype=torch.float64).parameters()} == {torch.float64}
    bf = difftx.load_model(d, dtype=torch.bfloat16)
    for n, p in model.named_parameters():  # the lambdas are the saved values, exactly
        if n.rsplit(".", 1)[-1] in LAMBDAS:
            assert torch.equal(bf.get_parameter(n), p.detach())
    again = difftx.load_model(difftx.save_model(bf, tmp_path / "bf"))  # saved and loaded back: the same tensors
    assert again.state_dict().keys() == bf.state_dict().keys()
    for k, v in bf.state_dict().items():
        assert again.state_dict()[k].dtype == v.dtype and torch.equal(again.state_dict()[k], v), k
    # an all-bf16 directory (model.to(bfloat16), lambdas included) loads with float32 lambdas of the same values
    allbf = difftx.load_model(difftx.save_model(tiny_model().to(torch.bfloat16), tmp_path / "allbf"))
    assert {p.dtype for n, p in allbf.named_parameters() if n.rsplit(".", 1)[-1] in LAMBDAS} == {torch.float32}
    assert allbf.embed.weight.dtype == torch.bfloat16
    pytest.importorskip("transformers")
    from difftx.interop.hf import DifftxForCausalLM

    DifftxForCausalLM.from_difftx(model).save_pretrained(tmp_path / "hf")
    hf = DifftxForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    assert {n: p.dtype for n, p in hf.model.named_parameters()} == {n: p.dtype for n, p in bf.named_parameters()}
    x = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        assert torch.equal(bf(x).logits, hf(x).logits)


def test_save_model_to_a_path_that_is_a_file_is_one_difftx_error(tmp_path):
    """save_model into an existing file (or under one) raised FileExistsError / NotADirectoryError, a traceback from
    the CLI; now one DifftxError naming the path and the fix, and the file is left as it was."""
    (tmp_path / "f").write_text("keep")
    for path, needle in ((tmp_path / "f", "a file of that name exists"), (tmp_path / "f" / "m", "is a file")):
        with pytest.raises(difftx.DifftxError, match=needle) as e:
            difftx.save_model(tiny_model(), path)
        assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert (tmp_path / "f").read_text() == "keep"


def test_load_model_of_a_safetensors_file_loads_that_file_or_names_it(tmp_path):
    """A .safetensors file stands for its directory's model only as that model's own model.safetensors: another
    file beside a model loaded the directory's weights, not the file named (a copy of other weights, say), and
    a stray file elsewhere was reported as its directory ('.: no difftx model here')."""
    from difftx.io import CheckpointError

    model = tiny_model()
    d = difftx.save_model(model, tmp_path / "m")
    other = tiny_model()
    torch.nn.init.zeros_(other.embed.weight)
    d2 = difftx.save_model(other, tmp_path / "m2")
    (d / "other.safetensors").write_bytes((d2 / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match=r"other\.safetensors: not this directory's weights"):
        difftx.load_model(d / "other.safetensors")
    assert torch.equal(difftx.load_model(d / "model.safetensors").embed.weight, model.embed.weight)
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match=r"junk\.safetensors \(in .*\): no difftx model here"):
        difftx.load_model(tmp_path / "junk.safetensors")


def test_a_save_over_a_model_that_fails_midway_leaves_the_old_model_loadable(tmp_path, full_disk):
    """The weights were renamed into place before the config was written: a config write that failed (disk full)
    left the new weights beside the old config, and the directory no longer loaded."""
    old = tiny_model()
    d = difftx.save_model(old, tmp_path / "m")
    new = build_model(ModelConfig(attention="softmax", d_model=64, n_layers=1, n_heads=2, vocab_size=61,
                                  max_seq_len=16))
    restore = full_disk()  # the second file written (the config) hits a full disk
    with pytest.raises(OSError, match="No space"):
        difftx.save_model(new, d)
    restore()
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]  # no temporary files left
    x = torch.randint(0, 61, (1, 5))
    with torch.no_grad():
        assert torch.equal(difftx.load_model(d)(x).logits, old(x).logits)


def test_float8_weights_are_one_checkpoint_error(tmp_path):
    """torch.isfinite is not implemented for float8: such a tensor was a NotImplementedError traceback."""
    from safetensors.torch import save_file
    from tests.conftest import load_owned

    d = difftx.save_model(tiny_model(), tmp_path / "m")
    state = load_owned(d / "model.safetensors")
    state["embed.weight"] = state["embed.weight"].to(torch.float8_e4m3fn)
    save_file(state, d / "model.safetensors")
    with pytest.raises(difftx.CheckpointError, match="'embed.weight' is float8_e4m3fn"):
        difftx.load_model(d)


def test_a_config_of_sizes_no_tensor_can_hold_is_one_checkpoint_error(tmp_path):
    """A corrupt config.json (vocab_size 10^17) was torch's RuntimeError traceback from building the model."""
    import json

    d = difftx.save_model(tiny_model(), tmp_path / "m")
    data = json.loads((d / "config.json").read_text())
    data["model"]["vocab_size"] = 10 ** 17
    (d / "config.json").write_text(json.dumps(data))
    with pytest.raises(difftx.CheckpointError, match="cannot build the model it describes"):
        difftx.load_model(d)


def test_save_model_refuses_a_training_run_and_its_checkpoints(tmp_path):
    """save_model into a run directory (or one of its checkpoints) rewrote its config.json without the run's `train`
    and `data` objects: `difftx train --resume auto` then refused the run as corrupt."""
    import json

    model = tiny_model()
    run_config = {"difftx_format": 1, "model": model.config.to_dict(), "train": {"steps": 2}, "data": {}}
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    difftx.save_model(model, ckpt)  # a new directory: fine
    (ckpt / "config.json").write_text(json.dumps(run_config))
    (ckpt / "trainer_state.json").write_text("{}")
    (tmp_path / "run" / "config.json").write_text(json.dumps(run_config))
    before = {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()}
    for target, why in ((tmp_path / "run", "checkpoints/"), (ckpt, "trainer_state.json")):
        with pytest.raises(ConfigError, match=why):
            difftx.save_model(model, target)
    (ckpt / "trainer_state.json").unlink()
    with pytest.raises(ConfigError, match="training run"):  # its config alone says so
        difftx.save_model(model, ckpt)
    del before[ckpt / "trainer_state.json"]
    assert {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()} == before
    d = difftx.save_model(model, tmp_path / "m")
    assert difftx.save_model(model, d) == d  # a model directory is still overwritten, as before


@pytest.mark.parametrize("tokenizer, needle", [
    ("byte", "must be a difftx tokenizer"),  # a spec string, not a tokenizer
    (None, "ids and the model's vocab_size is 64"),  # a char tokenizer wider than the model
])
def test_save_model_refuses_a_tokenizer_that_does_not_fit_and_writes_nothing(tokenizer, needle, tmp_path):
    from difftx.data import CharTokenizer

    model = build_model(ModelConfig(d_model=32, n_layers=1, n_heads=2, vocab_size=64))
    tok = tokenizer if tokenizer is not None else CharTokenizer.from_text("".join(map(chr, range(33, 133))))
    with pytest.raises(ConfigError, match="tokenizer: save_model: .*" + needle):
        difftx.save_model(model, tmp_path / "m", tokenizer=tok)
    assert not (tmp_path / "m").exists() or not any((tmp_path / "m").iterdir())


@pytest.mark.parametrize("change", ["prune", "weight_norm", "quantize_dynamic", "extra_tensor", "missing_tensor"])
@pytest.mark.parametrize("save", ["save_model", "hf-difftx", "hf-diffllama"])
def test_saving_a_model_whose_tensors_a_parametrization_or_pruning_renamed_is_one_clear_error(tmp_path, change, save):
    """prune / parametrize / peft's LoRA / quantize_dynamic rename a module's tensors (weight_orig + weight_mask,
    parametrizations.weight.original0, base_layer.weight, _packed_params): save_model wrote a checkpoint that
    load_model refused later, save_hf to a llama-like format raised a bare KeyError."""
    from torch.nn.utils import prune

    from difftx.errors import DifftxError
    from difftx.interop.convert import save_hf

    model = tiny_model()
    q = model.layers[0].attn.q_proj
    if change == "prune":
        prune.l1_unstructured(q, "weight", amount=0.5)
    elif change == "weight_norm":
        torch.nn.utils.parametrizations.weight_norm(q)
    elif change == "extra_tensor":  # a tensor added beside the model's own (an adapter's scale): no name missing
        q.register_buffer("adapter_scale", torch.ones(1))
    elif change == "missing_tensor":  # a norm swapped for one without a weight: no name added
        model.layers[0].attn_norm = torch.nn.Identity()
    else:
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)  # lm_head
    with pytest.raises(DifftxError, match="make them plain first"):
        if save == "save_model":
            difftx.save_model(model, tmp_path / "m")
        else:
            save_hf(model, tmp_path / "m", save)
    assert not (tmp_path / "m").exists() or not any((tmp_path / "m").iterdir())
    if change == "prune":  # made plain, it saves and loads back with the pruned weights
        prune.remove(q, "weight")
        loaded = difftx.load_model(difftx.save_model(model, tmp_path / "plain"))
        assert torch.equal(loaded.layers[0].attn.q_proj.weight, q.weight)


@pytest.mark.parametrize("failure", [KeyboardInterrupt, OSError])
def test_a_study_figure_that_fails_midway_keeps_the_earlier_figure(failure, tmp_path, monkeypatch):
    """``difftx compare``'s and ``grads``' PNGs (analysis.plots._save) were drawn straight onto their final names:
    Ctrl-C while the encoder wrote left a truncated figure, and a full disk (Pillow removes its file then) deleted
    the earlier one.  Now the earlier figure stays whole and no temporary file is left."""
    import errno

    PIL = pytest.importorskip("PIL.Image")
    pytest.importorskip("matplotlib")
    from difftx.analysis.plots import _figure, _save

    PIL.init()

    def encoder_that_stops(im, fp, filename, *args, **kwargs):
        fp.write(b"\x89PNG\r\n\x1a\n half a figure")
        raise failure() if failure is KeyboardInterrupt else OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    (tmp_path / "cost.png").write_bytes(b"an earlier figure")
    fig = _figure(2, 2)
    fig.subplots().plot([0, 1], [1, 0])
    monkeypatch.setitem(PIL.SAVE, "PNG", encoder_that_stops)
    with pytest.raises(failure):
        _save(fig, tmp_path / "cost.png")
    assert (tmp_path / "cost.png").read_bytes() == b"an earlier figure"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cost.png"]
    monkeypatch.undo()
    _save(fig, tmp_path / "cost.png")
    assert (tmp_path / "cost.png").read_bytes().startswith(b"\x89PNG") and len(list(tmp_path.iterdir())) == 1


def test_a_study_figure_interrupted_while_its_bytes_are_written_keeps_the_earlier_figure(tmp_path, monkeypatch):
    """The figure is drawn in memory, then written: Ctrl-C midway through writing its bytes leaves the earlier
    figure whole under its name (and no temporary file), not half a new one."""
    import io

    pytest.importorskip("matplotlib")
    from difftx.analysis.plots import _figure, _save

    fig = _figure(2, 2)
    fig.subplots().plot([0, 1], [1, 0])
    fig.savefig(io.BytesIO(), format="png")  # drawn once first: font caches and the like are not this write
    (tmp_path / "cost.png").write_bytes(b"an earlier figure")
    real_open = io.open

    class StopsMidway:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(bytes(data)[: len(data) // 2])
            self.f.flush()
            raise KeyboardInterrupt

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def open_that_stops(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return StopsMidway(f) if "w" in mode or "a" in mode or "+" in mode else f

    monkeypatch.setattr(io, "open", open_that_stops)
    with pytest.raises(KeyboardInterrupt):
        _save(fig, tmp_path / "cost.png")
    monkeypatch.undo()
    assert (tmp_path / "cost.png").read_bytes() == b"an earlier figure"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cost.png"]


@pytest.mark.parametrize("where", ["fsync", "mkstemp"])
def test_a_failed_atomic_write_names_the_file_it_was_for(where, tmp_path, monkeypatch, capsys):
    """A full disk during an evaluation's write said only "difftx eval: error: No space left on device; check the
    path, ..." (a failed write() or fsync() names no file), and a folder refusing the temporary file named
    ``.mqar.json.x1y2.tmp``, a file that never existed.  The one line names the result file now."""
    import errno
    import tempfile

    from difftx.cli import main

    ckpt = difftx.save_model(tiny_model(), tmp_path / "m")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.json").write_text("an earlier result")

    def failing_fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def failing_mkstemp(prefix="", suffix="", dir=None, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.path.join(dir, f"{prefix}x1y2{suffix}"))

    if where == "fsync":
        monkeypatch.setattr(os, "fsync", failing_fsync)
    else:
        monkeypatch.setattr(tempfile, "mkstemp", failing_mkstemp)
    rc = main(["eval", "mqar", "--checkpoint", str(ckpt), "--out", str(out), "--lengths", "16", "--pairs", "2",
               "--samples", "1", "--quiet", "--no-plot"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"difftx eval: error: {out / 'mqar.json'}: "), err
    assert os.strerror(errno.ENOSPC if where == "fsync" else errno.EACCES) in err[0]
    assert sorted(p.name for p in out.iterdir()) == ["keep.json"] and (out / "keep.json").read_text() == \
        "an earlier result"


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_between_the_renames_of_a_model_save_does_not_split_the_pair(signame, tmp_path, monkeypatch,
                                                                            sigint_default):
    """atomic_write_files renames each file into place in turn: Ctrl-C (or SIGTERM, handled as the trainer and
    compare handle it) arriving between the renames left the new model.safetensors beside the old config.json,
    "both or neither" broken.  The signal now waits until every file is in place, then acts as it would have."""
    import signal

    old = difftx.save_model(tiny_model(), tmp_path / "m")
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    replace, calls = os.replace, []

    def replace_then_signal(a, b):
        replace(a, b)
        calls.append(b)
        if len(calls) == 1:
            signal.raise_signal(getattr(signal, signame))  # the signal lands right after the first rename

    if signame == "SIGTERM":
        old_handler = signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(KeyboardInterrupt()))
    monkeypatch.setattr(os, "replace", replace_then_signal)
    model = tiny_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            difftx.save_model(model, old, extra_config={"marker": 1})
    finally:
        if signame == "SIGTERM":
            signal.signal(signal.SIGTERM, old_handler)
    monkeypatch.undo()
    assert len(calls) == 2  # both renames ran before the interrupt
    after = {p.name: p.read_bytes() for p in old.iterdir()}
    assert set(after) == set(before)
    assert all(after[n] != before[n] for n in before), "a new file beside an old one"
    assert difftx.load_model(old) is not None


def test_save_hf_of_a_state_dict_without_its_config_is_one_clear_error(tmp_path):
    """save_hf(state, path, fmt) without cfg= raised a bare AttributeError ('NoneType' object has no attribute ...)."""
    from difftx.errors import DifftxError
    from difftx.interop.convert import save_hf

    model = tiny_model()
    with pytest.raises(DifftxError, match="needs cfg="):
        save_hf(model.state_dict(), tmp_path / "m", "hf-difftx")
    assert not (tmp_path / "m").exists()
    save_hf(model.state_dict(), tmp_path / "m", "hf-difftx", cfg=model.config)
    assert (tmp_path / "m" / "config.json").exists()


def test_clean_state_dict_strips_every_wrapper_level_and_nothing_else():
    """Wrapper names are whole key parts at any depth (FSDP1 nests one per block); "module." was stripped first and
    anywhere, so "_fsdp_wrapped_module." became "_fsdp_wrapped_" and a part merely ending in "module" lost it."""
    from difftx.io import clean_state_dict

    sd = {"_orig_mod.module.layers.0.attn.w": 1, "_fsdp_wrapped_module.layers.1._fsdp_wrapped_module.ffn.w": 2,
          "module.layers.2.submodule.w": 3, "layers.3.module.w": 4}
    assert list(clean_state_dict(sd).items()) == [("layers.0.attn.w", 1), ("layers.1.ffn.w", 2),
                                                   ("layers.2.submodule.w", 3), ("layers.3.w", 4)]
