"""``difftx bench``: training, prefill and decode speed and memory of matched models, side by side."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import ConfigError


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_parser(sub) -> None:
    from ..benchmarking import ARMS, DTYPES, PHASES

    p = sub.add_parser(
        "bench", help="benchmark training, prefill and decode speed side by side",
        description="Matched-parameter Transformer, DIFF, DIFF V2, DNT and DIFF-in-DNT (plus transformers' "
                    "Llama and DiffLlama when installed) in one process: tokens/s for a training step, "
                    "prefill and cached decoding, peak training memory, KV-cache bytes and achieved FLOP/s "
                    "against the matmul peak measured in the same run.  Repeats are interleaved; medians "
                    "and ratios go to DIR/bench.json and DIR/bench.md.")
    p.add_argument("--out", required=True, help="directory for bench.json and bench.md")
    p.add_argument("--preset", default="small", help="model preset the arms are twins of (default: small)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default: 512)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step (default: 4)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timed repeats per arm (default: 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per arm before timing (default: 1)")
    p.add_argument("--dtypes", default="auto",
                   help=f"comma list of auto, {', '.join(DTYPES)} (bf16 = autocast; default auto: fp32, and bf16 "
                        "where the CPU/GPU has bf16 matmul hardware)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
    p.add_argument("--no-peers", action="store_true", help="leave out transformers' Llama and DiffLlama")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per decode run (default: 32)")
    p.add_argument("--timer", choices=["wall", "cpu"], default="wall",
                   help="wall-clock, or process CPU time (steadier ratios on a shared machine)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    adam = p.add_mutually_exclusive_group()
    adam.add_argument("--fused-adamw", dest="fused_adamw", action="store_const", const=True, default=None,
                      help="torch's fused AdamW kernel for every arm (the default where torch has it, the CPU included)")
    adam.add_argument("--foreach-adamw", dest="fused_adamw", action="store_const", const=False,
                      help="torch's foreach AdamW for every arm instead of the fused kernel")
    p.add_argument("--long-context", action="store_true",
                   help="instead: DIFF attention time and peak memory at --lengths tokens (fused vs 4call vs eager)")
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384",
                   help="sequence lengths for --long-context (default: 1024,...,16384)")
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke run (preset nano, 32 tokens, 1 repeat) for tests; numbers mean nothing")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from ..benchmarking import QUICK, BenchConfig, markdown, run_bench, write_results

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device", f"{args.device!r} requested but CUDA is not available; use --device cpu")
    if args.threads is not None and args.threads < 1:
        raise ConfigError("threads", f"must be at least 1, got {args.threads}")
    bc = BenchConfig(preset=args.preset, seq_len=args.seq_len, batch_size=args.batch_size, repeats=args.repeats,
                     warmup=args.warmup, dtypes=_csv(args.dtypes), arms=_csv(args.arms), peers=not args.no_peers,
                     phases=_csv(args.phases), decode_tokens=args.decode_tokens, timer=args.timer,
                     threads=args.threads, device=args.device, memory=not args.no_memory,
                     fused_adamw=args.fused_adamw)
    if args.quick:
        for k, v in QUICK.items():
            setattr(bc, k, v)
    from ..presets import PRESETS

    if bc.preset not in PRESETS:
        raise ConfigError("preset", f"unknown preset {bc.preset!r}; see `difftx info --list`")
    command = "difftx " + " ".join(sys.argv[sys.argv.index("bench"):] if "bench" in sys.argv else ["bench"])
    if args.long_context:
        return _long_context(args, bc, command)
    results = run_bench(bc, log=lambda s: print(s, file=sys.stderr))
    results["command"] = command
    js, md = write_results(results, Path(args.out))
    print(markdown(results))
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0


def _long_context(args, bc, command: str) -> int:
    import json

    import torch

    from ..benchmarking.long_context import attention_scaling, markdown
    from ..io import atomic_write_text

    try:
        lengths = [int(x) for x in _csv(args.lengths)]
    except ValueError:
        raise ConfigError("lengths", f"expects comma-separated integers, got {args.lengths!r}") from None
    if not lengths or min(lengths) < 1:
        raise ConfigError("lengths", f"expects positive integers, got {args.lengths!r}")
    if args.quick:
        lengths = [64, 256]
    torch.set_num_threads(bc.threads or torch.get_num_threads())
    from ..benchmarking import resolve_dtypes

    dtype = resolve_dtypes(bc.dtypes, torch.device(bc.device))[-1]  # auto: bf16 where native, else fp32
    result = attention_scaling(lengths, preset=bc.preset, dtype=dtype, log=lambda s: print(s, file=sys.stderr))
    result["command"] = command
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "long_context.json", json.dumps(result, indent=2) + "\n")
    text = markdown(result, command)
    atomic_write_text(out / "long_context.md", text)
    print(text)
    return 0
