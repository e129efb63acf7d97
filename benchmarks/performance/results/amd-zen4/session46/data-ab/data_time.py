"""Seconds for the data paths this session touched, one process per checkout (best of 3 each):
a BPE vocabulary trained and written to a fresh cache (build_tokenizer), read back from it, a fresh token shard
(prepare_tokens: bpe and byte), and an image folder read (load_image_folder).

    python data_time.py CORPUS IMAGE_DIR
"""
import sys, tempfile, time
from pathlib import Path
from difftx.data.corpus import resolve_corpus
from difftx.data.images import load_image_folder
from difftx.data.shards import prepare_tokens
from difftx.data.tokenizers import build_tokenizer

data, images = sys.argv[1], Path(sys.argv[2])
corpus = resolve_corpus(data)
text = open(data).read()


def best(fn):
    times = []
    for _ in range(3):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def bpe_fresh():
    with tempfile.TemporaryDirectory() as d:
        return build_tokenizer("bpe", lambda: (text,), cache_dir=Path(d)).vocab_size


with tempfile.TemporaryDirectory() as d:
    tok = build_tokenizer("bpe", lambda: (text,), cache_dir=Path(d))
    cached, _ = best(lambda: build_tokenizer("bpe", lambda: (text,), cache_dir=Path(d)))
fresh, _ = best(bpe_fresh)


def shard(spec):
    t = tok if spec == "bpe" else build_tokenizer("byte")
    with tempfile.TemporaryDirectory() as d:
        return len(prepare_tokens(corpus, t, Path(d), progress=False).tokens)


bpe_s, n_bpe = best(lambda: shard("bpe"))
byte_s, n_byte = best(lambda: shard("byte"))
img_s, ims = best(lambda: load_image_folder(images))
print(f"bpe train+cache {fresh:.2f}s, bpe cached {cached * 1e3:.1f}ms, shard bpe {bpe_s:.2f}s ({n_bpe} tokens), "
      f"shard byte {byte_s:.2f}s ({n_byte} tokens), image folder {img_s:.2f}s ({len(ims.labels)} images)")
