"""Seconds to tokenise tinyshakespeare into a fresh shard (bpe 1024 and byte), one process per checkout."""
import sys, tempfile, time
from pathlib import Path
from difftx.data.corpus import resolve_corpus
from difftx.data.shards import prepare_tokens
from difftx.data.tokenizers import build_tokenizer
data = sys.argv[1]
corpus = resolve_corpus(data)
out = {}
for spec in ("bpe", "byte"):
    with tempfile.TemporaryDirectory() as d:
        tok = build_tokenizer(spec, lambda: (open(data).read(),), cache_dir=Path(d)) if spec == "bpe" else build_tokenizer(spec)
        t = time.perf_counter(); td = prepare_tokens(corpus, tok, Path(d), progress=False); out[spec] = (time.perf_counter() - t, len(td.tokens))
print(" ".join(f"{k} {v[0]:.2f}s {v[1]} tokens" for k, v in out.items()))
