"""Medians of forward + backward ms per length over the alternating rounds in ab_*.txt, base / new.

    python benchmarks/performance/results/amd-avx2/long-blocks/summarize.py
"""

import statistics
import sys
from collections import defaultdict
from pathlib import Path

here = Path(__file__).parent
for name in sys.argv[1:] or ("ab_cpu1.txt", "ab_wall2.txt"):
    arm, times = None, defaultdict(lambda: defaultdict(list))
    for line in (here / name).read_text().splitlines():
        if line.startswith("== "):
            arm = line.split()[1]
        elif line.startswith("| ") and line[2].isdigit():
            n, rows, fwd, _, bwd, _ = (c.strip() for c in line.strip("|").split("|"))
            times[int(n)][arm].append((float(fwd) + float(bwd), int(rows)))
    print(f"{name}: forward + backward ms, median of rounds (block rows)\n")
    print("| N | base | new | base / new |")
    print("|---:|---:|---:|---:|")
    for n, arms in sorted(times.items()):
        med = {a: statistics.median(t for t, _ in v) for a, v in arms.items()}
        rows = {a: v[0][1] for a, v in arms.items()}
        print(f"| {n} | {med['base']:.0f} ({rows['base']}) | {med['new']:.0f} ({rows['new']}) | "
              f"{med['base'] / med['new']:.2f} |")
    print()
