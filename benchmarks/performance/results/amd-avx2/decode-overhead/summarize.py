"""Median ms per decoding step before and after, per shape, from ab.txt (decode_step.py lines prefixed by side)."""
import collections
import statistics
import sys
from pathlib import Path

runs = collections.defaultdict(lambda: {"before": [], "after": []})
for line in Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("ab.txt")).read_text().splitlines():
    side, rest = line.split(" ", 1)
    shape, value = rest.split(": ")
    runs[shape][side].append(float(value.split(" ms")[0]))
print("| shape | before ms/step | after ms/step | speedup of the medians | paired runs |")
print("|---|---:|---:|---:|---|")
for shape, v in runs.items():
    b, a = v["before"], v["after"]
    paired = sorted(x / y for x, y in zip(b, a))
    print(f"| {shape} | {statistics.median(b):.2f} | {statistics.median(a):.2f} | "
          f"{statistics.median(b) / statistics.median(a):.2f} | {paired[0]:.2f}-{paired[-1]:.2f} |")
