# This session's code (/work/main) against its start commit (472707f, worktree /tmp/old3), alternated, 1 thread.
S=/work/main/benchmarks/performance
for r in 1 2 3; do for side in old new; do
  src=/work/main/src; [ $side = old ] && src=/tmp/old3/src
  export PYTHONPATH=$src OMP_NUM_THREADS=1
  for arm in transformer diff; do
    d=$(python3 $S/decode_step.py --arm $arm --preset nano --batch 1 --context 8 --threads 1 --timer cpu 2>/dev/null | tail -1)
    echo "$r $side decode $arm: $d"
  done
  sh=$(cd /tmp/ab3 && python3 $S/results/amd-zen4/shard-build/shard_time.py /work/shared/data/tinyshakespeare.txt 2>/dev/null | tail -1)
  echo "$r $side shards tinyshakespeare: $sh"
  sh=$(cd /tmp/ab3 && python3 $S/results/amd-zen4/shard-build/shard_time.py /tmp/ab3/oneline.txt 2>/dev/null | tail -1)
  echo "$r $side shards one-line 8.9 MB: $sh"
  im=$(python3 $S/results/amd-zen4/session44-ab/image_time.py /tmp/ab3/images.npz 2>/dev/null | tail -1)
  echo "$r $side $im"
done; done
