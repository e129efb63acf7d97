"""Wall time of every `difftx eval NAME` at its default size, on CPU checkpoints of a small preset.

    python benchmarks/eval_runtimes.py [--preset tiny] [--kinds softmax,diff] [--out benchmarks/results/eval_runtimes]

Builds randomly initialised checkpoints of the preset (the cost of an
evaluation does not depend on the weights) unless --checkpoint is given, runs
each evaluation as a fresh command (`python -m difftx eval NAME ... --no-plot
--quiet`), and prints a table of the command's wall time and the evaluation's
own `seconds` from NAME.json; writes the same as runtimes.json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVALS = ["lm", "niah", "mqar", "attention", "outliers", "quant", "icl"]


def make_checkpoint(preset: str, kind: str, path: Path) -> Path:
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    import difftx
    from difftx.data import ByteTokenizer

    torch.manual_seed(0)
    model = difftx.build_model(difftx.ModelConfig.from_preset(preset, attention=kind))
    difftx.save_model(model, path)
    ByteTokenizer().save(path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="model preset for the checkpoints (default: tiny)")
    ap.add_argument("--kinds", default="softmax,diff", help="attention kinds (default: softmax,diff)")
    ap.add_argument("--checkpoint", default=None, help="evaluate this checkpoint instead of building them")
    ap.add_argument("--evals", default=",".join(EVALS), help="evaluations to time (default: all)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "eval_runtimes"), help="output directory")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpts = {"checkpoint": Path(args.checkpoint)} if args.checkpoint else {
        k: make_checkpoint(args.preset, k, Path(tempfile.mkdtemp(prefix=f"difftx_{args.preset}_{k}_")))
        for k in args.kinds.split(",")}
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows = []
    for name in args.evals.split(","):
        for kind, ck in ckpts.items():
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "difftx", "eval", name, "--checkpoint", str(ck),
                                "--out", str(out / kind), "--no-plot", "--quiet", "--force"], env=env, capture_output=True,
                               text=True)
            wall = time.perf_counter() - t0
            own = json.loads((out / kind / f"{name}.json").read_text())["seconds"] if r.returncode == 0 else None
            rows.append({"eval": name, "model": kind, "rc": r.returncode, "wall_s": round(wall, 2),
                         "eval_s": own, "error": r.stderr.strip()[-300:] if r.returncode else None})
            print(f"{name:10} {kind:8} wall {wall:6.1f} s  eval {own if own is not None else float('nan'):6.1f} s"
                  + (f"  FAILED: {rows[-1]['error']}" if r.returncode else ""), flush=True)
    load = os.getloadavg()
    doc = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "preset": args.preset,
           "torch_threads_env": os.environ.get("OMP_NUM_THREADS"), "loadavg_at_end": load, "rows": rows}
    (out / "runtimes.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"load average at the end: {load[0]:.2f}; wrote {out / 'runtimes.json'}")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
