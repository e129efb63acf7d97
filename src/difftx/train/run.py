"""From configs to a finished run directory: the one entry point the CLI and Python users call.

:func:`resolve_configs` applies the precedence defaults < recipe < explicit
values and ties the sequence length to the model.  :func:`train` checks the
output directory (a run there is never overwritten without ``--resume``),
reloads the saved config when resuming (only the fields in
``RESUMABLE_CHANGES`` may change), prepares the domain's data and loads the
checkpoint being resumed *before* writing anything, refuses a run whose memory floor
exceeds the free memory (:mod:`difftx.train.memory_check`), then writes the run
directory and runs the :class:`Trainer`.

Run directory contract (docs/training.md): ``config.json`` (difftx_format,
model, train, data, world), ``tokenizer.json``, ``metrics.jsonl``,
``checkpoints/step_XXXXXXXX/`` (each a loadable model directory).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Iterable, Optional

import torch

from ..accounting import count_parameters
from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError, option_flag
from ..io import CHECKPOINTS_DIR, CONFIG_FILE, FORMAT_KEY, FORMAT_VERSION, atomic_write_text, make_out_dir
from ..nn import native
from ..runtime import SLOW_BF16, keep_freed_memory, native_bf16_matmul
from .checkpoint import (STATE_FILE, earlier_hint, read_json, remove_partial, resolve_resume, restore_resaved,
                         set_aside)
from .config import RESUMABLE_CHANGES, TrainConfig
from .distributed import init_world, resolve_parallel, shutdown_world
from .domain import get_domain
from .memory_check import check_run
from .metrics import METRICS_FILE
from .recipes import get_recipe
from .trainer import Trainer

DEFAULT_PRESET = "nano"
DEFAULT_VISION_RECIPE = "vit-tiny-adamw"  # --domain vision without a recipe: the digits CPU recipe
# may differ between the invocations of one run (stop_at is never inherited)
PER_RUN_FIELDS = ("stop_at", "progress", "compile", "device", "cache_dir", "tensorboard", "threads")


def resolve_configs(recipe: Optional[str] = None, train: Optional[dict] = None, model: Optional[dict] = None,
                    preset: Optional[str] = None) -> tuple[TrainConfig, ModelConfig]:
    """TrainConfig and ModelConfig from defaults < recipe < the explicit ``train`` / ``model`` fields.

    ``domain_options`` / ``task_options`` merge key by key (``--domain-opt mixup=0`` turns one recipe option off).
    An explicit ``warmup`` (steps) replaces a recipe's ``warmup_epochs``; beside an explicit one it is refused.
    """
    train, model = dict(train or {}), dict(model or {})
    if recipe is None and train.get("domain") == "vision":
        recipe = DEFAULT_VISION_RECIPE
    r = get_recipe(recipe) if recipe else None
    if r is not None and r.train.get("epochs") is not None and train.get("steps") is not None \
            and "epochs" not in train:  # explicit --steps beats a recipe's epochs; warmup keeps its fraction
        train["epochs"] = None
        if r.train.get("warmup_epochs") is not None and "warmup_epochs" not in train:
            train["warmup_epochs"] = None
            if "warmup" not in train:
                train["warmup"] = round(r.train["warmup_epochs"] / r.train["epochs"] * train["steps"])
    if r is not None and r.train.get("warmup_epochs") is not None and train.get("warmup") is not None \
            and "warmup_epochs" not in train:  # an explicit --warmup beats a recipe's warmup epochs (it was ignored)
        train["warmup_epochs"] = None
    if train.get("grad_accum") is not None and "global_batch" not in train:
        train["global_batch"] = None  # an explicit --grad-accum beats a recipe's global batch (which would set it)
    for key in ("domain_options", "task_options"):  # option dicts merge: the recipe's < the explicit ones
        if r is not None and r.train.get(key) and key in train:
            train[key] = {**r.train[key], **(train[key] or {})}
    tcfg = TrainConfig(**{**(r.train if r else {}), **train})
    if train.get("warmup") is not None and tcfg.warmup_epochs is not None:  # one would be ignored
        raise ConfigError("warmup", "give the warmup in steps (--warmup) or in epochs (--warmup-epochs), not both")
    if train.get("steps") is not None and train.get("epochs") is not None:  # the epochs set the steps: one ignored
        raise ConfigError("steps", "give the run's length in steps (--steps) or in epochs (--epochs), not both")
    preset = preset or (r.preset if r else DEFAULT_PRESET)
    overrides = {**(r.model if r else {}), **model}
    if tcfg.seq_len is not None and "max_seq_len" not in model:
        overrides["max_seq_len"] = tcfg.seq_len
    patch = model.get("patch_size")
    if tcfg.domain == "vision" and isinstance(patch, int) and not isinstance(patch, bool) and patch > 0 \
            and "image_size" not in model:  # (another patch size is refused by ModelConfig, naming it)
        # the data decides the image size (VisionDomain.model_overrides checks the patch against it); until then
        # a placeholder the patch divides, so the preset's own image size does not reject the patch
        base = ModelConfig.from_preset(preset).image_size
        overrides["image_size"] = -(-base // patch) * patch
    mcfg = ModelConfig.from_preset(preset, **overrides)
    if tcfg.seq_len is None:
        tcfg = tcfg.replace(seq_len=mcfg.max_seq_len)
    if mcfg.domain != tcfg.domain:
        raise ConfigError("domain", f"preset {preset!r} is a {mcfg.domain} model but the run's domain is "
                                    f"{tcfg.domain!r}; pick a matching --preset or --domain")
    if tcfg.seq_len > mcfg.max_seq_len and mcfg.positions in ("learned", "sinusoidal"):
        raise ConfigError("seq_len", f"{tcfg.seq_len} exceeds the model's max_seq_len {mcfg.max_seq_len} "
                                     f"({mcfg.positions} positions)")
    return tcfg, mcfg


def run_exists(path: Path) -> bool:
    return any((path / name).exists() for name in (CONFIG_FILE, METRICS_FILE, CHECKPOINTS_DIR))


def _corpus_is_checked(saved: dict, old_t: TrainConfig) -> bool:
    """Whether resuming ``saved`` compares the corpus's contents with the ones it started on (the lm domain's
    ``_check_resumed_corpus``), so that a ``--data`` path other than the saved one is safe to accept."""
    data = saved.get("data")
    return old_t.domain == "lm" and old_t.task is None and isinstance(data, dict) \
        and isinstance(data.get("corpus_fingerprint"), str)


def _merge_resumed(saved: dict, source: Path, tcfg: TrainConfig, mcfg: ModelConfig, explicit_train: Iterable[str],
                   explicit_model: Iterable[str]) -> tuple[TrainConfig, ModelConfig]:
    """The saved configs, with the explicitly given fields that a resumed run may change."""
    if not isinstance(saved, dict) or not isinstance(saved.get("train"), dict) \
            or not isinstance(saved.get("model"), dict):
        raise ConfigError(None, f"{source / CONFIG_FILE}: not a difftx training run config (no 'train'/'model' "
                                "objects); the file is corrupt")
    if saved.get(FORMAT_KEY, FORMAT_VERSION) != FORMAT_VERSION:  # as io.load_model refuses the same checkpoint
        raise ConfigError(None, f"{source / CONFIG_FILE}: {FORMAT_KEY} {saved[FORMAT_KEY]!r}, but this difftx reads "
                                f"format {FORMAT_VERSION}; use the difftx version that wrote it")
    try:
        old_t, old_m = TrainConfig.from_dict(saved["train"]), ModelConfig.from_dict(saved["model"])
    except (ConfigError, TypeError, ValueError, AttributeError) as e:  # hand-edited or damaged: not the user's flags
        raise ConfigError(None, f"{source / CONFIG_FILE}: not a valid run config ({e}); the file is corrupt, use "
                                "another checkpoint") from None
    changes = {"stop_at": None}  # a stop step is for one invocation only
    for f in explicit_train:
        new, old = getattr(tcfg, f), getattr(old_t, f)
        if f in RESUMABLE_CHANGES or f in PER_RUN_FIELDS:
            changes[f] = new
        elif f == "data" and new is not None and _corpus_is_checked(saved, old_t):
            changes[f] = new  # the same corpus at another path (a relative --data from another directory, data
            # moved): the domain refuses other contents against the saved fingerprint on resume
        elif new != old:
            raise ConfigError(f, f"is {old!r} in the run being resumed ({source}), {new!r} here; a resumed run "
                                 "keeps its config (start a new --out to change it)")
    if "grad_accum" in changes and "global_batch" not in changes:
        changes["global_batch"] = None  # --grad-accum alone: the saved --global-batch would override it silently
    for f in explicit_model:
        if getattr(mcfg, f) != getattr(old_m, f):
            raise ConfigError(f, f"is {getattr(old_m, f)!r} in the run being resumed ({source}), "
                                 f"{getattr(mcfg, f)!r} here; a resumed run keeps its model")
    return old_t.replace(**changes), old_m


@contextlib.contextmanager
def _naming_the_one_before(ckpt: Optional[Path], out: Path):
    """A file of checkpoint ``ckpt`` that is corrupt is refused (not passed over, as a missing one is): its error
    also says how to resume the complete checkpoint before it (:func:`~difftx.train.checkpoint.earlier_hint`)."""
    try:
        yield
    except CheckpointError as e:
        hint = earlier_hint(e, ckpt, out) if ckpt is not None else ""
        if not hint:
            raise
        raise CheckpointError(f"{e}{hint}") from None


def train(tcfg: TrainConfig, mcfg: ModelConfig, out, resume: Optional[str] = None,
          explicit_train: Iterable[str] = (), explicit_model: Iterable[str] = (), callbacks=(),
          announce=print, memory_check: bool = True) -> dict:
    """Run (or resume) a training run into directory ``out``; returns a summary dict.

    A resumed run keeps its saved configs; ``explicit_train`` / ``explicit_model`` name the fields of ``tcfg`` /
    ``mcfg`` the caller gives (what the CLI's flags are), and only those may change it: e.g. ``train(tcfg, mcfg,
    out, resume="auto", explicit_train={"steps"})`` continues to ``tcfg.steps``; without it, to the saved steps.
    ``memory_check=False`` skips the memory check (difftx.train.memory_check): for a caller that checked
    already, such as ``difftx compare``, which checks every job of its study, with its parallel jobs, up front."""
    out = Path(out)
    explicit_train = set(explicit_train)
    keep_freed_memory()  # a training process keeps its freed activations for the next step (runtime.py)
    # a resumed run keeps its device unless given one (as every other saved field): not the command's default, auto
    device = tcfg.device
    if "device" not in explicit_train and (saved := _saved_device(resume, out)):
        if saved.startswith("cuda") and not torch.cuda.is_available():  # not "cuda was asked for": the run was
            raise ConfigError("device", f"this run was saved with --device {saved}, and torch sees no GPU here; "
                                        "resume with --device cpu")
        device = saved
    threads_before = torch.get_num_threads()  # --threads holds for the run: the caller's count comes back after it
    world = init_world(device)
    try:
        if resume is not None and world.world_size > 1:  # rank 0 puts back an interrupted re-save, then all resolve
            if world.is_main:
                restore_resaved(out if resume == "auto" else Path(resume))
            world.barrier()
        skipped: list[tuple[Path, list[str]]] = []  # newer step_* directories that lack files: passed over
        resume_ckpt = resolve_resume(resume, out, restore=world.world_size == 1,
                                     skipped=lambda paths, missing: skipped.extend(zip(paths, missing)))
        if resume == "auto" and resume_ckpt is None and (out / STATE_FILE).is_file():  # not a run: one of its steps
            raise ConfigError("out", f"{out} is a checkpoint, not a run directory; continue it with --resume {out} "
                                     "and --out its run directory (or a new one)")
        source = resume_ckpt if resume_ckpt is not None else (
            out if resume == "auto" and (out / CONFIG_FILE).is_file() else None)
        if source is None and run_exists(out):
            raise ConfigError("out", f"{out} already holds a training run; pass --resume auto to continue it or "
                                     "choose a new --out (nothing was changed)")
        if resume_ckpt is not None and resume_ckpt.resolve().parent.parent != out.resolve() and run_exists(out):
            raise ConfigError("out", f"{out} already holds another training run; choose a new --out to continue "
                                     f"{resume_ckpt} there")
        fixed_model = set(explicit_model)
        if source is not None:
            with _naming_the_one_before(resume_ckpt, out):
                saved = read_json(source / CONFIG_FILE, "run config")
            tcfg, mcfg = _merge_resumed(saved, source, tcfg, mcfg, explicit_train, explicit_model)
            fixed_model |= {"vocab_size", "max_seq_len"}
        if tcfg.tensorboard:  # given, or the resumed run's
            _require_tensorboard()

        if mcfg.domain != tcfg.domain:  # resolve_configs checks this; a caller's own pair of configs may not match
            raise ConfigError("domain", f"the model ({mcfg.preset or 'custom'!r}) is a {mcfg.domain} model but the "
                                        f"run's domain is {tcfg.domain!r}; give a {tcfg.domain} model config")
        _check_unread(tcfg, explicit_train, set(explicit_model))
        n_micro = tcfg.accumulation(world.world_size)  # checks that --global-batch divides; before any write
        if tcfg.global_batch is not None and "grad_accum" in explicit_train and n_micro != tcfg.grad_accum:
            raise ConfigError("grad_accum", f"{tcfg.grad_accum} disagrees with --global-batch {tcfg.global_batch}, "
                                            f"which needs {n_micro} micro-batches of {tcfg.batch_size} on "
                                            f"{world.world_size} process(es); give one of the two")
        if resolve_parallel(tcfg.parallel, world) == "fsdp" and tcfg.optimizer == "muon":
            raise ConfigError("optimizer", "muon needs whole matrices; use --parallel ddp with it")
        if tcfg.threads:
            torch.set_num_threads(tcfg.threads)
        domain = get_domain(tcfg, world)
        show = tcfg.progress if tcfg.progress is not None else sys.stderr.isatty()
        domain.prepare(source, progress=show and world.is_main)
        domain.check_explicit(frozenset(explicit_train))
        corpus = getattr(domain, "corpus", None)
        if "text_field" in explicit_train and corpus is not None and all(s.kind == "text" for s in corpus.sources):
            raise ConfigError("text_field", f"names the field of JSONL records or a dataset column, and "
                                            f"{corpus.description} is plain text; drop --text-field")
        mcfg = mcfg.replace(**domain.model_overrides(mcfg, frozenset(fixed_model))) if source is None else mcfg
        domain.model_overrides(mcfg, frozenset(fixed_model | {"vocab_size"}))  # the final check
        if tcfg.epochs is not None and source is None:
            tcfg = _epochs_to_steps(tcfg, domain, world.world_size)

        if tcfg.stop_at is not None and tcfg.stop_at > tcfg.steps:  # the run ends at its last step: it never stops
            raise ConfigError("stop_at", f"{tcfg.stop_at} is past the run's last step, {tcfg.steps}, where it ends "
                                         "anyway; give an earlier --stop-at, or more --steps")
        memory_warning = (check_run(world, mcfg, tcfg, resolve_parallel(tcfg.parallel, world)) if memory_check
                          else None)
        run_config = {FORMAT_KEY: FORMAT_VERSION, "model": mcfg.to_dict(), "train": tcfg.to_dict(),
                      "data": domain.describe(), "world_size": world.world_size,
                      "torch": torch.__version__}
        trainer = Trainer(mcfg, tcfg, domain, world, out, run_config, callbacks)
        if resume_ckpt is not None:  # load (and so check) the checkpoint before writing anything
            with _naming_the_one_before(resume_ckpt, out):
                trainer.resume(resume_ckpt)
            if tcfg.stop_at is not None and tcfg.stop_at <= trainer.step:
                raise ConfigError("stop_at", f"{tcfg.stop_at} is not past step {trainer.step}, where the run being "
                                             "resumed stands, so nothing would train; give a later --stop-at or "
                                             "drop it")
        if world.is_main:
            make_out_dir(out)
            remove_partial(out)
            if skipped:  # after every input check: a refused run leaves them as they were and prints its error alone
                what = "; ".join(f"{p} (no {', '.join(m)})" for p, m in skipped)
                # this run's own: renamed out of the way of its next saves (never deleted); another run's: untouched
                kept = [set_aside(p).name for p, _ in skipped if p.parent.parent.resolve() == out.resolve()]
                print(f"difftx train: warning: skipped incomplete checkpoint(s) {what}; resuming from {resume_ckpt}"
                      f"{'; kept, renamed to ' + ', '.join(kept) if kept else ''}", file=sys.stderr)
            atomic_write_text(out / CONFIG_FILE, json.dumps(run_config, indent=2))
            domain.save_artifacts(out)
        world.barrier()
        if world.is_main:  # the data's notes (files skipped): after every input check, as the hints below
            for note in domain.notes():
                print(f"difftx: {note}", file=sys.stderr)
        if world.is_main and announce and not tcfg.threads and world.device.type == "cpu":
            _hint_busy_cpu()  # after every input check, so a bad input still gets exactly one line
        if world.is_main and announce and memory_warning:
            print(f"difftx train: warning: {memory_warning}", file=sys.stderr)
        if world.is_main and announce and tcfg.warmup >= tcfg.steps > 0:  # allowed (a short test run), but says so
            print(f"difftx train: warning: the warmup ({tcfg.warmup} steps) is not shorter than the run "
                  f"({tcfg.steps} steps): the learning rate only reaches {tcfg.lr * tcfg.steps / tcfg.warmup:.3g} "
                  f"of --lr {tcfg.lr:g} and its {tcfg.schedule} schedule never starts; give --warmup below "
                  f"{tcfg.steps}", file=sys.stderr)
        if world.is_main and announce:
            native.warn_problem("difftx train", world.device)
        if world.is_main and announce and trainer.dtype is not None and not native_bf16_matmul(world.device):
            print(f"difftx train: warning: {SLOW_BF16}", file=sys.stderr)
        if world.is_main and announce:
            what = f"resuming from {resume_ckpt}" if resume_ckpt else "training"
            announce(f"difftx train: {what}: {mcfg.attention} attention, {mcfg.preset or 'custom'} "
                     f"({count_parameters(mcfg):,} params), {tcfg.steps} steps on {world.world_size} x "
                     f"{world.device.type} ({trainer.parallel}, {'bf16' if trainer.dtype else 'fp32'}"
                     f"{_recomputing(tcfg.activation_checkpointing)}"
                     f"{', documents masked' if tcfg.document_masking else ''}) -> {out}")
        return trainer.fit(resume_ckpt)
    finally:
        shutdown_world(world)
        if torch.get_num_threads() != threads_before:
            torch.set_num_threads(threads_before)


def _recomputing(every: int) -> str:
    """The start line's word on activation checkpointing: nothing when it is off."""
    if not every:
        return ""
    return ", recomputing every block" if every == 1 else f", recomputing one block in {every}"


def _saved_device(resume: Optional[str], out: Path) -> Optional[str]:
    """The ``device`` of the run being resumed, read from its ``config.json`` (the run's for ``--resume auto`` and
    ``--resume RUN``, the checkpoint's for ``--resume CHECKPOINT``) before the process group starts, as the group's
    backend depends on it; None when there is none to read (the saved config is checked properly later)."""
    if resume is None:
        return None
    try:
        saved = json.loads((Path(out if resume == "auto" else resume) / CONFIG_FILE).read_text(encoding="utf-8"))
        device = saved["train"]["device"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return device if isinstance(device, str) else None


def _check_unread(tcfg: TrainConfig, explicit: set, explicit_model: set = frozenset()) -> None:
    """An explicitly given field that the run's domain or data source never reads is refused, not ignored."""
    if "min_lr" in explicit and tcfg.schedule == "constant":  # only a decay reads it (optim.lr_at)
        from .recipes import RECIPES

        recipe = RECIPES.get(tcfg.recipe) if tcfg.recipe else None  # a recipe's own, as for --bpe-vocab-size below
        if recipe is None or recipe.train.get("min_lr") != tcfg.min_lr:
            raise ConfigError("min_lr", "is the rate a cosine or linear schedule decays to, and this run's schedule "
                                        "is constant; drop --min-lr (or give --schedule cosine or linear)")
    if tcfg.domain == "vision":
        for name in ("tokenizer", "bpe_vocab_size", "text_field", "task", "task_options", "seq_len", "vocab_size",
                     "cache_dir"):
            if name in explicit or name in explicit_model:
                raise ConfigError(name, f"is a language-model option and a vision run reads images; drop "
                                        f"{option_flag(name)}")
        if "eval_batches" in explicit:
            raise ConfigError("eval_batches", "a vision run evaluates its whole validation and test splits (in "
                                              "batches of --domain-opt eval_batch_size=N); drop --eval-batches")
        return
    if "bpe_vocab_size" in explicit and tcfg.tokenizer != "bpe":
        from .recipes import RECIPES

        recipe = RECIPES.get(tcfg.recipe) if tcfg.recipe else None  # a recipe's fields count as explicit: its
        if recipe is None or recipe.train.get("bpe_vocab_size") != tcfg.bpe_vocab_size:  # own is not the user's
            raise ConfigError("bpe_vocab_size", f"sizes the vocabulary of --tokenizer bpe, and this run's tokenizer "
                                                f"is {tcfg.tokenizer}; drop --bpe-vocab-size (or give --tokenizer bpe)")
    if tcfg.task is None:
        if "task_options" in explicit:
            raise ConfigError("task_options", "are options of a synthetic --task and this run trains on a "
                                              "corpus; give --task NAME or drop --task-opt")
    else:
        for name in ("text_field", "val_fraction"):
            if name in explicit:
                raise ConfigError(name, f"reads a corpus, and --task {tcfg.task} generates its data (validation "
                                        f"batches included); drop {option_flag(name)}")
        if "cache_dir" in explicit:  # only a corpus's token shards and bpe vocabularies go there (domain.prepare)
            raise ConfigError("cache_dir", f"holds a corpus's token shards and bpe vocabularies, and --task "
                                           f"{tcfg.task} generates its data, so nothing is cached; drop --cache-dir")


def _epochs_to_steps(tcfg: TrainConfig, domain, world_size: int) -> TrainConfig:
    global_batch = tcfg.batch_size * tcfg.accumulation(world_size) * world_size
    per_epoch = domain.steps_per_epoch(global_batch)
    if per_epoch is None:
        raise ConfigError("epochs", f"the {tcfg.domain} domain does not know its dataset size; give --steps")
    for name in ("epochs", "warmup_epochs"):  # finite, but the product may not be (1e308 epochs): no step count
        value = getattr(tcfg, name)
        if value is not None and not math.isfinite(value * per_epoch):
            raise ConfigError(name, f"{value:g} epochs of {per_epoch:.4g} steps each are more steps than can be "
                                    f"counted; give fewer {option_flag(name)}")
    steps = max(1, math.ceil(tcfg.epochs * per_epoch))
    warmup = round((tcfg.warmup_epochs or 0) * per_epoch) if tcfg.warmup_epochs is not None else tcfg.warmup
    return tcfg.replace(steps=steps, warmup=warmup)


def _require_tensorboard() -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError("tensorboard", "needs the tensorboard package: pip install 'difftx[tensorboard]'") from None


def _hint_busy_cpu() -> None:
    """Say so when the CPU is oversubscribed: OpenMP threads then wait on each other (10x slower steps)."""
    import os

    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except OSError:
        return
    if torch.get_num_threads() > 1 and load > cores:
        print(f"difftx train: the CPU is busy (load {load:.1f} on {cores} cores); --threads 1 may train much "
              "faster", file=sys.stderr)
