"""Fixtures of the vision tests: small synthetic image sets (arrays and folders) and one CPU thread."""

from __future__ import annotations

import numpy as np
import pytest


def blob_images(n_per_class: int = 20, n_classes: int = 3, size: int = 8, channels: int = 1, seed: int = 0):
    """Easy synthetic classes: class k is a bright square at a class-specific corner, plus noise."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 0.3, (n_per_class * n_classes, channels, size, size)).astype(np.float32)
    y = np.repeat(np.arange(n_classes), n_per_class)
    half = size // 2
    for i, k in enumerate(y):
        r, c = divmod(int(k) % 4, 2)
        x[i, :, r * half:(r + 1) * half, c * half:(c + 1) * half] += 0.7
    return x, y


@pytest.fixture
def npz_data(tmp_path):
    x, y = blob_images()
    path = tmp_path / "blobs.npz"
    np.savez(path, x=x, y=y)
    return path


def write_folder(root, sizes=None, n_per_class: int = 4, classes=("cat", "dog"), mode: str = "L"):
    """root/<class>/<i>.png; ``sizes`` maps (class, i) to (w, h) to make odd ones out."""
    from PIL import Image

    sizes = sizes or {}
    rng = np.random.default_rng(1)
    for k, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n_per_class):
            w, h = sizes.get((name, i), (8, 8))
            shape = (h, w) if mode == "L" else (h, w, 3)
            a = (rng.uniform(0, 80, shape) + 150 * k).astype(np.uint8)
            Image.fromarray(a).save(root / name / f"{i}.png")
    return root


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models: one thread (tests/conftest.py)."""
    yield
