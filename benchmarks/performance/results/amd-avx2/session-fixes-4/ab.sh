#!/bin/bash
# A/B: start commit (old) vs HEAD (new), alternating, 1 thread, CPU timer
for r in 1 2; do
  for v in old new; do
    src=/tmp/ab_old/src; [ $v = new ] && src=/work/main/src
    PYTHONPATH=$src DIFFTX_CACHE_DIR=/tmp/ab/cache-$v python3 -m difftx bench --dtypes fp32 --arms transformer,diff --no-peers --no-memory --repeats 5 --threads 1 --timer cpu --out /tmp/ab/$v-$r > /tmp/ab/$v-$r.log 2>&1
    echo "$v-$r rc=$?"
  done
done
