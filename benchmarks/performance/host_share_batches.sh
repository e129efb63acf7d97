#!/usr/bin/env bash
# bf16 training's share of the matmul peak measured in the same run, on pinned host cores, at several batch
# sizes of the small preset (sequence 512): does the share grow with the tokens a step carries (the optimiser,
# the weights' casts and the interpreter's per-operator cost are per step; the GEMMs get taller)?  Then the same
# with libgomp's threads spinning instead of sleeping between parallel regions (OMP_WAIT_POLICY=ACTIVE), and a
# profile of one step per batch size on one core.  For a GPU machine's host CPU (cuda_session.sh's
# host-share step measures 4 x 512 only) or any Intel AMX machine.
#
#   benchmarks/performance/host_share_batches.sh OUT_DIR [BATCHES] [REPEATS]
#
# BATCHES: comma list (default 4,16).  TIMER=cpu times process CPU time (the peaks too; default wall), which
# leaves out the time the hypervisor gives a shared host's cores to other guests (each run logs the pinned
# cores' steal ticks from /proc/stat).  STEPS: a comma list of share,active,profile (default: all).  One core
# is $ONE_CORE (default 2), two are $TWO_CORES (default 0,1).
set -uo pipefail
out=${1:?usage: host_share_batches.sh OUT_DIR [BATCHES] [REPEATS]}
batches=${2:-4,16}
repeats=${3:-3}
cd "$(dirname "$0")/../.."
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DIFFTX_CACHE_DIR=${DIFFTX_CACHE_DIR:-/tmp/difftx-host-cache}
py=${PYTHON:-python3}
one=${ONE_CORE:-2} two=${TWO_CORES:-0,1} timer=${TIMER:-wall} steps=${STEPS:-share,active,profile}
want() { [[ ",$steps," == *",$1,"* ]]; }
steal() { awk -v c="$1" 'BEGIN { n = split(c, a, ","); for (i = 1; i <= n; i++) w["cpu" a[i]] = 1 }
    $1 in w { s += $9 } END { print s + 0 }' /proc/stat; }  # the cores' steal ticks (USER_HZ)
{ lscpu | grep -E '^(Model name|CPU\(s\))'; grep -o -w -E 'avx512f|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  $py -c "import torch; print('torch', torch.__version__)"; } >"$out/env.log" 2>&1
run() {  # run NAME LIMIT CMD...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "== $name: rc=$? in $((SECONDS - t0)) s"
    grep -E '^\| (transformer|diff) |^## |aten::mm |Matmul peak measured' "$out/$name.log"
}
bench() {  # bench NAME CORES THREADS BATCH
    local s0; s0=$(steal "$2")
    run "$1" 200 taskset -c "$2" $py -m difftx bench --device cpu --threads "$3" --dtypes bf16 --arms transformer,diff \
        --no-peers --phases train --no-memory --repeats "$repeats" --batch-size "$4" --timer "$timer" --out "$out/$1"
    echo "   steal on cores $2: $(( $(steal "$2") - s0 )) ticks"
}
IFS=, read -r -a bs <<<"$batches"
want share && for b in "${bs[@]}"; do bench "t1-b$b" "$one" 1 "$b"; bench "t2-b$b" "$two" 2 "$b"; done
want active && for b in "${bs[@]}"; do OMP_WAIT_POLICY=ACTIVE bench "t2-b$b-active" "$two" 2 "$b"; done
want profile && for b in "${bs[@]}"; do
    run "profile-t1-b$b" 120 taskset -c "$one" $py benchmarks/performance/cpu_step_profile.py --arms transformer \
        --threads 1 --steps 1 --batch-size "$b" --top 16
done
exit 0
