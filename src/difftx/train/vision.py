"""The vision domain: ``difftx train --domain vision`` trains a ViT / V-DNT / DIFF-ViT classifier.

Data (:mod:`difftx.data.images`): the built-in digits, image folders or NumPy
arrays, split into train / val / test (stratified, by ``split_seed``) and
normalised with the training split's per-channel statistics.  The data decides
the model's ``image_size``, ``in_channels`` and ``num_classes`` unless they
are given (then they are checked).

Batches: the training images are visited in epochs, each a permutation drawn
from ``(seed, epoch)``; step ``s`` takes positions ``s*G .. s*G+G-1`` of that
stream (``G`` the global batch), and its augmentations are drawn from
``(seed, step)`` for the whole global batch (:mod:`difftx.data.augment`).  A
step's batch is therefore a pure function of the step, the same for any number
of processes or micro-batches: resuming is exact.

Evaluation covers the whole split (``val`` during training, ``val`` and
``test`` at the end): ``{split}_loss`` (plain cross-entropy) and
``{split}_acc`` (top-1), reduced over processes.

:func:`train_vision_arm` is the library entry point for a comparison study:
one arm (a ModelConfig, an optimizer, a learning rate, a seed, a budget) in,
test accuracy, throughput and CPU time out.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import tempfile
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..data import augment as aug
from ..data.images import channel_stats, load_image_set, normalize, split_indices
from ..errors import ConfigError, DataError
from .config import TrainConfig
from .distributed import World
from .domain import Domain, register_domain

META_FILE = "vision.json"
ORDER_STREAM = 0x0D3  # generator stream of the epoch permutations
# domain options (--domain-opt KEY=VALUE) besides the augmentations, with their defaults
DATA_OPTIONS = dict(test_fraction=0.2, split_seed=0, resize=None, eval_batch_size=500)
# named by the paper recipes but not implemented here: accepted with a warning
UNSUPPORTED_OPTIONS = ("randaugment", "stochastic_depth")


def parse_options(options: dict) -> tuple[dict, aug.AugmentOptions]:
    """Split ``domain_options`` into data options and :class:`AugmentOptions`, checking every value."""
    aug_names = {f.name for f in fields(aug.AugmentOptions)}
    known = set(DATA_OPTIONS) | aug_names | set(UNSUPPORTED_OPTIONS)
    for k in options:
        if k not in known:
            raise ConfigError("domain_options", f"unknown vision option {k!r}; known: {', '.join(sorted(known))}")
    ignored = [k for k in UNSUPPORTED_OPTIONS if options.get(k) not in (None, 0, 0.0, False)]
    if ignored:
        print(f"difftx train: vision options {', '.join(ignored)} are not implemented and are ignored",
              file=sys.stderr)
    data = {k: options.get(k, v) for k, v in DATA_OPTIONS.items()}

    def check(name, value, ok, what):
        if isinstance(value, bool) and what != "true or false" or not ok(value):
            raise ConfigError("domain_options", f"{name} must be {what}; got {value!r}")
        return value

    num = (int, float)
    check("test_fraction", data["test_fraction"], lambda v: isinstance(v, num) and 0 <= v < 1, "a number in [0, 1)")
    check("split_seed", data["split_seed"], lambda v: isinstance(v, int) and v >= 0, "a non-negative integer")
    check("resize", data["resize"], lambda v: v is None or isinstance(v, int) and v > 0, "a positive integer")
    check("eval_batch_size", data["eval_batch_size"], lambda v: isinstance(v, int) and v > 0, "a positive integer")
    a = {k: options[k] for k in aug_names if k in options}
    check("crop", a.get("crop", 0), lambda v: isinstance(v, int) and v >= 0, "a non-negative integer (padding)")
    check("flip", a.get("flip", False), lambda v: isinstance(v, bool), "true or false")
    for k in ("mixup", "cutmix"):
        check(k, a.get(k, 0.0), lambda v: isinstance(v, num) and 0 <= v < math.inf,
              "a non-negative Beta alpha (0: off)")
    for k in ("random_erasing", "mix_prob", "switch_prob"):
        check(k, a.get(k, 0.0), lambda v: isinstance(v, num) and 0 <= v <= 1, "a probability in [0, 1]")
    check("label_smoothing", a.get("label_smoothing", 0.0), lambda v: isinstance(v, num) and 0 <= v < 1,
          "a number in [0, 1)")
    return data, aug.AugmentOptions(**a)


@register_domain("vision")
class VisionDomain(Domain):
    """Image classification over an in-memory image set."""

    name = "vision"
    unit = "img"
    eval_splits = ("val", "test")

    def __init__(self, cfg: TrainConfig, world: World):
        super().__init__(cfg, world)
        if cfg.document_masking:
            raise ConfigError("document_masking", "keeps a language model's packed documents apart; an image has no "
                                                  "documents: drop --document-masking")
        if cfg.loss_chunk:
            raise ConfigError("loss_chunk", "chunks a language model's loss over its vocabulary; a vision model's "
                                            "classes are few: drop --loss-chunk")
        self.options, self.augment = parse_options(cfg.domain_options)
        self.data = None
        self.split: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._perms: dict[int, np.ndarray] = {}

    # ------------------------------------------------------------------ data
    def prepare(self, run_dir: Optional[Path] = None, progress: bool = True) -> None:
        cfg, opts = self.cfg, self.options
        self.data = data = load_image_set(cfg.data, opts["resize"])
        size = data.shape[1]
        if self.augment.crop >= size:  # a crop could then miss the image (and a huge padding exhausts memory)
            raise ConfigError("domain_options", f"crop {self.augment.crop} pads each side by the images' size "
                                                f"({size}) or more, so a crop can miss the image; give crop below "
                                                f"{size}")
        idx = split_indices(data.labels, cfg.val_fraction, opts["test_fraction"], opts["split_seed"], data.splits)
        if len(idx["train"]) == 0:
            raise DataError(f"{data.source}: no training images left after the split; lower --val-fraction or "
                            "--domain-opt test_fraction")
        self.mean, self.std = channel_stats(data.images[idx["train"]])
        self.split = {name: (normalize(data.images[i], self.mean, self.std), data.labels[i])
                      for name, i in idx.items()}
        self.n_classes = len(data.classes)
        self.model_classes = self.n_classes  # mixing's soft targets: the model's classes (model_overrides)
        saved = Path(run_dir) / META_FILE if run_dir is not None else None
        if saved is not None and saved.is_file():
            old = json.loads(saved.read_text())
            if old.get("fingerprint") != data.fingerprint() or old.get("classes") != data.classes:
                raise DataError(f"--data {cfg.data or 'digits'} is not the data of the run being resumed "
                                f"({old.get('source')}); resume with the same --data and --domain-opt resize")

    def check_explicit(self, explicit: frozenset) -> None:
        """A split fraction beside the image folder that gives that split would be ignored: refused."""
        given = self.data.splits or {}
        if "val" in given and "val_fraction" in explicit:
            raise ConfigError("val_fraction", f"the image folder gives the validation split "
                                              f"({Path(self.data.source) / 'val'}); drop --val-fraction (or "
                                              "remove that folder to carve the split out of train)")
        if "test" in given and "test_fraction" in self.cfg.domain_options:
            raise ConfigError("domain_options", f"test_fraction: the image folder gives the test split "
                                                f"({Path(self.data.source) / 'test'}); drop --domain-opt "
                                                "test_fraction (or remove that folder to carve the split out of "
                                                "train)")

    def notes(self) -> list[str]:
        return list(self.data.notes) if self.data is not None else []

    def describe(self) -> dict:
        d = self.data
        return {"source": d.source, "fingerprint": d.fingerprint(), "classes": d.classes,
                "image_shape": list(d.shape), **{f"n_{k}": len(v[1]) for k, v in self.split.items()},
                "mean": self.mean.tolist(), "std": self.std.tolist(), "options": self.options,
                "augment": asdict(self.augment)}

    def model_overrides(self, model_cfg, fixed: frozenset = frozenset()) -> dict:
        c, h, _ = self.data.shape
        want = {"image_size": h, "in_channels": c, "num_classes": self.n_classes}
        if "num_classes" in fixed and model_cfg.num_classes < self.n_classes:
            raise ConfigError("num_classes", f"the model has {model_cfg.num_classes} classes but the data's labels "
                                             f"go up to {self.n_classes - 1} (out of range); drop --set num_classes "
                                             f"or set it to at least {self.n_classes}")
        for k, fix in (("image_size", ", or resize with --domain-opt resize=N"), ("in_channels", "")):
            if k in fixed and getattr(model_cfg, k) != want[k]:
                raise ConfigError(k, f"is {getattr(model_cfg, k)} but the data's images are {c}x{h}x{h} "
                                     f"(channels x height x width); drop --set {k}{fix}")
        # --set num_classes may give the model more classes than the data has: soft targets span the model's.  The
        # trainer's last call passes the model it trains (a resumed run's from its config.json)
        self.model_classes = max(self.n_classes, model_cfg.num_classes)
        patch = model_cfg.patch_size
        if "image_size" not in fixed and h % patch:
            raise ConfigError("patch_size", f"{patch} does not divide the data's image size {h}; pick a divisor of "
                                            f"{h} (--set patch_size=N) or resize (--domain-opt resize=N)")
        return {k: v for k, v in want.items() if k not in fixed and getattr(model_cfg, k) != v}

    def save_artifacts(self, path: Path) -> None:
        from ..io import atomic_write_text

        d = self.data
        meta = {"classes": d.classes, "image_size": d.shape[1], "in_channels": d.shape[0],
                "mean": self.mean.tolist(), "std": self.std.tolist(), "source": d.source,
                "fingerprint": d.fingerprint(), "resize": self.options["resize"]}
        atomic_write_text(Path(path) / META_FILE, json.dumps(meta, indent=2))

    def steps_per_epoch(self, global_batch: int) -> Optional[float]:
        return len(self.split["train"][1]) / global_batch

    # ------------------------------------------------------------------ batches
    def _order(self, start: int, n: int) -> np.ndarray:
        """Training-set indices at positions ``start .. start+n-1`` of the endless stream of epochs."""
        size = len(self.split["train"][1])
        pos = start + np.arange(n)
        epoch, within = pos // size, pos % size
        out = np.empty(n, dtype=np.int64)
        for e in np.unique(epoch):
            if e not in self._perms:
                if len(self._perms) > 4:
                    self._perms.pop(min(self._perms))
                self._perms[int(e)] = np.random.default_rng([self.cfg.seed, int(e), ORDER_STREAM]).permutation(size)
            sel = epoch == e
            out[sel] = self._perms[int(e)][within[sel]]
        return out

    def train_batches(self, step: int, n_micro: int) -> list[dict]:
        b, world, opts = self.cfg.batch_size, self.world, self.augment
        per_rank = b * n_micro
        g = per_rank * world.world_size
        x, y = self.split["train"]
        order = self._order(step * g, g)
        _, h, w = x.shape[1:]
        draws = aug.draw(opts, self.cfg.seed, step, g, h, w)
        mine = np.arange(world.rank * per_rank, (world.rank + 1) * per_rank)
        images = aug.apply(x[order[mine]], draws, mine, opts)
        labels = y[order[mine]]
        targets = None
        if opts.mixing:  # soft targets on every step, mixed or not (one loss form for the run)
            partner = g - 1 - mine
            partner_labels = y[order[partner]]
            if draws.mix_lam < 1.0:
                images = aug.mix(images, aug.apply(x[order[partner]], draws, partner, opts), draws)
            targets = aug.soft_targets(labels, partner_labels, draws.mix_lam, self.model_classes,
                                       opts.label_smoothing)
        out = []
        for m in range(n_micro):
            sl = slice(m * b, (m + 1) * b)
            batch = {"images": torch.from_numpy(images[sl]), "labels": torch.from_numpy(labels[sl])}
            if targets is not None:
                batch["targets"] = torch.from_numpy(targets[sl])
            out.append(batch)
        return out

    def count(self, batch: dict) -> int:
        return len(batch["labels"])

    def size(self, batch: dict) -> int:
        return len(batch["labels"])

    def loss(self, model, batch: dict) -> torch.Tensor:
        if "targets" in batch:
            return model(batch["images"], targets=batch["targets"], loss_reduction="sum").loss
        return model(batch["images"], targets=batch["labels"], label_smoothing=self.augment.label_smoothing,
                     loss_reduction="sum").loss

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, model, split: str = "val") -> dict:
        x, y = self.split.get(split, (None, np.zeros(0)))
        if len(y) == 0:
            return {}
        w, device = self.world, self.world.device
        # the batches do not depend on the process count (so neither do the numbers); every process runs the
        # same number of forwards (FSDP's are collective), those past the last batch repeat batch 0 uncounted
        batches = np.array_split(np.arange(len(y)), math.ceil(len(y) / self.options["eval_batch_size"]))
        padded = -(-len(batches) // w.world_size) * w.world_size
        total = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, images
        for i in range(w.rank, padded, w.world_size):
            idx = batches[i if i < len(batches) else 0]
            images = torch.from_numpy(x[idx]).to(device)
            labels = torch.from_numpy(y[idx]).to(device)
            out = model(images, targets=labels, loss_reduction="sum")
            if i < len(batches):
                total[0] += out.loss.double()
                total[1] += (out.logits.argmax(-1) == labels).sum()
                total[2] += len(idx)
        w.all_reduce_sum(total)
        n = total[2].clamp_min(1)
        return {f"{split}_loss": float(total[0] / n), f"{split}_acc": float(total[1] / n)}


# ---------------------------------------------------------------------- one arm of a comparison
def train_vision_arm(model_cfg, optimizer: str = "adamw", lr: Optional[float] = None, seed: int = 0,
                     steps: Optional[int] = None, epochs: Optional[float] = None, data: Optional[str] = None,
                     out=None, recipe: Optional[str] = None, threads: Optional[int] = None, **train_fields) -> dict:
    """Train one arm of a vision comparison and measure it; returns a flat dict of results.

    ``model_cfg``: a vision :class:`~difftx.config.ModelConfig` (its image size, channels and
    classes follow the data).  The training settings come from ``recipe`` (default: the digits CPU
    recipe of the optimizer, ``vit-tiny-adamw`` / ``vit-tiny-msgdw``; other optimizers start from
    ``vit-tiny-adamw`` and need ``lr``), then ``optimizer``, ``lr`` (default: the recipe's), ``seed``,
    the budget (``steps`` or ``epochs``; default: the recipe's epochs; with ``steps`` the warmup keeps
    the recipe's fraction), ``data`` (default: the built-in digits), ``threads`` and any other
    TrainConfig field in ``train_fields``.  ``out``: keep the run directory there (default: a
    temporary one, deleted afterwards).

    Returns ``test_acc``, ``val_acc``, ``test_loss``, ``val_loss``, ``params``, ``steps``,
    ``images`` (seen in training), ``train_s`` (the training steps' wall time: evaluation,
    logging and checkpoints left out), ``wall_s`` (all of it: data, model, checkpoints), ``cpu_s`` (this process's CPU
    time over all threads), ``images_per_s`` (images / train_s), the arm's settings and
    ``run_dir`` (None when temporary).
    """
    from ..accounting import count_parameters
    from ..config import ModelConfig
    from .recipes import RECIPES
    from .run import resolve_configs, train

    if recipe is None:
        recipe = f"vit-tiny-{optimizer}" if f"vit-tiny-{optimizer}" in RECIPES else "vit-tiny-adamw"
        if optimizer not in ("adamw", "msgdw") and lr is None and "lr" not in train_fields:
            raise ConfigError("lr", f"give a learning rate for {optimizer} (the CPU recipes tune adamw and msgdw)")
    fields_ = {"optimizer": optimizer, "seed": seed, "progress": False, **train_fields}
    for k, v in (("lr", lr), ("steps", steps), ("epochs", epochs), ("data", data), ("threads", threads)):
        if v is not None:
            fields_[k] = v
    if lr is not None and "min_lr" not in fields_:
        fields_["min_lr"] = lr / 100
    tcfg, _ = resolve_configs(recipe, train=fields_)
    if tcfg.domain != "vision":
        raise ConfigError("domain", f"train_vision_arm needs a vision recipe; {recipe!r} is {tcfg.domain}")

    tmp = None
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="difftx-vision-arm-")
        out = Path(tmp.name) / "run"
    t0, c0 = time.perf_counter(), _cpu_seconds()
    try:
        summary = train(tcfg, model_cfg, out, announce=None)
        saved = json.loads((Path(out) / "config.json").read_text())
    finally:
        wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
        if tmp is not None:
            tmp.cleanup()
    final, used = ModelConfig.from_dict(saved["model"]), TrainConfig.from_dict(saved["train"])
    images = summary["step"] * used.batch_size * used.accumulation(saved["world_size"]) * saved["world_size"]
    train_s = summary["elapsed_s"]
    return {"attention": final.attention, "norms": final.norms, "preset": final.preset, "optimizer": used.optimizer,
            "lr": used.lr, "seed": used.seed, "recipe": recipe, "params": count_parameters(final),
            "test_acc": summary.get("test_acc"), "val_acc": summary.get("val_acc"),
            "test_loss": summary.get("test_loss"), "val_loss": summary.get("val_loss"),
            "steps": summary["step"], "images": images, "train_s": train_s, "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2), "images_per_s": images / train_s if train_s else None,
            "run_dir": None if tmp is not None else str(out)}


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
