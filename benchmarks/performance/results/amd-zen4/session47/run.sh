#!/usr/bin/env bash
# Where the bf16 / fp32 training ratio stops on this CPU (session 47, README.md): the step's operators in each dtype,
# the bf16 Linear kernels shape by shape, and the fused attention alone in each dtype.  Writes OUT/*.txt.
#   bash benchmarks/performance/results/amd-zen4/session47/run.sh OUT
set -u
out=${1:?usage: run.sh OUT}; here=$(dirname "$0"); mkdir -p "$out"
for dt in fp32 bf16; do
    python3 benchmarks/performance/cpu_step_profile.py --arms transformer,diff --dtype $dt --steps 3 --top 16 2>&1 \
        | grep -v USDT >"$out/step-profile-$dt.txt"
done
for t in 1 2; do python3 "$here/dot_shapes.py" $t >"$out/dot-shapes-${t}t.txt" 2>&1; done
for t in 1 2; do for dt in fp32 bf16; do for mode in fwd fb; do
    python3 "$here/attention_loop.py" $dt $t $mode 4
done; done; done >"$out/attention.txt" 2>&1
