"""Run a study end to end: the output directory, the learning-rate sweep, the jobs, then results and report.

* **Output directory.** ``OUT/study.json`` (the resolved study and the
  command) is written first; a directory that already holds files is never
  overwritten unless asked: ``--resume`` continues the study there (complete
  jobs are kept, interrupted ones continue from their checkpoints; only the
  fields in ``StudyConfig.RESUMABLE`` may change), ``--force`` deletes the
  previous study's files (and only a study directory's).
* **Execution.** On a CPU the jobs run in a pool of worker processes (spawned,
  one torch thread each by default: tiny models train much faster as two
  single-threaded processes than as one process with two threads; the cores
  of jobs that cannot run at once, for want of jobs or of memory, go to the
  jobs that do), longest first.  On a GPU, and under ``torchrun``, they run one after another in this
  process, each trained on every rank by the trainer (DDP/FSDP); measurements
  run on rank 0.
* **Results.** Every job's ``job.json`` is gathered into ``results.json``;
  ``report.md`` and the PNGs are written from ``results.json`` alone.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Optional

from ..errors import ConfigError, DataError, DifftxError
from ..io import atomic_write_text, make_out_dir
from ..runtime import keeps_threads
from .jobs import JOB_FILE, Job, plan, step_cost, sweep_plan
from .progress import StudyProgress
from .study import StudyConfig

STUDY_FILE = "study.json"
OUTPUTS = ("results.json", "report.md", "loss_curves.png", "retrieval.png", "attention.png", "grad_hist.png",
           "lr_sweep.png", "cost.png")


class StudyInterrupted(Exception):
    """Ctrl-C or SIGTERM: the jobs stopped at a checkpoint; ``--resume`` continues."""


# ----------------------------------------------------------------------------- the output directory
def load_study(out: Path) -> Optional[dict]:
    path = Path(out) / STUDY_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError("out", f"{path} is unreadable ({e}); start a new --out") from None


def resume_config(out: Path, explicit: dict) -> StudyConfig:
    """The stored study of ``out`` with the explicitly given fields; a changed measured field is an error."""
    saved = load_study(out)
    if saved is None:
        raise ConfigError("resume", f"{out} holds no study ({STUDY_FILE} missing); run without --resume to start one")
    path = Path(out) / STUDY_FILE
    if not isinstance(saved, dict) or not isinstance(saved.get("study"), dict):
        raise ConfigError("out", f"{path} holds no study object; the file is corrupt, start a new --out")
    try:
        stored = StudyConfig.from_dict(saved["study"])
    except ConfigError as e:
        raise ConfigError("out", f"{path}: {e}; the file is corrupt, start a new --out") from None
    except (TypeError, ValueError, AttributeError) as e:  # a value of the wrong kind (hand-edited or damaged)
        raise ConfigError("out", f"{path}: not a valid study ({type(e).__name__}: {e}); the file is corrupt, start a "
                                 "new --out") from None
    if "model" in explicit and "preset" not in explicit:  # --set adds to the default base's changes, as it did
        from .study import DEFAULTS                          # when the study was made: compare like with like

        domain = explicit.get("domain", stored.domain)
        explicit = {**explicit, "model": {**DEFAULTS.get(domain, {}).get("model", {}), **explicit["model"]}}
    if stored.domain == "lm" and explicit.get("data") is None and stored.data not in (None, "builtin") \
            and not Path(stored.data).expanduser().is_absolute():
        from ..data.corpus import resolve_corpus

        try:
            resolve_corpus(stored.data)
        except DataError as e:
            raise DataError(f"{e} (the --data of the study being resumed; a relative path is read from the current "
                            "directory: resume from the directory the study started in, or pass --data with the "
                            "corpus's path)") from None
    if stored.domain == "lm" and explicit.get("data") not in (None, stored.data):
        _check_same_corpus(Path(out), explicit["data"], stored.data)  # the same corpus at another path: accepted
        stored = StudyConfig.from_dict({**stored.to_dict(), "data": explicit["data"]})
    given = StudyConfig.from_dict({**stored.to_dict(), **explicit})
    for name, value in given.to_dict().items():
        if name not in StudyConfig.RESUMABLE and value != getattr(stored, name):
            raise ConfigError(name, f"is {getattr(stored, name)!r} in the study being resumed, {value!r} here; a "
                                    "resumed study keeps its settings (start a new --out to change them)")
    return given


def _check_same_corpus(out: Path, data: str, stored: Optional[str]) -> None:
    """``--data`` on resume may name the study's corpus by another path (one started with a relative path, resumed
    from another directory), checked against the contents fingerprint its corpus runs recorded; another corpus, or
    one that no run recorded yet, is refused as any other changed setting."""
    from ..data.corpus import resolve_corpus

    recorded = set()
    for path in sorted((out / "runs" / "corpus").glob("*/*/config.json")):
        try:
            fp = (json.loads(path.read_text(encoding="utf-8")).get("data") or {}).get("corpus_fingerprint")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(fp, str):
            recorded.add(fp)
    if recorded and len(recorded) == 1 and resolve_corpus(data).fingerprint() in recorded:
        return
    why = "other contents" if recorded else "its runs recorded no corpus contents to compare with"
    raise ConfigError("data", f"is {stored!r} in the study being resumed, {data!r} here ({why}); a resumed study "
                              "keeps its corpus (give the same data, or start a new --out)")


def stored_world_size(out: Path) -> Optional[int]:
    """The number of processes the study in ``out`` ran on: its ``study.json``'s, else (a study of older versions)
    a finished job's; None when neither says."""
    saved = load_study(out)
    n = saved.get("world_size") if isinstance(saved, dict) else None
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    from .worker import read_job

    for path in sorted((Path(out) / "runs").rglob(JOB_FILE)):
        n = ((read_job(path.parent) or {}).get("train") or {}).get("world_size")
        if isinstance(n, int) and not isinstance(n, bool):
            return n
    return None


def check_world_size(out: Path, world_size: int) -> None:
    """A resumed study runs on the processes it ran on: the global batch and a run's steps depend on their number,
    and a job's key does not name it (its finished jobs would be reused beside runs of another step count)."""
    stored = stored_world_size(out)
    if stored is None or stored == world_size:
        return
    how = "without torchrun" if stored == 1 else f"on {stored} processes (e.g. torchrun --nproc-per-node {stored})"
    _processes = lambda n: f"{n} process" + ("es" if n != 1 else "")  # noqa: E731
    raise ConfigError("resume", f"{out} was run on {_processes(stored)}, this resume has {world_size}; the global "
                                f"batch and the steps of a run depend on it, so resume {how}, or start a new --out "
                                "(nothing was changed)")


def prepare_out(out: Path, study: StudyConfig, force: bool, resume: bool, command: str, world_size: int = 1) -> bool:
    """Check and claim the output directory; nothing is deleted unless ``force`` and it is a study's.

    True when it wrote a new ``study.json`` into a directory that was empty (or absent): a study this
    invocation started, that :func:`discard_new_study` may take back if its input fails before any job finishes.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError("out", f"{out} exists and is not a directory")
    busy = out.is_dir() and any(out.iterdir())
    has_study = (out / STUDY_FILE).is_file()
    if busy and not (force or resume):
        what = "a study" if has_study else "files"
        raise ConfigError("out", f"{out} already holds {what}; pass --resume to continue it, --force to start over, "
                                 "or choose another --out (nothing was changed)")
    if resume and busy and not has_study:
        raise ConfigError("resume", f"{out} holds no study ({STUDY_FILE} missing); run without --resume to start one "
                                    "in an empty --out (nothing was changed)")
    if resume and has_study:  # the stored study, with only runtime settings changed (what --resume checks first)
        resume_config(out, study.to_dict())
    if force and busy:
        if not has_study:
            raise ConfigError("out", f"{out} is not a difftx compare directory (no {STUDY_FILE}); --force deletes only "
                                     "a study's files, so choose another --out (nothing was changed)")
        shutil.rmtree(out / "runs", ignore_errors=True)
        for name in OUTPUTS + (STUDY_FILE,):
            (out / name).unlink(missing_ok=True)
    make_out_dir(out, flag="--out")
    if not (resume and has_study):
        from .. import __version__

        atomic_write_text(out / STUDY_FILE, json.dumps({"difftx_compare": 1, "difftx_version": __version__,
                                                         "command": command, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                         "world_size": world_size, "study": study.to_dict()}, indent=2))
    return not busy and not (resume and has_study)


def discard_new_study(out: Path) -> None:
    """Undo a new study whose input failed before any job finished: ``study.json`` and ``runs/`` go, so the same
    command, input fixed, runs into the same ``--out`` (a finished job is a result: then nothing is removed)."""
    out = Path(out)
    if any((out / "runs").rglob("job.json")) or any((out / name).exists() for name in OUTPUTS):
        return
    shutil.rmtree(out / "runs", ignore_errors=True)
    (out / STUDY_FILE).unlink(missing_ok=True)


def check_inputs(study: StudyConfig) -> None:
    """Everything that can be checked before a job starts: every arm's config, every job's training config
    (device, budgets), the corpus, the tokenizer, the task options."""
    from ..train.config import TrainConfig
    from .jobs import plan, train_config

    for task in study.tasks():
        for arm in study.arm_list():
            study.model_config(arm, task)
    for job in plan(study):
        train_config(study, job)  # TrainConfig validates itself (e.g. --device)
    if study.domain == "lm" and study.tokenizer not in ("byte", "char", "bpe"):
        from ..data.tokenizers import build_tokenizer

        build_tokenizer(study.tokenizer)  # a saved tokenizer: it must exist and load
    if study.domain == "lm" and study.data is not None:
        from ..data.corpus import resolve_corpus

        corpus = resolve_corpus(study.data)
        if all(src.kind == "text" for src in corpus.sources):  # at most one token per byte, one end-of-text per file
            n = corpus.nbytes() + len(corpus.sources)
            val = int(round(n * TrainConfig.val_fraction))
            need = study.task_seq_len("corpus") + 1
            if min(val, n - val) < need:
                raise DataError(f"--data {study.data}: at most {val} validation tokens (the last "
                                f"{TrainConfig.val_fraction:.0%} of the corpus), fewer than --seq-len + 1 = {need}; "
                                "give more --data or a smaller --seq-len")
    if study.retrieval != "none":
        from ..data.tasks import get_task
        from ..data.tokenizers import ByteTokenizer
        from .jobs import retrieval_task_options

        flag = {"seq_len_flag": "--retrieval-seq-len"} if study.retrieval in ("niah", "mqar") else {}  # its errors'
        try:
            get_task(study.retrieval)(ByteTokenizer(), study.retrieval_seq_len, 0, **retrieval_task_options(study),
                                      **flag)
        except (TypeError, ValueError) as e:  # an option of the wrong kind (vocab=x): one line, not a traceback
            if isinstance(e, ConfigError) and e.field == "seq_len":  # the length is the problem, not an option
                why = str(e).removeprefix("seq_len: ")
                raise ConfigError("--retrieval-seq-len", f"{study.retrieval}: {why}") from None
            raise ConfigError("--retrieval-opt", f"{study.retrieval}: {e}") from None


# ----------------------------------------------------------------------------- execution
def cpu_count() -> int:
    from ..runtime import usable_cpus

    return usable_cpus()


def resolve_workers(study: StudyConfig, n_jobs: int, device_type: str, distributed: bool) -> int:
    """Parallel job processes (at most; memory and the job count may lower them: :func:`threads_per_job` then
    shares the CPUs among those that run)."""
    if distributed or device_type == "cuda":
        return 1
    return study.workers or max(1, min(n_jobs, cpu_count()))


def threads_per_job(study: StudyConfig, workers: int, device_type: str, distributed: bool) -> Optional[int]:
    """Torch threads for each of ``workers`` parallel jobs: ``--threads``, else the CPUs shared out among the jobs
    that actually run at once (fewer than asked when the study has fewer jobs or memory fits fewer: their cores
    go to the jobs that run, not idle)."""
    if distributed or device_type == "cuda" or study.threads:
        return study.threads
    return max(1, cpu_count() // workers)


def fit_in_memory(study: StudyConfig, workers: int, world) -> tuple[int, bool, Optional[str]]:
    """(parallel jobs, whether memory lowered them, a warning line or None).

    Refuses a study whose largest job, or ``--workers`` of them at once, cannot fit in the free memory
    (difftx.train.memory_check).  With ``--workers`` auto, runs only as many jobs at once as fit with room for a
    peak of TYPICAL x the floor: fewer parallel jobs cost time, running out of memory costs the study."""
    from ..train.memory_check import TYPICAL, copies_that_fit, host_processes, require_fit, run_floor
    from ..train.trainer import autocast_dtype
    from .jobs import plan, train_config

    largest, seen = None, set()
    for job in plan(study, world_size=world.world_size):
        if (job.task, job.arm.id) in seen:  # seeds (and learning rates) do not change a job's memory
            continue
        seen.add((job.task, job.arm.id))
        tcfg = train_config(study, job)
        floor = run_floor(study.model_config(job.arm, job.task), tcfg,
                          autocast_dtype(tcfg.dtype, world.device) is not None)
        if largest is None or floor["total"] > largest[1]["total"]:
            largest = job, floor
    if largest is None:
        return workers, False, None
    job, floor = largest
    per_job = host_processes(world.device)  # torchrun's processes on this host's CPU share its memory
    shrink = "lower --batch-size or --seq-len" if job.task == "corpus" else \
        "lower --retrieval-batch-size or --retrieval-seq-len"
    if study.activation_checkpointing != 1:
        shrink += ", or recompute activations with --activation-checkpointing 1"
    what = f"the study's largest job ({job.arm.id}, {job.task})"
    warning = require_fit(floor, world.device, what, shrink, copies=per_job)
    if study.workers is not None:  # asked for: refused only if that many cannot fit
        if workers > 1:
            warning = require_fit(floor, world.device, what, shrink, copies=workers * per_job,
                                  fewer_advice="lower --workers")
        return workers, False, warning
    fit = copies_that_fit(floor, world.device, TYPICAL)  # auto: as many as fit with room for a typical peak
    if fit is None or workers * per_job <= fit:
        return workers, False, warning
    return max(1, fit // per_job), True, warning


class Executor:
    """Runs jobs and feeds the progress display; in this process or in a spawned CPU pool."""

    def __init__(self, study: StudyConfig, out: Path, workers: int, threads: Optional[int], is_main: bool):
        self.study, self.out, self.workers, self.threads, self.is_main = study, Path(out), workers, threads, is_main
        self.pool = self.queue = None
        self.ran = 0  # jobs this process trained or measured (not read back from an earlier job.json)
        if workers > 1:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            from .worker import init_worker

            ctx = mp.get_context("spawn")
            self.queue, self.stop = ctx.Queue(), ctx.Event()
            self.pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=init_worker,
                                            initargs=(self.queue, threads or 1, self.stop))
        elif threads:
            import torch

            torch.set_num_threads(threads)

    def run(self, jobs: list[Job], progress: StudyProgress) -> dict[str, dict]:
        from .worker import read_job

        results, todo = {}, []
        for job in jobs:
            done = read_job(job.run_dir(self.out))
            if done is not None:
                results[job.key] = done
                progress.finish(job.key)
            else:
                todo.append(job)
        self.ran += len(todo)
        todo.sort(key=lambda j: -j.steps * progress.cost[j.key])  # longest first balances the pool
        if self.pool is None:
            from .worker import run_job

            for job in todo:
                results[job.key] = run_job(self.study, job, self.out, report=progress.handle if self.is_main
                                           else (lambda e: None))
                progress.finish(job.key, note(results[job.key]))
            return results
        return {**results, **self._run_pool(todo, progress)}

    def _run_pool(self, todo: list[Job], progress: StudyProgress) -> dict[str, dict]:
        import queue as queue_mod
        from concurrent.futures import FIRST_COMPLETED, wait

        from .worker import pool_job

        futures = {self.pool.submit(pool_job, self.study.to_dict(), job, str(self.out)): job for job in todo}
        results, pending = {}, set(futures)
        try:
            while pending:
                finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                self._drain(progress, queue_mod)
                for f in finished:
                    job = futures[f]
                    results[job.key] = f.result()  # a job's error stops the study (after the running jobs stop)
                    progress.finish(job.key, note(results[job.key]))
                progress.render()
        except BaseException:
            self.stop.set()  # running jobs checkpoint after their current step; queued ones do not start
            for f in pending:
                f.cancel()
            raise
        return results

    def _drain(self, progress: StudyProgress, queue_mod) -> None:
        while True:
            try:
                progress.handle(self.queue.get_nowait())
            except queue_mod.Empty:
                return

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


def note(result: dict) -> str:
    if result.get("diverged"):
        return "diverged"
    final = result.get("final", {})
    parts = [f"{k} {final[k]:.4f}" for k in ("val_loss", "test_acc") if final.get(k) is not None]
    if "retrieval" in result:
        parts.append(f"retrieval {result['retrieval']['overall']:.3f}")
    return ", ".join(parts)


# ----------------------------------------------------------------------------- the study
def _sigterm_stops_the_study() -> Optional[object]:
    """SIGTERM (``kill``, a scheduler's stop) stops the study as Ctrl-C does: running jobs checkpoint after their
    step and the pool is waited for.  Without it the parent died at once and the pool's processes, orphaned,
    trained their jobs to the end into the study's directory.  A second SIGTERM acts as usual.  Returns the
    handler to put back (None off the main thread, where Python cannot set one)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    old = signal.getsignal(signal.SIGTERM)

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, stop)
    return old if old is not None else signal.SIG_DFL


def _cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the job pool), user + system."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return time.process_time()
    r = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(x.ru_utime + x.ru_stime for x in r)


def _earlier_timing(out: Path) -> Optional[dict]:
    """The timing an earlier run of the study wrote into ``results.json`` (None without a readable one), less the
    fields ``build_results`` recomputes from the jobs."""
    try:
        timing = json.loads((out / "results.json").read_text(encoding="utf-8")).get("timing")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(timing, dict) or not isinstance(timing.get("wall_s"), (int, float)):
        return None
    return {k: v for k, v in timing.items() if k not in ("jobs_cpu_s", "jobs_continued")}


@keeps_threads
def run_study(study: StudyConfig, out, force: bool = False, resume: bool = False, command: str = "",
              progress: Optional[bool] = None, stream=None) -> Optional[dict]:
    """Run ``study`` into ``out``; returns the results dict on rank 0 (None on other ranks).

    ``stream``: where the progress display goes (default: ``sys.stderr`` at the time of the call)."""
    from ..train.distributed import init_world, shutdown_world
    from ..train.memory_check import on_rank0
    from .results import build_results, choose_lrs
    from .report import write_outputs

    out = Path(out)
    world = init_world(study.device)  # under torchrun: the process group every job's training shares
    executor, created = None, False
    old_sigterm = _sigterm_stops_the_study()
    try:
        if resume and (out / STUDY_FILE).is_file():  # every rank: each refuses, none waits at a barrier
            check_world_size(out, world.world_size)
        check_inputs(study)
        workers = resolve_workers(study, 1 << 30, world.device.type, world.distributed)
        workers, memory_bound, memory_warning = on_rank0(world, lambda: fit_in_memory(study, workers, world))
        if world.is_main:
            created = prepare_out(out, study, force, resume, command, world.world_size)
        world.barrier()
        sweep = sweep_plan(study, world.world_size) if study.lr_sweep else []
        main = plan(study, world_size=world.world_size)
        if sweep:  # placeholder main jobs for the ETA; the sweep's best runs are reused, so drop one seed's corpus
            main = [j for j in main if not (j.task == "corpus" and j.seed == study.seed)]
        costs = {j.key: step_cost(study, j) for j in sweep + main}
        workers = min(workers, max(1, len(sweep + main)))
        threads = threads_per_job(study, workers, world.device.type, world.distributed)
        show = world.is_main and (progress if progress is not None else True)
        prog = StudyProgress(sweep + main, costs, workers, stream=stream, enabled=show)
        prog.line(f"difftx compare: {len(study.arm_list())} arms x {study.seeds} seeds x {len(study.tasks())} tasks"
                  f"{f' + {len(sweep)}-run lr sweep' if sweep else ''} on {world.world_size} x {world.device.type}"
                  f" ({workers} parallel job{'s' if workers > 1 else ''}"
                  f"{'; more would not fit in memory' if memory_bound else ''}) -> {out}")
        if memory_warning:
            prog.line(f"difftx compare: warning: {memory_warning}")
        t0, cpu0, tree0 = time.perf_counter(), time.process_time(), _cpu_s()
        executor = Executor(study, out, workers, threads, world.is_main)
        sweep_results = executor.run(sweep, prog) if sweep else {}
        lrs = choose_lrs(study, sweep, sweep_results) if sweep else {}
        jobs = plan(study, lrs, world.world_size)
        for j in jobs:
            if j.key not in prog.jobs:
                prog.jobs[j.key], prog.cost[j.key] = j, step_cost(study, j)
        for key in [k for k in prog.jobs if k not in {j.key for j in jobs + sweep}]:
            del prog.jobs[key]
        results = executor.run(jobs, prog)
        executor.close()  # the pool's processes are reaped here, so their CPU time is counted below
        prog.close()
        if not world.is_main:
            return None
        timing = {"wall_s": round(time.perf_counter() - t0, 1), "workers": workers, "threads_per_worker": threads,
                  "main_cpu_s": round(time.process_time() - cpu0, 1),
                  "process_cpu_s": round(_cpu_s() - tree0, 1)}
        if resume and executor.ran == 0:  # a finished study resumed: its cost is the earlier run's, not this 0 s
            timing = _earlier_timing(out) or timing
        res = build_results(study, jobs, results, sweep, sweep_results, lrs, timing, command)
        written = write_outputs(res, out)
        prog.line(f"difftx compare: wrote {', '.join(written)} to {out} in {timing['wall_s']:.0f} s")
        return res
    except KeyboardInterrupt:
        raise StudyInterrupted(f"interrupted; continue with: difftx compare --out {out} --resume") from None
    except DifftxError:
        if created:  # bad input found only by a job (e.g. too little --data): take back the new study
            if executor is not None:
                executor.close()
                executor = None
            discard_new_study(out)
        raise
    finally:
        if executor is not None:
            executor.close()
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)
        shutdown_world(world)
