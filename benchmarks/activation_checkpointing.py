"""Training memory and speed of activation checkpointing (``--activation-checkpointing N``), side by side.

    python benchmarks/activation_checkpointing.py [--preset small] [--attentions softmax,diff]
        [--shapes 4x512,1x2048] [--dtypes fp32,bf16] [--every 0,2,1] [--repeats 3] [--threads 2]

For each attention kind, shape (batch x sequence) and dtype: the preset's model, one AdamW training step as the
trainer runs it (bf16: autocast, the attention backend the trainer picks), with every Nth block recomputed in
backward (0: none).  Peak memory (difftx.benchmarking.memory.measured_training_memory: fp32 weights and optimizer
state + the step's high-water mark of live tensor bytes, also shown alone) against the memory check's floor; the
median seconds per step over ``--repeats`` interleaved repeats in alternating order (wall clock); and whether the
loss and every gradient are the same bits as with N = 0.  Prints a markdown table and writes
``OUT/activation_checkpointing.md``.
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
from difftx.train.trainer import training_attention_backend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--attentions", default="softmax,diff")
    ap.add_argument("--shapes", default="4x512,1x2048")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--every", default="0,2,1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    everies = [int(e) for e in args.every.split(",")]
    rows = []
    for attention in args.attentions.split(","):
        for shape in args.shapes.split(","):
            b, n = (int(v) for v in shape.split("x"))
            for dtype in args.dtypes.split(","):
                bf16 = dtype == "bf16"
                cfg = ModelConfig.from_preset(args.preset, attention=attention, max_seq_len=max(n, 1))
                torch.manual_seed(0)
                model = build_model(cfg)
                backend = training_attention_backend(cfg, torch.device("cpu"), torch.bfloat16 if bf16 else None, n)
                if backend is not None:
                    model.set_attention_backend(backend)
                opt = build_optimizer(model, "adamw", lr=1e-4, weight_decay=0.1)
                x, y = torch.randint(0, cfg.vocab_size, (b, n)), torch.randint(0, cfg.vocab_size, (b, n))

                def step(every):
                    model.set_activation_checkpointing(every)
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        loss = model(x, targets=y, loss_reduction="mean").loss
                    loss.backward()
                    grads = [p.grad for p in model.parameters()]
                    opt.zero_grad(set_to_none=True)  # no update: every arm sees the same weights
                    return loss.detach(), grads

                first = {e: step(e) for e in everies}  # warm-up, and the bits each arm computes
                times = {e: [] for e in everies}
                for r in range(args.repeats):  # interleaved, the order reversed every other repeat
                    for e in (everies if r % 2 == 0 else everies[::-1]):
                        t = time.perf_counter()
                        step(e)
                        times[e].append(time.perf_counter() - t)
                ref_loss, ref_grads = first[everies[0]]
                for e in everies:
                    loss, grads = first[e]
                    same = torch.equal(loss, ref_loss) and all(torch.equal(g, h) for g, h in zip(grads, ref_grads))
                    mem = measured_training_memory(cfg, b, n, "adamw", bf16, activation_checkpointing=e)
                    floor = training_memory_floor(cfg, b, n, "adamw", bf16=bf16, activation_checkpointing=e)
                    rows.append((attention, shape, dtype, e, mem["total"], floor["total"],
                                 statistics.median(times[e]), same, mem["step"]))
    lines = [f"# Activation checkpointing: training memory and speed ({args.preset} preset, AdamW)", "",
             f"Command: `python benchmarks/activation_checkpointing.py --preset {args.preset} --attentions "
             f"{args.attentions} --shapes {args.shapes} --dtypes {args.dtypes} --every {args.every} --repeats "
             f"{args.repeats} --threads {args.threads}` (torch {torch.__version__}, {args.threads} threads, "
             f"{time.strftime('%Y-%m-%d', time.gmtime())}).  Memory: fp32 weights + AdamW state + the step's peak "
             "of live tensor bytes; floor: the memory check's lower bound; s/step: forward + backward, median of "
             "interleaved repeats (order alternating), wall clock; same bits: the loss and every gradient equal "
             "those of N = 0.", "",
             "| attention | batch x seq | dtype | --activation-checkpointing | memory MiB | x off | of which the "
             "step MiB | x off | floor MiB | s/step | x off | same bits |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    base = {r[:3]: (r[4], r[6], r[8]) for r in rows if r[3] == everies[0]}
    for attention, shape, dtype, e, mem, floor, t, same, step in rows:
        m0, t0, s0 = base[(attention, shape, dtype)]
        lines.append(f"| {attention} | {shape} | {dtype} | {e or 'off'} | {mem / 2 ** 20:,.0f} | {mem / m0:.2f} | "
                     f"{step / 2 ** 20:,.0f} | {step / s0:.2f} | {floor / 2 ** 20:,.0f} | {t:.2f} | {t / t0:.2f} | "
                     f"{'yes' if same else 'NO'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "activation_checkpointing.md").write_text(text)


if __name__ == "__main__":
    main()
