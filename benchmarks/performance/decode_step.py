"""Milliseconds per cached decoding step of difftx's models, for A/B runs of two checkouts.

Greedy decoding of ``--new`` tokens after a ``--context``-token prompt, ``--batch`` sequences, rewound and
repeated ``--rounds`` times; the best round's time per step (the least disturbed by a noisy machine).  With
``--timer cpu`` (process CPU time; one thread only) a VM's stolen time does not count.  At small batch and
context the step is mostly Python and dispatch (``nano``: 4 layers of 128), at the bench's shapes mostly the
weights and the cache read from memory.

    python benchmarks/performance/decode_step.py --arm diff --preset nano --batch 1 --context 8 --threads 1 --timer cpu

To compare two checkouts, run it alternately with each one's ``src`` on PYTHONPATH
(``results/amd-avx2/decode-overhead/README.md`` has the loop).
"""

from __future__ import annotations

import argparse
import time

import torch

from difftx import ModelConfig
from difftx.benchmarking.speed import ARMS
from difftx.models import build_model


def greedy_steps(model, cache, first, context: int, new: int, clock) -> float:
    """Seconds (by ``clock``) of ``new`` greedy steps after the cache is rewound to its ``context``-token prompt,
    whose logits are ``first``."""
    cache.length = context  # rewind: the prompt's keys and values stay
    cache.next_position.fill_(context)
    logits = first
    t = clock()
    for _ in range(new):
        logits = model(logits[:, -1:].argmax(-1), cache=cache).logits
    return clock() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arm", default="diff", choices=sorted(ARMS))
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=480)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--timer", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: under autocast, as the bench")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.timer == "cpu" else time.perf_counter
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset(args.preset, **ARMS[args.arm])
    model = build_model(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.context))
    best = float("inf")
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    with torch.no_grad(), amp:
        cache = model.new_cache(args.batch, args.context + args.new)
        first = model(prompt, cache=cache).logits
        for rnd in range(args.rounds + 1):  # round 0 warms up
            seconds = greedy_steps(model, cache, first, args.context, args.new, clock)
            if rnd:
                best = min(best, seconds / args.new)
    print(f"{args.arm} {args.preset} {args.dtype} batch {args.batch} context {args.context} threads {args.threads} "
          f"{args.timer}: {best * 1e3:.2f} ms/step, {args.batch / best:.0f} tokens/s")


if __name__ == "__main__":
    main()
