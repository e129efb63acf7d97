"""``difftx train``: parse flags, resolve configs (defaults < --recipe < flags), run :func:`difftx.train.train`.

Every flag defaults to "not given" so the precedence is exact and a resumed run
can tell which values were asked for.  With no arguments it trains the ``nano``
preset on the built-in corpus (the Python standard library) for 500 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ..errors import DifftxError

# flag dest -> TrainConfig field (same name unless listed)
TRAIN_FLAGS = ("data", "tokenizer", "bpe_vocab_size", "text_field", "val_fraction", "task", "domain", "cache_dir",
               "seq_len", "batch_size", "grad_accum", "global_batch", "steps", "epochs", "warmup_epochs", "optimizer",
               "lr", "min_lr", "schedule", "warmup", "weight_decay", "betas", "momentum", "nesterov", "eps",
               "decay_all", "grad_clip", "dtype", "compile", "device", "threads", "parallel", "seed", "eval_every",
               "eval_batches", "log_every", "diag_every", "checkpoint_every", "keep_last", "stop_at", "tensorboard",
               "progress", "task_options", "domain_options", "loss_chunk", "activation_checkpointing",
               "document_masking")
MODEL_FLAGS = ("attention", "norms", "d_model", "n_layers", "n_heads", "vocab_size")


def _kv(items, flag):
    from .info import parse_overrides

    return parse_overrides(items, flag) if items else None


def _betas(text: str):
    try:
        b1, b2 = (float(x) for x in text.split(","))
    except ValueError:  # argparse shows an ArgumentTypeError's message; any other ValueError as "invalid _betas value"
        raise argparse.ArgumentTypeError(f"expects two numbers like 0.9,0.95; got {text!r}") from None
    return (b1, b2)


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model on a text corpus or a synthetic task (images: --domain vision)",
                       description="Train a difftx model. With no arguments: the nano preset on the built-in corpus "
                                   "(this Python's standard library) for 500 steps. Values come from the defaults, "
                                   "then --recipe, then the flags you give.")
    d = p.add_argument_group("data")
    d.add_argument("--data", help="text file, directory, glob, .jsonl or saved HF dataset (default: built-in corpus); "
                                       "--domain vision: image folders, .npz / .npy arrays (default: the built-in "
                                       "digits; docs/vision.md)")
    d.add_argument("--tokenizer", help="byte (default), char, bpe (trained locally, cached) or a tokenizer.json path")
    d.add_argument("--bpe-vocab-size", type=int, help="vocabulary size of a locally trained bpe tokenizer (4096)")
    d.add_argument("--text-field", help="JSONL / dataset field holding the text (default: text)")
    d.add_argument("--val-fraction", type=float, help="tail fraction of the tokens held out for validation (0.1)")
    d.add_argument("--task", help="train on a registered synthetic task (e.g. niah, mqar) instead of --data")
    d.add_argument("--task-opt", action="append", metavar="KEY=VALUE", help="an option of the --task (repeatable)")
    d.add_argument("--domain", choices=["lm", "vision"], help="lm (default) or vision")
    d.add_argument("--domain-opt", action="append", metavar="KEY=VALUE", help="an option of the domain (repeatable)")
    d.add_argument("--cache-dir", help="token shards and bpe vocabularies (default: $DIFFTX_CACHE, else "
                                       "$DIFFTX_CACHE_DIR, else $XDG_CACHE_HOME/difftx, else ~/.cache/difftx)")
    m = p.add_argument_group("model")
    m.add_argument("--preset", help="model preset (default: nano; see `difftx info --list`)")
    m.add_argument("--attention", choices=["softmax", "diff", "diff2"], help="attention kind (matched-size twin)")
    m.add_argument("--norms", help="norm placement: S1..S5, dnt, post")
    m.add_argument("--d-model", type=int, help="model width")
    m.add_argument("--n-layers", type=int, help="number of layers")
    m.add_argument("--n-heads", type=int, help="number of heads (differential heads for diff)")
    m.add_argument("--vocab-size", type=int, help="model vocabulary (default: the tokenizer's; may be padded up)")
    m.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any ModelConfig field (repeatable), e.g. --set dropout=0.1")
    o = p.add_argument_group("optimisation")
    o.add_argument("--recipe", help="a paper's recipe by name (see --list-recipes)")
    o.add_argument("--list-recipes", action="store_true", help="list the recipes and exit")
    o.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's max_seq_len)")
    o.add_argument("--batch-size", type=int, help="sequences (images) per micro-batch per process (12)")
    o.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (1)")
    o.add_argument("--global-batch", type=int, help="sequences per step over all processes (sets --grad-accum)")
    o.add_argument("--steps", type=int, help="optimizer steps (500)")
    o.add_argument("--epochs", type=float, help="train this many epochs instead of --steps")
    o.add_argument("--warmup-epochs", type=float, help="warmup in epochs (needs --epochs)")
    o.add_argument("--optimizer", choices=["adamw", "msgdw", "sgd", "muon"], help="optimizer (adamw)")
    o.add_argument("--lr", type=float, help="peak learning rate (1e-3)")
    o.add_argument("--min-lr", type=float, help="final learning rate of the decay (1e-4)")
    o.add_argument("--schedule", choices=["cosine", "linear", "constant"], help="schedule after warmup (cosine)")
    o.add_argument("--warmup", type=int, help="linear warmup steps (100)")
    o.add_argument("--weight-decay", type=float, help="decoupled weight decay (0.1)")
    o.add_argument("--betas", type=_betas, help="AdamW betas, e.g. 0.9,0.95 (0.9,0.99)")
    o.add_argument("--momentum", type=float, help="momentum of msgdw / sgd (0.9)")
    o.add_argument("--nesterov", action="store_true", default=None, help="Nesterov momentum for msgdw / sgd")
    o.add_argument("--eps", type=float, help="AdamW epsilon (1e-8)")
    o.add_argument("--decay-all", action="store_true", default=None,
                   help="also decay norms, biases, lambdas and embeddings")
    o.add_argument("--grad-clip", type=float, help="clip the global gradient norm (1.0; 0 disables)")
    r = p.add_argument_group("runtime")
    r.add_argument("--dtype", choices=["auto", "fp32", "bf16"], help="auto: bf16 autocast where the hardware has it")
    r.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    r.add_argument("--device", help="auto (default), cpu, cuda or cuda:N")
    r.add_argument("--threads", type=int, help="CPU threads per process (default: torch's; 1 is best on a busy "
                                               "machine or for tiny models)")
    r.add_argument("--loss-chunk", type=int, metavar="TOKENS",
                   help="language models: compute the loss TOKENS tokens at a time, never holding all batch x "
                        "sequence x vocabulary logits (saves memory with a large vocabulary; 0, the default: off)")
    r.add_argument("--activation-checkpointing", type=int, metavar="N",
                   help="every Nth block keeps only its input for backward and recomputes the rest there: much "
                        "less training memory for about one more forward per step, the same bits (1: every block; "
                        "0, the default: off)")
    d.add_argument("--document-masking", action="store_true", default=None,
                   help="attention stays within each document of a training window (documents end with the "
                        "tokenizer's end-of-text token: --tokenizer bpe or a tokenizer.json), with positions "
                        "restarting at each document")
    r.add_argument("--parallel", choices=["auto", "none", "ddp", "fsdp"],
                   help="under torchrun: ddp (default) or fsdp (FSDP2 fully_shard)")
    r.add_argument("--seed", type=int, help="random seed (1337)")
    c = p.add_argument_group("evaluation, logging and checkpoints")
    c.add_argument("--eval-every", type=int, help="validate every N steps (250; 0: at the end only)")
    c.add_argument("--eval-batches", type=int, help="validation batches (50)")
    c.add_argument("--log-every", type=int, help="a metrics.jsonl row every N steps (1; at least 1)")
    c.add_argument("--diag-every", type=int, help="per-layer lambda and gradient norms every N steps (100; 0: off)")
    c.add_argument("--checkpoint-every", type=int, help="checkpoint every N steps (0: at the end only)")
    c.add_argument("--keep-last", type=int, help="checkpoints to keep (3)")
    c.add_argument("--stop-at", type=int, help="stop after this step with a checkpoint (continue with --resume)")
    c.add_argument("--tensorboard", action="store_true", default=None, help="also log to OUT/tensorboard")
    c.add_argument("--no-tensorboard", dest="tensorboard", action="store_false",
                   help="no tensorboard log (turns off the one a resumed run was saved with)")
    c.add_argument("--progress", dest="progress", action="store_true", default=None, help="force the progress bar")
    c.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    c.add_argument("--resume", metavar="auto|PATH", help="auto: continue the run in --out from its newest "
                                                          "checkpoint; PATH: a checkpoint or run directory")
    c.add_argument("--out", help="run directory (default: runs/YYYYmmdd-HHMMSS)")
    p.set_defaults(func=run)


def _list_recipes() -> int:
    from ..train.recipes import RECIPES

    width = max(map(len, RECIPES))
    for r in RECIPES.values():
        print(f"{r.name:<{width}}  {r.preset:<15} {r.description} [{r.source}]")
    return 0


# the optimiser fields each optimiser reads (Muon's AdamW, for the parameters it does not orthogonalise, reads
# betas and eps; its own momentum is fixed at 0.95, Nesterov)
_OPTIMIZER_READS = {"adamw": {"betas", "eps"}, "muon": {"betas", "eps"}, "msgdw": {"momentum", "nesterov"},
                    "sgd": {"momentum", "nesterov"}}


def _check_optimizer_flags(given, optimizer: str) -> None:
    """A flag of another optimiser is refused, not ignored (``--momentum 0.9`` with Muon, ``--betas`` with msgdw)."""
    reads = _OPTIMIZER_READS.get(optimizer)
    for name in ("betas", "eps", "momentum", "nesterov"):
        if reads is not None and name in given and name not in reads:
            users = " and ".join(o for o, r in _OPTIMIZER_READS.items() if name in r)
            raise DifftxError(f"--{name} is read by {users}, and this run trains with {optimizer}; "
                              f"drop --{name} (or choose an --optimizer that reads it)")


def run(args) -> int:
    if args.list_recipes:
        return _list_recipes()
    from ..train import resolve_configs, train

    args.task_options = _kv(args.task_opt, "--task-opt")
    args.domain_options = _kv(args.domain_opt, "--domain-opt")
    train_kw = {f: getattr(args, f) for f in TRAIN_FLAGS if getattr(args, f, None) is not None}
    model_kw = {f: getattr(args, f) for f in MODEL_FLAGS if getattr(args, f, None) is not None}
    model_kw.update(_kv(args.set, "--set") or {})
    tcfg, mcfg = resolve_configs(args.recipe, train_kw, model_kw, args.preset)
    if args.resume is None:  # a resumed run trains with its saved optimiser; a changed flag is refused there
        _check_optimizer_flags(train_kw, tcfg.optimizer)
    if args.out is None:
        if args.resume == "auto":
            raise DifftxError("--resume auto continues the run in --out; give --out DIR")
        base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        out, n = base, 1
        while out.exists():
            out, n = base.with_name(f"{base.name}-{n}"), n + 1
        args.out = str(out)
    explicit_train = set(train_kw) | (set(get_recipe_fields(args.recipe)) if args.recipe else set())
    summary = train(tcfg, mcfg, args.out, resume=args.resume, explicit_train=explicit_train,
                    explicit_model=set(model_kw) | ({"preset"} if args.preset else set()))
    if summary is None or int(os.environ.get("RANK", "0")) != 0:  # under torchrun the summary is rank 0's, once
        return 0
    out = Path(summary["run_dir"])
    val = "".join(f", {k} {summary[k]:.4f}" for k in ("val_loss", "val_acc", "test_acc") if summary.get(k) is not None)
    if val and summary.get("eval_step") not in (None, summary["step"]):  # --stop-at between evaluations
        val += f" (evaluated at step {summary['eval_step']})"
    print(f"difftx train: step {summary['step']}/{summary['steps']} in {summary['elapsed_s']:.1f}s{val}")
    files = [f for f in ("config.json", "tokenizer.json", "vision.json", "metrics.jsonl") if (out / f).is_file()]
    print(f"  run:        {out}  ({', '.join(files)})")
    if summary.get("checkpoint"):
        print(f"  checkpoint: {summary['checkpoint']}")
    if summary.get("stopped_by") or summary["step"] < summary["steps"]:
        print(f"  continue:   difftx train --out {out} --resume auto")
    print(f"  load:       difftx.load_model({json.dumps(str(out))})")
    return 0


def get_recipe_fields(name: str) -> list[str]:
    from ..train.recipes import get_recipe

    return [k for k in get_recipe(name).train if k != "recipe"]
