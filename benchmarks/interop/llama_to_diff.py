"""How much of a trained Llama survives each Llama -> DIFF initialisation at step 0 (and after a short fine-tune).

One command; prints a table and writes JSON:

    PYTHONPATH=src python benchmarks/interop/llama_to_diff.py --out benchmarks/interop/results/llama_to_diff.json

Trains a small Llama-shaped softmax model (pre-norm RMSNorm, SwiGLU, RoPE, GQA)
on a byte-level corpus, writes it as a transformers Llama directory, converts
it with ``difftx convert --diff-init MODE`` (the library call), and measures on
held-out text: the loss, KL(source || converted) per token, the largest logit
difference and top-1 agreement, then (``--finetune-steps``) the loss after
continued training of every arm with the same data and optimiser.  A DIFF model
with freshly initialised attention (everything else copied) is the reference
for "nothing of attention kept".
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import difftx
from difftx.interop.convert import convert, read_any, save_hf
from difftx.interop.llama_to_diff import DIFF_INIT_MODES, diff_config_for


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        idx = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[i:i + seq + 1] for i in idx.tolist()])
        yield x[:, :-1], x[:, 1:]


def train(model, data, steps, lr, batch, seq, seed, label=""):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    model.train()
    it = batches(data, batch, seq, gen)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / max(1, steps)))
        x, y = next(it)
        loss = model(x, targets=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 50 == 0:
            print(f"  {label} step {step + 1}/{steps} loss {loss.item():.3f}", file=sys.stderr, flush=True)
    model.eval()
    return model


@torch.no_grad()
def measure(model, source_logits, x, y):
    logits = model(x).logits.float()
    lp, lq = source_logits.log_softmax(-1), logits.log_softmax(-1)
    return dict(
        loss=float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))),
        kl=float((lp.exp() * (lp - lq)).sum(-1).mean()),
        max_logit_diff=float((logits - source_logits).abs().max()),
        top1_agree=float((logits.argmax(-1) == source_logits.argmax(-1)).float().mean()),
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="/work/shared/data/tinyshakespeare.txt", help="text corpus (bytes are tokens)")
    ap.add_argument("--steps", type=int, default=600, help="training steps of the source Llama")
    ap.add_argument("--finetune-steps", type=int, default=150, help="continued-training steps per arm (0: skip)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length")
    ap.add_argument("--batch", type=int, default=16, help="batch size")
    ap.add_argument("--seed", type=int, default=0, help="seed")
    ap.add_argument("--out", help="write the results JSON here")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

    raw = torch.tensor(list(Path(args.data).read_bytes()), dtype=torch.long)
    cut = int(0.9 * len(raw))
    train_data, val_data = raw[:cut], raw[cut:]
    cfg = difftx.ModelConfig(attention="softmax", d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                             vocab_size=256, max_seq_len=args.seq, norms="S1", norm_eps=1e-6)
    t0 = time.time()
    source = train(difftx.build_model(cfg), train_data, args.steps, 3e-3, args.batch, args.seq, args.seed, "source")
    train_s = time.time() - t0
    gen = torch.Generator().manual_seed(args.seed + 1)
    x, y = next(batches(val_data, 32, args.seq, gen))
    with torch.no_grad():
        source_logits = source(x).logits.float()

    rows = {"source (Llama)": dict(measure(source, source_logits, x, y), params=source.num_parameters())}
    arms = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(source, Path(tmp) / "llama", "hf-llama")
        for mode in DIFF_INIT_MODES:
            convert(Path(tmp) / "llama", Path(tmp) / mode, diff_init=mode)
            arms[mode] = difftx.load_model(Path(tmp) / mode)
        cfg_l, sd_l, _ = read_any(Path(tmp) / "llama")
    fresh_cfg = diff_config_for(cfg_l, "twin")
    fresh = difftx.build_model(fresh_cfg).eval()
    fresh.load_state_dict({k: v for k, v in sd_l.items() if ".attn." not in k}, strict=False)
    arms["fresh attention (reference)"] = fresh
    for name, model in arms.items():
        rows[name] = dict(measure(model, source_logits, x, y), params=model.num_parameters())

    if args.finetune_steps:
        for name, model in [("source (Llama)", source)] + list(arms.items()):
            tuned = train(model, train_data, args.finetune_steps, 1e-3, args.batch, args.seq, args.seed + 2, name)
            rows[name]["loss_after_finetune"] = measure(tuned, source_logits, x, y)["loss"]

    head = f"{'arm':30s} {'params':>8s} {'val loss':>9s} {'KL nats/tok':>12s} {'max|dlogit|':>12s} {'top1 agree':>10s}"
    if args.finetune_steps:
        head += f" {'loss after ' + str(args.finetune_steps):>16s}"
    print(head)
    for name, r in rows.items():
        line = (f"{name:30s} {r['params']:8d} {r['loss']:9.4f} {r['kl']:12.3g} {r['max_logit_diff']:12.3g} "
                f"{r['top1_agree']:10.3f}")
        if "loss_after_finetune" in r:
            line += f" {r['loss_after_finetune']:16.4f}"
        print(line)
    result = dict(
        command="PYTHONPATH=src python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        source_config=cfg.to_dict(), steps=args.steps, finetune_steps=args.finetune_steps, seq=args.seq,
        batch=args.batch, seed=args.seed, train_seconds=round(train_s, 1), rows=rows,
        machine=dict(platform=platform.platform(), torch=torch.__version__, threads=torch.get_num_threads()),
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
