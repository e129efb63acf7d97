"""``difftx bench``: training, prefill and decode speed and memory of matched models, side by side."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import ConfigError
from ..runtime import keeps_threads

RESULT_FILES = ("bench.json", "bench.md")
LONG_CONTEXT_FILES = ("long_context.json", "long_context.md")


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
    p.add_argument("--preset", help="language-model preset the arms are twins of (default: small)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: 512)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default: 4)")
    p.add_argument("--repeats", type=int, help="interleaved timed repeats per arm (default: 5)")
    p.add_argument("--warmup", type=int, help="untimed runs per arm before timing (default: 1)")
    p.add_argument("--dtypes", default="auto",
                   help=f"comma list of auto, {', '.join(DTYPES)} (bf16 = autocast; default auto: fp32, and bf16 "
                        "where the CPU/GPU has bf16 matmul hardware)")
    p.add_argument("--arms", help=f"comma list of {', '.join(ARMS)} (default: all)")
    p.add_argument("--phases", help=f"comma list of {', '.join(PHASES)} (default: all)")
    p.add_argument("--no-peers", action="store_true", help="leave out transformers' Llama and DiffLlama")
    p.add_argument("--decode-tokens", type=int, help="tokens generated per decode run (the decode phase; default: 32)")
    p.add_argument("--timer", choices=["wall", "cpu"],
                   help="wall-clock (default), or process CPU time (steadier ratios on a shared machine; "
                        "--device cpu only)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("--no-memory", action="store_true", help="skip the train phase's peak-memory measurement")
    adam = p.add_mutually_exclusive_group()
    adam.add_argument("--fused-adamw", dest="fused_adamw", action="store_const", const=True, default=None,
                      help="torch's fused AdamW kernel for every arm (the default where torch has it, the CPU included)")
    adam.add_argument("--foreach-adamw", dest="fused_adamw", action="store_const", const=False,
                      help="torch's foreach AdamW for every arm instead of the fused kernel")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every arm's forward (peers' too) for training and prefill, in the untimed "
                        "warmup; decoding stays eager")
    p.add_argument("--diff-attention", default=None, metavar="VARIANT",
                   help="the diff and diff-dnt arms' attention formulation: auto (default: the measured winner per "
                        "device and dtype), fused, 2call, 4call, triton, sdpa (= 2call)")
    p.add_argument("--long-context", action="store_true",
                   help="instead: DIFF attention time and peak memory at --lengths tokens (fused vs 4call vs eager; "
                        "reads --preset, --batch-size (default 1), --dtypes (one), --device, --threads)")
    p.add_argument("--lengths", default=None,
                   help="sequence lengths for --long-context (default: 1024,...,16384; 64,256 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke run (preset nano, 32 tokens, 1 repeat; options given explicitly still apply) "
                        "for tests; numbers mean nothing")
    p.add_argument("--force", action="store_true",
                   help="overwrite the results of an earlier run in --out (default: refuse)")
    p.set_defaults(func=run)


# options of the speed benchmark that --long-context does not read: (dest, flag)
SPEED_ONLY = (("seq_len", "--seq-len"), ("repeats", "--repeats"), ("warmup", "--warmup"), ("arms", "--arms"),
              ("phases", "--phases"), ("no_peers", "--no-peers"), ("decode_tokens", "--decode-tokens"),
              ("timer", "--timer"), ("no_memory", "--no-memory"), ("fused_adamw", "--fused-adamw/--foreach-adamw"),
              ("compile", "--compile"), ("diff_attention", "--diff-attention"))


def _check_mode(args) -> None:
    """An option the chosen mode never reads is refused (given explicitly; the defaults are None or False)."""
    if not args.long_context:
        if args.lengths is not None:
            raise ConfigError("--lengths", "sets the lengths of --long-context only; add --long-context, or give "
                                           "the speed benchmark's length with --seq-len")
        phases = _csv(args.phases) if args.phases is not None else None
        adamw = None if args.fused_adamw is None else "--fused-adamw" if args.fused_adamw else "--foreach-adamw"
        if args.compile and phases is not None and not {"train", "prefill"} & set(phases):
            raise ConfigError("--compile", f"compiles the train and prefill phases (decoding stays eager), and "
                                           f"--phases {args.phases} leaves both out; drop --compile or add a phase")
        for flag, given, phase in (("--decode-tokens", args.decode_tokens is not None, "decode"),
                                   ("--no-memory", args.no_memory, "train"), (adamw, adamw is not None, "train")):
            if given and phases is not None and phase not in phases:  # --phases train --decode-tokens 64 ran
                raise ConfigError(flag, f"is read by the {phase} phase, and --phases {args.phases} leaves it out; "
                                        f"drop it (or add {phase} to --phases)")
        return
    switches = ("no_peers", "no_memory", "compile")  # store_true: False when not given (--foreach-adamw stores False)
    given = [flag for dest, flag in SPEED_ONLY if (getattr(args, dest) if dest in switches
                                                   else getattr(args, dest) is not None)]
    if given:
        raise ConfigError(given[0], "is an option of the speed benchmark, which --long-context does not run (it "
                                    "times one attention layer at --lengths); drop it or drop --long-context")
    if len(_csv(args.dtypes)) > 1:
        raise ConfigError("--dtypes", f"--long-context measures one dtype; got {args.dtypes!r}: give one of them")


def run(args) -> int:
    from ..benchmarking import ARMS, PHASES, QUICK, BenchConfig, markdown, run_bench, write_results
    from ..io import make_out_dir, refuse_old_results

    _check_mode(args)
    # --quick's tiny settings, then every option given explicitly on top (validated like any other value)
    sizes = dict(QUICK) if args.quick else {}
    for k in ("preset", "seq_len", "batch_size", "repeats", "warmup", "decode_tokens", "threads"):
        if getattr(args, k) is not None:
            sizes[k] = getattr(args, k)
    bc = BenchConfig(dtypes=_csv(args.dtypes), arms=_csv(args.arms) if args.arms is not None else list(ARMS),
                     peers=not args.no_peers, phases=_csv(args.phases) if args.phases is not None else list(PHASES),
                     timer=args.timer or "wall", device=args.device, memory=not args.no_memory,
                     fused_adamw=args.fused_adamw, compile=args.compile,
                     diff_attention=args.diff_attention or "auto", **sizes)
    default_lengths = "64,256" if args.quick else "1024,2048,4096,8192,16384"
    lengths = _lengths(default_lengths if args.lengths is None else args.lengths) if args.long_context else []
    bc.validate()  # every bad value is one line before anything runs or is written
    if not args.long_context:
        _check_no_peers(args, bc)
        bc.check_seq_len()
        bc.check_memory()
    else:
        from ..benchmarking.long_context import check_memory

        check_memory(lengths, bc.preset, args.batch_size or 1, _long_context_dtype(bc), bc.device)
    out = Path(args.out)
    refuse_old_results(out, LONG_CONTEXT_FILES if args.long_context else RESULT_FILES, args.force)
    make_out_dir(out)
    command = "difftx " + " ".join(sys.argv[sys.argv.index("bench"):] if "bench" in sys.argv else ["bench"])
    if args.long_context:
        return _long_context(args, bc, lengths, out, command)
    results = run_bench(bc, log=lambda s: print(s, file=sys.stderr))
    results["command"] = command
    js, md = write_results(results, out)
    print(markdown(results))
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0


def _check_no_peers(args, bc) -> None:
    """--no-peers with a preset that gets no peers (not LLaMA-shaped: GELU MLP, learned positions) leaves out nothing:
    refused, not ignored."""
    from ..benchmarking.speed import peers_match
    from ..config import ModelConfig

    if args.no_peers and not peers_match(ModelConfig.from_preset(bc.preset)):
        raise ConfigError("--no-peers", f"leaves out transformers' Llama and DiffLlama, and preset {bc.preset} gets "
                                        "none (they are LLaMA-shaped: SwiGLU, RoPE, pre-norm RMSNorm, no biases); "
                                        "drop it")


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in _csv(text)]
    except ValueError:
        raise ConfigError("lengths", f"expects comma-separated integers, got {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise ConfigError("lengths", f"expects positive integers, got {text!r}")
    return lengths


def _long_context_dtype(bc) -> str:
    import torch

    from ..benchmarking import resolve_dtypes

    return resolve_dtypes(bc.dtypes, torch.device(bc.device))[-1]  # auto: bf16 where native, else fp32


@keeps_threads
def _long_context(args, bc, lengths: list, out: Path, command: str) -> int:
    import json

    import torch

    from ..benchmarking.long_context import attention_scaling, markdown
    from ..io import atomic_write_files

    torch.set_num_threads(bc.threads or torch.get_num_threads())
    dtype = _long_context_dtype(bc)
    from ..runtime import SLOW_BF16, native_bf16_matmul

    if dtype == "bf16" and not native_bf16_matmul(torch.device(bc.device)):  # as the speed bench warns
        print(f"difftx bench: warning: {SLOW_BF16}", file=sys.stderr)
    batch = {"batch": args.batch_size} if args.batch_size is not None else {}  # default: one sequence
    result = attention_scaling(lengths, preset=bc.preset, dtype=dtype, device=bc.device,
                               log=lambda s: print(s, file=sys.stderr), **batch)
    result["command"] = command
    text = markdown(result, command)
    atomic_write_files({out / "long_context.json": (json.dumps(result, indent=2) + "\n").encode("utf-8"),
                        out / "long_context.md": text.encode("utf-8")})  # both or neither
    print(text)
    return 0
