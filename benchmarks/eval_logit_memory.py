"""Peak memory of the long-context evaluations: all (B, N, V) logits at once against the LM head on slices.

    python benchmarks/eval_logit_memory.py [--lengths 2048,8192,16384] [--vocab 32768] [--out benchmarks/results]

A small DIFF model (d_model 128, 2 layers) with a large vocabulary, so that the logits, not the model,
decide the peak.  For each length: ``evaluate_lm`` on one window (the long-context NLL) and ``predictions``
(the greedy argmax NIAH's and MQAR's teacher-forced scoring use), with the LM head on the whole window
(the evaluations before slicing: ``LOGIT_BUDGET`` set above B x N x V) and on slices of at most
``difftx.evals.common.LOGIT_BUDGET`` logits.  Peak of live tensor bytes (difftx.benchmarking.memory);
wall seconds, one thread.  Prints a markdown table and writes ``eval_logit_memory.md``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import difftx.evals.common as common
from difftx.benchmarking.memory import peak_live_bytes
from difftx.config import ModelConfig
from difftx.evals.lm import evaluate_lm
from difftx.models import build_model


def measure(fn) -> tuple[float, float]:
    """(peak MiB, seconds) of ``fn()``; seconds from a second, unprofiled run."""
    peak, _ = peak_live_bytes(fn)
    t = time.perf_counter()
    fn()
    return peak / 2 ** 20, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8192,16384")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lengths = [int(x) for x in args.lengths.split(",")]
    cfg = ModelConfig(attention="diff", d_model=128, n_layers=2, n_heads=2, vocab_size=args.vocab,
                      max_seq_len=max(lengths))
    model = build_model(cfg).eval()
    budget = common.LOGIT_BUDGET
    rows = []
    for n in lengths:
        tokens = torch.randint(0, args.vocab, (n + 1,), generator=torch.Generator().manual_seed(0))
        ids = tokens[None, :n]
        for what, fn in (("lm (NLL)", lambda: evaluate_lm(model, tokens, seq_len=n, max_tokens=n, batch_size=1)),
                         ("predictions (argmax)", lambda: common.predictions(model, ids))):
            out = {}
            for arm, b in (("whole", 1 << 62), ("slices", budget)):
                common.LOGIT_BUDGET = b
                with torch.no_grad():
                    out[arm] = measure(fn)
            common.LOGIT_BUDGET = budget
            rows.append((n, what, out))
    logits_mib = {n: n * args.vocab * 4 / 2 ** 20 for n in lengths}
    lines = [f"# Evaluation peak memory: whole logits vs LM head on slices (vocab {args.vocab:,}, DIFF d_model 128, "
             f"2 layers, batch 1)", "",
             f"Command: `python benchmarks/eval_logit_memory.py --lengths {args.lengths} --vocab {args.vocab}` "
             f"(torch {torch.__version__}, 1 thread, {time.strftime('%Y-%m-%d', time.gmtime())}); slices of at "
             f"most {budget:,} logits ({budget * 4 / 2 ** 20:.0f} MiB in fp32).", "",
             "| tokens | evaluation | one window's logits MiB | peak MiB, whole | peak MiB, slices | ratio | "
             "s, whole | s, slices |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for n, what, out in rows:
        (pw, tw), (ps, ts) = out["whole"], out["slices"]
        lines.append(f"| {n:,} | {what} | {logits_mib[n]:,.0f} | {pw:,.0f} | {ps:,.0f} | {ps / pw:.2f} | "
                     f"{tw:.2f} | {ts:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "eval_logit_memory.md").write_text(text)


if __name__ == "__main__":
    main()
