"""Token-shard building and generate(), timed with whichever difftx is on the path (run it under two trees).

    PYTHONPATH=OLD/src python time_paths.py     # then PYTHONPATH=NEW/src, alternating

Shards: the built-in corpus (stdlib sources) with the byte tokenizer and a 4096-token BPE (trained once,
outside the timing), each tokenized into a fresh cache (1 thread, CPU time; BPE segments encode in parallel
in Rust, so CPU time counts its threads).  generate(): nano DIFF, 4 x 32 prompt, 64 new tokens, top-p 0.9
sampling with the KV cache (1 thread, CPU time).  Prints one JSON line.
"""

import json
import tempfile
import time

import torch

import difftx
from difftx.data.corpus import resolve_corpus
from difftx.data.shards import prepare_tokens
from difftx.data.tokenizers import ByteTokenizer, train_bpe

torch.set_num_threads(1)
corpus = resolve_corpus(None)
texts = list(corpus.texts())
bpe = train_bpe(iter(texts[:200]), 4096)
out = {"version": difftx.__file__}
for name, tok in (("byte", ByteTokenizer()), ("bpe", bpe)):
    with tempfile.TemporaryDirectory() as d:
        t = time.process_time()
        data = prepare_tokens(corpus, tok, d, progress=False)
        out[f"shard_{name}_s"] = round(time.process_time() - t, 3)
        out[f"shard_{name}_tokens"] = int(len(data.tokens))
torch.manual_seed(0)
model = difftx.build_model(difftx.ModelConfig.from_preset("nano", attention="diff")).eval()
x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
model.generate(x, 8, top_p=0.9)
times = []
for _ in range(5):
    t = time.process_time()
    model.generate(x, 64, top_p=0.9, generator=torch.Generator().manual_seed(1))
    times.append(time.process_time() - t)
out["generate_tokens_per_s"] = round(4 * 64 / sorted(times)[2], 1)
print(json.dumps(out))
