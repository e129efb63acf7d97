"""What difftx's transformers registration costs at import time.

One command; prints a table and writes JSON:

    PYTHONPATH=src python benchmarks/interop/import_time.py --repeats 5 --out benchmarks/interop/results/import_time.json

Each scenario runs in a fresh interpreter; scenarios are interleaved
(A B A B ...) and medians reported, so a noisy machine affects both arms alike.

* ``import difftx`` and, from ``-X importtime``, the part spent in difftx.interop
  (the resolver and the post-import hook: all that ``import difftx`` adds for interop).
* transformers' auto classes used after ``import difftx`` vs after ``import torch`` only:
  ``AutoConfig`` (registers DifftxConfig), ``AutoModelForCausalLM`` (registers
  DifftxForCausalLM, importing transformers' model base classes), and the time
  until transformers' model classes are loaded either way, which ``from_pretrained``
  needs: the registration moves that cost earlier, it does not add to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")

STAGES = """
import time, json
t = [time.perf_counter()]
{pre}
t.append(time.perf_counter())
from transformers import AutoConfig
t.append(time.perf_counter())
from transformers import AutoModelForCausalLM
t.append(time.perf_counter())
import transformers.modeling_utils, transformers.generation.utils
t.append(time.perf_counter())
print(json.dumps([b - a for a, b in zip(t, t[1:])]))
"""

IMPORT_DIFFTX = """
import time, json, sys
t0 = time.perf_counter(); import difftx; t1 = time.perf_counter()
print(json.dumps([t1 - t0, "transformers" in sys.modules]))
"""


def run(code: str, extra_args=()) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.run([sys.executable, *extra_args, "-c", code], capture_output=True, text=True, env=env,
                          check=True)


def interop_share() -> float:
    """Seconds of ``import difftx`` spent importing difftx.interop (cumulative, from -X importtime)."""
    err = run("import difftx", ("-X", "importtime")).stderr
    for line in err.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 3 and parts[2] == "difftx.interop":
            return int(parts[1]) / 1e6
    return float("nan")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="fresh interpreters per scenario (interleaved)")
    ap.add_argument("--out", help="write the results JSON here")
    args = ap.parse_args(argv)

    samples = {"import difftx": [], "difftx.interop share": [], "without difftx": [], "after import difftx": []}
    leaked = False
    for _ in range(args.repeats):
        secs, has_tf = json.loads(run(IMPORT_DIFFTX).stdout)
        samples["import difftx"].append(secs)
        leaked |= has_tf
        samples["difftx.interop share"].append(interop_share())
        # the baseline imports torch first, as import difftx does, so only the registration differs
        samples["without difftx"].append(json.loads(run(STAGES.format(pre="import torch")).stdout))
        samples["after import difftx"].append(json.loads(run(STAGES.format(pre="import difftx")).stdout))

    med = {k: statistics.median(v) for k, v in samples.items() if k in ("import difftx", "difftx.interop share")}
    stages = ("AutoConfig", "AutoModelForCausalLM", "model classes")
    for arm in ("without difftx", "after import difftx"):
        rows = samples[arm]
        for i, stage in enumerate(stages):
            med[f"{arm}: {stage}"] = statistics.median(r[i + 1] for r in rows)
        med[f"{arm}: total"] = statistics.median(sum(r[1:]) for r in rows)

    print(f"import difftx: {med['import difftx']:.3f} s (median of {args.repeats}); of which difftx.interop "
          f"{1000 * med['difftx.interop share']:.1f} ms; transformers imported: {leaked}")
    print(f"{'stage (seconds, median)':28s} {'after import torch':>18s} {'after import difftx':>20s}")
    for stage in stages + ("total",):
        print(f"{stage:28s} {med['without difftx: ' + stage]:18.3f} {med['after import difftx: ' + stage]:20.3f}")
    result = dict(command="PYTHONPATH=src python benchmarks/interop/import_time.py "
                          + " ".join(argv if argv is not None else sys.argv[1:]),
                  medians_s=med, transformers_imported_by_import_difftx=leaked, samples=samples)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
