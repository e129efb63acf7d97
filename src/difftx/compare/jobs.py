"""Jobs: one training run (task x arm x seed x learning rate) and the configs the trainer gets for it.

A job's directory, ``OUT/runs/TASK/ARM/seedS-lrLR``, is an ordinary ``difftx
train`` run directory plus ``job.json`` (the measurements), written last: a job
is complete exactly when ``job.json`` exists, so an interrupted study resumes
by skipping complete jobs and continuing the others from their checkpoints.
The same job in a learning-rate sweep and in the study proper is the same
directory, so a sweep's best run is not trained twice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ..accounting import flops_per_token
from ..train.config import TrainConfig
from .arms import Arm
from .study import OPTIMIZER_SETTINGS, StudyConfig

JOB_FILE = "job.json"


@dataclass(frozen=True)
class Job:
    task: str            # corpus | retrieval
    arm: Arm
    seed: int
    lr: float
    steps: int
    sweep: bool = False  # part of the learning-rate sweep (corpus, first seed)

    @property
    def key(self) -> str:
        return f"{self.task}/{self.arm.id}/seed{self.seed}-lr{self.lr:g}"

    def run_dir(self, out: Path) -> Path:
        return Path(out) / "runs" / self.key

    def describe(self) -> str:
        return f"{self.arm.id} {self.task} seed {self.seed}" + (f" lr {self.lr:g}" if self.sweep else "")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["arm"] = self.arm.id
        d["key"] = self.key
        return d


def train_config(study: StudyConfig, job: Job) -> TrainConfig:
    """The TrainConfig of a job: the study's budget and batches, the arm's optimiser recipe and lr."""
    opt = dict(OPTIMIZER_SETTINGS[study.domain].get(job.arm.optimizer, {}))
    warmup = round(opt.pop("warmup_fraction", 0.0) * job.steps)
    seq = study.task_seq_len(job.task)
    fields = dict(
        domain=study.domain, data=study.data if job.task == "corpus" else None, tokenizer=study.tokenizer,
        cache_dir=study.cache_dir, seq_len=seq, batch_size=study.task_batch(job.task), steps=job.steps,
        optimizer=job.arm.optimizer, lr=job.lr, min_lr=job.lr * study.min_lr_ratio, schedule=study.schedule,
        warmup=warmup, grad_clip=study.grad_clip, dtype=study.dtype, device=study.device, threads=study.threads,
        seed=job.seed, eval_every=eval_every(study, job), eval_batches=study.eval_batches, log_every=1,
        diag_every=0, checkpoint_every=0, keep_last=1, progress=False,
        activation_checkpointing=study.activation_checkpointing,
        document_masking=study.document_masking and job.task == "corpus", **opt)
    if job.task == "retrieval":
        fields.update(task=study.retrieval, task_options=retrieval_task_options(study))
    return TrainConfig(**fields)


def eval_every(study: StudyConfig, job: Job) -> int:
    """Validation evaluations along the run: ``eval_points`` of them for the corpus, start and end for tasks."""
    points = study.eval_points if job.task == "corpus" else 1
    return max(1, job.steps // points)


def retrieval_task_options(study: StudyConfig) -> dict:
    opts = dict(study.retrieval_options)
    if study.retrieval == "niah":
        opts.setdefault("template", "short")
        opts.setdefault("digits", 2)
        opts.setdefault("needles", "1-4")
    return opts


def step_cost(study: StudyConfig, job: Job) -> float:
    """Relative cost of one step (FLOPs of the step), for the schedule and the first ETA."""
    cfg = study.model_config(job.arm, job.task)
    seq = study.task_seq_len(job.task) or 1
    try:
        per_token = flops_per_token(cfg, seq, True, True)
    except Exception:  # an unusual config: fall back to 6 x parameters
        from ..accounting import count_parameters

        per_token = 6.0 * count_parameters(cfg)
    # norms and the second softmax are not matmul FLOPs but cost CPU time at small widths (measured ~1.2-1.4x)
    extra = 1.0 + 0.2 * (cfg.attention != "softmax") + 0.25 * bool(cfg.mid_norm_attn or cfg.qk_norm)
    return per_token * seq * study.task_batch(job.task) * extra


def plan(study: StudyConfig, lrs: dict[str, float] | None = None, world_size: int = 1) -> list[Job]:
    """The study's jobs (every task x arm x seed) at the given per-arm learning rates."""
    jobs = []
    for task in study.tasks():
        steps = study.task_steps(task, world_size)
        for arm in study.arm_list():
            lr = (lrs or {}).get(arm.id, study.lr_for(arm))
            for seed in study.seed_list():
                jobs.append(Job(task, arm, seed, lr, steps))
    return jobs


def sweep_plan(study: StudyConfig, world_size: int = 1) -> list[Job]:
    """The sweep: every arm at every lr of its optimiser's grid, corpus task, first seed."""
    grid = study.lr_sweep or {}
    steps = study.task_steps("corpus", world_size)
    jobs = []
    for arm in study.arm_list():
        for lr in grid.get(arm.optimizer, [study.lr_for(arm)]):
            jobs.append(Job("corpus", arm, study.seed, float(lr), steps, sweep=True))
    return jobs
