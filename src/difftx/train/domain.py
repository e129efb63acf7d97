"""The domain-specific parts of training, behind one small interface: batches, loss, evaluation.

The loop in :mod:`difftx.train.trainer` knows nothing about text or images; it
asks a :class:`Domain` for

* ``train_batches(step, n_micro)``: this process's micro-batches of a step
  (dicts of CPU tensors; a pure function of the step, so resuming is exact),
* ``count(batch)``: how many targets a batch scores (tokens not equal to -100,
  or images); gradients are normalised by the count of the whole step,
* ``loss(model, batch)``: the loss *summed* over those targets,
* ``evaluate(model, split)``: metrics such as ``{"val_loss": ...}``, reduced
  over processes,

plus the artifacts that go with a checkpoint (``save_artifacts``: the
tokenizer) and the model-config fields the data decides (``model_overrides``:
vocabulary size, sequence length).  :class:`LMDomain` is the language-model
domain, over a corpus or a registered synthetic task.  Another domain (e.g.
``vision``) subclasses :class:`Domain` and calls :func:`register_domain`; see
docs/training.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from ..errors import ConfigError, DataError
from .config import TrainConfig
from .distributed import World

DOMAINS: dict[str, Callable[[TrainConfig, World], "Domain"]] = {}
# task samplers: validation batches use steps from here on, disjoint from training's.  Under 2^32: task samplers
# seed from 32-bit words (difftx.evals.common.rng_for), in which 2^40 + i was training step i.
VAL_STEP_BASE = 1 << 31


def register_domain(name: str):
    """Register ``factory(train_cfg, world) -> Domain`` for ``difftx train --domain NAME``."""
    def deco(factory):
        DOMAINS[name] = factory
        return factory

    return deco


def get_domain(cfg: TrainConfig, world: World) -> "Domain":
    if cfg.domain not in DOMAINS:
        import importlib

        try:  # domains living elsewhere register themselves on import
            importlib.import_module(f"difftx.train.{cfg.domain}")
        except ModuleNotFoundError as e:
            if e.name != f"difftx.train.{cfg.domain}":
                raise
    if cfg.domain not in DOMAINS:
        raise ConfigError("domain", f"unknown or unavailable domain {cfg.domain!r}; available: {', '.join(DOMAINS)}")
    return DOMAINS[cfg.domain](cfg, world)


class Domain:
    """Base class: override what your domain needs.  Batches are dicts of tensors."""

    name = "base"
    unit = "tok"          # what size() counts, for the throughput display (tok, img)
    eval_splits = ("val",)  # splits evaluated at the end of training (e.g. ("val", "test"))

    def __init__(self, cfg: TrainConfig, world: World):
        self.cfg = cfg
        self.world = world

    def prepare(self, run_dir: Optional[Path] = None, progress: bool = True) -> None:
        """Load or build the data; ``run_dir`` holds artifacts of a run being resumed."""

    def check_explicit(self, explicit: frozenset) -> None:
        """After :meth:`prepare`: refuse a TrainConfig field in ``explicit`` (given by the user) that this data
        leaves unread."""

    def notes(self) -> list[str]:
        """What :meth:`prepare` noticed about the data (files skipped, ...): printed once the run's inputs are all
        checked, so a failing run prints its error alone."""
        return []

    def describe(self) -> dict:
        return {}

    def model_overrides(self, model_cfg, fixed: frozenset = frozenset()) -> dict:
        """ModelConfig fields the data decides; ``fixed`` names fields the user set (check, don't change)."""
        return {}

    def save_artifacts(self, path: Path) -> None:
        pass

    def steps_per_epoch(self, global_batch: int) -> Optional[float]:
        return None

    def train_batches(self, step: int, n_micro: int) -> list[dict]:
        raise NotImplementedError

    def count(self, batch: dict) -> int:
        raise NotImplementedError

    def size(self, batch: dict) -> int:
        return int(next(iter(batch.values())).numel())

    def loss(self, model, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model, split: str = "val") -> dict:
        return {}


class LMDomain(Domain):
    """Next-token prediction over a tokenised corpus or a synthetic task."""

    name = "lm"

    def __init__(self, cfg: TrainConfig, world: World):
        super().__init__(cfg, world)
        if cfg.domain_options:
            raise ConfigError("domain_options", f"the lm domain takes no options (got "
                                                f"{', '.join(sorted(cfg.domain_options))}); drop --domain-opt")
        self.tokenizer = None
        self.data = None
        self.sampler = None
        self.task = None
        self.corpus = None

    # ------------------------------------------------------------------ data
    def prepare(self, run_dir: Optional[Path] = None, progress: bool = True) -> None:
        from ..data.tokenizers import build_tokenizer, load_tokenizer

        cfg = self.cfg
        saved = Path(run_dir) / "tokenizer.json" if run_dir is not None else None
        if cfg.task is not None:
            from ..data.tasks import get_task

            factory = get_task(cfg.task)
            self.tokenizer = load_tokenizer(saved) if saved and saved.is_file() else build_tokenizer(cfg.tokenizer)
            if cfg.document_masking:
                raise ConfigError("document_masking", f"keeps a corpus's documents apart, and the task {cfg.task!r} "
                                                      "makes each sequence itself: drop --document-masking")
            try:
                self.task = factory(self.tokenizer, cfg.seq_len, cfg.seed, **cfg.task_options)
            except TypeError as e:
                raise ConfigError("task_options", f"task {cfg.task!r} rejected its options ({e})") from None
            return
        from ..data.corpus import resolve_corpus
        from ..data.shards import WindowSampler, default_cache_dir, prepare_tokens

        try:
            self.corpus = resolve_corpus(cfg.data, cfg.text_field)
        except DataError as e:
            import glob

            if run_dir is None or cfg.data is None or Path(cfg.data).exists() or glob.glob(cfg.data):
                raise
            raise DataError(f"{e} (the --data of the run being resumed; a relative path is read from the current "
                            "directory: run from the directory it started in, or pass --data with the corpus's "
                            "path)") from None
        if run_dir is not None:
            self._check_resumed_corpus(Path(run_dir))
        cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
        if saved is not None and saved.is_file():
            self.tokenizer = load_tokenizer(saved)
        elif self.world.is_main:
            self.tokenizer = build_tokenizer(cfg.tokenizer, self.corpus.texts, self.corpus.fingerprint(),
                                             cfg.bpe_vocab_size, cache)
        if self.world.distributed:  # rank 0 builds the tokenizer and the shard; the others read them
            self.tokenizer = self._share_tokenizer()
        if cfg.document_masking and self.tokenizer.eos_id is None:
            raise ConfigError("document_masking", f"needs the documents separated by an end-of-text token, and the "
                                                  f"{self.tokenizer.kind} tokenizer has none: use --tokenizer bpe "
                                                  "(its <|endoftext|> ends every document) or a tokenizer.json with "
                                                  "an EOS token")
        if self.world.is_main:
            self.data = prepare_tokens(self.corpus, self.tokenizer, cache, cfg.val_fraction, progress)
        self.world.barrier()
        if not self.world.is_main:
            self.data = prepare_tokens(self.corpus, self.tokenizer, cache, cfg.val_fraction, build=False)
        self.sampler = WindowSampler(self.data.train, cfg.seq_len, cfg.seed, "train")
        # a --val-fraction that rounds to no token is a validation split too small to use, not no validation
        self.val_sampler = WindowSampler(self.data.val, cfg.seq_len, cfg.seed, "validation") \
            if cfg.val_fraction > 0 else None

    def notes(self) -> list[str]:
        return list(self.corpus.notes) if self.corpus is not None else []

    def _check_resumed_corpus(self, run_dir: Path) -> None:
        """A resumed run trains on the corpus it started on (same path, other contents: not an exact resume)."""
        import json

        from ..errors import DataError

        try:
            saved = json.loads((run_dir / "config.json").read_text()).get("data", {}).get("corpus_fingerprint")
        except (OSError, ValueError, AttributeError):
            return  # no readable run config: the resume reports it
        if saved is not None and saved != self.corpus.fingerprint():
            raise DataError(f"--data {self.cfg.data or '(built-in corpus)'}: not the corpus of the run being "
                            f"resumed ({run_dir}): its contents changed since; resume with the same data, or start "
                            "a new --out")

    def _share_tokenizer(self):
        from ..data.tokenizers import tokenizer_from_dict

        data = self.world.broadcast_object(self.tokenizer.to_dict() if self.world.is_main else None)
        return self.tokenizer if self.world.is_main else tokenizer_from_dict(data)

    def describe(self) -> dict:
        tok = {"kind": self.tokenizer.kind, "vocab_size": self.tokenizer.vocab_size,
               "fingerprint": self.tokenizer.fingerprint()}
        if self.task is not None:
            return {"task": self.cfg.task, "task_options": self.cfg.task_options, "tokenizer": tok}
        m = self.data.manifest
        return {"corpus": m["corpus"], "corpus_fingerprint": m["corpus_fingerprint"], "shard": m["path"],
                "n_tokens": m["n_tokens"], "n_train": m["n_train"], "n_val": m["n_val"], "dtype": m["dtype"],
                "sources": len(m["sources"]), "tokenizer": tok}

    def model_overrides(self, model_cfg, fixed: frozenset = frozenset()) -> dict:
        vocab, whose = self.tokenizer.vocab_size, f"{self.tokenizer.kind} tokenizer's"
        task_vocab = int(getattr(self.task, "vocab", 0) or 0)  # a task drawing its own ids (mqar's vocab option)
        if task_vocab > vocab:
            vocab, whose = task_vocab, f"{self.cfg.task} task's"
        if "vocab_size" not in fixed:
            return {"vocab_size": vocab}
        if model_cfg.vocab_size < vocab:
            raise ConfigError("vocab_size", f"the model's vocabulary ({model_cfg.vocab_size}) is smaller than the "
                                            f"{whose} ({vocab}); raise --vocab-size or drop it to use {vocab}")
        return {}

    def save_artifacts(self, path: Path) -> None:
        self.tokenizer.save(Path(path))

    def steps_per_epoch(self, global_batch: int) -> Optional[float]:
        if self.data is None:
            return None
        return self.data.n_train / (global_batch * self.cfg.seq_len)

    # ------------------------------------------------------------------ batches
    def train_batches(self, step: int, n_micro: int) -> list[dict]:
        b, rank = self.cfg.batch_size, self.world.rank
        per_rank = b * n_micro
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        if self.task is not None:
            # the step's whole global batch from (seed, step), this process's rows of it: the data of a
            # step then depends on neither the process count nor the micro-batch split (as a corpus's)
            x, y = (t[mine] for t in self.task.batch(per_rank * self.world.world_size, step, 0))
            return [{"input_ids": x[m * b:(m + 1) * b], "targets": y[m * b:(m + 1) * b]} for m in range(n_micro)]
        offsets = self.sampler.offsets(step, per_rank * self.world.world_size)[mine]
        out = []
        for m in range(n_micro):
            x, y = self.sampler.gather(offsets[m * b:(m + 1) * b])
            out.append({"input_ids": x, "targets": y})
        return out

    def count(self, batch: dict) -> int:
        return int((batch["targets"] != -100).sum())

    def size(self, batch: dict) -> int:
        return int(batch["input_ids"].numel())

    def loss(self, model, batch: dict) -> torch.Tensor:
        kw = {}
        if self.cfg.document_masking:  # each window's documents (split after every EOS) attend only to themselves
            from ..nn.mask import document_ids

            kw["document_ids"] = document_ids(batch["input_ids"], self.tokenizer.eos_id)
        out = model(batch["input_ids"], targets=batch["targets"], attention_mask=batch.get("attention_mask"),
                    loss_reduction="sum", loss_chunk=self.cfg.loss_chunk, **kw)
        return out.loss

    # ------------------------------------------------------------------ evaluation
    def _val_batches(self) -> list[tuple[dict, bool]]:
        """This process's share of the ``eval_batches`` validation batches, each with whether it counts: every
        process runs the same number of forwards (FSDP's are collective), the ones past ``eval_batches``
        (repeats of batch 0) only for that, so the loss is the same whatever the process count."""
        n, b, w = self.cfg.eval_batches, self.cfg.batch_size, self.world
        padded = -(-n // w.world_size) * w.world_size
        mine = [(i if i < n else 0, i < n) for i in range(w.rank, padded, w.world_size)]
        if self.task is not None:
            return [(dict(zip(("input_ids", "targets"), self.task.batch(b, VAL_STEP_BASE + i, 0))), real)
                    for i, real in mine]
        if self.val_sampler is None:
            return []
        offsets = self.val_sampler.fixed(n * b)
        return [(dict(zip(("input_ids", "targets"), self.val_sampler.gather(offsets[i * b:(i + 1) * b]))), real)
                for i, real in mine]

    def evaluate(self, model, split: str = "val") -> dict:
        batches = self._val_batches()
        if not batches:
            return {}
        device = self.world.device
        total = torch.zeros(2, dtype=torch.float64, device=device)
        for batch, real in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = self.loss(model, batch).double()
            if real:
                total[0] += loss
                total[1] += self.count(batch)
        self.world.all_reduce_sum(total)
        return {"val_loss": float(total[0] / total[1].clamp_min(1))}


register_domain("lm")(LMDomain)
