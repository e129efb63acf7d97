"""The A/B inputs: a one-line text file (tinyshakespeare x 8, newlines turned to spaces) and 20000 random uint8 images.

    python make_inputs.py /work/shared/data/tinyshakespeare.txt /tmp/ab3
"""
import sys
from pathlib import Path

import numpy as np

src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
text = src.read_text()
(out / "oneline.txt").write_text((text.replace("\n", " ") + " ") * 8)
rng = np.random.default_rng(0)
np.savez(out / "images.npz", x=rng.integers(0, 256, (20000, 32, 32, 3), dtype=np.uint8), y=rng.integers(0, 10, 20000))
