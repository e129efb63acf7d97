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
# the long-context run reads --preset, --batch-size, --dtypes, --device, --threads (and --force); it refuses the
# speed options (--timer, --repeats, ...), which go to the first run only
lc=()
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
        --preset | --batch-size | --dtypes | --device | --threads)
            lc+=("${args[i]}" "${args[i + 1]:-}")
            i=$((i + 1)) ;;
        --preset=* | --batch-size=* | --dtypes=* | --device=* | --threads=* | --force) lc+=("${args[i]}") ;;
    esac
done
python -m difftx bench --out "$OUT" "$@"
# bf16 where the CPU has bf16 hardware, else fp32
python -m difftx bench --long-context --out "$OUT" ${lc[@]+"${lc[@]}"}
python "$HERE/attention_variants.py" --out "$OUT/attention_variants.json" | tee "$OUT/attention_variants.md"
python "$HERE/native_kernels.py" --threads 1 | tee "$OUT/native_kernels.md"
echo "results in $OUT"
