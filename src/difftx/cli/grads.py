"""``difftx grads``: gradient flow (DIFF vs Transformer) and heavy-tailed gradients (S1..S5, DIFF; AdamW, mSGDW).

Thin: parses, builds the models and the local data, calls
:mod:`difftx.analysis.flow` and :mod:`difftx.analysis.tail_study`, writes
``flow.json``, ``tails.json``, ``report.md`` and PNGs into ``--out``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from ..errors import ConfigError, DifftxError
from ..runtime import keeps_threads

DEFAULT_SETTINGS = "S1,S2,S3,S4,S5,diff"
RESULT_FILES = ("flow.json", "tails.json", "report.md")  # an earlier run's, kept unless --force
DEFAULT_LRS = {"adamw": 3e-3, "msgdw": 0.3}  # sgd takes msgdw's, muon adamw's (unless --lr-sgd / --lr-muon)
# what --settings accepts (difftx.analysis.common.SETTINGS_ACCEPTED, which imports torch: the CLI parses without it)
SETTINGS_ACCEPTED = ("a norm placement (S1..S5, dnt = S5, pre = S1, post: softmax attention), an attention kind "
                     "(diff, diff2, softmax: the base's norms), or KIND-PLACEMENT such as diff-S1..diff-S5, diff2-S5, "
                     "softmax-post")
TINY = dict(d_model=64, n_layers=2)  # the default model: preset "nano" shrunk to 2 x 64 (4 heads of 16)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "grads", help="gradient flow (DIFF vs Transformer) and heavy-tail analysis",
        description="Gradient flow of matched DIFF and Transformer models (DIFF paper, Appendix E) and the "
                    "distribution of gradient entries and gradient noise across norm settings and optimisers "
                    "(DNT Fig. 1, Simsekli et al. 2019).  By default a tiny model (preset nano at 2 x 64) on the "
                    "byte-tokenised Python standard library source, in well under a minute on a CPU.")
    p.add_argument("--out", required=True, help="output directory for flow.json, tails.json, report.md and PNGs")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="base preset (see `difftx info --list`); default: nano at 2 layers x 64")
    src.add_argument("--checkpoint", action="append", default=[], metavar="PATH",
                     help="analyse a saved model or run directory instead (repeatable; a DIFF and a softmax "
                          "checkpoint of one depth together give flow ratios, with a warning when they are not "
                          "matched-parameter)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a ModelConfig field of the base config (repeatable), e.g. --set n_layers=4")
    p.add_argument("--only", choices=["flow", "tails"], help="run only one of the two studies")
    p.add_argument("--steps", type=int, default=None, help="gradient-flow optimiser steps after initialisation (20)")
    p.add_argument("--flow-optimizer", default=None, help="optimiser of the gradient-flow runs (adamw)")
    p.add_argument("--unpaired", action="store_true",
                   help="initialise the DIFF and Transformer twins independently (default: shared tensors equal)")
    p.add_argument("--tail-steps", type=int, default=None,
                   help="training steps before the tail measurement (20; 0 for checkpoints: measure as saved)")
    p.add_argument("--settings", default=None,
                   help=f"norm settings / attention kinds for the tail study, comma-separated ({DEFAULT_SETTINGS}); "
                        "each is " + SETTINGS_ACCEPTED)
    p.add_argument("--optimizers", default=None,
                   help="optimisers for the tail study (adamw,msgdw; none are used with --tail-steps 0)")
    p.add_argument("--lr-adamw", type=float, help=f"AdamW learning rate ({DEFAULT_LRS['adamw']:g})")
    p.add_argument("--lr-msgdw", type=float, help=f"mSGDW learning rate ({DEFAULT_LRS['msgdw']:g})")
    p.add_argument("--lr-sgd", type=float, help="SGD learning rate (default: --lr-msgdw's)")
    p.add_argument("--lr-muon", type=float,
                   help="Muon learning rate (default: --lr-adamw's; its update is scaled to match AdamW's)")
    p.add_argument("--clip", type=float, default=None, help="gradient-norm clip, 0 for none (1.0, as DNT)")
    p.add_argument("--noise-batches", type=int, default=None, help="mini-batch gradients per noise estimate (12)")
    p.add_argument("--max-noise-entries", type=int, default=None,
                   help="coordinates sampled per matrix kind for the noise estimate (8192)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per batch (8)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (64)")
    p.add_argument("--data", help="a UTF-8 text file (default: the Python standard library source); fresh models read "
                                  "it as bytes, --checkpoint models with their saved tokenizer (tokenizer.json "
                                  "beside the model; bytes when there is none)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data seed (0)")
    p.add_argument("--seeds", type=int, default=None,
                   help="repeat the tail study over this many seeds (seed, seed+1, ...); tables show mean +- sd (1)")
    p.add_argument("--device", default="cpu", help="torch device (cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 for models under 5M parameters, whose small matmuls "
                        "only lose to threading overhead; else torch's default)")
    p.add_argument("--no-plots", action="store_true", help="write JSON and report.md only")
    p.add_argument("--force", action="store_true",
                   help="overwrite the results of an earlier run in --out (default: refuse)")
    p.set_defaults(func=run)


# the options only one study reads (dest: flag); each defaults to None ("not given") and takes DEFAULTS after _check
FLOW_ONLY = {"steps": "--steps", "flow_optimizer": "--flow-optimizer", "unpaired": "--unpaired"}
TAILS_ONLY = {"tail_steps": "--tail-steps", "settings": "--settings", "optimizers": "--optimizers",
              "noise_batches": "--noise-batches", "max_noise_entries": "--max-noise-entries", "seeds": "--seeds"}
DEFAULTS = dict(steps=20, flow_optimizer="adamw", settings=DEFAULT_SETTINGS, optimizers="adamw,msgdw", clip=1.0,
                noise_batches=12, max_noise_entries=8192, seeds=1)


def _given(args, dest: str) -> bool:
    return getattr(args, dest) not in (None, False)


def _check_unread(args) -> None:
    """An option given explicitly that no study of this run reads is refused, not ignored."""
    if args.only is not None:
        skipped, flags = ("tail study", TAILS_ONLY) if args.only == "flow" else ("gradient flow", FLOW_ONLY)
        for flag in (flag for dest, flag in flags.items() if _given(args, dest)):
            raise ConfigError(flag, f"is an option of the {skipped}, and --only {args.only} skips it; drop it (or "
                                    f"drop --only {args.only})")
    for dest, what in (("unpaired", "initialises fresh twins"), ("settings", "builds fresh models")):
        if args.checkpoint and _given(args, dest):
            raise ConfigError(FLOW_ONLY.get(dest) or TAILS_ONLY[dest], f"{what}; a --checkpoint is analysed as "
                                                                       "saved, so drop it")
    if args.steps == 0 and args.only != "tails":  # one gradient evaluation at step 0: the optimiser never acts
        if args.flow_optimizer is not None:
            raise ConfigError("--flow-optimizer", "steps the gradient-flow models, and --steps 0 measures them at "
                                                  "step 0 only; drop it (or give --steps N)")
        if args.clip is not None and (args.only == "flow" or _tail_steps(args) == 0):
            raise ConfigError("--clip", "clips the training steps, and --steps 0 takes none"
                                        + (" (nor does the tail study: --tail-steps 0)" if args.only is None else "")
                                        + "; drop it")
    if _tail_steps(args) == 0 and args.only != "flow":
        why = "a --checkpoint is measured as saved unless --tail-steps N" if args.tail_steps is None else \
            "--tail-steps 0 measures as saved"
        if args.optimizers is not None:
            raise ConfigError("--optimizers", f"trains the tail study's models, and {why}; drop it (or give "
                                              "--tail-steps N)")
        if args.clip is not None and args.only == "tails":
            raise ConfigError("--clip", f"clips the training steps, and {why}; drop it")


def _tail_steps(args) -> int:
    """The tail study's training steps: --tail-steps, else 20 for fresh models and 0 (as saved) for checkpoints."""
    return args.tail_steps if args.tail_steps is not None else 0 if args.checkpoint else 20


def _check(args) -> None:
    from ..optim import OPTIMIZERS

    _check_unread(args)
    tails_train = args.only != "flow" and _tail_steps(args) > 0  # the tail study trains with --optimizers
    for dest, value in DEFAULTS.items():  # what was not given takes its default (the help says which)
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    for flag, value, low in (("--steps", args.steps, 0), ("--batch-size", args.batch_size, 1), ("--seeds", args.seeds, 1),
                             ("--seq-len", args.seq_len, 2), ("--noise-batches", args.noise_batches, 2),
                             ("--max-noise-entries", args.max_noise_entries, 16)):
        if value < low:
            raise ConfigError(flag, f"must be >= {low}; got {value}")
    if args.tail_steps is not None and args.tail_steps < 0:
        raise ConfigError("--tail-steps", f"must be >= 0; got {args.tail_steps}")
    if args.seed < 0:  # numpy's seeds are non-negative: --seed -1 was its ValueError traceback after --out was made
        raise ConfigError("--seed", f"must be >= 0; got {args.seed}")
    for flag, names in (("--flow-optimizer", [args.flow_optimizer]), ("--optimizers", _split(args.optimizers))):
        for name in names:
            if name not in OPTIMIZERS:
                raise ConfigError(flag, f"unknown optimiser {name!r}; one of {', '.join(OPTIMIZERS)}")
        if not names:
            raise ConfigError(flag, f"give at least one of {', '.join(OPTIMIZERS)}")
    if not _split(args.settings):
        raise ConfigError("--settings", f"give at least one setting, e.g. {DEFAULT_SETTINGS}")
    for flag, names in (("--settings", _split(args.settings)), ("--optimizers", _split(args.optimizers))):
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # the same row run again reads as seeds agreeing exactly (mean +- 0): use --seeds for repeats
            raise ConfigError(flag, f"names {', '.join(twice)} more than once; give each once (--seeds N repeats "
                                    "the study over seeds)")
    from ..runtime import resolve_device

    args.device = str(resolve_device(args.device))
    if args.threads is not None and args.threads < 1:
        raise ConfigError("--threads", f"must be >= 1; got {args.threads}")
    flow_steps = args.only != "tails" and args.steps > 0  # --steps 0 measures step 0 only: no optimiser step
    used = ({args.flow_optimizer} if flow_steps else set()) | \
        (set(_split(args.optimizers)) if tails_train else set())
    used |= {base for name, base in (("sgd", "msgdw"), ("muon", "adamw"))  # their defaults are these rates
             if name in used and getattr(args, f"lr_{name}") is None}
    for name in OPTIMIZERS:
        flag, value = f"--lr-{name}", getattr(args, f"lr_{name}")
        if value is None:
            continue
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(flag, f"must be a positive finite learning rate; got {value}")
        if name not in used:
            tails = args.optimizers if tails_train or args.only == "flow" else "none (--tail-steps 0)"
            flow_opt = args.flow_optimizer if flow_steps or args.only == "tails" else "none (--steps 0)"
            raise ConfigError(flag, f"no study here uses {name} (gradient flow: {flow_opt}, tails: "
                                    f"{tails}{'; --only ' + args.only if args.only else ''}); drop it")
    if not (math.isfinite(args.clip) and args.clip >= 0):
        raise ConfigError("--clip", f"must be a finite norm >= 0 (0 for no clipping); got {args.clip}")


def lrs(args) -> dict:
    """Each optimiser's learning rate: the one given, else its default (sgd: mSGDW's, muon: AdamW's)."""
    out = {name: getattr(args, f"lr_{name}") or DEFAULT_LRS[name] for name in ("adamw", "msgdw")}
    return {**out, "sgd": args.lr_sgd or out["msgdw"], "muon": args.lr_muon or out["adamw"]}


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _base_config(args):
    from ..config import ModelConfig
    from .info import parse_overrides

    overrides = parse_overrides(args.set)
    try:
        if args.preset:
            cfg = ModelConfig.from_preset(args.preset, **overrides)
        else:
            cfg = ModelConfig.from_preset("nano", **{**TINY, **overrides})
    except TypeError as e:
        raise DifftxError(str(e)) from None
    if cfg.domain != "lm":
        if "domain" in overrides:  # no --preset given, or --set overrode its domain
            raise ConfigError("--set", f"domain={cfg.domain} makes a {cfg.domain} model; difftx grads studies "
                                       "language models: drop it")
        raise ConfigError("--preset", f"{args.preset!r} is a {cfg.domain} model; difftx grads studies language models")
    return cfg


def _check_distinct_settings(settings) -> None:
    """Two --settings names for one model (dnt and S5, pre and S1, diff and diff-S1 on an S1 base) ran it twice
    under two names, which reads as seeds agreeing exactly; refused, naming both."""
    seen = {}
    for name, cfg in settings:
        d = cfg.to_dict()
        d.pop("norms", None)  # a preset's name: its flags (resolved into d) are the model
        key = repr(sorted(d.items()))
        if key in seen:
            raise ConfigError("--settings", f"{seen[key]} and {name} are the same model here (same attention and "
                                            "norm placement), so it would run twice under two names; give one of "
                                            "them (--seeds N repeats the study over seeds)")
        seen[key] = name


def _check_seq_len(cfg, seq_len: int) -> None:
    if cfg.positions in ("learned", "sinusoidal") and seq_len > cfg.max_seq_len:
        raise ConfigError("--seq-len", f"{seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}")


def _load_checkpoints(paths: list[str], device: str):
    from .. import load_model
    from ..evals.common import saved_tokenizer

    loaded = []
    for i, path in enumerate(paths):
        model = load_model(path, device=device)
        if model.config.domain != "lm":
            raise ConfigError("--checkpoint", f"{path} is a {model.config.domain} model; grads studies language models")
        # the tokenizer saved beside the model (a model.safetensors path: its folder's), or byte ids when there is
        # none; a damaged one is one DataError naming it, not byte ids in its place
        tok = saved_tokenizer(path, "difftx grads", optional=True)
        name = Path(path).resolve().name or f"model{i}"
        if any(name == n for n, *_ in loaded):
            name = f"{name}-{i}"
        loaded.append((name, path, model, tok))
    return loaded


def _check_same_tokenizer(loaded) -> None:
    """Every model of a run sees the same token ids, the first checkpoint's tokenizer's: a checkpoint saved with
    another tokenizer (no tokenizer.json: byte ids) is refused."""
    from ..data.tokenizers import ByteTokenizer

    def fingerprint(tok):
        return (tok or ByteTokenizer()).fingerprint()

    (_, first, _, tok0), *rest = loaded
    for _, path, _, tok in rest:
        if fingerprint(tok) != fingerprint(tok0):
            kinds = [t.kind if t is not None else "byte ids, no tokenizer.json" for t in (tok0, tok)]
            raise ConfigError("--checkpoint", f"{first} and {path} were saved with different tokenizers ({kinds[0]}; "
                                              f"{kinds[1]}), and every model here reads the same token ids: study "
                                              "them in separate runs")


MATCHED_PARAMS = 0.01  # a twin pair differs by DIFF's lambda vectors and per-head gain only (well under 1%)


def _flow_pair(loaded):
    """(DIFF, softmax) entries of ``loaded`` when they are a gradient-flow pair (one DIFF V1 or V2 and one softmax
    checkpoint, as for a fresh base), else None."""
    kinds = sorted(m.config.attention for _, _, m, _ in loaded)
    if kinds not in (["diff", "softmax"], ["diff2", "softmax"]):
        return None
    (d,), (t,) = ([e for e in loaded if (e[2].config.attention == "softmax") == soft] for soft in (False, True))
    return d, t


def _check_flow_pair(loaded):
    """A DIFF / Transformer checkpoint pair of different depths is refused (its per-layer ratios would pair layer i
    of one with layer i of the other and drop the deeper model's extra layers; its all-layer ratios sum over
    different numbers of layers).  A pair of one depth that is not matched-parameter (different d_model, or
    parameter counts more than 1% apart) is measured, and the returned note says so; None for a matched pair."""
    pair = _flow_pair(loaded)
    if pair is None:
        return None
    (dname, dpath, dm, _), (tname, tpath, tm, _) = pair
    dc, tc = dm.config, tm.config
    if dc.n_layers != tc.n_layers:
        raise ConfigError("--checkpoint", f"{dpath} (DIFF) has {dc.n_layers} layers and {tpath} (Transformer) "
                                          f"{tc.n_layers}: the gradient-flow ratios are per layer and summed over "
                                          "layers, so they do not align across depths; compare checkpoints of one "
                                          "depth, or give --only tails")
    why = []
    if dc.d_model != tc.d_model:
        why.append(f"d_model {dc.d_model} and {tc.d_model}")
    pd, pt = dm.num_parameters(), tm.num_parameters()
    if abs(pd - pt) > MATCHED_PARAMS * max(pd, pt):
        why.append(f"{pd:,} and {pt:,} parameters")
    if not why:
        return None
    return (f"{dname} (DIFF) and {tname} (Transformer) are not a matched-parameter pair ({'; '.join(why)}): their "
            "gradient-flow ratios compare models of different size, not only attention kinds")


def _seeded(seed: int, model):
    """``model`` (a loaded checkpoint), with torch's RNG (dropout masks) seeded as
    :func:`difftx.analysis.common.build` seeds it for a fresh model of that seed."""
    import torch

    torch.manual_seed(seed)
    return model


def _set_threads(args, n_params: int) -> None:
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif n_params < 5_000_000 and not str(args.device).startswith("cuda"):
        torch.set_num_threads(1)


class _Study:
    """What both sections need: the models' source, the tokens, the output directory, the report."""

    def __init__(self, args):
        from ..analysis import common

        self.args = args
        self.out = Path(args.out)
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError("--out", f"{self.out} exists and is not a directory")
        from ..io import refuse_old_results

        refuse_old_results(self.out, RESULT_FILES, args.force)
        text = common.load_text(args.data)
        self.meta = {"batch_size": args.batch_size, "seq_len": args.seq_len, "seed": args.seed,
                     "data": args.data or "python stdlib source", "device": args.device}
        self.loaded, self.base, self.settings = [], None, []
        self.flow_mismatch = None  # why a checkpoint flow pair is not matched-parameter (None: matched, or no pair)
        if args.checkpoint:
            self.loaded = _load_checkpoints(args.checkpoint, args.device)
            if args.set:
                raise ConfigError("--set", "overrides the config of a fresh model; a --checkpoint is analysed as "
                                           "saved, so drop --set (or drop --checkpoint to study a new model)")
            tokenizer = self.loaded[0][3]  # a checkpoint's own tokenizer.json, if it has one
            _check_same_tokenizer(self.loaded)
            vocab = min(m.config.vocab_size for _, _, m, _ in self.loaded)
            for _, _, m, _ in self.loaded:
                _check_seq_len(m.config, args.seq_len)
            self.meta["checkpoints"] = {name: str(path) for name, path, _, _ in self.loaded}
            if args.only != "tails":
                self.flow_mismatch = _check_flow_pair(self.loaded)
            self.tail_steps = _tail_steps(args)
            _set_threads(args, max(m.num_parameters() for _, _, m, _ in self.loaded))
        else:
            from ..accounting import count_parameters

            self.base = _base_config(args)
            _check_seq_len(self.base, args.seq_len)
            self.settings = [(s, common.setting_config(self.base, s)) for s in _split(args.settings)]
            _check_distinct_settings(self.settings)
            tokenizer, vocab = None, self.base.vocab_size
            self.meta["base_config"] = self.base.to_dict()
            self.tail_steps = _tail_steps(args)
            _set_threads(args, count_parameters(self.base))
        self.tokens = common.tokenize(text, vocab, tokenizer)
        # what the ids are: bytes, or the checkpoints' own tokenizer (the meta said "byte tokens" either way)
        self.meta["tokenizer"] = tokenizer.kind if tokenizer is not None else "byte"
        if self.tokens.size < args.seq_len + 1:  # what Batches needs; checked here, before --out is made
            raise ConfigError("--seq-len", f"{args.seq_len} needs at least {args.seq_len + 1} tokens of data, and "
                                           f"the data has {self.tokens.size}; give a shorter --seq-len or more --data")
        configs = [m.config for _, _, m, _ in self.loaded] or \
            [self.base, self.base.twin("softmax" if self.base.attention != "softmax" else "diff")] + \
            [c for _, c in self.settings]
        _check_memory(args, configs)
        self.lrs = lrs(args)
        what = ", ".join(f"`{p}`" for _, p, _, _ in self.loaded) if self.loaded else "freshly initialised"
        self.report = ["# difftx grads", "",
                       f"Models: {what}.  Data: {self.meta['data']}, {self.meta['tokenizer']} tokens"
                       + (" (the checkpoints' tokenizer)" if tokenizer is not None else "")
                       + f"; batches of {args.batch_size} x {args.seq_len}, seed {args.seed}.", ""]
        self.written: list[str] = []
        self.plots = None
        if not args.no_plots:
            from ..analysis import plots

            if plots.have_matplotlib():
                self.plots = plots
            else:
                print("difftx grads: matplotlib is not installed (pip install 'difftx[plot]'); writing JSON only")

    def batches(self, seed: int):
        from ..analysis.common import Batches

        a = self.args
        return Batches(self.tokens, a.seq_len, a.batch_size, seed=seed, device=a.device)

    def write_json(self, name: str, obj: dict) -> None:
        from ..analysis.common import json_safe
        from ..io import atomic_write_text

        atomic_write_text(self.out / name, json.dumps(json_safe(obj), indent=1))
        if self.args.force and not self.written:  # this run's first result: the earlier run's report.md, whose tables
            (self.out / "report.md").unlink(missing_ok=True)  # it contradicts, goes (an interrupted run kept it)
        self.written.append(name)


def _flow_section(st: _Study) -> None:
    import torch

    from ..analysis import flow

    args, t0 = st.args, time.perf_counter()
    if st.loaded:
        torch.manual_seed(args.seed)  # fresh twins are built seeded; checkpoints' dropout masks follow --seed too
        pair = _flow_pair(st.loaded)
        if pair is not None:  # DIFF (V1 or V2, as for a fresh base) and softmax
            models = {"diff": pair[0][2], "transformer": pair[1][2]}
        else:
            models = {name: m for name, _, m, _ in st.loaded}
    else:
        models = flow.twin_models(st.base, seed=args.seed, paired=not args.unpaired, device=args.device)
    res = flow.run_flow(models, st.batches(args.seed), steps=args.steps, optimizer=args.flow_optimizer,
                        lr=st.lrs[args.flow_optimizer], clip=args.clip, start="saved" if st.loaded else "init")
    res.update(meta=st.meta, paired=not args.unpaired and not st.loaded, seconds=round(time.perf_counter() - t0, 2))
    if "ratio" in res:
        res.update(matched=st.flow_mismatch is None, mismatch=st.flow_mismatch)
    if st.flow_mismatch:
        print(f"difftx grads: warning: {st.flow_mismatch}", file=sys.stderr)
    st.write_json("flow.json", res)
    table = flow.flow_table(res)
    print(f"gradient flow ({args.flow_optimizer}, {args.steps} steps, {res['seconds']} s):\n{table}\n")
    st.report += ["## Gradient flow (DIFF paper, Appendix E)", "",
                  f"Gradient Frobenius norms per group, {args.flow_optimizer} lr {res['lr']}, {args.steps} steps "
                  + ("from the checkpoints as saved (step 0)" if st.loaded else "from initialisation (step 0)")
                  + "; ratio = DIFF / Transformer; the early ratio is the median over steps 1..K.", ""]
    if st.flow_mismatch:
        st.report += [f"**Not matched:** {st.flow_mismatch}.", ""]
    st.report += [table, ""]
    if st.plots is not None:
        st.plots.plot_flow(res, st.out / "flow.png")
        st.written.append("flow.png")
    _drop_stale_figures(st, ["flow.png"])


TAIL_TABLES = [("entries", "q99_9_over_q50", "|g| entries, q99.9 / q50 (Gaussian: 4.9)"),
               ("entries", "hill", "|g| entries, Hill tail index (top 1%; lower = heavier)"),
               ("entries", "excess_kurtosis", "|g| entries, excess kurtosis (Gaussian: 0)"),
               ("noise", "alpha_mohammadi", "gradient noise, Mohammadi alpha (2 = Gaussian; lower = heavier)")]


def _tails_section(st: _Study) -> None:
    from .. import load_model
    from ..analysis import common, tail_study

    args, t0 = st.args, time.perf_counter()
    seeds = range(args.seed, args.seed + args.seeds)  # a list of --seeds 10^11 was a MemoryError traceback
    res = None
    for seed in seeds:
        if st.loaded:
            candidates = [(name, (lambda p=path, sd=seed: _seeded(sd, load_model(p, device=args.device))))
                          for name, path, _, _ in st.loaded]
        else:
            candidates = [(s, (lambda c=c, sd=seed: common.build(c, sd, args.device))) for s, c in st.settings]
        r = tail_study.run_tail_study(
            candidates, st.batches(seed), _split(args.optimizers), st.tail_steps, lrs=st.lrs, clip=args.clip,
            noise_batches=args.noise_batches, max_noise_entries=args.max_noise_entries, seed=seed,
            progress=lambda msg: print(msg, file=sys.stderr, flush=True))
        for row in r["rows"]:
            row["seed"] = seed
        if res is None:
            res = r
        else:
            res["rows"] += r["rows"]
    res.update(meta=st.meta, seeds=list(seeds), seconds=round(time.perf_counter() - t0, 2),
               start="saved" if st.loaded else "init")
    st.write_json("tails.json", res)
    at0 = "as saved" if st.loaded else "at initialisation"  # what --tail-steps 0 measures
    steps = at0 if st.tail_steps == 0 else f"{st.tail_steps} steps"
    print(f"heavy tails ({steps}, {args.noise_batches} noise batches, {len(seeds)} seed(s), {res['seconds']} s):")
    # "After 0 training steps per optimiser" was said of checkpoints measured as saved, with no optimiser
    when = (f"Measured {at0}, with no training steps (optimizer: none)" if st.tail_steps == 0 else
            f"After {st.tail_steps} training steps per optimiser"
            + (" from the checkpoints' saved weights" if st.loaded else " from initialisation"))
    st.report += ["## Heavy tails (DNT Fig. 1; Simsekli et al. 2019)", "",
                  f"{when}; entries are the mean of {args.noise_batches} mini-batch gradients, noise their "
                  "deviations.", ""]
    for section, stat, title in TAIL_TABLES:
        table = tail_study.tails_table(res, stat, section)
        st.report += [f"### {title}", "", table, ""]
        if stat in ("q99_9_over_q50", "alpha_mohammadi"):
            print(f"{title}:\n{table}\n")
    if st.plots is not None:
        drawn = [(f"tails_hist_{opt}.png", st.plots.plot_tail_histograms(res, opt, st.out / f"tails_hist_{opt}.png"))
                 for opt in res["optimizers"]]
        drawn.append(("tails_summary.png", st.plots.plot_tail_summary(res, st.out / "tails_summary.png")))
        for name, path in drawn:
            if path is None:  # every row it would draw diverged: recorded in the tables, nothing to plot
                stale = st.out / name  # an earlier run's figure (--force) would misstate this run
                removed = stale.exists()
                if removed:
                    stale.unlink()
                print(f"difftx grads: no {name}: every tail row it would show diverged"
                      + ("; the earlier run's figure of that name was removed" if removed else ""))
            else:
                st.written.append(name)
    _drop_stale_figures(st, ["tails_summary.png"] + sorted(p.name for p in st.out.glob("tails_hist_*.png")))


def _drop_stale_figures(st: _Study, names: list[str]) -> None:
    """With --force, an earlier run's figures of a study this run redid but did not redraw (--no-plots, no
    matplotlib, fewer --optimizers) are removed: beside this run's JSON they would misstate it."""
    if not st.args.force:
        return
    stale = [n for n in names if n not in st.written and (st.out / n).is_file()]
    for n in stale:
        (st.out / n).unlink()
    if stale:
        print(f"difftx grads: removed {', '.join(stale)}: the earlier run's figures (--force), which this run did "
              "not redraw")


def _check_memory(args, configs) -> None:
    """InsufficientMemory, one line, when the largest model's training step at --batch-size x --seq-len cannot fit
    in the device's free memory (the training check's floor, :mod:`difftx.train.memory_check`; the two studies
    train their models one at a time).  --batch-size 10**11 asked numpy for 745 GiB of window offsets: a
    traceback."""
    from ..train import memory_check

    floors = [memory_check.training_memory_floor(c, args.batch_size, args.seq_len) for c in configs]
    memory_check.require_fit(max(floors, key=lambda f: f["total"]), args.device, "the largest model's training step",
                             "lower --batch-size or --seq-len")
    if args.only == "flow" or not memory_check.enabled():
        return
    # the tail study keeps --max-noise-entries sampled entries of each matrix kind from every one of --noise-batches
    # gradients, on the CPU, and stacks them (a second copy): --noise-batches 10^11 grew them until it crashed
    from ..accounting import count_parameters
    from ..analysis.tail_study import KIND_ORDER

    entries = min(args.max_noise_entries, max(count_parameters(c) for c in configs)) * len(KIND_ORDER)
    memory_check.require_bytes(args.noise_batches * entries * 8 * 2, "cpu",
                               f"{args.noise_batches:,} noise batches x up to {entries:,} sampled gradient entries",
                               "pass fewer --noise-batches or --max-noise-entries")


@keeps_threads
def run(args) -> int:
    from ..io import atomic_write_text, make_out_dir
    from ..nn import native

    t_start = time.perf_counter()
    _check(args)
    st = _Study(args)  # validates everything before anything is written
    make_out_dir(st.out)
    native.warn_problem("difftx grads", args.device)
    if args.only in (None, "flow"):
        _flow_section(st)
    if args.only in (None, "tails"):
        _tails_section(st)
    atomic_write_text(st.out / "report.md", "\n".join(st.report) + "\n")
    st.written.append("report.md")
    print(f"wrote {', '.join(st.written)} to {st.out} in {time.perf_counter() - t_start:.1f} s")
    return 0
