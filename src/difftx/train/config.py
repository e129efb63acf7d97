"""TrainConfig: everything about a training run that is not the model's architecture.

One dataclass, validated once in ``__post_init__`` (a bad value raises
:class:`~difftx.errors.ConfigError` naming the field).  Precedence when the CLI
builds one: these defaults < a ``--recipe`` < explicit flags.  The defaults are
a CPU run that finishes in about a minute (the ``nano`` preset on the built-in
corpus) with nanoGPT's shakespeare_char optimiser settings.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from ..config import known_fields
from ..errors import ConfigError
from ..optim import OPTIMIZERS, SCHEDULES

DTYPES = ("auto", "fp32", "bf16")
PARALLEL = ("auto", "none", "ddp", "fsdp")
MAX_SEED = 1 << 63

# fields a resumed run may change (the rest must match the run being resumed)
RESUMABLE_CHANGES = ("steps", "stop_at", "eval_every", "eval_batches", "log_every", "diag_every",
                     "checkpoint_every", "keep_last", "tensorboard", "progress", "compile", "cache_dir", "device",
                     "parallel", "dtype", "threads", "loss_chunk", "activation_checkpointing",
                     "grad_accum", "global_batch")  # how a step's batch is split: its size is checked on resume


@dataclass
class TrainConfig:
    """A training run.  Counts are optimizer steps; batch sizes count sequences (or images)."""

    # data
    domain: str = "lm"                    # lm | vision (registered by difftx.train.domain)
    data: Optional[str] = None            # file, directory, glob, .jsonl, HF dataset dir; None: built-in corpus
    tokenizer: str = "byte"               # byte | char | bpe | path to a tokenizer.json
    bpe_vocab_size: int = 4096            # vocabulary of a locally trained bpe tokenizer
    text_field: str = "text"              # JSONL / datasets field holding the text
    val_fraction: float = 0.1             # tail of the token stream held out for validation
    task: Optional[str] = None            # a registered synthetic task instead of a corpus
    task_options: dict = field(default_factory=dict)
    domain_options: dict = field(default_factory=dict)  # extra knobs of a domain (e.g. vision augmentation)
    # token shards and bpe vocabularies; default $DIFFTX_CACHE, else $DIFFTX_CACHE_DIR, else
    # $XDG_CACHE_HOME/difftx, else ~/.cache/difftx
    cache_dir: Optional[str] = None

    # batch and length
    seq_len: Optional[int] = None         # None: the model's max_seq_len
    batch_size: int = 12                  # sequences per micro-batch per process
    grad_accum: int = 1                   # micro-batches per optimizer step
    global_batch: Optional[int] = None    # sequences per step over all processes; sets grad_accum when given
    steps: int = 500
    epochs: Optional[float] = None        # set steps from the dataset size instead (domains that know it)
    warmup_epochs: Optional[float] = None

    # optimiser and schedule
    optimizer: str = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-4
    schedule: str = "cosine"
    warmup: int = 100
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.99)
    momentum: float = 0.9
    nesterov: bool = False
    eps: float = 1e-8
    decay_all: bool = False               # weight decay on norms, biases, lambdas and embeddings too
    grad_clip: float = 1.0                # 0 disables clipping (the norm is still logged)

    # runtime
    dtype: str = "auto"                   # auto: bf16 autocast where the hardware has it, else fp32
    compile: bool = False
    device: str = "auto"                  # auto | cpu | cuda
    threads: Optional[int] = None         # CPU threads per process (torch.set_num_threads); None: torch's default
    loss_chunk: int = 0                   # lm: the loss this many tokens at a time, never all logits; 0: off
    activation_checkpointing: int = 0     # every Nth block recomputes its activations in backward; 0: off, 1: all
    document_masking: bool = False        # lm: attention stays within each document of a window (split at EOS)
    parallel: str = "auto"                # auto (ddp when launched with several processes) | none | ddp | fsdp
    seed: int = 1337

    # evaluation, logging, checkpoints
    eval_every: int = 250                 # 0: only at the end
    eval_batches: int = 50
    log_every: int = 1                    # a metrics.jsonl row every this many steps
    diag_every: int = 100                 # per-layer lambda and per-group gradient norms; 0: never
    checkpoint_every: int = 0             # 0: only at the end
    keep_last: int = 3
    stop_at: Optional[int] = None         # stop (with a checkpoint) after this step; resume later
    tensorboard: bool = False
    progress: Optional[bool] = None       # None: a progress bar when stderr is a terminal
    recipe: Optional[str] = None          # informational: the recipe this config came from

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        self.task_options = dict(self.task_options or {})
        self.domain_options = dict(self.domain_options or {})

        def positive_int(name: str, allow_zero: bool = False, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if allow_zero else 1):
                raise ConfigError(name, f"must be a {'non-negative' if allow_zero else 'positive'} integer; got {v!r}")

        def number(name: str, lo: float = 0.0, hi: float = math.inf, lo_open: bool = False) -> None:
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi
            if not ok or (lo_open and v == lo):
                where = f"{'>' if lo_open else '>='} {lo:g}" if hi == math.inf else \
                    f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
                raise ConfigError(name, f"must be a finite number {where}; got {v!r}")

        def choice(name: str, options) -> None:
            if getattr(self, name) not in options:
                raise ConfigError(name, f"must be one of {', '.join(options)}; got {getattr(self, name)!r}")

        choice("optimizer", OPTIMIZERS)
        choice("schedule", SCHEDULES)
        choice("dtype", DTYPES)
        choice("parallel", PARALLEL)
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ConfigError("device", f"must be auto, cpu or cuda[:N]; got {self.device!r}")
        for name in ("batch_size", "grad_accum", "steps", "bpe_vocab_size", "eval_batches", "keep_last", "log_every"):
            positive_int(name)
        for name in ("warmup", "eval_every", "diag_every", "checkpoint_every", "loss_chunk",
                     "activation_checkpointing"):  # 0: off (see above)
            positive_int(name, allow_zero=True)
        for name in ("seq_len", "global_batch", "stop_at", "threads"):
            positive_int(name, allow_none=True)
        positive_int("seed", allow_zero=True)
        if not isinstance(self.document_masking, bool):
            raise ConfigError("document_masking", f"must be true or false; got {self.document_masking!r}")
        if self.seed >= MAX_SEED:  # torch.manual_seed(seed + rank) takes 64 bits
            raise ConfigError("seed", f"must be below 2^63; got {self.seed}")
        number("lr", 0.0, lo_open=True)
        number("min_lr")
        number("weight_decay")
        number("momentum", 0.0, 1.0)
        number("eps", 0.0, lo_open=True)
        number("grad_clip")
        number("val_fraction", 0.0, 0.9)
        if self.optimizer == "muon" and (self.momentum != TrainConfig.momentum or self.nesterov):
            raise ConfigError("momentum" if self.nesterov is False else "nesterov",
                              "Muon keeps its own momentum (0.95, Nesterov); momentum and nesterov set msgdw's and "
                              "sgd's: drop them")
        if self.nesterov and self.momentum == 0 and self.optimizer in ("sgd", "msgdw"):
            raise ConfigError("nesterov", "needs a momentum above 0 (torch's SGD refuses Nesterov without one); "
                                          "drop --nesterov or give --momentum")
        if self.min_lr > self.lr and self.schedule != "constant":  # unread there (optim.lr_at)
            raise ConfigError("min_lr", f"({self.min_lr}) must not exceed lr ({self.lr})")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            raise ConfigError("betas", f"must be two numbers in [0, 1); got {self.betas!r}")
        if self.epochs is not None:
            number("epochs", 0.0, lo_open=True)
        if self.warmup_epochs is not None:
            if self.epochs is None:
                raise ConfigError("warmup_epochs", "needs --epochs (with --steps give the warmup in steps: --warmup)")
            number("warmup_epochs")
        if self.task is not None and self.data is not None:
            raise ConfigError("task", "give either --task or --data, not both")

    # ------------------------------------------------------------------ derived
    def accumulation(self, world_size: int = 1) -> int:
        """Micro-batches per step: ``grad_accum``, or what ``global_batch`` needs at this world size."""
        if self.global_batch is None:
            return self.grad_accum
        per_step = self.batch_size * world_size
        if self.global_batch % per_step:
            raise ConfigError("global_batch", f"{self.global_batch} is not a multiple of batch_size x processes "
                                              f"= {self.batch_size} x {world_size}; adjust --batch-size or "
                                              "--global-batch")
        return self.global_batch // per_step

    def lr_kwargs(self) -> dict:
        return dict(total_steps=self.steps, peak_lr=self.lr, schedule=self.schedule, warmup=self.warmup,
                    min_lr=self.min_lr)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        data = known_fields(cls, data)
        if data.get("epochs") is None and data.get("warmup_epochs") is not None:
            data["warmup_epochs"] = None  # saved by runs before this was refused: it was ignored, and still is
        return cls(**data)

    def replace(self, **changes) -> "TrainConfig":
        return TrainConfig.from_dict({**self.to_dict(), **changes})
