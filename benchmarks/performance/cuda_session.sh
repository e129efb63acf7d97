#!/usr/bin/env bash
# One GPU session's checks and measurements, in order of value, each step under its own time limit so that
# one failure or stall leaves the rest: the CUDA tests, `difftx bench` at the issue's shapes (small preset,
# 4 x 512) and at GPU-sized ones (16 x 2048), a profile of the training step (cuda_ops.py), and the DIFF
# attention formulations (pinned SDPA kernels, compiled flex).
#
#   benchmarks/performance/cuda_session.sh OUT_DIR [STEPS]
#
# STEPS: a comma list of tests,triton,host,ops,bench,bench-large,variants,variants-flex,host-bench,host-share (the
# default; triton: tests/nn/test_triton_diff.py, the Triton kernels of DIFF attention on the GPU), and, not in the
# default: triton-ops (benchmarks/performance/triton_diff.py: the kernels' block shapes, dQ from its own pass or by
# atomics from the K/V pass, against 2call and the twin),
# bench-pair (transformer and diff, DIFF on the kernels, on them with DIFFTX_TRITON_DQ=atomic, named with
# --diff-attention triton (decoding on them too), then with DIFFTX_TRITON=0), bench-pair-large (the same at
# 16 x 2048),
# bench-compile: transformer and diff at 4 x 512, training and prefill, torch.compile'd
# against eager in the same call (eager first), bench-compile-large the same at 16 x 2048; host-share-compile:
# the host's bf16 training share on 2 pinned cores, eager then compiled.
# host: the native CPU kernels' tests on the GPU machine's own processor (its vector widths, AVX-512 and AMX
# where it has them, are ones a session's CPU may lack); host-bench: the kernels timed there (bf16, 1 thread);
# host-share: bf16 training's share of the matmul peak on the host CPU, 2 pinned cores then 1.  Needs torch with CUDA;
# imports difftx from this checkout's src/ (nothing installed).  Logs and results go to OUT_DIR.
set -uo pipefail
out=${1:?usage: cuda_session.sh OUT_DIR [STEPS]}
steps=${2:-tests,triton,host,ops,bench,bench-large,variants,variants-flex,host-bench,host-share}
cd "$(dirname "$0")/../.."
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
want() { [[ ",$steps," == *",$1,"* ]]; }
step() {  # step NAME SECONDS CMD...: run, log to OUT/NAME.log, report rc and time
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s (limit $limit)"
    tail -n "${TAIL:-25}" "$out/$name.log"
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    $py -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
    $py -c "import transformers; print('transformers', transformers.__version__)"
    lscpu | grep -E '^(Model name|CPU\(s\))'; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
} >"$out/env.log" 2>&1
cat "$out/env.log"
want tests && TAIL=40 step tests 240 $py -m pytest tests/test_cuda.py -q -p no:cacheprovider -o addopts="" \
    --timeout 90 -rfE
want host && TAIL=15 DIFFTX_CACHE_DIR=/tmp/difftx-host-cache step host 120 $py -m pytest tests/nn/test_native.py \
    tests/nn/test_second_derivatives.py tests/nn/test_reduced_precision.py -q -p no:cacheprovider -o addopts="" \
    --timeout 100 -rfE
want triton && TAIL=30 step triton 200 $py -m pytest tests/nn/test_triton_diff.py -q -p no:cacheprovider -o addopts="" \
    --timeout 150 -rfE
want triton-ops && TAIL=40 step triton-ops 300 $py benchmarks/performance/triton_diff.py \
    --masks plain,docs,window,decode --configs "default;64,32,8,3" --dq pass,atomic --out "$out/triton-ops.json"
if want bench-pair; then  # DIFF on the Triton kernels (auto) and on two SDPA calls, the Transformer in both runs
    pair="--device cuda --arms transformer,diff --no-peers --repeats 5"
    step bench-pair-triton 120 $py -m difftx bench $pair --out "$out/bench-pair-triton"
    DIFFTX_TRITON_DQ=atomic step bench-pair-triton-atomic 120 $py -m difftx bench $pair \
        --out "$out/bench-pair-triton-atomic"
    step bench-pair-triton-named 120 $py -m difftx bench $pair --diff-attention triton \
        --out "$out/bench-pair-triton-named"  # decoding on the kernels too
    DIFFTX_TRITON=0 step bench-pair-2call 120 $py -m difftx bench $pair --out "$out/bench-pair-2call"
fi
if want bench-pair-large; then  # the same at 16 x 2048, where the GPU is busy rather than waiting on launches
    pair="--device cuda --arms transformer,diff --no-peers --repeats 3 --batch-size 16 --seq-len 2048 --decode-tokens 32"
    step bench-pair-triton-16x2048 150 $py -m difftx bench $pair --out "$out/bench-pair-triton-16x2048"
    DIFFTX_TRITON_DQ=atomic step bench-pair-triton-atomic-16x2048 150 $py -m difftx bench $pair \
        --out "$out/bench-pair-triton-atomic-16x2048"
    DIFFTX_TRITON=0 step bench-pair-2call-16x2048 150 $py -m difftx bench $pair --out "$out/bench-pair-2call-16x2048"
fi
want ops && step ops 60 $py benchmarks/performance/cuda_ops.py --out "$out/cuda-ops.json"
want bench && step bench 80 $py -m difftx bench --device cuda --out "$out/bench-small" --repeats 5
if want bench-compile; then  # the same two arms and options, eager then compiled (the warmup compiles, untimed)
    pair="--device cuda --arms transformer,diff --no-peers --phases train,prefill --repeats 5"
    step bench-eager-pair 90 $py -m difftx bench $pair --out "$out/bench-eager-pair"
    step bench-compile 420 $py -m difftx bench $pair --compile --out "$out/bench-compile"
fi
if want bench-compile-large; then  # the same at 16 x 2048, where the GPU is busy rather than waiting on launches
    pair="--device cuda --arms transformer,diff --no-peers --phases train,prefill --repeats 3 --batch-size 16"
    pair="$pair --seq-len 2048"
    step bench-eager-pair-16x2048 90 $py -m difftx bench $pair --out "$out/bench-eager-pair-16x2048"
    step bench-compile-16x2048 240 $py -m difftx bench $pair --compile --out "$out/bench-compile-16x2048"
fi
want bench-large && step bench-large 80 $py -m difftx bench --device cuda --out "$out/bench-16x2048" --repeats 3 \
    --batch-size 16 --seq-len 2048 --decode-tokens 32
want variants && step variants 80 $py benchmarks/performance/attention_variants.py --device cuda --preset small \
    --batch 8 --seq-len 2048 --repeats 5 --inner 5 --out "$out/variants-8x2048.json"
want variants-flex && step variants-flex 130 $py benchmarks/performance/attention_variants.py --device cuda \
    --preset small --batch 8 --seq-len 2048 --repeats 5 --inner 5 --dtypes bf16 --flex --rows flex,2call \
    --out "$out/variants-flex-8x2048.json"
want host-bench && DIFFTX_CACHE_DIR=/tmp/difftx-host-cache step host-bench 90 $py benchmarks/performance/native_kernels.py \
    --threads 1 --dtypes bf16,fp32 --repeats 7
share() {  # share NAME CORES THREADS: the bf16 training step against the peak measured in the same run
    DIFFTX_CACHE_DIR=/tmp/difftx-host-cache step "$1" 150 taskset -c "$2" $py -m difftx bench --device cpu \
        --threads "$3" --dtypes bf16 --arms transformer,diff --no-peers --phases train --no-memory --repeats 5 \
        --out "$out/$1"
}
want host-share && share cpu-share-2t 0,1 2
if want host-share-compile; then
    share cpu-share-eager-2t 0,1 2
    DIFFTX_CACHE_DIR=/tmp/difftx-host-cache step cpu-share-compiled-2t 240 taskset -c 0,1 $py -m difftx bench \
        --device cpu --threads 2 --dtypes bf16 --arms transformer,diff --no-peers --phases train --no-memory \
        --repeats 5 --compile --out "$out/cpu-share-compiled-2t"
fi
want host-share && share cpu-share-1t 2 1
for f in "$out"/bench-*/bench.md "$out"/cpu-share-*/bench.md; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
exit 0
