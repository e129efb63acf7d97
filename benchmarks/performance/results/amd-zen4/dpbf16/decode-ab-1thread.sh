for r in 1 2 3; do for side in new old; do
  src=/work/main/src; [ $side = old ] && src=/tmp/old/src
  out=/tmp/ab/dec1-$side-$r; rm -rf $out
  PYTHONPATH=$src python3 -m difftx bench --out $out --arms transformer,diff --dtypes fp32,bf16 --phases decode --no-peers --repeats 3 --threads 1 --timer cpu > /dev/null 2>&1
  echo "$r $side $(grep '^| transformer\|^| diff ' $out/bench.md | awk -F'|' '{printf "%s d%s; ", $2, $4}')" >> /tmp/ab/decode1.txt
done; done
