S=/work/main/benchmarks/performance/results/amd-zen4/session-ab/step_time.py
for r in 1 2 3; do for side in new old; do
  src=/work/main/src; [ $side = old ] && src=/tmp/old2/src
  for cfg in "transformer fp32" "diff bf16"; do
    t=$(PYTHONPATH=$src OMP_NUM_THREADS=1 python3 $S $cfg 2>/dev/null | tail -1)
    echo "$r $side $cfg $t" >> /tmp/ab2/step.txt
  done
done; done
echo done >> /tmp/ab2/step.txt
