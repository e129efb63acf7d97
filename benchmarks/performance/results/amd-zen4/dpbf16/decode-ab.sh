for r in 1 2 3; do for side in old new; do
  src=/work/main/src; [ $side = old ] && src=/tmp/old/src
  out=/tmp/ab/decode-$side-$r; rm -rf $out
  PYTHONPATH=$src python3 -m difftx bench --out $out --arms transformer,diff --dtypes fp32,bf16 --phases prefill,decode --no-peers --repeats 3 > /dev/null 2>&1
  echo "$r $side $(grep '^| transformer\|^| diff ' $out/bench.md | awk -F'|' '{printf "%s p%s d%s; ", $2, $6, $8}')" >> /tmp/ab/decode.txt
done; done
