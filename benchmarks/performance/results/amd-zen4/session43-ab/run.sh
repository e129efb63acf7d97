S=/work/main/benchmarks/performance
for r in 1 2 3; do for side in old new; do
  src=/work/main/src; [ $side = old ] && src=/tmp/old2/src
  export PYTHONPATH=$src OMP_NUM_THREADS=1
  for arm in transformer diff; do
    d=$(python3 $S/decode_step.py --arm $arm --preset nano --batch 1 --context 8 --threads 1 --timer cpu 2>/dev/null | tail -1)
    echo "$r $side decode $arm: $d" >> /tmp/ab2/out.txt
  done
  sh=$(cd /tmp/ab2 && python3 $S/results/amd-zen4/shard-build/shard_time.py /work/shared/data/tinyshakespeare.txt 2>/dev/null | tail -3 | tr '\n' ' ')
  echo "$r $side shards: $sh" >> /tmp/ab2/out.txt
  st=$(python3 $S/results/amd-zen4/session-ab/step_time.py transformer fp32 2>/dev/null | tail -1)
  echo "$r $side step transformer fp32 1thread: $st" >> /tmp/ab2/out.txt
done; done
echo done >> /tmp/ab2/out.txt
