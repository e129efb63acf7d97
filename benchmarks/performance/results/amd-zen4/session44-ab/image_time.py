"""Seconds to load an .npz of 20000 uint8 32x32x3 images (load_npz: scaled to float32 [0, 1]), best of 5."""
import sys, time
from pathlib import Path
from difftx.data.images import load_npz
best = min((lambda t: (load_npz(Path(sys.argv[1])), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
print(f"images {best:.3f}s")
