#!/usr/bin/env bash
# Every committed benchmark, one command:  benchmarks/performance/run_all.sh [OUT_DIR] [extra difftx bench flags]
# e.g. on a quiet 2-core machine:   benchmarks/performance/run_all.sh benchmarks/performance/results/quiet-2core
#      (an OUT that already holds bench results is refused: pass --force to overwrite them)
#      on a shared machine:         benchmarks/performance/run_all.sh benchmarks/performance/results/dev --timer cpu --threads 1
set -euo pipefail
OUT=${1:-benchmarks/performance/results/$(hostname)-$(date +%Y%m%d)}
shift || true
HERE=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH="$HERE/../../src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
python -m difftx bench --out "$OUT" "$@"
python -m difftx bench --long-context --out "$OUT" "$@"   # bf16 where the CPU has bf16 hardware, else fp32
python "$HERE/attention_variants.py" --out "$OUT/attention_variants.json" | tee "$OUT/attention_variants.md"
python "$HERE/native_kernels.py" --threads 1 | tee "$OUT/native_kernels.md"
echo "results in $OUT"
