"""Training speed with document masking (``--document-masking``), side by side with plain causal attention.

    python benchmarks/document_masking.py [--preset small] [--attentions softmax,diff] [--shape 4x512]
        [--dtypes fp32,bf16] [--doc-lengths 32,128,512] [--repeats 5] [--threads 2] [--memory]

For each attention kind, dtype and mean document length: the preset's model and one AdamW training step as the
trainer runs it (bf16: autocast, the trainer's attention backend), on windows of packed documents whose lengths
are drawn (geometric, a fixed seed) with that mean.  Three arms, run in alternating order over ``--repeats``
interleaved repeats (median seconds per step, wall clock):

* ``causal``: no document mask (documents see each other, as without the flag);
* ``documents``: the document mask as the trainer applies it (each document its own plain causal call on the
  CPU's fused kernels);
* ``masked blocks``: the same mask through the fused path's masked torch blocks, which ids that come back
  after another document (not one run per document) take.

With ``--memory``, also the peak training memory of the causal and documents arms
(difftx.benchmarking.memory.measured_training_memory: fp32 weights and AdamW state + the step's high-water mark
of live tensor bytes).  Prints a markdown table and writes ``OUT/document_masking.md``.
"""

from __future__ import annotations

import argparse
import functools
import math
from pathlib import Path

import torch

from difftx.benchmarking.memory import measured_training_memory
from difftx.benchmarking.steps import adamw_step, interleaved_medians, switched, trainer_model
from difftx.config import ModelConfig
from difftx.nn.mask import AttnMask


def packed_documents(b: int, n: int, mean: float, seed: int) -> torch.Tensor:
    """(b, n) document ids: runs of geometric lengths (at least 1 token) with mean ``mean``, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    q = 1.0 - 1.0 / mean  # P(length > k + 1 | length > k)
    rows = []
    for _ in range(b):
        ids, doc = [], 0
        while len(ids) < n:
            u = float(torch.rand((), generator=g))
            length = 1 if q <= 0 else 1 + int(math.log(1.0 - u) / math.log(q))
            ids += [doc] * length
            doc += 1
        rows.append(ids[:n])
    return torch.tensor(rows)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    except OSError:
        return "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--attentions", default="softmax,diff")
    ap.add_argument("--shape", default="4x512")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--doc-lengths", default="32,128,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--memory", action="store_true", help="also the peak training memory of each arm")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    b, n = (int(v) for v in args.shape.split("x"))
    rows = []
    for attention in args.attentions.split(","):
        for dtype in args.dtypes.split(","):
            bf16 = dtype == "bf16"
            cfg = ModelConfig.from_preset(args.preset, attention=attention, max_seq_len=n)
            model, opt = trainer_model(cfg, bf16, n)
            x, y = torch.randint(0, cfg.vocab_size, (b, n)), torch.randint(0, cfg.vocab_size, (b, n))
            step = functools.partial(adamw_step, model, opt, x, y, bf16)
            for mean in (int(v) for v in args.doc_lengths.split(",")):
                doc = packed_documents(b, n, mean, seed=mean)
                arms = {"causal": functools.partial(step, document_ids=None),
                        "documents": functools.partial(step, document_ids=doc),
                        "masked blocks": switched(functools.partial(step, document_ids=doc), AttnMask, "segments",
                                                  lambda self: None)}
                med = interleaved_medians(arms, args.repeats)
                docs = int((doc[:, 1:] != doc[:, :-1]).sum()) + b
                mem = {}
                if args.memory:
                    for k, d in (("causal", None), ("documents", doc)):
                        mem[k] = measured_training_memory(cfg, b, n, bf16=bf16, document_ids=d)["total"]
                rows.append((attention, dtype, mean, docs / b, med, mem))
                print(f"{attention} {dtype} mean {mean}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in med.items()),
                      flush=True)
    lines = [f"# Document masking: training step time ({args.preset}, {b} x {n} tokens, {args.threads} threads)", "",
             f"Machine: {_cpu_name()}, torch {torch.__version__}.", "",
             f"Command: `python benchmarks/document_masking.py --preset {args.preset} --attentions {args.attentions} "
             f"--shape {args.shape} --dtypes {args.dtypes} --doc-lengths {args.doc_lengths} --repeats "
             f"{args.repeats} --threads {args.threads}{' --memory' if args.memory else ''}`", "",
             "Median seconds per AdamW step (forward, backward, optimizer) over interleaved repeats; ratios to the "
             "causal arm (below 1: faster).", "",
             "| attention | dtype | mean doc length | docs per window | causal ms | documents ms | ratio | "
             "masked blocks ms | ratio |" + (" causal MiB | documents MiB | ratio |" if args.memory else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if args.memory else "")]
    for attention, dtype, mean, per, med, mem in rows:
        c = med["causal"]
        line = (f"| {attention} | {dtype} | {mean} | {per:.1f} | {c * 1e3:.0f} | {med['documents'] * 1e3:.0f} | "
                f"{med['documents'] / c:.2f} | {med['masked blocks'] * 1e3:.0f} | {med['masked blocks'] / c:.2f} |")
        if mem:
            line += (f" {mem['causal'] / 2 ** 20:.0f} | {mem['documents'] / 2 ** 20:.0f} | "
                     f"{mem['documents'] / mem['causal']:.2f} |")
        lines.append(line)
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "document_masking.md").write_text(text)


if __name__ == "__main__":
    main()
