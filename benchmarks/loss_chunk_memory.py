"""Training memory and speed of the chunked loss (``--loss-chunk``) against the full logits, side by side.

    python benchmarks/loss_chunk_memory.py [--preset small] [--vocabs 256,32768,131072] [--chunks 0,1024]
                                           [--batch-size 4] [--seq-len 512] [--repeats 4]

For each vocabulary: the preset's DIFF model with that vocabulary, one AdamW training step in fp32 as the
trainer runs it; peak memory (difftx.benchmarking.memory.measured_training_memory: fp32 weights and
optimizer state + the step's high-water mark of live tensor bytes) and the median seconds per step over
``--repeats`` interleaved repeats, in alternating order (one thread, wall clock), with the loss of the
first step (the same batch for every arm).  Prints a markdown table and writes
``benchmarks/results/loss_chunk_memory.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from difftx.accounting import training_memory_floor
from difftx.benchmarking.memory import measured_training_memory
from difftx.config import ModelConfig
from difftx.models import build_model
from difftx.optim import build_optimizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--vocabs", default="256,32768,131072")
    ap.add_argument("--chunks", default="0,1024")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    vocabs = [int(v) for v in args.vocabs.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    b, n = args.batch_size, args.seq_len
    rows = []
    for vocab in vocabs:
        cfg = ModelConfig.from_preset(args.preset, attention="diff", vocab_size=vocab)
        torch.manual_seed(0)
        model = build_model(cfg)
        opt = build_optimizer(model, "adamw", lr=1e-4, weight_decay=0.1)
        x, y = torch.randint(0, vocab, (b, n)), torch.randint(0, vocab, (b, n))
        first, times = {}, {c: [] for c in chunks}

        def step(c):
            loss = model(x, targets=y, loss_reduction="mean", loss_chunk=c).loss
            loss.backward()
            opt.zero_grad(set_to_none=True)  # no update: every arm sees the same weights
            return float(loss.detach())

        for c in chunks:
            first[c] = step(c)  # warm-up
        for r in range(args.repeats):  # interleaved, the order reversed every other repeat (A B, B A, ...)
            for c in (chunks if r % 2 == 0 else chunks[::-1]):
                t = time.perf_counter()
                step(c)
                times[c].append(time.perf_counter() - t)
        for c in chunks:
            mem = measured_training_memory(cfg, b, n, "adamw", loss_chunk=c)
            floor = training_memory_floor(cfg, b, n, "adamw", loss_chunk=c)
            rows.append((vocab, c, mem["total"], floor["total"], statistics.median(times[c]), first[c]))
    lines = [f"# Chunked loss: training memory and speed ({args.preset} preset, DIFF, batch {b} x {n}, fp32, AdamW)",
             "", f"Command: `python benchmarks/loss_chunk_memory.py --preset {args.preset} --vocabs {args.vocabs} "
             f"--chunks {args.chunks} --batch-size {b} --seq-len {n} --repeats {args.repeats}` "
             f"(torch {torch.__version__}, 1 thread, {time.strftime('%Y-%m-%d', time.gmtime())}).  Memory: fp32 "
             "weights + AdamW state + the step's peak of live tensor bytes; floor: the memory check's lower bound; "
             "s/step: forward + backward, median of interleaved repeats (order alternating), wall clock.", "",
             "| vocab | --loss-chunk | memory MiB | x full | floor MiB | s/step | x full | loss (step 1) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {v: (m, t) for v, c, m, _, t, _ in rows if c == chunks[0]}
    for vocab, c, mem, floor, t, loss in rows:
        m0, t0 = base[vocab]
        lines.append(f"| {vocab:,} | {c or 'off'} | {mem / 2 ** 20:,.0f} | {mem / m0:.2f} | {floor / 2 ** 20:,.0f} | "
                     f"{t:.2f} | {t / t0:.2f} | {loss:.6f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "loss_chunk_memory.md").write_text(text)


if __name__ == "__main__":
    main()
