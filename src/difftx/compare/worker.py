"""One job: train with :func:`difftx.train.train`, then measure, then write ``job.json`` (last).

Runs in the study's own process (one GPU, or every rank under ``torchrun``:
training is distributed through the trainer, measurements run on rank 0) or
in a worker process of the CPU pool (:func:`init_worker`).  Progress goes to a
``report(event: dict)`` callable: the runner's display, or a queue back to it.
A run that diverges (non-finite loss) is a result, not an error: ``job.json``
records it and the report says so.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from ..analysis.common import json_safe
from ..data.shards import SplitTooSmall
from ..io import atomic_write_text
from .jobs import JOB_FILE, Job, train_config
from .study import StudyConfig

Report = Callable[[dict], None]


class _Progress:
    """Trainer callback: step events, at most a few per second (and always the last step)."""

    def __init__(self, job: Job, report: Report, every_s: float = 0.25):
        self.job, self.report, self.every_s = job, report, every_s
        self.last = 0.0
        self.stopping = False

    def on_step_end(self, trainer, row) -> None:
        if _STOP is not None and _STOP.is_set() and not self.stopping:
            # the study is stopping: the trainer's own SIGINT handling checkpoints after this step and returns
            self.stopping = True
            os.kill(os.getpid(), signal.SIGINT)
        now = time.monotonic()
        if now - self.last >= self.every_s or row["step"] == self.job.steps:
            self.last = now
            self.report({"event": "step", "job": self.job.key, "step": row["step"], "steps": self.job.steps,
                         "loss": row["loss"]})


def read_job(run_dir: Path) -> Optional[dict]:
    path = Path(run_dir) / JOB_FILE
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None  # a damaged result is recomputed
    return result if _is_result(result) else None  # so is valid JSON of the wrong shape ([], null, keys missing)


_SECTIONS = ("final", "train", "curve", "throughput", "memory", "retrieval", "attention", "outliers", "tails")


def _is_result(r) -> bool:
    """Whether ``r`` has the shape :func:`run_job` writes, as far as the results read it without checking."""
    def integer(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not isinstance(r, dict) or not isinstance(r.get("job"), dict):
        return False
    if not (integer(r["job"].get("seed")) and integer(r["job"].get("steps"))):
        return False
    if any(r.get(k) is not None and not isinstance(r[k], dict) for k in _SECTIONS):
        return False
    if r.get("lambdas") is not None and not isinstance(r["lambdas"], list):
        return False
    curve = r.get("curve")
    if curve:
        rows = [curve.get("val"), curve.get("train")]
        if not all(isinstance(x, list) and all(isinstance(row, list) and len(row) >= 2 for row in x) for x in rows):
            return False
        if curve.get("tokens_per_step") is not None and not isinstance(curve["tokens_per_step"], (int, float)):
            return False
    retrieval = r.get("retrieval")
    return not retrieval or isinstance(retrieval.get("overall"), (int, float))


RESUMED_JOB_FIELDS = ("threads", "device", "cache_dir", "data", "activation_checkpointing")


def _resumed_job_fields(study: StudyConfig, job: Job) -> tuple:
    """RESUMED_JOB_FIELDS less the cache directory where the job reads none (a retrieval task, a vision run): the
    trainer refuses an explicit --cache-dir that its run would not read."""
    if job.task == "corpus" and study.domain == "lm":
        return RESUMED_JOB_FIELDS
    return tuple(f for f in RESUMED_JOB_FIELDS if f != "cache_dir")


def run_job(study: StudyConfig, job: Job, out: Path, report: Report = lambda e: None) -> dict:
    """Train (or continue) the job's run, measure it, write and return ``job.json``'s contents."""
    from ..train import TrainingDiverged, train
    from ..train.distributed import init_world

    run_dir = job.run_dir(out)
    done = read_job(run_dir)
    if done is not None:
        return done
    world = init_world(study.device)  # the caller's process group, when under torchrun
    tcfg = train_config(study, job)
    mcfg = study.model_config(job.arm, job.task)
    report({"event": "start", "job": job.key, "steps": job.steps})
    if tcfg.threads:  # the job's measurements run on its training's threads (train() gives its caller's count back)
        torch.set_num_threads(tcfg.threads)
    start = _resumed_step(run_dir)  # an interrupted job continues: this process trains only the rest
    cpu0, wall0 = time.process_time(), time.perf_counter()
    result = {"job": job.to_dict(), "label": job.arm.label, "params": None, "diverged": False}
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the trainer's own lines; the study's display replaces them
            summary = train(tcfg, mcfg, run_dir, resume="auto", callbacks=[_Progress(job, report)], announce=None,
                            memory_check=False,  # the runner checked the study's jobs at once (fit_in_memory)
                            # an interrupted job takes the resumed study's runtime settings and corpus path (checked
                            # against its contents), not the ones its run saved
                            explicit_train=_resumed_job_fields(study, job))
    except TrainingDiverged as e:
        summary = None
        result.update(diverged=True, message=str(e))
    except SplitTooSmall as e:  # the trainer's advice names --val-fraction, which compare does not have
        raise SplitTooSmall(e.what, e.n_tokens, e.seq_len, advice="give more data or a smaller --seq-len") from None
    result["train"] = {"cpu_s": round(time.process_time() - cpu0, 3), "wall_s": round(time.perf_counter() - wall0, 3),
                       "world_size": world.world_size, "threads": torch.get_num_threads()}
    if summary is not None and summary.get("stopped_by"):
        raise KeyboardInterrupt(f"{job.key} stopped by {summary['stopped_by']}")
    broken = [k for k in ("val_loss", "test_loss") if summary and summary.get(k) is not None
              and not math.isfinite(summary[k])]
    if broken:  # the trainer checks a step's loss before applying it: the last update can still break the weights,
        summary = None  # whose evaluations then read as results (a vision run's NaN logits: test_acc ~0.1, finite)
        result.update(diverged=True, message=f"non-finite {broken[0]} after the last step")
    if world.is_main:
        report({"event": "measure", "job": job.key})
        rows = _metrics(run_dir)
        result["train"]["steps"] = max([r["step"] for r in rows if "loss" in r], default=start) - start  # cpu_s's
        result.update(curves(rows, job, tcfg))
        from ..accounting import count_parameters

        result["params"] = count_parameters(mcfg)
        if summary is not None:
            result["final"] = {k: v for k, v in summary.items() if k in ("val_loss", "val_acc", "test_acc", "test_loss")}
            result.update(measurements(study, job, run_dir, tcfg, rows))
        atomic_write_text(run_dir / JOB_FILE, json.dumps(json_safe(result), indent=1))
    world.barrier()
    report({"event": "done", "job": job.key})
    return result


def _resumed_step(run_dir: Path) -> int:
    """The step the job's training continues from: its newest checkpoint's (0 for a fresh job)."""
    from ..train.checkpoint import resolve_resume

    ckpt = resolve_resume("auto", run_dir) if Path(run_dir).is_dir() else None
    return int(ckpt.name.split("_")[1]) if ckpt is not None else 0


def _metrics(run_dir: Path) -> list[dict]:
    rows = []
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def curves(rows: list[dict], job: Job, tcfg) -> dict:
    """Validation points and a thinned training-loss curve, by step and by tokens (or samples)."""
    train_rows = [r for r in rows if "loss" in r]
    evals = [r for r in rows if any(k.startswith(("val_", "test_")) for k in r)]
    keep = max(1, len(train_rows) // 200)
    per_step = (train_rows[-1]["tokens"] / train_rows[-1]["step"]) if train_rows and train_rows[-1].get("tokens") \
        else None
    return {"curve": {"tokens_per_step": per_step,
                      "train": [[r["step"], r["loss"]] for r in train_rows[::keep]],
                      "val": [[r["step"], r.get("val_loss"), r.get("val_acc")] for r in evals if "val_loss" in r]}}


def measurements(study: StudyConfig, job: Job, run_dir: Path, tcfg, rows: list[dict]) -> dict:
    """Throughput, memory, and per task: outliers and gradient tails (corpus) or retrieval and attention."""
    from ..evals.common import load_checkpoint
    from ..optim import build_optimizer
    from ..train.distributed import World, pick_device
    from ..train.domain import get_domain
    from ..train.trainer import autocast_dtype, training_attention_backend
    from . import measure

    device = pick_device(study.device)

    def load():  # the trained weights (vision runs have no tokenizer)
        if study.domain == "lm":
            return load_checkpoint(run_dir, device=str(device))
        from ..io import load_model

        return load_model(run_dir, device=str(device)).eval(), None

    model, tok = load()
    domain = get_domain(tcfg, World(device=device))
    domain.prepare(run_dir, progress=False)
    dtype = autocast_dtype(tcfg.dtype, device)
    out: dict = {"throughput": {"per_s": measure.throughput(rows), "unit": domain.unit}}
    batch = {k: v.to(device) for k, v in domain.train_batches(0, 1)[0].items()}
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype is not None else _null
    if model.config.attention == "diff2":  # V2's lambdas are per token: their mean over one training batch
        with torch.no_grad(), autocast():
            domain.loss(model.eval(), batch)
    if model.config.attention != "softmax":
        out["lambdas"] = model.lambdas()

    # memory of one training step at the run's micro-batch, with the training kernels and precision
    backend = training_attention_backend(model.config, device, dtype, tcfg.seq_len or 0)
    if backend is not None:
        model.set_attention_backend(backend)
    model.train()
    opt = build_optimizer(model, tcfg.optimizer, lr=1e-12, weight_decay=0.0, betas=tcfg.betas,
                          momentum=tcfg.momentum)
    out["memory"] = measure.peak_step_memory(model, opt, lambda m: domain.loss(m, batch), autocast)
    del opt
    model, tok = load()  # the trained weights again, untouched

    if job.task == "corpus":
        if study.domain == "lm":
            from ..evals.outliers import evaluate_outliers_text

            r = evaluate_outliers_text(model, tok, data=study.data, max_tokens=study.outlier_tokens,
                                       seq_len=tcfg.seq_len,  # documents apart, as the run trained
                                       document_eos=tok.eos_id if tcfg.document_masking else None)
            out["outliers"] = {k: {s: r[k][s] for s in ("top1", "top10", "median")}
                               for k in ("attention_logits", "hidden_states")}
        out["tails"] = measure.gradient_tails(model, measure.DomainBatches(domain, device), study.tail_batches,
                                              study.tail_entries, seed=job.seed)
    else:
        out.update(retrieval(study, model, tok, tcfg))
    return out


def retrieval(study: StudyConfig, model, tok, tcfg) -> dict:
    """The retrieval table (cells keyed by name) and attention allocation of a retrieval-trained model."""
    from ..evals.common import parse_range

    seq, opts, n = tcfg.seq_len, tcfg.task_options, study.retrieval_samples
    if study.retrieval == "mqar":
        from ..evals.mqar import check_shape, evaluate_mqar
        from . import measure

        vocab = int(opts.get("vocab") or model.config.vocab_size)
        lo, hi = parse_range(opts.get("pairs", "4-16"), "pairs")
        grid = sorted({lo, hi, *(p for p in (2, 4, 8, 16, 32) if lo <= p <= 2 * hi)})
        lengths = [seq, 2 * seq]
        grid = [p for p in grid if any(check_shape(L, p, vocab) is None for L in lengths)]
        r = evaluate_mqar(model, lengths=lengths, pairs=grid, samples=n, vocab=vocab, seed=0)
        cells = {f"N{c['pairs']}@{c['seq_len']}": c["accuracy"] for c in r["cells"]}
        mid = max(p for p in grid if check_shape(seq, p, vocab) is None and p <= hi)
        alloc = measure.mqar_allocation(model, seq, vocab, mid, n, seed=0)
        return {"retrieval": {"task": "mqar", "metric": "accuracy", "cells": cells,
                              "overall": r["overall_accuracy"], "vocab": vocab, "pairs": grid, "lengths": lengths},
                "attention": {"setting": f"MQAR, {mid} pairs, length {seq}", "mean": alloc["mean"],
                              "by_layer": alloc["by_layer"]}}
    from ..evals.attention import evaluate_attention
    from ..evals.niah import evaluate_niah

    kw = {k: opts[k] for k in ("template", "digits") if k in opts}
    r = evaluate_niah(model, tok, grid="N1R1,N2R2,N4R2,N6R2", lengths=[seq], samples=max(1, n // 8), seed=0,
                      generation=next(model.parameters()).device.type == "cuda", **kw)
    cells = {k: v["teacher_forced"] for k, v in r["table"].items()}
    a = evaluate_attention(model, tok, length=seq, samples=max(1, n // 8), seed=0, **kw)
    return {"retrieval": {"task": "niah", "metric": "teacher-forced exact match", "cells": cells,
                          "token_accuracy": {k: v["token_accuracy"] for k, v in r["table"].items()},
                          "overall": r["overall"]["teacher_forced"], "skipped": r["skipped"], "lengths": [seq]},
            "attention": {"setting": f"niah, 1 needle, length {seq}", "mean": a["mean"], "by_layer": a["by_layer"]}}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------- the CPU pool
_QUEUE = None
_STOP = None  # a multiprocessing Event: set by the parent when the study is interrupted


def init_worker(queue, threads: int, stop=None) -> None:
    """Pool initializer: torch threads for this process; progress events go to ``queue``."""
    global _QUEUE, _STOP
    _QUEUE, _STOP = queue, stop
    from ..runtime import keep_freed_memory

    keep_freed_memory()  # a spawned process starts with malloc's defaults
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and sets ``stop``


def pool_job(study_dict: dict, job: Job, out: str) -> dict:
    if _STOP is not None and _STOP.is_set():  # queued before the interruption: do not start
        raise KeyboardInterrupt(f"{job.key} not started (study interrupted)")
    study = StudyConfig.from_dict(study_dict)
    return run_job(study, job, Path(out), report=_QUEUE.put if _QUEUE is not None else (lambda e: None))
