"""CPU inference of one arm with its attention as CPU flash (``sdpa``) or difftx's fused path, side by side.

    python benchmarks/performance/inference_variants.py --arm transformer --dtype bf16 --threads 2

Prefill (a no-grad forward of batch x seq_len tokens) and cached decoding (``--new`` greedy steps after a
``--context``-token prompt), the two variants interleaved round by round (A B A B ...); prints each variant's
median tokens/s and the median and range of the per-round ratio fused / sdpa.  One thread times process CPU
time (a VM's stolen time does not count), more threads wall time.  This is the measurement behind
``difftx.nn.backends._cpu_fused_wins``'s choice for inference (docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from difftx import ModelConfig
from difftx.benchmarking.speed import ARMS
from difftx.models import build_model
from decode_step import greedy_steps  # this folder's decoding loop (the script's folder is on sys.path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arm", default="transformer", choices=sorted(ARMS))
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--context", type=int, default=480)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset(args.preset, **ARMS[args.arm])
    model = build_model(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len))
    prompt = x[:, :args.context]
    rates: dict = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
        cache = model.new_cache(args.batch, args.context + args.new)
        first = model(prompt, cache=cache).logits
        for rnd in range(args.rounds + 1):  # round 0 warms up
            for variant in ("sdpa", "fused"):
                model.set_attention_backend("auto", diff_variant=variant)
                t = clock()
                model(x)
                prefill = clock() - t
                decode = greedy_steps(model, cache, first, args.context, args.new, clock)
                if rnd:
                    rates.setdefault(("prefill", variant), []).append(x.numel() / prefill)
                    rates.setdefault(("decode", variant), []).append(args.batch * args.new / decode)
    print(f"{args.arm} {args.preset} {args.dtype}, {args.threads} thread(s), {args.rounds} interleaved rounds, "
          f"{'cpu' if args.threads == 1 else 'wall'} time")
    print("| phase | sdpa tok/s | fused tok/s | fused / sdpa (median) | range |")
    print("|---|---:|---:|---:|---|")
    for phase in ("prefill", "decode"):
        a, b = rates[(phase, "sdpa")], rates[(phase, "fused")]
        r = [f / s for f, s in zip(b, a)]
        print(f"| {phase} | {statistics.median(a):.0f} | {statistics.median(b):.0f} | {statistics.median(r):.3f} | "
              f"{min(r):.3f}-{max(r):.3f} |")


if __name__ == "__main__":
    main()
