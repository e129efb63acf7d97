"""``difftx train --domain vision``: the run directory, exact resume, learning, and bad input (exit 2, one line)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

import difftx
from difftx.cli import main
from difftx.models.vision import VisionEncoder
from .conftest import blob_images, write_folder

TINY = ["--domain", "vision", "--preset", "vdnt-tiny", "--d-model", "32", "--n-layers", "2", "--n-heads", "2",
        "--batch-size", "8", "--no-progress", "--threads", "1", "--seed", "5"]


def train(data, out, *args):
    return main(["train", "--data", str(data), *TINY, "--out", str(out), *map(str, args)])


def rows(run, key):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r[key] for r in map(json.loads, lines) if key in r]


def test_run_directory_contract(tmp_path, npz_data, capsys):
    out = tmp_path / "run"
    assert train(npz_data, out, "--steps", 4, "--eval-every", 2, "--checkpoint-every", 2,
                 "--domain-opt", "test_fraction=0.25") == 0
    printed = capsys.readouterr().out
    assert "test_acc" in printed and "vision.json" in printed
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"]["image_size"] == 8 and cfg["model"]["num_classes"] == 3  # from the data
    assert cfg["data"]["n_test"] == 15 and cfg["data"]["n_val"] == 6 and cfg["data"]["n_train"] == 39
    assert len(rows(out, "val_acc")) == 2  # steps 2 and 4
    (test_acc,) = rows(out, "test_acc")
    assert 0.0 <= test_acc <= 1.0 and len(rows(out, "test_loss")) == 1
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_00000002", "step_00000004"]
    meta = json.loads((out / "checkpoints" / ckpts[-1] / "vision.json").read_text())
    assert meta["classes"] == ["0", "1", "2"] and meta["image_size"] == 8
    model = difftx.load_model(out)
    assert isinstance(model, VisionEncoder)
    same = difftx.load_model(out / "checkpoints" / ckpts[-1]).state_dict()
    assert all(torch.equal(v, same[k]) for k, v in model.state_dict().items())
    assert cfg["data"]["mean"] == meta["mean"] and cfg["data"]["fingerprint"] == meta["fingerprint"]


NO_AUGMENT = ["--domain-opt", "mixup=0", "--domain-opt", "cutmix=0"]  # the default digits recipe mixes
ALL_AUGMENT = [f"--domain-opt={o}" for o in ("crop=1", "flip=true", "mixup=0.8", "cutmix=1.0", "label_smoothing=0.1",
                                              "random_erasing=0.25")]


@pytest.mark.parametrize("augment", [NO_AUGMENT, ALL_AUGMENT], ids=["plain", "augmented"])
def test_exact_resume(tmp_path, npz_data, augment):
    common = ["--steps", 6, "--eval-every", 3, "--diag-every", 3, "--attention", "diff", "--optimizer", "msgdw",
              "--lr", 0.05, *augment]
    assert train(npz_data, tmp_path / "full", *common) == 0
    assert train(npz_data, tmp_path / "half", *common, "--stop-at", 3) == 0
    assert train(npz_data, tmp_path / "half", *common, "--resume", "auto") == 0
    for key in ("loss", "val_acc", "val_loss", "test_acc", "lambdas"):
        assert rows(tmp_path / "half", key) == rows(tmp_path / "full", key), key
    assert train(npz_data, tmp_path / "half", *common, "--resume", "auto") == 0  # finished: nothing more to log
    assert rows(tmp_path / "half", "test_acc") == rows(tmp_path / "full", "test_acc")
    a, b = difftx.load_model(tmp_path / "full").state_dict(), difftx.load_model(tmp_path / "half").state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_tiny_model_learns(tmp_path, npz_data):
    out = tmp_path / "run"
    assert train(npz_data, out, "--steps", 100, "--eval-every", 0, "--lr", 3e-3, *NO_AUGMENT) == 0
    assert rows(out, "test_acc")[0] >= 0.9 and rows(out, "val_acc")[0] >= 0.9
    assert rows(out, "loss")[-1] < 0.5 * rows(out, "loss")[0]


def test_train_vision_arm(tmp_path, npz_data):
    from difftx import ModelConfig
    from difftx.train.vision import train_vision_arm

    cfg = ModelConfig.from_preset("vit-tiny", d_model=32, n_layers=1, n_heads=2)
    r = train_vision_arm(cfg, optimizer="msgdw", seed=2, steps=3, data=str(npz_data), threads=1, batch_size=8)
    assert r["optimizer"] == "msgdw" and r["lr"] == 0.1 and r["seed"] == 2 and r["steps"] == 3
    assert r["images"] == 24 and r["run_dir"] is None and r["params"] > 0
    assert 0 <= r["test_acc"] <= 1 and r["cpu_s"] > 0 and r["images_per_s"] > 0


def test_train_vision_arm_refuses_a_language_model_before_writing(tmp_path, npz_data):
    """A language-model config went through the data checks and into training (writing the run directory), to fail
    at the first step with the decoder's ValueError about token ids."""
    from difftx import ModelConfig
    from difftx.errors import ConfigError
    from difftx.train.vision import train_vision_arm

    out = tmp_path / "run"
    match = r"domain: the model \('nano'\) is a lm model but the run's domain is 'vision'"
    with pytest.raises(ConfigError, match=match) as e:
        train_vision_arm(ModelConfig.from_preset("nano"), steps=1, data=str(npz_data), threads=1, out=out)
    assert "\n" not in str(e.value) and not out.exists()


# ---------------------------------------------------------------------- bad input: one line, exit 2
def _fails(capsys, code, match, *argv):
    assert main(["train", *map(str, argv)]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("difftx train: error:") and match in err, err
    return err


def test_patch_size_that_does_not_divide(tmp_path, npz_data, capsys):
    _fails(capsys, 2, "patch_size: 3 does not divide the data's image size 8", "--data", npz_data, *TINY,
           "--set", "patch_size=3", "--out", tmp_path / "a")
    _fails(capsys, 2, "image_size 8 is not divisible by patch_size 3", "--data", npz_data, *TINY,
           "--set", "patch_size=3", "--set", "image_size=8", "--out", tmp_path / "a")
    x, y = blob_images(size=9)
    np.savez(tmp_path / "nine.npz", x=x, y=y)
    _fails(capsys, 2, "patch_size: 2 does not divide the data's image size 9", "--data", tmp_path / "nine.npz",
           *TINY, "--out", tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # the data's size decides, not the preset's 8: patch 3 fits 9x9 images
    assert train(tmp_path / "nine.npz", tmp_path / "c", "--set", "patch_size=3", "--steps", 1) == 0
    saved = json.loads((tmp_path / "c" / "config.json").read_text())["model"]
    assert (saved["image_size"], saved["patch_size"]) == (9, 3)


@pytest.mark.parametrize("patch", ["null", "0", "abc", "2.5"])
def test_a_patch_size_that_is_not_a_positive_integer_is_named(tmp_path, npz_data, capsys, patch):
    """--set patch_size=null (or 0, or a string) was divided into the preset's image size first: a TypeError or
    ZeroDivisionError traceback; 2.5 was refused as image_size 10.0."""
    _fails(capsys, 2, "patch_size: must be a positive integer; got", "--data", npz_data, *TINY,
           "--set", f"patch_size={patch}", "--out", tmp_path / "a")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("size", [10 ** 9, 10 ** 5])
def test_a_resize_past_memory_is_one_line(tmp_path, npz_data, capsys, monkeypatch, size):
    """--domain-opt resize=10**9 was a torch "Storage size calculation overflowed" traceback (10**5: an
    allocation error); an image folder went to Pillow with it.  Both are refused before any pixel is made."""
    monkeypatch.delenv("DIFFTX_MEMORY_CHECK", raising=False)
    monkeypatch.setattr("difftx.train.memory_check.free_memory", lambda device: 8 * 2 ** 30)
    write_folder(tmp_path / "folder")
    for data in (npz_data, tmp_path / "folder"):
        _fails(capsys, 2, f"images resized to {size}x{size} (float32) need at least", "--data", data, *TINY,
               "--domain-opt", f"resize={size}", "--out", tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_bad_data_and_options(tmp_path, npz_data, capsys):
    out = tmp_path / "run"
    _fails(capsys, 2, "no such file or directory", "--data", tmp_path / "missing", *TINY, "--out", out)
    (tmp_path / "empty").mkdir()
    _fails(capsys, 2, "no class folders", "--data", tmp_path / "empty", *TINY, "--out", out)
    _fails(capsys, 2, "labels go up to 2 (out of range)", "--data", npz_data, *TINY, "--set", "num_classes=2",
           "--out", out)
    _fails(capsys, 2, "unknown vision option 'flipp'", "--data", npz_data, *TINY, "--domain-opt", "flipp=true",
           "--out", out)
    err = _fails(capsys, 2, "in_channels: is 3", "--data", npz_data, *TINY, "--set", "in_channels=3", "--out", out)
    assert "resize" not in err  # resizing does not change the channels: the fix named was no fix
    assert not out.exists()


def test_resume_with_other_data_is_refused(tmp_path, npz_data, capsys):
    out = tmp_path / "run"
    assert train(npz_data, out, "--steps", 4, "--stop-at", 2) == 0
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    capsys.readouterr()
    _fails(capsys, 2, "data: is", "--data", tmp_path / "other.npz", *TINY, "--steps", 4, "--out", out,
           "--resume", "auto")  # another path: the saved config says so
    x, y = blob_images(seed=9)
    np.savez(npz_data, x=x, y=y)  # the same path, other images: the saved fingerprint says so
    _fails(capsys, 2, "not the data of the run being resumed", "--data", npz_data, *TINY, "--steps", 4,
           "--out", out, "--resume", "auto")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


def test_an_explicit_warmup_beside_the_recipes_epochs_is_kept_and_the_run_resumes(tmp_path, npz_data):
    """The digits recipe's warmup epochs silently replaced an explicit --warmup of an --epochs run, so the run's own
    command with --resume auto was refused (its --warmup disagreed with the saved one)."""
    out, common = tmp_path / "run", ["--epochs", 1, "--warmup", 1, "--eval-every", 0, *NO_AUGMENT]
    assert train(npz_data, out, *common, "--stop-at", 2) == 0
    assert train(npz_data, out, *common, "--resume", "auto") == 0
    saved = json.loads((out / "config.json").read_text())["train"]
    assert (saved["warmup"], saved["warmup_epochs"]) == (1, None) and rows(out, "step")[-1] == saved["steps"] > 2


def test_default_vision_run_uses_the_digits_recipe():
    from difftx.train import resolve_configs

    tcfg, mcfg = resolve_configs(train={"domain": "vision", "steps": 40})
    assert mcfg.preset == "vit-tiny" and tcfg.recipe == "vit-tiny-adamw" and tcfg.batch_size == 32
    assert tcfg.steps == 40 and tcfg.epochs is None and tcfg.warmup == 3  # 3 of 40 epochs
    tcfg, _ = resolve_configs("vdnt-tiny-msgdw")
    assert tcfg.epochs == 40 and tcfg.optimizer == "msgdw" and tcfg.domain_options == {"mixup": 0.8, "cutmix": 1.0}
    tcfg, _ = resolve_configs("vdnt-tiny-adamw", train={"domain_options": {"label_smoothing": 0.1}})
    assert tcfg.domain_options == {"mixup": 0.8, "cutmix": 1.0, "label_smoothing": 0.1}  # merged with the recipe's
    tcfg, _ = resolve_configs("vdnt-tiny-adamw", train={"domain_options": {"mixup": 0}})
    assert tcfg.domain_options == {"mixup": 0, "cutmix": 1.0}


def test_mixing_with_more_model_classes_than_the_data(tmp_path, npz_data):
    """--set num_classes above the data's classes is allowed; mixing's soft targets then span the model's classes
    (they were the data's 3 wide against 5 logits: a shape error at the first step), also after a resume."""
    out = tmp_path / "run"
    args = ["--domain-opt", "mixup=0.8", "--domain-opt", "cutmix=1.0", "--domain-opt", "label_smoothing=0.1",
            "--checkpoint-every", 2]
    assert train(npz_data, out, "--steps", 2, "--set", "num_classes=5", *args) == 0
    assert json.loads((out / "config.json").read_text())["model"]["num_classes"] == 5
    assert train(npz_data, out, "--steps", 3, "--resume", "auto", *args) == 0  # the model's 5 from its config
    assert all(np.isfinite(rows(out, "loss")))


@pytest.mark.parametrize("args,flag", [
    (["--eval-batches", "3"], "--eval-batches"),
    (["--tokenizer", "char"], "--tokenizer"),
    (["--bpe-vocab-size", "512"], "--bpe-vocab-size"),
    (["--text-field", "body"], "--text-field"),
    (["--task-opt", "pairs=4"], "--task-opt"),
    (["--seq-len", "100"], "--seq-len"),  # set the unused max_seq_len of the vision model to 100
    (["--vocab-size", "1000"], "--vocab-size"),
    (["--cache-dir", "unread-cache"], "--cache-dir"),  # token shards and bpe vocabularies: images have neither
])
def test_options_a_vision_run_does_not_read_are_refused(tmp_path, npz_data, capsys, args, flag):
    """These were accepted and ignored (a vision run evaluates its whole splits and reads images)."""
    out = tmp_path / "run"
    err = _fails(capsys, 2, flag, "--data", npz_data, *TINY, "--steps", 1, "--eval-every", 0, *args, "--out", out)
    assert "vision" in err and "drop" in err
    assert not out.exists()
    assert train(npz_data, out, "--steps", 1, "--eval-every", 0) == 0  # without it: trains
    if flag == "--eval-batches":  # a resumed run may change it (the others must match the run's: refused already)
        _fails(capsys, 2, flag, "--data", npz_data, *TINY, *args, "--out", out, "--resume", "auto")


def test_a_resume_on_another_batch_per_step_counts_images(tmp_path, npz_data, capsys):
    """The refusal of a resume whose step would take another number of images said 'sequences'."""
    out = tmp_path / "run"
    assert train(npz_data, out, "--steps", 4, "--stop-at", 2) == 0
    capsys.readouterr()
    _fails(capsys, 2, "took 8 images a step", "--data", npz_data, *TINY, "--steps", 4, "--grad-accum", 2,
           "--out", out, "--resume", "auto")


def test_split_fractions_beside_the_folders_splits_are_refused(tmp_path, capsys):
    """--val-fraction and --domain-opt test_fraction were silently ignored when the image folders give that split
    (DIR/val/, DIR/test/); they are refused, naming the fix.  A split the folders leave out is still carved."""
    from .conftest import write_folder

    root = tmp_path / "ds"
    for part, n in (("train", 6), ("val", 2), ("test", 2)):
        write_folder(root / part, n_per_class=n)
    out = tmp_path / "run"
    err = _fails(capsys, 2, "--val-fraction:", "--data", root, *TINY, "--steps", 1, "--val-fraction", 0.3,
                 "--out", out)
    assert f"{root / 'val'}" in err and "drop --val-fraction" in err
    err = _fails(capsys, 2, "test_fraction", "--data", root, *TINY, "--steps", 1, "--domain-opt",
                 "test_fraction=0.3", "--out", out)
    assert f"{root / 'test'}" in err and "drop --domain-opt test_fraction" in err
    assert not out.exists()
    assert train(root, out, "--steps", 1, "--eval-every", 0) == 0  # without them: the folders' splits
    assert json.loads((out / "config.json").read_text())["data"]["n_val"] == 4
    (root / "val").rename(tmp_path / "gone")  # no val/ folder: --val-fraction carves it out of train
    assert train(root, tmp_path / "run2", "--steps", 1, "--eval-every", 0, "--val-fraction", 0.5) == 0
    assert json.loads((tmp_path / "run2" / "config.json").read_text())["data"]["n_val"] == 6


def test_a_kaggle_layout_trains_on_train_and_carves_its_test_split(tmp_path, capsys):
    """DIR/train/<class>/ beside DIR/test/*.png (a competition's unlabelled test set) failed with exit 2 ('no class
    folders'); the run trains, its test split carved out of train/ (so test_fraction is accepted), and the note
    says the folder was left out."""
    from PIL import Image

    from .conftest import write_folder

    root = tmp_path / "kaggle"
    write_folder(root / "train", n_per_class=8)
    (root / "test").mkdir()
    for i in range(5):
        Image.fromarray(np.full((8, 8), 40 * i, dtype=np.uint8)).save(root / "test" / f"{i}.png")
    out = tmp_path / "run"
    assert train(root, out, "--steps", 1, "--eval-every", 0, "--domain-opt", "test_fraction=0.25") == 0
    err = capsys.readouterr().err
    assert f"left out {root / 'test'}: 5 images without class folders" in err
    data = json.loads((out / "config.json").read_text())["data"]
    assert data["n_test"] == 4 and data["n_train"] + data["n_val"] + data["n_test"] == 16


def test_a_failing_run_prints_its_error_alone_and_a_good_one_the_data_notes(tmp_path, capsys):
    """The 'skipped N non-image files' note went to stderr as the folder was read, so a run that then failed (an
    unreadable image, a patch size the data refuses) printed two lines; the error is the one line now, and the notes
    come once every input check has passed."""
    from .conftest import write_folder

    root = write_folder(tmp_path / "imgs")
    (root / "cat" / "README.txt").write_text("where these came from")
    out = tmp_path / "run"
    _fails(capsys, 2, "patch_size: 3 does not divide", "--data", root, *TINY, "--set", "patch_size=3",
           "--out", out)
    (root / "dog" / "broken.png").write_bytes(b"not a png")
    _fails(capsys, 2, "broken.png: not a readable image", "--data", root, *TINY, "--out", out)
    assert not out.exists()
    (root / "dog" / "broken.png").unlink()
    assert train(root, out, "--steps", 1, "--eval-every", 0) == 0
    err = capsys.readouterr().err
    assert f"skipped 1 non-image files under {root}" in err and "error" not in err


def test_an_int32_image_array_is_one_error_line_and_no_run(tmp_path, capsys):
    """An int32 array of 0..255 pixels trained on its raw values (uint8 ones are scaled to [0, 1]); difftx train
    refuses it in one line naming the cast, exit 2, before the run directory is made."""
    x, y = blob_images()
    np.savez(tmp_path / "i32.npz", x=(x * 255).astype(np.int32), y=y)
    _fails(capsys, 2, "save them as x.astype(np.uint8)", "--data", tmp_path / "i32.npz", *TINY, "--steps", "1",
           "--out", tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_images_without_pixels_are_one_data_error_line(tmp_path, capsys):
    """(N, 0, 0) images passed every data check: NumPy's empty-mean RuntimeWarnings from the split statistics, then
    the model config's 'image_size: must be a positive integer; got 0', which never named the data."""
    y = np.arange(20) % 2
    for name, shape in (("hw", (20, 0, 0)), ("c", (20, 0, 8, 8))):
        np.savez(tmp_path / f"{name}.npz", x=np.zeros(shape, np.float32), y=y)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no RuntimeWarning on the way to the error line
            _fails(capsys, 2, f"{name}.npz: images of shape", "--data", tmp_path / f"{name}.npz", *TINY,
                   "--out", tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_crop_padding_of_the_image_size_or_more_is_refused(tmp_path, npz_data, capsys):
    """--domain-opt crop=N pads each side by N: from N = the image size on a crop can be all padding (a blank image
    keeping its label), and a large N was a NumPy allocation traceback at the first step, after the run directory
    was written."""
    for crop in (8, 10**6):
        _fails(capsys, 2, f"crop {crop} pads each side", "--data", npz_data, *TINY, "--steps", 1,
               "--domain-opt", f"crop={crop}", "--out", tmp_path / "run")
    assert not (tmp_path / "run").exists()
    assert train(npz_data, tmp_path / "run", "--steps", 1, "--domain-opt", "crop=7") == 0
