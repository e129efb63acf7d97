# This session's code (/work/main) against its start commit (330eb5a, worktree /tmp/old46), alternated, 1 thread.
#   git worktree add -f /tmp/old46 330eb5a; python make_images.py /tmp/ab46/images; bash run.sh > data-decode-ab.txt
S=/work/main/benchmarks/performance
D=$S/results/amd-zen4/session46/data-ab
for r in 1 2 3; do for side in old new; do
  src=/work/main/src; [ $side = old ] && src=/tmp/old46/src
  export PYTHONPATH=$src OMP_NUM_THREADS=1
  echo "$r $side data: $(python3 $D/data_time.py /work/shared/data/tinyshakespeare.txt /tmp/ab46/images 2>/dev/null | tail -1)"
  for dt in fp32 bf16; do
    d=$(python3 $S/decode_step.py --arm diff2 --dtype $dt --threads 1 --timer cpu 2>/dev/null | tail -1)
    echo "$r $side decode diff2 $dt: $d"
  done
done; done
