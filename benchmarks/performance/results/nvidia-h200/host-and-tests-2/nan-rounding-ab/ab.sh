#!/usr/bin/env bash
# A/B of the native kernels before (dc7d726^) and after the NaN-keeping bf16 rounding, alternating.
# Run from the repository root: bash benchmarks/performance/results/nvidia-h200/host-and-tests-2/nan-rounding-ab/ab.sh OUT 3
# (CORE: the core to pin to, default 3).  The old tree is src/ with the kernel file of dc7d726^.
out=${1:?}; rounds=${2:-3}; mkdir -p "$out"
[ -d abtmp/old_src ] || { mkdir -p abtmp && cp -r src abtmp/old_src &&
    git show dc7d726^:src/difftx/nn/cpu_kernels.c > abtmp/old_src/difftx/nn/cpu_kernels.c; } || exit 1
for i in $(seq "$rounds"); do
  for v in old new; do
    if [ $v = old ]; then pp=abtmp/old_src; else pp=src; fi
    PYTHONPATH=$pp DIFFTX_CACHE_DIR=/tmp/difftx-ab-$v timeout 100 taskset -c "${CORE:-3}" python3 \
      benchmarks/performance/native_kernels.py --threads 1 --dtypes bf16 --repeats 5 > "$out/$v-$i.md" 2>&1
    echo "== $v $i"; grep -E "Native|SwiGLU|RMSNorm|RoPE" "$out/$v-$i.md" | cut -c1-150
  done
done
