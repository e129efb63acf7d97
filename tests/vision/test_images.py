"""Image data: the three sources, the stratified split, and one clear error for each bad input."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

from difftx.data.images import channel_stats, load_image_set, normalize, split_indices
from difftx.errors import DataError
from .conftest import blob_images, write_folder


def test_builtin_digits():
    d = load_image_set(None)
    assert d.images.shape == (1797, 1, 8, 8) and d.images.dtype == np.float32
    assert d.images.min() == 0.0 and d.images.max() == 1.0  # 0..16 scaled
    assert d.classes == [str(i) for i in range(10)] and sorted(set(d.labels.tolist())) == list(range(10))
    assert load_image_set("digits").fingerprint() == d.fingerprint()


def test_digits_beside_a_digits_folder_is_the_builtin_with_a_note(tmp_path, monkeypatch):
    """--data digits took the built-in digits with nothing said when a ./digits image folder was there too."""
    monkeypatch.chdir(tmp_path)
    assert load_image_set("digits").notes == []
    write_folder(tmp_path / "digits")
    d = load_image_set("digits")
    assert d.classes == [str(i) for i in range(10)]  # the name, as documented
    assert d.notes == ["--data digits is the built-in digits; ./digits in the current directory is not read (give "
                       "--data ./digits for it)"]
    assert load_image_set("./digits").classes == ["cat", "dog"] and load_image_set(None).notes == []


def test_missing_sklearn_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(DataError, match=r"scikit-learn: pip install 'difftx\[vision\]'"):
        load_image_set(None)


def test_missing_pillow_is_one_clear_line(monkeypatch, tmp_path):
    write_folder(tmp_path / "imgs")
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(DataError, match=r"Pillow: pip install 'difftx\[vision\]'"):
        load_image_set(str(tmp_path / "imgs"))


@pytest.mark.parametrize("size, channels", [(4, 3), (2, 3), (3, 4), (4, 1), (6, 3)])
def test_tiny_square_images_in_either_channel_order(tmp_path, size, channels):
    """(N, k, k, C) is channels last and (N, C, k, k) channels first, also for images of 4 rows or fewer."""
    x, y = blob_images(size=size, channels=channels)
    for name, arr in (("first", x), ("last", np.moveaxis(x, 1, -1))):
        np.savez(tmp_path / f"{name}.npz", x=arr, y=y)
        got = load_image_set(str(tmp_path / f"{name}.npz"))
        assert got.images.shape == (len(y), channels, size, size), name
        np.testing.assert_array_equal(got.images, x)


def test_numpy_sources_agree(tmp_path):
    x, y = blob_images(size=6, channels=3)
    np.savez(tmp_path / "a.npz", x=x, y=y)
    np.save(tmp_path / "x.npy", np.moveaxis(x, 1, -1))  # channels last is recognised
    np.save(tmp_path / "y.npy", y)
    (tmp_path / "d").mkdir()
    np.save(tmp_path / "d" / "x.npy", x)
    np.save(tmp_path / "d" / "y.npy", y.astype(np.float64))  # integer-valued floats are fine
    sets = [load_image_set(str(tmp_path / "a.npz")), load_image_set(f"{tmp_path / 'x.npy'},{tmp_path / 'y.npy'}"),
            load_image_set(str(tmp_path / "d"))]
    for s in sets:
        assert s.images.shape == (60, 3, 6, 6) and s.classes == ["0", "1", "2"]
        np.testing.assert_array_equal(s.images, x)
        np.testing.assert_array_equal(s.labels, y)


def test_uint8_grey_arrays_are_scaled(tmp_path):
    x = np.full((4, 5, 5), 255, dtype=np.uint8)
    np.savez(tmp_path / "g.npz", x=x, y=np.array([0, 1, 0, 1]))
    d = load_image_set(str(tmp_path / "g.npz"))
    assert d.images.shape == (4, 1, 5, 5) and float(d.images.max()) == 1.0


def test_image_folder_grey_and_rgb(tmp_path):
    d = load_image_set(str(write_folder(tmp_path / "grey", n_per_class=3)))
    assert d.images.shape == (6, 1, 8, 8) and d.classes == ["cat", "dog"] and d.labels.tolist() == [0] * 3 + [1] * 3
    assert 0.0 <= d.images.min() and d.images.max() <= 1.0
    assert d.images[3:].mean() > d.images[:3].mean() + 0.3  # the dog images are brighter
    rgb = load_image_set(str(write_folder(tmp_path / "rgb", n_per_class=2, mode="RGB")))
    assert rgb.images.shape == (4, 3, 8, 8)
    assert d.splits is None


def test_16_bit_grey_images_beside_rgb_keep_their_range(tmp_path):
    """A 16-bit grey image in a folder that also holds RGB images was converted to RGB by Pillow, which clips its
    values at 255: every pixel above 255 of 65535 came out 1.0.  It is read by its own range, as in a grey folder."""
    from PIL import Image

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    Image.fromarray(np.full((8, 8), 40000, dtype=np.uint16)).save(tmp_path / "a" / "0.png")
    Image.fromarray(np.full((8, 8, 3), 100, dtype=np.uint8)).save(tmp_path / "b" / "0.png")
    d = load_image_set(str(tmp_path))
    assert d.images.shape == (2, 3, 8, 8)
    np.testing.assert_allclose(d.images[0], 40000 / 65535, rtol=1e-6)  # grey: the same value in R, G and B
    np.testing.assert_allclose(d.images[1], 100 / 255, rtol=1e-6)


def test_image_folder_with_given_splits(tmp_path):
    write_folder(tmp_path / "ds" / "train", n_per_class=10)
    write_folder(tmp_path / "ds" / "test", n_per_class=2)
    d = load_image_set(str(tmp_path / "ds"))
    assert set(d.splits) == {"train", "test"} and len(d.images) == 24
    idx = split_indices(d.labels, 0.2, 0.5, 0, d.splits)
    np.testing.assert_array_equal(idx["test"], d.splits["test"])  # given test kept; test_fraction unused
    assert len(idx["val"]) == 4 and len(idx["train"]) == 16  # val carved out of train, per class
    assert set(idx["val"]) | set(idx["train"]) == set(d.splits["train"].tolist())


def test_split_is_stratified_deterministic_and_disjoint():
    labels = np.repeat(np.arange(4), 50)
    a = split_indices(labels, 0.1, 0.2, seed=0)
    b = split_indices(labels, 0.1, 0.2, seed=0)
    c = split_indices(labels, 0.1, 0.2, seed=1)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["test"], c["test"])
    assert sorted(np.concatenate(list(a.values())).tolist()) == list(range(200))
    for k, n in (("test", 10), ("val", 5), ("train", 35)):
        assert np.bincount(labels[a[k]]).tolist() == [n] * 4, k
    with pytest.raises(DataError, match="sum to less than 1"):
        split_indices(labels, 0.5, 0.5)


def test_normalisation_uses_channel_statistics():
    x, _ = blob_images(channels=3)
    mean, std = channel_stats(x)
    z = normalize(x, mean, std)
    np.testing.assert_allclose(z.mean(axis=(0, 2, 3)), 0.0, atol=1e-5)
    np.testing.assert_allclose(z.std(axis=(0, 2, 3)), 1.0, atol=1e-4)


def test_resize(tmp_path):
    write_folder(tmp_path / "f", sizes={("cat", 0): (12, 10)})  # one odd size: resize makes them all 6x6
    d = load_image_set(str(tmp_path / "f"), resize=6)
    assert d.images.shape == (8, 1, 6, 6)
    x, y = blob_images(size=8)
    np.savez(tmp_path / "a.npz", x=x, y=y)
    assert load_image_set(str(tmp_path / "a.npz"), resize=4).images.shape == (60, 1, 4, 4)


# ---------------------------------------------------------------------- bad input
def _bad(spec, match, **kw):
    with pytest.raises(DataError, match=match) as e:
        load_image_set(str(spec), **kw)
    assert "\n" not in str(e.value)


def test_missing_path(tmp_path):
    _bad(tmp_path / "nope", "no such file or directory")


def test_folder_without_class_folders(tmp_path):
    (tmp_path / "empty").mkdir()
    _bad(tmp_path / "empty", "no class folders")
    (tmp_path / "one" / "cat").mkdir(parents=True)
    _bad(tmp_path / "one", "at least 2 classes")


def test_class_folder_without_images(tmp_path):
    root = write_folder(tmp_path / "f")
    (root / "emu").mkdir()
    (root / "emu" / "notes.txt").write_text("no pictures here")
    _bad(root, r"emu: no images")


def test_mismatched_image_sizes_name_the_file(tmp_path):
    root = write_folder(tmp_path / "f", sizes={("dog", 2): (10, 8)})
    _bad(root, r"dog/2\.png: 10x8 pixels, but .*cat/0\.png is 8x8; .*resize=N")


def test_non_square_images(tmp_path):
    root = write_folder(tmp_path / "f", sizes={(c, i): (8, 6) for c in ("cat", "dog") for i in range(4)})
    _bad(root, "square")


def test_unreadable_image(tmp_path):
    root = write_folder(tmp_path / "f")
    (root / "cat" / "broken.png").write_bytes(b"not a png")
    _bad(root, r"broken\.png: not a readable image")


def test_bad_arrays(tmp_path):
    x, y = blob_images()
    np.savez(tmp_path / "keys.npz", images=x, labels=y)
    _bad(tmp_path / "keys.npz", "needs arrays named x .* and y .* it holds images, labels")
    np.savez(tmp_path / "many.npz", **{f"w{i:05d}": np.zeros(1) for i in range(10_000)})  # a saved state dict
    _bad(tmp_path / "many.npz", r"it holds w00000, w00001, .*, w00007 and 9992 more$")  # not 10,000 names
    np.savez(tmp_path / "len.npz", x=x, y=y[:-1])
    _bad(tmp_path / "len.npz", "60 images but labels of shape")
    np.savez(tmp_path / "neg.npz", x=x, y=y - 1)
    _bad(tmp_path / "neg.npz", "label -1 of image 0 is out of range")
    np.savez(tmp_path / "frac.npz", x=x, y=y + 0.5)
    _bad(tmp_path / "frac.npz", "non-integer")
    np.savez(tmp_path / "one.npz", x=x, y=np.zeros_like(y))
    _bad(tmp_path / "one.npz", "at least 2 classes")
    np.savez(tmp_path / "dims.npz", x=x[:, 0, 0], y=y)
    _bad(tmp_path / "dims.npz", "images must be")
    np.savez(tmp_path / "complex.npz", x=x + 1j, y=y)  # was cast to float, the imaginary part dropped
    _bad(tmp_path / "complex.npz", "images must be real numbers, got dtype complex")
    x[0, 0, 0, 0] = np.nan
    np.savez(tmp_path / "nan.npz", x=x, y=y)
    _bad(tmp_path / "nan.npz", "NaN")
    (tmp_path / "t.txt").write_text("hello")
    _bad(tmp_path / "t.txt", "not an image folder or .npz")
    _bad(f"{tmp_path / 'x.npy'},{tmp_path / 'y.npy'}", "x.npy: no such file")


def test_stl10_layout_gives_splits_and_leaves_out_the_unlabeled_part(tmp_path):
    """DIR/{train,test,unlabeled}/... (STL-10 as image folders) was read as three classes, train, test and
    unlabeled; it is the train and test splits, and the unlabeled images are left out with a note."""
    from PIL import Image

    root = tmp_path / "stl"
    write_folder(root / "train", n_per_class=3)
    write_folder(root / "test", n_per_class=2)
    (root / "unlabeled").mkdir()
    for i in range(5):
        Image.fromarray(np.full((8, 8), 7 * i, dtype=np.uint8)).save(root / "unlabeled" / f"{i}.png")
    d = load_image_set(str(root))
    assert d.classes == ["cat", "dog"] and len(d.images) == 10
    assert set(d.splits) == {"train", "test"}
    assert len(d.splits["train"]) == 6 and len(d.splits["test"]) == 4
    assert sorted(d.labels[d.splits["test"]].tolist()) == [0, 0, 1, 1]
    assert any("unlabeled" in n and "5" in n for n in d.notes), d.notes


def test_labels_that_are_ids_not_class_indices_are_refused(tmp_path):
    """Integer labels up to 10^7 (ids, not class indices 0..K-1) silently made a 10^7-class model; a label range far
    wider than the labels that occur is refused, naming the fix.  Classes missing from a subset are still fine."""
    x, y = blob_images()  # 60 images, labels 0, 1, 2
    ids = np.where(y == 2, 10**7, y)
    np.savez(tmp_path / "ids.npz", x=x, y=ids)
    _bad(tmp_path / "ids.npz", r"labels go up to 10000000 .* 3 distinct .*np\.unique\(y, return_inverse=True\)")
    np.savez(tmp_path / "gap.npz", x=x, y=np.where(y == 2, 255, y))  # an 'ignore' label 255 among 0 and 1
    _bad(tmp_path / "gap.npz", "labels go up to 255")
    np.savez(tmp_path / "subset.npz", x=x, y=y * 9)  # 0, 9, 18: a subset of 19 classes, some absent
    d = load_image_set(str(tmp_path / "subset.npz"))
    assert len(d.classes) == 19 and d.classes[-1] == "18"


def test_uint16_arrays_are_scaled_as_16_bit_image_files_are(tmp_path):
    """uint8 arrays were scaled to [0, 1] but uint16 ones kept 0..65535; they are divided by 65535, as a 16-bit grey
    image file is, so the same pixels give the same images from either source."""
    from PIL import Image

    rng = np.random.default_rng(3)
    x = rng.integers(0, 65536, (4, 8, 8), dtype=np.uint16)
    y = np.array([0, 0, 1, 1])
    np.savez(tmp_path / "a.npz", x=x, y=y)
    arr = load_image_set(str(tmp_path / "a.npz"))
    assert 0.0 <= arr.images.min() and arr.images.max() <= 1.0
    np.testing.assert_allclose(arr.images[:, 0], x / 65535, rtol=1e-6)
    for i, (a, k) in enumerate(zip(x, y)):
        (tmp_path / "f" / str(k)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(a).save(tmp_path / "f" / str(k) / f"{i}.png")
    files = load_image_set(str(tmp_path / "f"))
    np.testing.assert_array_equal(files.images, arr.images)


@pytest.mark.parametrize("dtype, lo, hi, fix", [
    (np.int16, 0, 255, r"x\.astype\(np\.uint8\)"),    # 8-bit values in a wider type
    (np.int32, 0, 255, r"x\.astype\(np\.uint8\)"),
    (np.int64, 0, 255, r"x\.astype\(np\.uint8\)"),
    (np.int16, 0, 4095, r"x\.astype\(np\.uint16\)"),  # a 12-bit sensor's values
    (np.uint32, 0, 65535, r"x\.astype\(np\.uint16\)"),
    (np.uint32, 0, 10**6, r"float32 in \[0, 1\]"),
    (np.int16, -1024, 3071, r"float32 in \[0, 1\]"),  # negative values (CT numbers)
])
def test_integer_arrays_without_a_known_pixel_range_are_refused(tmp_path, dtype, lo, hi, fix):
    """int16 / int32 / uint32 image arrays kept their raw values (0..255, 0..4095, ...) while uint8 and uint16 ones
    were scaled to [0, 1]; their dtype gives no pixel range, so they are refused in one line naming the dtype, the
    values found and the cast that fits them, and that cast loads the pixels scaled to [0, 1]."""
    rng = np.random.default_rng(5)
    x = rng.integers(lo, hi, (4, 8, 8), endpoint=True).astype(dtype)
    x[0, 0, :2] = lo, hi
    y = np.array([0, 0, 1, 1])
    np.savez(tmp_path / "a.npz", x=x, y=y)
    _bad(tmp_path / "a.npz", rf"dtype {np.dtype(dtype).name} \(values {lo}\.\.{hi}\).*save them as {fix}")
    if "uint8" in fix or "uint16" in fix:
        cast = x.astype(np.uint8 if "uint8" in fix else np.uint16)
        np.savez(tmp_path / "b.npz", x=cast, y=y)
        got = load_image_set(str(tmp_path / "b.npz")).images
        np.testing.assert_allclose(got[:, 0], x / (255 if "uint8" in fix else 65535), rtol=1e-6)
        assert 0.0 <= got.min() and got.max() <= 1.0


@pytest.mark.parametrize("name", ["unlabeled", "unlabelled"])
def test_an_unlabeled_folder_beside_class_folders_is_no_class(tmp_path, name):
    """DIR/{cat,dog,unlabeled}/ (no train/ split): the unlabeled images were read as a third class 'unlabeled';
    they are left out with a note, as beside train/ and test/."""
    import shutil

    from PIL import Image

    root = write_folder(tmp_path / "imgs", n_per_class=3)
    (root / name / "sub").mkdir(parents=True)
    for i in range(5):
        Image.fromarray(np.full((8, 8), 7 * i, dtype=np.uint8)).save(root / name / "sub" / f"{i}.png")
    d = load_image_set(str(root))
    assert d.classes == ["cat", "dog"] and len(d.images) == 6 and d.splits is None
    assert sorted(d.labels.tolist()) == [0, 0, 0, 1, 1, 1]
    assert any(name in n and "5 unlabeled images" in n for n in d.notes), d.notes
    shutil.rmtree(root / "dog")  # cat and unlabeled: one class, and a classifier needs two
    _bad(root, r"found 1 class folder \(cat\)")
    shutil.rmtree(root / "cat")
    _bad(root, "no class folders in it .*unlabeled, unlabelled folders are left out")


def test_split_folders_without_train_are_refused(tmp_path):
    """DIR/{val,test}/<class>/ (no train/) was read as two classes named val and test: a classifier of split names.
    Without train/ and without other class folders it is refused, naming both readings."""
    write_folder(tmp_path / "splits" / "val")
    write_folder(tmp_path / "splits" / "test")
    _bad(tmp_path / "splits", r"splits: its only folders are val/, test/, .*without train/: as given splits they "
                              r"need .*splits/train/<class>/<images>.*; as classes, rename them")
    write_folder(tmp_path / "flat", classes=("val", "test"))  # images right in val/ and test/: still only split names
    _bad(tmp_path / "flat", r"flat: its only folders are val/, test/")
    write_folder(tmp_path / "one" / "test", classes=("cat", "dog", "emu"))
    _bad(tmp_path / "one", r"one: its only folders are test/")


def test_a_split_of_class_folders_among_class_folders_is_refused(tmp_path):
    """DIR/{cat,dog}/*.png beside DIR/test/{cat,dog}/*.png was read as three classes, the third named test: either
    the splits lack train/ or the class test holds only subfolders; refused, naming both readings."""
    root = write_folder(tmp_path / "mixed")
    write_folder(root / "test")
    _bad(root, r"mixed: test/ holds folders, not images, beside the class folders cat/, dog/: as given splits they "
               r"need .*mixed/train/<class>/<images>.*; as a class, rename test/")


def test_classes_named_like_splits_among_other_classes_stay_classes(tmp_path):
    """A class that happens to be called train or test (its images in its folder) beside other classes is a class:
    no split layout, no refusal."""
    d = load_image_set(str(write_folder(tmp_path / "vehicles", classes=("bus", "car", "train"), n_per_class=2)))
    assert d.classes == ["bus", "car", "train"] and d.splits is None and len(d.images) == 6
    assert d.labels.tolist() == [0, 0, 1, 1, 2, 2]
    root = write_folder(tmp_path / "exams", classes=("quiz", "test", "val"), n_per_class=2)
    write_folder(root / "test" / "nested", classes=("more",), n_per_class=1)  # a subfolder too: still the class test
    d = load_image_set(str(root))
    assert d.classes == ["quiz", "test", "val"] and d.splits is None and d.labels.tolist().count(1) == 3


@pytest.mark.parametrize("name", ["unlabeled", "unlabelled"])
def test_an_unlabeled_folder_inside_a_split_is_no_class(tmp_path, name):
    """DIR/train/{cat,dog,unlabeled}/: the unlabeled images were read as a third class 'unlabeled' (beside the
    splits or the class folders they were left out); inside a split they are left out too, with a note."""
    import shutil

    root = tmp_path / "ds"
    write_folder(root / "train", classes=("cat", "dog", name), n_per_class=3)
    write_folder(root / "test", n_per_class=2)
    d = load_image_set(str(root))
    assert d.classes == ["cat", "dog"] and len(d.images) == 10
    assert len(d.splits["train"]) == 6 and len(d.splits["test"]) == 4
    assert sorted(d.labels[d.splits["train"]].tolist()) == [0, 0, 0, 1, 1, 1]
    assert any(f"train/{name}" in n and "3 unlabeled images" in n for n in d.notes), d.notes
    shutil.rmtree(root / "train" / "cat")
    shutil.rmtree(root / "train" / "dog")
    _bad(root, r"ds/train: no class folders in it .*unlabeled, unlabelled folders are left out")


def test_a_folder_beside_the_splits_is_refused(tmp_path):
    """DIR/{train,val,notes}/: the one extra folder turned the split layout off, so train, val and notes were read
    as three classes; refused, naming the extra folder and the fix."""
    root = tmp_path / "ds"
    write_folder(root / "train")
    write_folder(root / "val", n_per_class=2)
    write_folder(root, classes=("notes",), n_per_class=1)
    _bad(root, r"ds: notes/ beside the split folders train/, val/ .*: move notes/ out of .*ds \(or name it "
               r"unlabeled/ if its images have no labels\)")
    (root / "notes").rename(root / "unlabeled")  # the fix: now the splits, with the unlabeled image left out
    d = load_image_set(str(root))
    assert d.classes == ["cat", "dog"] and set(d.splits) == {"train", "val"} and len(d.images) == 12
    assert any("unlabeled: 1 unlabeled image " in n for n in d.notes), d.notes


def _loose_images(folder, n):
    """n grey 8x8 PNGs right in ``folder`` (no class folders: unlabelled, as a Kaggle test set)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.fromarray(np.full((8, 8), 9 * i, dtype=np.uint8)).save(folder / f"img_{i}.png")


@pytest.mark.parametrize("split", ["test", "val"])
def test_a_split_of_images_without_class_folders_is_left_out_and_drawn_from_train(tmp_path, split):
    """DIR/train/<class>/ beside DIR/test/*.png (a Kaggle test set: images, no labels) was refused ('DIR/test: no class
    folders in it'); like an unlabeled/ folder those images have one reading, unlabelled, so they are left out with a
    note and that split is carved out of train/ as when no test/ is given."""
    root = tmp_path / "kaggle"
    write_folder(root / "train", n_per_class=5)
    _loose_images(root / split, 7)
    d = load_image_set(str(root))
    assert d.classes == ["cat", "dog"] and len(d.images) == 10 and set(d.splits) == {"train"}
    assert sorted(d.labels.tolist()) == [0] * 5 + [1] * 5  # the unlabelled images are not read as a class
    note = (f"left out {root / split}: 7 images without class folders (unlabelled: a classifier trains and evaluates "
            f"on labelled ones); the {split} split comes from train/")
    assert any(n.startswith(note) for n in d.notes), d.notes
    idx = split_indices(d.labels, 0.2, 0.4, 0, d.splits)  # the split is carved out of train/, stratified
    per_class = {"val": 1, "test": 2}[split]
    assert sorted(d.labels[idx[split]].tolist()) == [0] * per_class + [1] * per_class
    assert not set(idx[split].tolist()) & set(idx["train"].tolist())
    assert np.array_equal(idx[split], split_indices(d.labels, 0.2, 0.4, 0)[split])  # as without the folder


def test_a_split_of_only_unlabelled_images_reads_alike_directly_or_in_unlabeled(tmp_path):
    """A test/ whose images are all unlabelled is left out whether they lie in it or in test/unlabeled/ (that was
    refused as 'no class folders'); a labelled test/ beside an unlabelled val/ is kept; an empty test/ and a train/
    without class folders (nothing to train on) are still refused."""
    import shutil

    root = tmp_path / "ds"
    write_folder(root / "train", n_per_class=4)
    _loose_images(root / "test" / "unlabeled", 3)
    _loose_images(root / "test", 2)
    d = load_image_set(str(root))
    assert set(d.splits) == {"train"} and len(d.images) == 8
    assert [n for n in d.notes if "test" in n] == [n for n in d.notes if n.startswith(
        f"left out {root / 'test'}: 5 images without class folders")], d.notes  # one note for the split
    for f in (root / "test").glob("*.png"):
        f.unlink()
    d = load_image_set(str(root))
    assert set(d.splits) == {"train"} and any(n.startswith(f"left out {root / 'test'}: 3 images ") for n in d.notes)
    shutil.rmtree(root / "test")
    _loose_images(root / "val", 4)
    write_folder(root / "test", n_per_class=2)
    d = load_image_set(str(root))
    assert set(d.splits) == {"train", "test"} and len(d.splits["test"]) == 4 and len(d.images) == 12
    assert any(n.startswith(f"left out {root / 'val'}: 4 images ") for n in d.notes), d.notes
    shutil.rmtree(root / "val")
    (root / "val").mkdir()
    _bad(root, r"ds/val: no class folders in it")  # empty: nothing that reads as unlabelled images
    shutil.rmtree(root / "val")
    shutil.rmtree(root / "train")
    _loose_images(root / "train", 6)
    _bad(root, r"ds/train: no class folders in it")


@pytest.mark.parametrize("split", ["train", "test"])
def test_images_directly_in_a_split_beside_its_class_folders_are_refused(tmp_path, split):
    """DIR/{split}/{cat,dog}/ plus DIR/{split}/*.png: the loose images were silently never read.  They are misplaced
    labelled images or unlabelled ones; refused in one line naming both fixes, and the second fix loads."""
    root = tmp_path / "ds"
    write_folder(root / "train", n_per_class=4)
    write_folder(root / "test", n_per_class=2)
    _loose_images(root / split, 3)
    _bad(root, rf"ds/{split}: 3 image files directly in it beside its class folders cat/, dog/ \(a split holds "
               rf"<class>/<images> only\): move them into their class folders, or into .*ds/{split}/unlabeled/ if "
               "they have no labels")
    (root / split / "unlabeled").mkdir()
    for f in (root / split).glob("*.png"):
        f.rename(root / split / "unlabeled" / f.name)
    d = load_image_set(str(root))
    assert set(d.splits) == {"train", "test"} and len(d.images) == 12
    assert any(f"{split}/unlabeled: 3 unlabeled images" in n for n in d.notes), d.notes


@pytest.mark.parametrize("n", [1, 3])
def test_images_directly_in_the_data_folder_beside_its_class_folders_are_refused(tmp_path, n):
    """DIR/{cat,dog}/ plus DIR/*.png: the loose images were silently never read (as in a split beside its class
    folders, which is refused).  Refused in one line naming DIR, the count and both fixes; a README, a CSV and hidden
    files there stay allowed, and the second fix loads."""
    root = write_folder(tmp_path / "ds", n_per_class=3)
    (root / "README.md").write_text("cats and dogs\n")
    (root / "labels.csv").write_text("file,label\n")
    _loose_images(root / ".thumbs", 1)
    (root / ".thumbs" / "img_0.png").rename(root / ".cover.png")  # a hidden image file: no image of the data
    d = load_image_set(str(root))  # non-image and hidden files beside the class folders: read as before
    assert d.classes == ["cat", "dog"] and len(d.images) == 6 and d.splits is None
    _loose_images(root, n)
    at = re.escape(str(root))
    fix = "them into their class folders" if n > 1 else "it into its class folder"
    _bad(root, rf"^{at}: {n} image files? directly in it beside its class folders cat/, dog/ \(an image folder "
               rf"holds <class>/<images> only\): move {fix}, or into {at}/unlabeled/ if (they have|it has) no "
               "labels$")
    (root / "unlabeled").mkdir()
    for f in root.glob("img_*.png"):
        f.rename(root / "unlabeled" / f.name)
    d = load_image_set(str(root))
    assert d.classes == ["cat", "dog"] and len(d.images) == 6 and d.splits is None
    assert any(f"ds/unlabeled: {n} unlabeled image" in note for note in d.notes), d.notes


def test_images_directly_in_the_data_folder_beside_the_splits_are_refused(tmp_path):
    """DIR/{train,val,test}/ plus DIR/*.png: the loose images were silently never read.  Refused in one line naming
    the splits and both fixes (their class folders in a split, or DIR/unlabeled/); a README and a CSV beside the
    splits stay allowed, and the second fix loads with the splits kept."""
    root = tmp_path / "ds"
    write_folder(root / "train", n_per_class=4)
    write_folder(root / "val", n_per_class=1)
    write_folder(root / "test", n_per_class=2)
    (root / "README.txt").write_text("splits\n")
    (root / "test.csv").write_text("file\n")
    d = load_image_set(str(root))
    assert set(d.splits) == {"train", "val", "test"} and len(d.images) == 14
    _loose_images(root, 5)
    at = re.escape(str(root))
    _bad(root, rf"^{at}: 5 image files directly in it beside the split folders train/, val/, test/ \(given "
               rf"splits hold <split>/<class>/<images> only\): move them into their class folders in a split, or "
               rf"into {at}/unlabeled/ if they have no labels$")
    (root / "unlabeled").mkdir()
    for f in root.glob("img_*.png"):
        f.rename(root / "unlabeled" / f.name)
    d = load_image_set(str(root))
    assert set(d.splits) == {"train", "val", "test"} and len(d.images) == 14 and d.classes == ["cat", "dog"]
    assert any("ds/unlabeled: 5 unlabeled images" in n for n in d.notes), d.notes


def test_32_bit_integer_images_outside_the_16_bit_range_are_refused(tmp_path):
    """Pillow opens a 16-bit PGM as its 32-bit mode I: those are divided by 65535 like other 16-bit files.  An int32
    TIFF (also mode I) with values beyond 65535 or below 0 came out outside [0, 1] (100000 -> 1.53); refused."""
    from PIL import Image

    for name in ("a", "b"):
        (tmp_path / "pgm" / name).mkdir(parents=True)
    for name, value in (("a", 40000), ("b", 1000)):  # 16-bit binary PGMs, written by hand (Pillow 10.0 cannot)
        (tmp_path / "pgm" / name / "0.pgm").write_bytes(b"P5\n8 8\n65535\n" + np.full((8, 8), value, ">u2").tobytes())
    with Image.open(tmp_path / "pgm" / "a" / "0.pgm") as im:
        assert im.mode == "I"
    d = load_image_set(str(tmp_path / "pgm"))
    np.testing.assert_allclose(d.images[:, 0, 0, 0], [40000 / 65535, 1000 / 65535], rtol=1e-6)
    for name, value in (("big", 100000), ("negative", -5)):
        root = tmp_path / name
        for cls in ("a", "b"):
            (root / cls).mkdir(parents=True)
            Image.fromarray(np.full((8, 8), 7, dtype=np.int32)).save(root / cls / "0.tif")
        a = np.full((8, 8), 7, dtype=np.int32)
        a[2, 3] = value
        Image.fromarray(a).save(root / "b" / "1.tif")
        _bad(root, rf"{name}/b/1.tif: a 32-bit integer image with values {min(7, value)}..{max(7, value)}; .*"
                   r"save it as 16-bit \(values 0..65535\) or as a float image \(mode F\) in \[0, 1\]")
