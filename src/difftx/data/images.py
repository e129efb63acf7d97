"""Image-classification data for ``difftx train --domain vision``: what ``--data`` means, read the same way every time.

``--data`` may be

* nothing (or ``digits``): the handwritten digits that ship inside scikit-learn
  (1797 grey 8x8 images, 10 classes, pixel values 0..16; no download; the
  ``vision`` extra),
* a directory of image folders, one folder per class (``DIR/<class>/*.png``;
  read with Pillow, the ``vision`` extra), or with given splits
  (``DIR/train/<class>/...`` plus ``DIR/val/...`` and/or ``DIR/test/...``, and no other folder); an
  ``unlabeled`` (or ``unlabelled``) folder, as in STL-10, is left out with a note, beside the
  splits, inside one or beside the class folders alike (it is never a class).  Among other class folders a
  ``train``, ``val`` or ``test`` folder that holds images is a class (``bus/``, ``car/``, ``train/``).  Layouts
  that read either way are refused, naming both readings: ``val/`` and/or ``test/`` without ``train/`` and
  without other classes, a ``val/`` or ``test/`` of class folders among class folders, and a ``train/`` of class
  folders beside a folder that is no split (``DIR/notes/``).  A ``val/`` or ``test/`` split of images without
  class folders (a Kaggle test set: ``DIR/test/*.jpg``) is unlabelled too: it has that one reading (beside
  ``train/`` it is no class), so it is left out with a note, as ``unlabeled/`` is, and that split is drawn from
  ``train/`` as when the folder is absent (a classifier trains and evaluates on labelled images).  Image files
  directly in ``DIR`` beside its class folders or its splits, or directly in a split beside its class folders,
  would never be read and are refused (misplaced labelled images, or unlabelled ones: move them into their class
  folders, or into an ``unlabeled/`` folder there); other files there (a README, a CSV) are fine,
* NumPy arrays: an ``.npz`` holding ``x`` and ``y``, a directory holding
  ``x.npy`` and ``y.npy``, or two files ``IMAGES.npy,LABELS.npy``.

Everything is held in memory as float32 ``(N, C, H, W)``.  Pixel values of
8- and 16-bit sources (files, ``uint8`` and ``uint16`` arrays) are scaled to
[0, 1] by their range (digits: /16); float (and bool) arrays are kept as they are.  Pillow's 32-bit integer
mode ``I`` (how it opens 16-bit PGMs, and older versions 16-bit PNGs) is read as 16-bit; an image of that mode
with values outside 0..65535 (an int32 TIFF) is refused.  Other integer arrays
(``int8`` .. ``int64``, ``uint32``, ``uint64``) have no known pixel range and are refused, naming the cast
that fits their values (``uint8``, ``uint16``, or float32 divided by the maximum).  Arrays may be
``(N, H, W)`` (grey), ``(N, C, H, W)`` or ``(N, H, W, C)`` (channels last is recognised when the last axis has 1, 3 or 4
entries and the second more than 4, or the second and third are equal and the
last is not: tiny square images; ``(N, k, k, k)`` is read as channels first).  Class names are the folder names, sorted
(arrays and digits: ``"0"``, ``"1"``, ...).  Array labels are class indices 0..K-1 (K = the
largest + 1); a range of more than 100 classes and more than 10 per distinct label (ids, an ignore
value such as 255) is refused.

Splits are stratified and deterministic: within each class a permutation from
``split_seed`` (not the training seed, so runs with different seeds share their
test set) puts the first ``test_fraction`` into test, the next
``val_fraction`` into validation.  Normalisation uses the per-channel mean and
standard deviation of the training split.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import DataError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")
SPLIT_NAMES = ("train", "val", "test")
UNLABELED_NAMES = ("unlabeled", "unlabelled")  # images without labels (STL-10), left out: never a class
BUILTIN = "digits"
# labels 0..K-1 with K above this and above 10 x the distinct labels are refused (ids, not class indices)
MAX_SPARSE_CLASSES = 100
# integer image arrays with a known pixel range, scaled to [0, 1] as 8- and 16-bit image files are
PIXEL_SCALE = {np.dtype(np.uint8): 255.0, np.dtype(np.uint16): 65535.0}
_GREY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"}


@dataclass
class ImageSet:
    """Images (float32, N x C x H x W), integer labels and class names; ``splits`` when the source fixes them;
    ``notes``: what the reader left out (``difftx train`` prints them once every input check has passed, so a
    failing run prints its error alone)."""

    images: np.ndarray
    labels: np.ndarray
    classes: list[str]
    source: str
    splits: Optional[dict[str, np.ndarray]] = None
    notes: list[str] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(int(s) for s in self.images.shape[1:])

    def fingerprint(self) -> str:
        """SHA-256 of the pixels and labels (16 hex digits): the same data gives the same print."""
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.images).tobytes())
        h.update(np.ascontiguousarray(self.labels).tobytes())
        return h.hexdigest()[:16]


# ---------------------------------------------------------------------- sources
def load_image_set(spec: Optional[str] = None, resize: Optional[int] = None) -> ImageSet:
    """The data named by ``--data`` (see the module docstring); ``resize``: make every image N x N."""
    if spec is None or spec == BUILTIN:
        data = load_digits()
        if spec == BUILTIN and Path(spec).exists():  # the name wins, as documented; the path must not pass unseen
            data.notes.append(f"--data {BUILTIN} is the built-in digits; ./{BUILTIN} in the current directory is "
                              f"not read (give --data ./{BUILTIN} for it)")
    elif "," in spec and not Path(spec).exists():
        x, y = (s.strip() for s in spec.split(",", 1))
        data = _from_arrays(_read_npy(Path(x)), _read_npy(Path(y)), f"{x},{y}")
    else:
        path = Path(spec)
        if not path.exists():
            raise DataError(f"--data {spec}: no such file or directory (give an image folder, an .npz with x and y, "
                            f"a directory with x.npy and y.npy, or nothing for the built-in digits)")
        if path.is_file() and path.suffix == ".npz":
            data = load_npz(path)
        elif path.is_file():
            raise DataError(f"--data {spec}: not an image folder or .npz file (for a pair of .npy files give "
                            "IMAGES.npy,LABELS.npy)")
        elif (path / "x.npy").is_file() and (path / "y.npy").is_file():
            data = _from_arrays(_read_npy(path / "x.npy"), _read_npy(path / "y.npy"), str(path))
        else:
            data = load_image_folder(path, resize)
            resize = None  # done while reading
    if resize is not None:
        _require_resized_fit(len(data.images), data.images.shape[1] if data.images.ndim == 4 else 1, resize)
        data.images = resize_images(data.images, resize)
    _check_images(data)
    return data


def load_digits() -> ImageSet:
    """scikit-learn's handwritten digits: 1797 images of 8x8, values 0..16 scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError:
        raise DataError("the built-in digits data needs scikit-learn: pip install 'difftx[vision]' "
                        "(or give --data)") from None
    d = sk_digits()
    images = (d.images.astype(np.float32) / 16.0)[:, None]
    return ImageSet(images, d.target.astype(np.int64), [str(c) for c in d.target_names], BUILTIN)


def load_npz(path: Path) -> ImageSet:
    try:
        with np.load(path, allow_pickle=False) as f:
            keys = set(f.files)
            if not {"x", "y"} <= keys:
                names = sorted(keys)  # a saved state dict holds thousands: the line names a few
                held = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
                raise DataError(f"{path}: needs arrays named x (images) and y (labels); it holds {held or 'nothing'}")
            x, y = f["x"], f["y"]
    except DataError:
        raise
    except Exception as e:  # zip/format errors, object arrays (pickles are refused)
        raise DataError(f"{path}: not a readable .npz of numeric arrays ({type(e).__name__}: {e})") from None
    return _from_arrays(x, y, str(path))


def _read_npy(path: Path) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        return np.load(path, allow_pickle=False)
    except Exception as e:
        raise DataError(f"{path}: not a readable .npy of numbers ({type(e).__name__}: {e})") from None


def _from_arrays(x: np.ndarray, y: np.ndarray, source: str) -> ImageSet:
    if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating) or x.dtype == bool):
        raise DataError(f"{source}: images must be real numbers, got dtype {x.dtype}")
    if np.issubdtype(x.dtype, np.integer) and x.dtype not in PIXEL_SCALE:
        raise DataError(_unscaled_integers(x, source))
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] in (1, 3, 4) and (x.shape[1] > 4 or x.shape[1] == x.shape[2] != x.shape[3]):
        x = np.moveaxis(x, -1, 1)  # channels last: more than 4 rows, or square images (N, k, k, C), C != k
    elif x.ndim != 4:
        raise DataError(f"{source}: images must be (N, H, W), (N, C, H, W) or (N, H, W, C); got shape {x.shape}")
    y = np.asarray(y)
    if y.ndim != 1 or len(y) != len(x):
        raise DataError(f"{source}: labels must be one integer per image: {len(x)} images but labels of shape "
                        f"{y.shape}")
    scale = PIXEL_SCALE.get(x.dtype, 1.0)  # as 8-/16-bit files; float and bool as they are
    images = x.astype(np.float32) / scale
    labels = _integer_labels(y, source)
    return ImageSet(images, labels, [str(c) for c in range(int(labels.max()) + 1)] if len(labels) else [], source)


def _unscaled_integers(x: np.ndarray, source: str) -> str:
    """The one-line refusal of an integer image array whose dtype gives no pixel range, with the cast that fits."""
    if x.size == 0:
        fix, found = "x.astype(np.uint8) (0..255), x.astype(np.uint16) (0..65535) or float32 in [0, 1]", ""
    else:
        lo, hi = int(x.min()), int(x.max())
        found = f" (values {lo}..{hi})"
        if lo < 0:
            fix = "float32 in [0, 1], e.g. (x - x.min()) / (x.max() - x.min()) with the range the data can take"
        elif hi <= 255:
            fix = "x.astype(np.uint8) (scaled by 1/255)"
        elif hi <= 65535:
            fix = "x.astype(np.uint16) (scaled by 1/65535)"
        else:
            fix = "float32 in [0, 1], e.g. x.astype(np.float32) / MAX with the largest value the data can take"
    return (f"{source}: images of dtype {x.dtype}{found} have no known pixel range (uint8 arrays are scaled by 1/255, "
            f"uint16 by 1/65535, float ones kept); save them as {fix}")


def _integer_labels(y: np.ndarray, source: str) -> np.ndarray:
    if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
        raise DataError(f"{source}: labels must be integers 0..K-1, got dtype {y.dtype}")
    if np.issubdtype(y.dtype, np.floating) and not (np.isfinite(y).all() and (y == np.round(y)).all()):
        raise DataError(f"{source}: labels must be integers 0..K-1; found non-integer values")
    labels = y.astype(np.int64)
    if len(labels) and labels.min() < 0:
        bad = int(np.argmax(labels < 0))
        raise DataError(f"{source}: label {labels[bad]} of image {bad} is out of range; labels must be 0..K-1")
    if len(labels):
        top, distinct = int(labels.max()), len(np.unique(labels))
        if top + 1 > max(MAX_SPARSE_CLASSES, 10 * distinct):  # ids or codes, not class indices
            raise DataError(f"{source}: labels go up to {top} but only {distinct} distinct values occur, so the model "
                            f"would get {top + 1} classes; labels must be class indices 0..K-1 (map them with "
                            "np.unique(y, return_inverse=True))")
    return labels


def load_image_folder(root: Path, resize: Optional[int] = None) -> ImageSet:
    """``root/<class>/<images>``, or ``root/{train,val,test}/<class>/<images>`` with given splits (an
    ``unlabeled`` folder, as in STL-10, is left out with a note: beside the splits, inside one, or beside the
    classes); layouts that read either way are refused (see :func:`_split_layout`).

    A ``val/`` or ``test/`` split without class folders whose images are all unlabelled (directly in it, as in a
    Kaggle test set, or in ``unlabeled/``) is left out with a note and that split drawn from ``train/``: like an
    ``unlabeled/`` folder it has one reading (its images have no class), and refusing it would only make the
    user move a folder the data came with.  ``train/`` without class folders has nothing to train on: refused.
    Image files directly in ``root`` beside its class folders or its splits, or directly in a split beside its
    class folders, read two ways (labelled images put in the wrong folder, or unlabelled ones) and would be lost
    silently: refused, naming both fixes (see :func:`_loose_images`).  Other files there (README, CSV) are
    allowed."""
    try:
        from PIL import Image
    except ImportError:
        raise DataError("reading image folders needs Pillow: pip install 'difftx[vision]'") from None
    subdirs = _subfolders(root)
    split_layout = _split_layout(root, subdirs)
    parts = {p.name: p for p in subdirs if p.name in SPLIT_NAMES} if split_layout else {"all": root}
    loose = _image_count(root, recursive=False) if split_layout else 0  # root's own image files beside the splits
    if loose:
        splits = [parts[s] for s in SPLIT_NAMES if s in parts]
        raise DataError(_loose_images(root, loose, splits, "the split folders",
                                      "given splits hold <split>/<class>/<images>", " in a split"))
    # unlabeled folders are no class: beside the class folders, beside the splits or inside one
    notes = [_unlabeled_note(p) for p in subdirs if p.name in UNLABELED_NAMES] if split_layout else []
    class_dirs = {}
    for part, path in parts.items():
        sub = _subfolders(path)
        dirs = [p for p in sub if p.name not in UNLABELED_NAMES]
        unlabeled = [p for p in sub if p.name in UNLABELED_NAMES]
        loose = _image_count(path, recursive=False)  # a split's (or root's) own image files
        if loose and dirs:
            holds = "an image folder holds <class>/<images>" if part == "all" else "a split holds <class>/<images>"
            raise DataError(_loose_images(path, loose, dirs, "its class folders", holds))
        if not dirs and part in ("val", "test") and (loose or unlabeled):
            n = loose + sum(_image_count(p) for p in unlabeled)
            notes.append(f"left out {path}: {n} image{'s' * (n != 1)} without class folders (unlabelled: a "
                         f"classifier trains and evaluates on labelled ones); the {part} split comes from "
                         f"train/, as when no {part}/ is given")
            continue
        notes += [_unlabeled_note(p) for p in unlabeled]
        if not dirs:
            left_out = f"; {', '.join(UNLABELED_NAMES)} folders are left out" if len(sub) > len(dirs) else ""
            raise DataError(f"{path}: no class folders in it (expected {path}/<class name>/<image files>{left_out})")
        class_dirs[part] = dirs
    classes = sorted({d.name for dirs in class_dirs.values() for d in dirs})
    if len(classes) < 2:
        raise DataError(f"{root}: found {len(classes)} class folder ({', '.join(classes)}); a classifier needs "
                        "at least 2 classes")
    files, labels, part_of, skipped = [], [], [], 0
    for part, dirs in class_dirs.items():
        for d in dirs:
            found = 0
            for f in sorted(d.rglob("*")):
                if not f.is_file() or any(s.startswith(".") for s in f.relative_to(d).parts):
                    continue
                if f.suffix.lower() not in IMAGE_EXTENSIONS:
                    skipped += 1
                    continue
                files.append(f)
                labels.append(classes.index(d.name))
                part_of.append(part)
                found += 1
            if not found:
                raise DataError(f"{d}: no images in this class folder ({', '.join(IMAGE_EXTENSIONS[:4])}, ...); "
                                "add some or remove the folder")
    if skipped:
        notes.append(f"skipped {skipped} non-image files under {root}")

    pics = []
    for f in files:
        try:
            with Image.open(f) as im:
                im.load()
                pics.append(im.copy() if im.mode != "P" else im.convert("RGBA"))
        except Exception as e:
            raise DataError(f"{f}: not a readable image ({type(e).__name__}: {e}); remove or replace it") from None
        if pics[-1].mode == "I":  # 32-bit: how Pillow opens 16-bit PGMs (older ones 16-bit PNGs), or an int32 TIFF
            lo, hi = pics[-1].getextrema()
            if lo < 0 or hi > 65535:
                raise DataError(f"{f}: a 32-bit integer image with values {lo}..{hi}; integer images are read as "
                                "8- or 16-bit (divided by 255 or 65535): save it as 16-bit (values 0..65535) or "
                                "as a float image (mode F) in [0, 1]")
    grey = all(im.mode in _GREY_MODES for im in pics)
    if resize is not None:
        _require_resized_fit(len(pics), 1 if grey else 3, resize)
    arrays, first = [], None
    for f, im in zip(files, pics):
        if resize is not None:
            im = im.resize((resize, resize), Image.BILINEAR)
        elif first is None:
            first = (f, im.size)
        elif im.size != first[1]:
            raise DataError(f"{f}: {im.size[0]}x{im.size[1]} pixels, but {first[0]} is {first[1][0]}x{first[1][1]}; "
                            "all images must have one size (resize them, or pass --domain-opt resize=N)")
        arrays.append(_pixels(im, grey))
    images = np.stack(arrays)
    labels_arr = np.asarray(labels, dtype=np.int64)
    splits = None
    if split_layout:
        part_arr = np.asarray(part_of)
        splits = {p: np.flatnonzero(part_arr == p) for p in class_dirs}  # a left-out split is drawn from train
    return ImageSet(images, labels_arr, classes, str(root), splits, notes)


def _subfolders(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def _image_count(path: Path, recursive: bool = True) -> int:
    """Image files under ``path`` (``recursive=False``: its own, not hidden ones)."""
    if recursive:
        return sum(1 for f in path.rglob("*") if f.suffix.lower() in IMAGE_EXTENSIONS and f.is_file())
    return sum(1 for f in path.iterdir()
               if f.suffix.lower() in IMAGE_EXTENSIONS and f.is_file() and not f.name.startswith("."))


def _loose_images(path: Path, n: int, folders: list[Path], beside: str, holds: str, where: str = "") -> str:
    """The one-line refusal of the ``n`` image files directly in ``path`` beside ``folders`` (its class folders, or
    the splits): never read, and either labelled images in the wrong folder or unlabelled ones, so both fixes."""
    shown = ", ".join(f"{d.name}/" for d in folders[:3]) + ", ..." * (len(folders) > 3)
    move, label = ("them into their class folders", "they have") if n != 1 else ("it into its class folder", "it has")
    return (f"{path}: {n} image file{'s' * (n != 1)} directly in it beside {beside} {shown} ({holds} only): move "
            f"{move}{where}, or into {path / UNLABELED_NAMES[0]}/ if {label} no labels")


def _unlabeled_note(path: Path) -> str:
    n = _image_count(path)
    return f"left out {path}: {n} unlabeled image{'s' * (n != 1)} (a classifier trains on labelled ones)"


def _holds_class_folders(path: Path) -> bool:
    """A folder laid out as a split (``<class>/<images>``): subfolders and no images of its own.  A class folder
    holds images (perhaps in subfolders too); a split folder's own image files would be unread."""
    return not _image_count(path, recursive=False) and bool(_subfolders(path))


def _split_layout(root: Path, subdirs: list[Path]) -> bool:
    """Whether ``root`` holds given splits rather than class folders.

    Given splits are ``train/`` with ``val/`` and/or ``test/`` and nothing else (``unlabeled/`` aside).  Beside
    other folders, a ``train``, ``val`` or ``test`` folder of images is a class like any other (``bus/``, ``car/``,
    ``train/``).  Refused, with both readings: split names without ``train/`` and no other class (``val/`` and
    ``test/`` alone would train a classifier on split names), a ``val/`` or ``test/`` of class folders among class
    folders, and a ``train/`` of class folders beside folders that are no split (``notes/``: the splits read as
    classes, or a class never read)."""
    names = {p.name for p in subdirs if p.name not in UNLABELED_NAMES}
    splits = [s for s in SPLIT_NAMES if s in names]
    others = sorted(names - set(SPLIT_NAMES))
    if not splits:
        return False
    if "train" in splits and not others:
        return True
    split_like = [s for s in splits if _holds_class_folders(root / s)]
    listed = ", ".join(f"{s}/" for s in splits)
    if "train" in split_like:
        extra = ", ".join(f"{o}/" for o in others)
        raise DataError(f"{root}: {extra} beside the split folders {listed} (given splits are train/ with val/ "
                        f"and/or test/, nothing else): move {extra} out of {root} (or name it unlabeled/ if its "
                        f"images have no labels); if {listed} {'are classes' if len(splits) > 1 else 'is a class'}, "
                        f"rename {'them' if len(splits) > 1 else 'it'}")
    if not others:
        raise DataError(f"{root}: its only folders are {listed}, named like splits but without train/: as given "
                        f"splits they need {root}/train/<class>/<images> beside them; as classes, rename them")
    if split_like:
        what = ", ".join(f"{s}/" for s in split_like)
        classes = ", ".join(f"{o}/" for o in others[:3]) + ", ..." * (len(others) > 3)
        raise DataError(f"{root}: {what} hold{'s' * (len(split_like) == 1)} folders, not images, beside the class "
                        f"folders {classes}: as given splits they need {root}/train/<class>/<images> (move the "
                        f"classes into it); as a class, rename {what}")
    return False


def _pixels(im, grey: bool) -> np.ndarray:
    """A Pillow image as float32 (C, H, W) in [0, 1] (16-bit and float images by their own range; a grey image in a
    colour set has its grey in R, G and B: Pillow's own conversion to RGB clips 16-bit values at 255)."""
    if im.mode in _GREY_MODES:
        if im.mode in ("I", "I;16", "I;16B", "I;16L"):  # "I": 16-bit values (larger ones are refused on reading)
            a = np.asarray(im, dtype=np.float32) / 65535.0
        elif im.mode == "F":
            a = np.asarray(im, dtype=np.float32)
        else:
            a = np.asarray(im.convert("L"), dtype=np.float32) / 255.0
        return a[None] if grey else np.repeat(a[None], 3, axis=0)
    return np.asarray(im.convert("RGB"), dtype=np.float32).transpose(2, 0, 1) / 255.0


def _require_resized_fit(n: int, channels: int, size: int) -> None:
    """--domain-opt resize=10**9 asked torch (or Pillow) for exabytes: a traceback; refused in one line instead."""
    from ..train.memory_check import require_bytes

    require_bytes(4 * n * channels * size * size, "cpu", f"{n:,} images resized to {size}x{size} (float32)",
                  "give a smaller --domain-opt resize=N")


def resize_images(images: np.ndarray, size: int) -> np.ndarray:
    """Bilinear (antialiased) resize of (N, C, H, W) float images to size x size."""
    import torch
    import torch.nn.functional as F

    if images.shape[-2:] == (size, size):
        return images
    t = torch.from_numpy(np.ascontiguousarray(images))
    return F.interpolate(t, size=(size, size), mode="bilinear", antialias=True, align_corners=False).numpy()


def _check_images(data: ImageSet) -> None:
    n, (_, h, w) = len(data.images), data.shape
    if n == 0:
        raise DataError(f"{data.source}: no images")
    if data.images.size == 0:  # (N, 0, 0) or (N, 0, H, W): the split statistics would be NaN
        raise DataError(f"{data.source}: images of shape {data.shape} (channels, height, width) hold no pixels")
    if h != w:
        raise DataError(f"{data.source}: images are {h}x{w}; the vision models take square images "
                        "(pass --domain-opt resize=N)")
    if not np.isfinite(data.images).all():
        raise DataError(f"{data.source}: images hold NaN or infinite values")
    if len(np.unique(data.labels)) < 2:
        raise DataError(f"{data.source}: all images have the same label; a classifier needs at least 2 classes")


# ---------------------------------------------------------------------- splits and statistics
def split_indices(labels: np.ndarray, val_fraction: float, test_fraction: float, seed: int = 0,
                  given: Optional[dict[str, np.ndarray]] = None) -> dict[str, np.ndarray]:
    """Stratified, deterministic ``{"train", "val", "test"}`` index arrays (sorted).

    ``given`` (folder splits): kept; a missing ``val`` (or ``test``) is carved out of ``train``.
    """
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise DataError(f"val_fraction {val_fraction} and test_fraction {test_fraction} must be in [0, 1) and sum "
                        "to less than 1")
    if given is not None:
        pool = given["train"]
        carve_val = 0.0 if "val" in given else val_fraction
        carve_test = 0.0 if "test" in given else test_fraction
        out = _stratified(labels, pool, carve_val, carve_test, seed)
        for name in ("val", "test"):
            if name in given:
                out[name] = np.sort(given[name])
        return out
    return _stratified(labels, np.arange(len(labels)), val_fraction, test_fraction, seed)


def _stratified(labels, pool, val_fraction, test_fraction, seed) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, 0x5EED])
    out = {"train": [], "val": [], "test": []}
    for c in np.unique(labels[pool]):
        idx = pool[labels[pool] == c]
        idx = idx[rng.permutation(len(idx))]
        n_test = int(round(len(idx) * test_fraction))
        n_val = int(round(len(idx) * val_fraction))
        out["test"].append(idx[:n_test])
        out["val"].append(idx[n_test:n_test + n_val])
        out["train"].append(idx[n_test + n_val:])
    return {k: np.sort(np.concatenate(v)).astype(np.int64) for k, v in out.items()}


def channel_stats(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and standard deviation (float64 accumulation; std floored at 1e-6)."""
    mean = images.mean(axis=(0, 2, 3), dtype=np.float64)
    std = images.std(axis=(0, 2, 3), dtype=np.float64)
    return mean.astype(np.float32), np.maximum(std, 1e-6).astype(np.float32)


def normalize(images: np.ndarray, mean, std) -> np.ndarray:
    mean = np.asarray(mean, dtype=np.float32)[None, :, None, None]
    std = np.asarray(std, dtype=np.float32)[None, :, None, None]
    return ((images - mean) / std).astype(np.float32)
