"""An image folder for the A/B: DIR/train/<class>/ (10 classes x 180) and DIR/test/<class>/ (10 x 20), 32x32 RGB PNGs.

    python make_images.py /tmp/ab46/images
"""
import sys
from pathlib import Path

import numpy as np
from PIL import Image

root = Path(sys.argv[1])
rng = np.random.default_rng(0)
for split, n in (("train", 180), ("test", 20)):
    for c in range(10):
        d = root / split / f"class{c}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(d / f"{i}.png")
