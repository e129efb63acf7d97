"""``difftx compare``: parse flags into a :class:`~difftx.compare.StudyConfig`, run it, print where the report is.

Every flag defaults to "not given", so ``--resume`` can tell the fields asked
for from the stored study's (a resumed study keeps its measured settings).
With no arguments it runs the default study (docs/compare.md): six language
arms x 2 seeds on the built-in corpus and on MQAR, in about 6-7 minutes on a
quiet 2-core CPU.  Under ``torchrun`` every rank runs this same command.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from ..errors import ConfigError, option_flag

DEFAULT_OUT = "runs/compare"

# flag dest -> StudyConfig field (same name)
STUDY_FLAGS = ("domain", "preset", "seeds", "seed", "data", "tokenizer", "cache_dir", "tokens", "steps", "seq_len",
               "batch_size", "retrieval", "retrieval_tokens", "retrieval_steps", "retrieval_seq_len",
               "retrieval_batch_size", "schedule", "min_lr_ratio", "grad_clip", "eval_points", "eval_batches",
               "outlier_tokens", "tail_batches", "retrieval_samples", "dtype", "device", "workers", "threads",
               "activation_checkpointing", "document_masking")
# fields only a retrieval task reads, and fields only a language study reads (a vision run evaluates whole splits)
RETRIEVAL_FIELDS = ("retrieval_tokens", "retrieval_steps", "retrieval_seq_len", "retrieval_batch_size",
                    "retrieval_options", "retrieval_samples")
LM_FIELDS = ("tokenizer", "cache_dir", "seq_len", "eval_batches", "outlier_tokens", "document_masking")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "compare", help="the papers' claims measured at your scale (the main job)",
        description="Train matched-parameter arms (Transformer, DIFF, DNT, DIFF inside DNT; AdamW and mSGDW) on the "
                    "same data for the same token budget and several seeds, measure each (validation loss, "
                    "multi-needle retrieval, attention allocation, activation outliers, gradient tails, speed, "
                    "memory) and write report.md, results.json and PNGs into --out. With no arguments: the default "
                    "study, about 6-7 minutes on a quiet 2-core CPU. See docs/compare.md.")
    p.add_argument("--out", help=f"output directory (default: {DEFAULT_OUT}); a non-empty directory is refused "
                                 "unless --resume or --force")
    p.add_argument("--resume", action="store_true",
                   help="continue the study in --out: finished jobs are kept, interrupted ones continue")
    p.add_argument("--force", action="store_true",
                   help="delete the previous study in --out first (only a difftx compare directory)")
    s = p.add_argument_group("study")
    s.add_argument("--domain", choices=["lm", "vision"], help="lm (default) or vision (ViT vs V-DNT, needs the "
                                                              "vision domain)")
    s.add_argument("--arms", help="comma-separated MODEL:OPTIMIZER arms (default: transformer:adamw,diff:adamw,"
                                  "transformer:msgdw,dnt:adamw,dnt:msgdw,diff-dnt:adamw); --list-arms shows models")
    s.add_argument("--list-arms", action="store_true", help="list the models an arm can use and exit")
    s.add_argument("--seeds", type=int, help="seeds per arm (2); seeds are --seed, --seed+1, ...")
    s.add_argument("--seed", type=int, help="the first seed (0)")
    m = p.add_argument_group("model")
    m.add_argument("--preset", help="base preset, the Transformer form every arm is built from (default: nano at "
                                    "2 layers with Xavier init; a preset given here comes as it is; see "
                                    "`difftx info --list`)")
    m.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a ModelConfig field of the base (repeatable), e.g. --set n_layers=4")
    d = p.add_argument_group("data and budget")
    d.add_argument("--data", help="text corpus (file, directory, glob, .jsonl; default: the built-in corpus)")
    d.add_argument("--tokenizer", help="byte (default), char, bpe or a tokenizer.json path")
    d.add_argument("--document-masking", action="store_true", default=None,
                   help="corpus runs: attention stays within each document of a window (needs --tokenizer bpe or a "
                        "tokenizer.json with an end-of-text token)")
    d.add_argument("--cache-dir", help="token shards (default: $DIFFTX_CACHE, else $DIFFTX_CACHE_DIR, else "
                                       "$XDG_CACHE_HOME/difftx, else ~/.cache/difftx)")
    d.add_argument("--tokens", type=int, help="corpus tokens per run (the token budget; default 256000)")
    d.add_argument("--steps", type=int, help="corpus steps per run instead of --tokens (vision: the budget)")
    d.add_argument("--seq-len", type=int, help="corpus tokens per sequence (64)")
    d.add_argument("--batch-size", type=int, help="corpus sequences per step per process (16)")
    d.add_argument("--retrieval", choices=["mqar", "niah", "none"],
                   help="retrieval task trained from scratch per arm (mqar; niah: the DIFF paper's multi-needle task)")
    d.add_argument("--retrieval-tokens", type=int, help="retrieval tokens per run (default 400000)")
    d.add_argument("--retrieval-steps", type=int, help="retrieval steps per run instead of --retrieval-tokens")
    d.add_argument("--retrieval-seq-len", type=int, help="retrieval sequence length (64)")
    d.add_argument("--retrieval-batch-size", type=int, help="retrieval sequences per step per process")
    d.add_argument("--retrieval-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the retrieval task (repeatable), e.g. --retrieval-opt pairs=2-8")
    o = p.add_argument_group("optimisation")
    o.add_argument("--lr", action="append", default=[], metavar="KEY=LR",
                   help="learning rate per optimizer or per arm id (repeatable), e.g. --lr adamw=3e-3 "
                        "--lr dnt-msgdw=0.5 (default: the measured defaults in docs/compare.md)")
    o.add_argument("--lr-sweep", nargs="?", const="default", metavar="OPT=LR:LR:...",
                   help="pick each arm's lr by a sweep on the corpus (first seed); alone: the default grids "
                        "(adamw 1e-3:2e-3:4e-3:8e-3, msgdw 0.1:0.3:1:3), or e.g. adamw=1e-3:3e-3,msgdw=0.3:1")
    o.add_argument("--schedule", choices=["cosine", "linear", "constant"], help="lr schedule after warmup (cosine)")
    o.add_argument("--min-lr-ratio", type=float, help="final lr as a fraction of the peak (0.1)")
    o.add_argument("--grad-clip", type=float, help="global gradient-norm clip, 0 for none (1.0)")
    e = p.add_argument_group("measurements")
    e.add_argument("--eval-points", type=int, help="validation evaluations along each corpus run (8)")
    e.add_argument("--eval-batches", type=int, help="batches per validation evaluation (16)")
    e.add_argument("--outlier-tokens", type=int, help="validation tokens for the activation outliers (4096)")
    e.add_argument("--tail-batches", type=int, help="fresh batches for the gradient-tail statistics (8)")
    e.add_argument("--retrieval-samples", type=int, help="samples per retrieval cell (32)")
    r = p.add_argument_group("runtime")
    r.add_argument("--device", help="auto (default), cpu, cuda or cuda:N; under torchrun each rank's GPU")
    r.add_argument("--dtype", choices=["auto", "fp32", "bf16"], help="auto: bf16 autocast where the hardware has it")
    r.add_argument("--workers", type=int, help="parallel job processes on a CPU (default: one per core)")
    r.add_argument("--threads", type=int, help="torch threads per job process (default: cores / the jobs that run at "
                   "once)")
    r.add_argument("--activation-checkpointing", type=int, metavar="N",
                   help="every Nth block of each job recomputes its activations in backward: less memory, the same "
                        "results (timings aside), about 1.3x the training time at N=1 (0, the default: off)")
    r.add_argument("--no-progress", action="store_true", help="no progress display (the final lines only)")
    r.add_argument("--quiet", action="store_true", help="print nothing on success")
    p.set_defaults(func=run)


def _number(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(flag, f"expects a number, got {text!r}") from None


def parse_lr(items: list[str]) -> dict:
    out = {}
    for item in items:
        parts = [x.strip() for x in item.split(",") if x.strip()]
        if not parts:  # "" read as "no rates given" ran the defaults
            raise ConfigError("--lr", f"expects KEY=LR (an optimizer or an arm id), e.g. adamw=3e-3; got {item!r}")
        for part in parts:
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise ConfigError("--lr", f"expects KEY=LR (an optimizer or an arm id), e.g. adamw=3e-3; got {part!r}")
            out[key.strip()] = _number(value, "--lr")
    return out


def parse_sweep(text: str | None):
    if text is None:
        return None
    if text == "default":
        from ..compare.study import DEFAULT_SWEEP

        return {k: list(v) for k, v in DEFAULT_SWEEP.items()}
    out = {}
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts:  # "" read as "no grid given" ran no sweep; the flag alone gives the default grids
        raise ConfigError("--lr-sweep", f"expects OPT=LR:LR:..., e.g. adamw=1e-3:3e-3, or no value for the "
                                        f"default grids; got {text!r}")
    for part in parts:
        key, sep, grid = part.partition("=")
        if not sep or not grid or not key.strip():
            raise ConfigError("--lr-sweep", f"expects OPT=LR:LR:..., e.g. adamw=1e-3:3e-3; got {part!r}")
        out[key.strip()] = [_number(x, "--lr-sweep") for x in grid.split(":")]
    return out


def explicit_fields(args) -> dict:
    """The StudyConfig fields the command line gives (and only those)."""
    from .info import parse_overrides

    fields = {f: getattr(args, f) for f in STUDY_FLAGS if getattr(args, f, None) is not None}
    if args.arms is not None:
        fields["arms"] = [a for a in args.arms.split(",") if a.strip()]
    if args.set:
        fields["model"] = parse_overrides(args.set)
    if args.retrieval_opt:
        fields["retrieval_options"] = parse_overrides(args.retrieval_opt, "--retrieval-opt")
    if args.lr:
        fields["lr"] = parse_lr(args.lr)
    sweep = parse_sweep(args.lr_sweep)
    if sweep is not None:
        fields["lr_sweep"] = sweep
    return fields


def check_unread(fields: dict, study) -> None:
    """An option given explicitly that the study would not read is refused, not ignored."""
    for tokens, steps in (("tokens", "steps"), ("retrieval_tokens", "retrieval_steps")):
        if tokens in fields and steps in fields:
            raise ConfigError(f"{option_flag(tokens)}/{option_flag(steps)}",
                              "are two budgets for the same runs, and the steps would win; give one")
    if "min_lr_ratio" in fields and study.schedule == "constant":  # only a decay reads it (optim.lr_at)
        raise ConfigError("--min-lr-ratio", "sets the rate a cosine or linear schedule decays to, and this study's "
                                            "schedule is constant; drop it (or give --schedule cosine or linear)")
    if study.domain == "vision":
        for name in (n for n in LM_FIELDS if n in fields):
            why = ("a vision study evaluates its whole validation and test splits" if name == "eval_batches" else
                   "a language-study option, and a vision study reads images")
            raise ConfigError(option_flag(name), f"{why}; drop it")
    if study.retrieval == "none":
        why, fix = (("a vision study trains no retrieval task", "") if study.domain == "vision" else
                    ("--retrieval none trains none", " (or give --retrieval mqar or niah)"))
        for name in (n for n in RETRIEVAL_FIELDS if n in fields):
            raise ConfigError(option_flag(name), f"is an option of the retrieval task, and {why}; drop it{fix}")


def _list_arms() -> int:
    from ..compare.arms import DEFAULT_ARMS, MODELS

    for domain, models in MODELS.items():
        print(f"{domain} models (use as MODEL:OPTIMIZER; optimizers adamw, msgdw, sgd, muon):")
        for name, m in models.items():
            print(f"  {name:12s} {m.label}")
        print(f"  default arms: {','.join(DEFAULT_ARMS[domain])}")
    return 0


def run(args) -> int:
    if args.list_arms:
        return _list_arms()
    from ..compare import StudyConfig, run_study
    from ..compare.runner import StudyInterrupted, load_study, resume_config

    if args.resume and args.force:
        raise ConfigError("--resume/--force", "give one: --resume continues the study, --force deletes it")
    out = Path(args.out or DEFAULT_OUT)
    fields = explicit_fields(args)
    study = resume_config(out, fields) if args.resume else StudyConfig(**fields)
    check_unread(fields, study)
    if args.resume:  # the study's own command: the one that reproduces it
        command = (load_study(out) or {}).get("command") or "difftx compare"
    elif sys.argv[1:2] == ["compare"]:
        command = " ".join(["difftx compare", *(shlex.quote(a) for a in sys.argv[2:])])
    else:  # called as a function (tests, notebooks): the flags are not known verbatim
        command = "difftx compare" + (f" --out {shlex.quote(str(out))}" if args.out else "")
    if not args.quiet:
        import torch

        from ..nn import native
        from ..runtime import SLOW_BF16, native_bf16_matmul
        from ..train.distributed import pick_device

        if study.dtype == "bf16" and not native_bf16_matmul(pick_device(study.device)):
            print(f"difftx compare: warning: {SLOW_BF16}", file=sys.stderr)
        if study.device == "cpu" or (study.device == "auto" and not torch.cuda.is_available()):
            native.warn_problem("difftx compare", "cpu")  # builds the kernels its workers then load from the cache
    try:
        res = run_study(study, out, force=args.force, resume=args.resume, command=command,
                        progress=not (args.no_progress or args.quiet))
    except StudyInterrupted as e:
        print(f"difftx compare: {e}", file=sys.stderr)
        return 130
    if res is None or args.quiet:
        return 0
    q = res["questions"]
    print(f"difftx compare: {out / 'report.md'}  ({res['timing']['wall_s']:.0f} s)")
    for key, text in (("diff_vs_transformer", "DIFF beats the Transformer"),
                      ("dnt_msgdw_matches_adamw", "DNT lets mSGDW match AdamW")):
        if key in q:
            print(f"  {text}? {q[key]['answer']}")
    return 0

