"""What a study is: :class:`StudyConfig` (validated once) and the jobs it expands to.

A study trains every arm on two tasks, each for ``--seeds`` seeds:

* ``corpus``: next-token prediction on the corpus (``--data``, default the
  built-in one) for the same token budget (``--tokens``), the same batches
  (the trainer draws them from ``(seed, step)``, so every arm sees the same
  windows in the same order for a seed) and its own learning rate;
* ``retrieval``: a retrieval task learnt from scratch with the same budget
  rules (``--retrieval mqar``, the default at CPU scale, or ``niah``, the
  DIFF paper's multi-needle task; ``none`` skips it).

Learning rates come from :data:`DEFAULT_LRS` (per optimiser: values that
train every default arm stably at the default scale, not tuned per arm), from
``--lr`` (per optimiser or per arm), or from ``--lr-sweep`` (a grid per optimiser; each arm gets the
grid's best final validation loss on the corpus, first seed).  The other
optimiser settings are the papers' recipes (:data:`OPTIMIZER_SETTINGS`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from ..config import ModelConfig
from ..errors import ConfigError
from .arms import DEFAULT_ARMS, Arm, parse_arms

TASKS = ("corpus", "retrieval")
MAX_SEEDS = 1000   # seeds per arm: each is a training run per arm and task (more is a typo, not a study)
SEED_LIMIT = 2 ** 63  # the trainer's seeds are below it (TrainConfig)
RETRIEVAL_TASKS = ("mqar", "niah", "none")

# Per domain and optimiser; stable for every default arm at the default scale (not tuned per arm: use --lr-sweep).
# Vision: the digits recipes of difftx.train.recipes (vit-/vdnt-tiny-adamw/-msgdw).
DEFAULT_LRS = {"lm": {"adamw": 4e-3, "msgdw": 0.3, "sgd": 0.3, "muon": 0.02},
               "vision": {"adamw": 2e-3, "msgdw": 0.1, "sgd": 0.1, "muon": 0.02}}
DEFAULT_SWEEP = {"adamw": (1e-3, 2e-3, 4e-3, 8e-3), "msgdw": (0.1, 0.3, 1.0, 3.0)}
# The papers' recipes (DNT Table 5: AdamW (0.9, 0.95), wd 0.1, warmup; mSGDW momentum 0.9, wd 1e-4, no warmup).
# Warmup is a fraction of the run (the recipes' 2000 of 200k steps is 1%; tiny runs need a little more).
_MSGDW = dict(momentum=0.9, weight_decay=1e-4, warmup_fraction=0.0)
OPTIMIZER_SETTINGS = {
    "lm": {"adamw": dict(betas=(0.9, 0.95), weight_decay=0.1, warmup_fraction=0.05), "msgdw": _MSGDW,
           "sgd": dict(momentum=0.9, weight_decay=0.0, warmup_fraction=0.0),
           "muon": dict(weight_decay=0.1, warmup_fraction=0.05)},
    "vision": {"adamw": dict(betas=(0.9, 0.99), weight_decay=0.05, warmup_fraction=0.15),
               "msgdw": dict(_MSGDW, warmup_fraction=0.15),
               "sgd": dict(momentum=0.9, weight_decay=0.0, warmup_fraction=0.15),
               "muon": dict(weight_decay=0.05, warmup_fraction=0.15)},
}

# The default scale per domain: what fits in 10 minutes on a 2-core CPU (docs/compare.md, "Budget").
DEFAULTS = {
    # Xavier init in every arm: DNT Table 5 trains GPT-2 and L-DNT alike with it (nano's own is GPT-2's normal)
    "lm": dict(preset="nano", model={"n_layers": 2, "init": "xavier"}, seq_len=64, batch_size=16, tokens=256_000,
               retrieval="mqar", retrieval_seq_len=64, retrieval_batch_size=32, retrieval_tokens=400_000,
               retrieval_options={"pairs": "2-6", "vocab": 64}),
    "vision": dict(preset="vit-tiny", model={}, seq_len=None, batch_size=64, steps=300, retrieval="none"),
}
# The papers' scale, printed beside the study's in the report.
PAPERS_SCALE = {
    "diff": "DIFF Transformer: 3B-parameter models on 350B tokens (sec. 3.1); scaling runs 830M-13.1B on 10B tokens",
    "dnt": "DNT: 124M-1.4B language models for 200K steps of 480-512 x 1024 tokens (about 100B tokens); "
           "ViT/V-DNT-Large and -Huge on ImageNet-1k for 150 epochs",
}


@dataclass
class StudyConfig:
    """A comparison study.  ``None`` fields take the domain's default (:data:`DEFAULTS`)."""

    domain: str = "lm"
    preset: Optional[str] = None
    model: Optional[dict] = None            # ModelConfig changes applied to the base (before the arms')
    arms: Optional[list] = None             # ["transformer:adamw", ...]
    seeds: int = 2
    seed: int = 0                           # the first seed; seeds are seed, seed+1, ...
    data: Optional[str] = None
    tokenizer: str = "byte"
    document_masking: bool = False          # corpus runs: attention within each document (needs an EOS tokenizer)
    cache_dir: Optional[str] = None

    # corpus task budget: steps = ceil(tokens / (global batch x seq_len)) unless steps is given
    tokens: Optional[int] = None
    steps: Optional[int] = None
    seq_len: Optional[int] = None
    batch_size: Optional[int] = None        # sequences per step per process

    # retrieval task
    retrieval: Optional[str] = None         # mqar | niah | none
    retrieval_tokens: Optional[int] = None
    retrieval_steps: Optional[int] = None
    retrieval_seq_len: Optional[int] = None
    retrieval_batch_size: Optional[int] = None
    retrieval_options: Optional[dict] = None

    # optimisation
    lr: dict = field(default_factory=dict)  # {"adamw": 3e-3} or {"dnt-msgdw": 0.5}: per optimiser or per arm id
    lr_sweep: Optional[dict] = None         # {"adamw": [1e-3, ...], ...}: sweep these per arm on the corpus
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0

    # evaluation
    eval_points: int = 8                    # validation evaluations along each corpus run
    eval_batches: int = 16
    outlier_tokens: int = 4096
    tail_batches: int = 8
    tail_entries: int = 4096
    retrieval_samples: int = 32

    # runtime
    dtype: str = "auto"
    device: str = "auto"
    workers: Optional[int] = None           # parallel job processes on a CPU (None: auto)
    threads: Optional[int] = None           # torch threads per job process (None: auto)
    activation_checkpointing: int = 0       # every Nth block recomputed in backward (0: off); the same results

    def __post_init__(self) -> None:
        if self.domain not in DEFAULTS:
            raise ConfigError("domain", f"must be one of {', '.join(DEFAULTS)}; got {self.domain!r}")
        d = DEFAULTS[self.domain]
        # the default's model changes ("nano at 2 layers, Xavier init") belong to its preset: --set adds to them; a
        # --preset of the user's is taken as it is, plus --set (gpt2-124m was trained at 2 layers)
        self.model = {**d["model"], **(self.model or {})} if self.preset is None else dict(self.model or {})
        if self.retrieval not in (None, d["retrieval"]):
            self.retrieval_options = dict(self.retrieval_options or {})  # the default's options are its own task's
        elif self.retrieval_options is not None and isinstance(d.get("retrieval_options"), dict):
            # (MQAR's pairs and keys); --retrieval-opt adds to them, as --set adds to the default base's changes
            self.retrieval_options = {**d["retrieval_options"], **self.retrieval_options}
        for name, value in d.items():
            if getattr(self, name, None) is None:
                setattr(self, name, dict(value) if isinstance(value, dict) else value)
        if self.arms is None:
            self.arms = list(DEFAULT_ARMS[self.domain])
        self.arms = [a.spec for a in parse_arms(self.arms, self.domain)]
        self.retrieval_options = dict(self.retrieval_options or {})
        self.lr = {str(k): float(v) for k, v in (self.lr or {}).items()}
        if self.lr_sweep is not None:
            self.lr_sweep = {str(k): sorted(float(x) for x in v) for k, v in self.lr_sweep.items()}
        self._validate()

    def _validate(self) -> None:
        def positive(name: str, allow_none: bool = True) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(name, f"must be a positive integer; got {v!r}")

        for name in ("seeds", "eval_points", "eval_batches", "outlier_tokens", "tail_batches", "tail_entries",
                     "retrieval_samples"):
            positive(name, allow_none=False)
        for name in ("tokens", "steps", "seq_len", "batch_size", "retrieval_tokens", "retrieval_steps",
                     "retrieval_seq_len", "retrieval_batch_size", "workers", "threads"):
            positive(name)
        if not isinstance(self.document_masking, bool):
            raise ConfigError("document_masking", f"must be true or false; got {self.document_masking!r}")
        if self.document_masking and self.domain != "lm":
            raise ConfigError("document_masking", "keeps a language corpus's documents apart; images have none: "
                                                  "drop it")
        if self.document_masking and self.tokenizer in ("byte", "char"):
            raise ConfigError("document_masking", f"needs the documents separated by an end-of-text token, and the "
                                                  f"{self.tokenizer} tokenizer has none: give --tokenizer bpe (or a "
                                                  "tokenizer.json with an EOS token)")
        v = self.activation_checkpointing
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError("activation_checkpointing", f"must be a non-negative integer (0: off); got {v!r}")
        if self.seeds > MAX_SEEDS:
            raise ConfigError("seeds", f"at most {MAX_SEEDS} seeds per arm (each is a training run per arm and task); "
                                       f"got {self.seeds}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError("seed", f"must be an integer; got {self.seed!r}")
        if self.seed < 0:
            raise ConfigError("seed", f"must be >= 0; got {self.seed}")
        if self.seed + self.seeds - 1 >= SEED_LIMIT:
            raise ConfigError("seed", f"the last seed, {self.seed} + {self.seeds} - 1, must be below 2^63; give a "
                                      "smaller --seed")
        if self.tail_batches < 2:
            raise ConfigError("tail_batches", "needs at least 2 gradients to measure noise")
        if self.retrieval not in RETRIEVAL_TASKS:
            raise ConfigError("retrieval", f"must be one of {', '.join(RETRIEVAL_TASKS)}; got {self.retrieval!r}")
        if self.domain == "vision" and self.retrieval != "none":
            raise ConfigError("retrieval", "retrieval tasks are language tasks; use --retrieval none with "
                                           "--domain vision")
        if self.domain == "vision" and self.tokens is not None:
            raise ConfigError("tokens", "vision studies count --steps, not tokens")
        if self.domain == "lm" and self.steps is None and self.tokens is None:
            raise ConfigError("tokens", "give --tokens or --steps")
        if not (0.0 <= self.min_lr_ratio <= 1.0):
            raise ConfigError("min_lr_ratio", f"must be in [0, 1]; got {self.min_lr_ratio}")
        if self.grad_clip < 0:
            raise ConfigError("grad_clip", f"must be >= 0; got {self.grad_clip}")
        ids = {a.id for a in self.arm_list()}
        opts = {a.optimizer for a in self.arm_list()}
        for key, v in self.lr.items():
            if key not in ids and key not in opts:
                raise ConfigError("lr", f"{key!r} is neither an optimiser of the study ({', '.join(sorted(opts))}) "
                                        f"nor an arm id ({', '.join(sorted(ids))})")
            if not (v > 0 and math.isfinite(v)):
                raise ConfigError("lr", f"{key}: must be a positive number; got {v}")
        if self.lr_sweep is not None:
            for key, grid in self.lr_sweep.items():
                if key not in opts:
                    raise ConfigError("lr_sweep", f"{key!r} is not an optimiser of the study ({', '.join(sorted(opts))})")
                if not grid or any(not (x > 0 and math.isfinite(x)) for x in grid):
                    raise ConfigError("lr_sweep", f"{key}: needs positive learning rates; got {grid}")
                names = [f"{x:g}" for x in grid]  # a job's directory is named by its lr: one run each
                twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
                if twice is not None:
                    raise ConfigError("lr_sweep", f"{key}: lists the learning rate {twice} twice; give each once")
            arm_opt = {a.id: a.optimizer for a in self.arm_list()}
            for key in self.lr:  # a swept optimiser's arms train at its grid: an --lr for them would go unread
                if arm_opt.get(key, key) in self.lr_sweep:
                    raise ConfigError("lr", f"{key}: the --lr-sweep grid of {arm_opt.get(key, key)} sets this lr; "
                                            "give it in the grid or drop it")

    # ------------------------------------------------------------------ arms and models
    def arm_list(self) -> list[Arm]:
        return parse_arms(self.arms, self.domain)

    def seed_list(self) -> list[int]:
        return list(range(self.seed, self.seed + self.seeds))

    def base_config(self) -> ModelConfig:
        try:
            cfg = ModelConfig.from_preset(self.preset, **(self.model or {}))
        except TypeError as e:
            raise ConfigError("model", str(e)) from None
        if cfg.domain != self.domain:
            raise ConfigError("preset", f"{self.preset!r} is a {cfg.domain} model; this is a {self.domain} study "
                                        f"(pick a {self.domain} preset or --domain {cfg.domain})")
        return cfg

    def model_config(self, arm: Arm, task: str = "corpus") -> ModelConfig:
        cfg = arm.model_config(self.base_config())
        seq = self.task_seq_len(task)
        if seq is not None and cfg.domain == "lm":
            if cfg.positions in ("learned", "sinusoidal") and seq > cfg.max_seq_len:
                raise ConfigError("seq_len", f"{seq} exceeds the preset's max_seq_len {cfg.max_seq_len} "
                                             f"({cfg.positions} positions)")
            cfg = cfg.replace(max_seq_len=max(seq, cfg.max_seq_len) if cfg.positions in ("learned", "sinusoidal")
                              else seq)
        return cfg

    def lr_for(self, arm: Arm) -> float:
        return self.lr.get(arm.id, self.lr.get(arm.optimizer, DEFAULT_LRS[self.domain].get(arm.optimizer, 1e-3)))

    def lr_source(self, arm: Arm) -> str:
        if arm.id in self.lr:
            return "--lr (arm)"
        if arm.optimizer in self.lr:
            return "--lr (optimizer)"
        return "default"

    # ------------------------------------------------------------------ budgets
    def task_seq_len(self, task: str) -> Optional[int]:
        return self.retrieval_seq_len if task == "retrieval" else self.seq_len

    def task_batch(self, task: str) -> int:
        return self.retrieval_batch_size if task == "retrieval" else self.batch_size

    def task_steps(self, task: str, world_size: int = 1) -> int:
        steps = self.retrieval_steps if task == "retrieval" else self.steps
        if steps is not None:
            return steps
        tokens = self.retrieval_tokens if task == "retrieval" else self.tokens
        per_step = self.task_batch(task) * world_size * (self.task_seq_len(task) or 1)
        return max(1, math.ceil(tokens / per_step))

    def tasks(self) -> list[str]:
        return ["corpus"] + (["retrieval"] if self.retrieval != "none" else [])

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "StudyConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(unknown[0], "unknown study field")
        return cls(**data)

    # fields that may differ when a study is resumed (they do not change any number it measures)
    RESUMABLE = ("workers", "threads", "device", "cache_dir", "activation_checkpointing")
