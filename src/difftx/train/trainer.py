"""The training loop: domain-agnostic, single- or multi-process, exactly resumable.

One optimizer step:

1. the learning rate from the schedule (:func:`difftx.optim.lr_at`);
2. this process's micro-batches from the domain (a pure function of the step);
3. the number of scored targets of the *whole step* (all micro-batches, all
   processes; one all-reduce), then per micro-batch ``loss_sum * world / count``
   backward, so k micro-batches give the update of one k-times larger batch,
   padded or not (DDP/FSDP average gradients over processes, hence ``* world``);
   gradients are all-reduced only after the last micro-batch;
4. gradient clipping (the norm is logged either way); a non-finite loss or
   gradient norm stops the run *before* the update, leaving the last good
   checkpoint the newest; an update that made the weights non-finite stops it
   before they are saved (checked where a checkpoint is due);
5. the optimizer step, then logging, evaluation, diagnostics and checkpoints
   at their intervals.

Mixed precision is bf16 autocast with fp32 weights (the models keep lambda,
softmax statistics and norms in fp32).  Randomness: the model is initialised
from ``seed`` on every process; after that each process's torch, Python and NumPy RNGs are seeded
with ``seed + rank``; data windows are drawn from ``(seed, step)``.
"""

from __future__ import annotations

import contextlib
import math
import random
import re
import signal
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..errors import ConfigError, DifftxError
from ..io import clean_state_dict
from ..models import build_model
from ..optim import build_optimizer, lr_at, set_lr
from ..runtime import native_bf16_matmul
from . import checkpoint as ckpt
from .config import TrainConfig
from .distributed import (World, full_tensor, gathered_params, parallelize, reshard, resolve_parallel,
                          sync_gradients)
from .domain import Domain
from .metrics import MetricsLogger, Progress


class TrainingDiverged(DifftxError):
    """The loss or gradient norm became NaN or infinite."""


def autocast_dtype(pref: str, device: torch.device) -> Optional[torch.dtype]:
    """bf16 where the hardware runs it natively (``auto``), or as asked; None means fp32."""
    if pref == "fp32":
        return None
    if pref == "bf16":
        return torch.bfloat16
    return torch.bfloat16 if native_bf16_matmul(device) else None


CPU_EAGER_MAX_SEQ = 256


def training_attention_backend(model_cfg, device: torch.device, dtype: Optional[torch.dtype],
                               seq_len: int) -> Optional[str]:
    """The backend to train with when the config says ``auto`` (None: leave it).

    On a CPU under bf16 autocast, torch's flash-attention backward is slow in bf16:
    for sequences up to 256 the eager path trains faster, softmax and DIFF alike
    (benchmarks/results/train_nanogpt_cpu.md; 0.7x the step time at the nanoGPT shape).
    """
    if model_cfg.attn_backend == "auto" and device.type == "cpu" and dtype == torch.bfloat16 \
            and seq_len <= CPU_EAGER_MAX_SEQ:
        return "eager"
    return None


class Trainer:
    """Train ``model_cfg`` under ``cfg`` on ``domain``, writing into ``run_dir``.

    ``callbacks`` are objects with any of ``on_before_optimizer_step(trainer)``
    (gradients are final) and ``on_step_end(trainer, row)``.
    """

    def __init__(self, model_cfg, cfg: TrainConfig, domain: Domain, world: World, run_dir: Path,
                 run_config: dict, callbacks=()):
        self.cfg, self.domain, self.world = cfg, domain, world
        self.run_dir, self.run_config = Path(run_dir), run_config
        self.callbacks = list(callbacks)
        self.parallel = resolve_parallel(cfg.parallel, world)
        self.n_micro = cfg.accumulation(world.world_size)
        self.dtype = autocast_dtype(cfg.dtype, world.device)

        torch.manual_seed(cfg.seed)  # the same initial weights on every process
        self.model = build_model(model_cfg).to(world.device)
        backend = training_attention_backend(model_cfg, world.device, self.dtype, cfg.seq_len or 0)
        if backend is not None:
            self.model.set_attention_backend(backend)
        self.model.set_activation_checkpointing(cfg.activation_checkpointing)
        self.train_model = parallelize(self.model, world, self.parallel, cfg.compile)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                         betas=cfg.betas, momentum=cfg.momentum, nesterov=cfg.nesterov, eps=cfg.eps,
                                         decay_all=cfg.decay_all)
        torch.manual_seed(cfg.seed + world.rank)  # runtime randomness (dropout) differs per process
        random.seed(cfg.seed + world.rank)  # and user callbacks' or future code's draws repeat run to run
        np.random.seed((cfg.seed + world.rank) % 2 ** 32)
        self.step = 0
        self.tokens_seen = 0
        self.samples_seen = 0
        self.elapsed = 0.0
        self.last_eval: dict = {}
        self.resumed_from: Optional[Path] = None
        self._stop_signal: Optional[int] = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "samples_seen": self.samples_seen,
                "data_position": {"sampler": "stateless (seed, step)", "next_step": self.step},
                "elapsed_s": round(self.elapsed, 3), "world_size": self.world.world_size,
                "parallel": self.parallel, "micro_batches": self.n_micro, "last_eval": self.last_eval}

    def resume(self, path: Path) -> None:
        """Restore checkpoint ``path`` (model, optimizer, RNG, step); :meth:`fit` then continues from it."""
        self.load_state_dict(ckpt.load_checkpoint(self, path))
        self.resumed_from = Path(path)

    def load_state_dict(self, state: dict) -> None:
        saved = int(state.get("world_size", self.world.world_size)) * int(state.get("micro_batches", self.n_micro))
        if saved != self.world.world_size * self.n_micro:  # the same sequences per step, or the run is another one
            b, unit = self.cfg.batch_size, "sequences" if self.cfg.domain == "lm" else "images"
            raise ConfigError("--grad-accum", f"the run being resumed took {saved * b} {unit} a step "
                                              f"({state.get('world_size')} processes x {state.get('micro_batches')} "
                                              f"micro-batches of {b}), here {self.world.world_size} x {self.n_micro}; "
                                              f"pass --global-batch {saved * b} to keep it")
        self.step = int(state["step"])
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.samples_seen = int(state.get("samples_seen", 0))
        self.elapsed = float(state.get("elapsed_s", 0.0))
        self.last_eval = dict(state.get("last_eval", {}))

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.world.device.type, dtype=self.dtype)

    # ------------------------------------------------------------------ one step
    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.world.device, non_blocking=True) for k, v in batch.items()}

    def train_step(self) -> Optional[dict]:
        """One optimizer step; returns the metrics row (None when a stop signal arrived first)."""
        cfg, world, step = self.cfg, self.world, self.step
        lr = lr_at(step, **cfg.lr_kwargs())
        set_lr(self.optimizer, lr)
        batches = self.domain.train_batches(step, self.n_micro)
        totals = torch.tensor([sum(self.domain.count(b) for b in batches), sum(self.domain.size(b) for b in batches),
                               sum(len(next(iter(b.values()))) for b in batches),  # sequences (or images)
                               1.0 if self._stop_signal is not None else 0.0],  # any process asked to stop
                              dtype=torch.float64, device=world.device)
        world.all_reduce_sum(totals)
        count, size, samples, stop = totals.tolist()
        if stop > 0:
            return None
        scale = world.world_size / max(count, 1.0)
        loss_sum = torch.zeros((), dtype=torch.float64, device=world.device)
        for i, batch in enumerate(batches):
            batch = self._to_device(batch)
            with sync_gradients(self.train_model, self.parallel, sync=i == len(batches) - 1):
                with self.autocast():
                    loss = self.domain.loss(self.train_model, batch)
                (loss * scale).backward()
            loss_sum += loss.detach().double()
        world.all_reduce_sum(loss_sum)
        mean_loss = float(loss_sum) / max(count, 1.0)
        # the step's gradients before clipping, as grad_norm is (clipped ones would all scale down to the clip)
        diag = self.diagnostics() if cfg.diag_every and (step + 1) % cfg.diag_every == 0 else {}
        gnorm = self._clip()
        if not (math.isfinite(mean_loss) and math.isfinite(gnorm)):
            self.optimizer.zero_grad(set_to_none=True)
            last = ckpt.newest_complete(self.run_dir)[0]  # the one --resume auto would take: not a damaged one
            raise TrainingDiverged(
                f"non-finite {'loss' if not math.isfinite(mean_loss) else 'gradient norm'} at step {step + 1} "
                f"(loss {mean_loss}, grad norm {gnorm}); stopped before applying it. Last good checkpoint: "
                f"{last or 'none'}. Lower --lr, raise --warmup, clip with --grad-clip or use --dtype fp32")
        for cb in self.callbacks:
            if hasattr(cb, "on_before_optimizer_step"):
                cb.on_before_optimizer_step(self)
        row = {"step": step + 1, "loss": mean_loss, "lr": lr, "grad_norm": gnorm, **diag}
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += int(size)
        self.samples_seen += int(samples)
        row["tokens"] = self.tokens_seen
        row["_size"] = size
        return row

    def _weights_finite(self) -> bool:
        """Whether every weight (every process's shard) is finite.  A step with a finite loss and gradient norm can
        still overflow them (an absurd --lr); the next step's loss would show it, but a checkpoint of this step would
        be saved first.  One pass over the weights and one all-reduce: run where the weights are saved, not every
        step."""
        bad = torch.zeros((), dtype=torch.float64, device=self.world.device)
        for p in self.model.parameters():
            w = p.detach()
            w = w.to_local() if hasattr(w, "to_local") else w  # an FSDP shard
            bad += (~torch.isfinite(w)).sum()
        return not self.world.all_reduce_sum(bad).item()

    def _check_weights(self, about: str) -> None:
        """Raise :class:`TrainingDiverged` before a checkpoint of non-finite weights is saved."""
        if not self._weights_finite():
            last = ckpt.newest_complete(self.run_dir)[0]
            raise TrainingDiverged(
                f"non-finite weights after the update of step {self.step}{about}; not saved. Last good checkpoint: "
                f"{last or 'none'}. Lower --lr, raise --warmup, clip with --grad-clip or use --dtype fp32")

    def _clip(self) -> float:
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return float(full_tensor(norm))

    def diagnostics(self) -> dict:
        """Per-layer lambda and gradient norms per parameter kind (summed over layers) and per layer."""
        kinds: dict[str, float] = {}
        layers: dict[int, float] = {}
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            sq = float(full_tensor(p.grad).detach().float().pow(2).sum())
            name = next(iter(clean_state_dict({name: None})))
            m = re.match(r"layers\.(\d+)\.(.*)", name)
            key = m.group(2) if m else name
            kinds[key] = kinds.get(key, 0.0) + sq
            if m:
                layers[int(m.group(1))] = layers.get(int(m.group(1)), 0.0) + sq
        with gathered_params(self.model, self.parallel), torch.no_grad():
            lambdas = self.model.lambdas()
        return {"lambdas": lambdas, "grad_norms": {k: math.sqrt(v) for k, v in kinds.items()},
                "layer_grad_norms": [math.sqrt(layers[i]) for i in sorted(layers)]}

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, split: str = "val") -> dict:
        self.model.eval()
        try:
            with torch.no_grad(), self.autocast():
                return self.domain.evaluate(self.model, split)
        finally:
            reshard(self.model, self.parallel)
            self.model.train()

    # ------------------------------------------------------------------ the loop
    def _on_signal(self, signum, frame) -> None:
        """Finish the current step, checkpoint and return; a second signal acts as usual."""
        self._stop_signal = signum
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)

    def fit(self, resume_from: Optional[Path] = None) -> dict:
        cfg, world = self.cfg, self.world
        if resume_from is not None and self.resumed_from != Path(resume_from):
            self.resume(resume_from)
        resume_from = self.resumed_from
        if resume_from is not None and world.is_main:  # after every input check (the checkpoint loaded): the
            ckpt.remove_later(self.run_dir, self.step)  # checkpoints after it go before their metrics rows do
        stop_at = min(cfg.stop_at or cfg.steps, cfg.steps)
        logger = MetricsLogger(self.run_dir, world.is_main, cfg.tensorboard,
                               resume_step=self.step if resume_from is not None else None,
                               history=Path(resume_from).parent.parent if resume_from is not None else None)
        progress = Progress(cfg.steps, self.step, cfg.progress, self.domain.unit, world.is_main)
        handlers = self._install_signals()
        self.model.train()
        saved_at, stopped_by = None, None
        try:
            while self.step < stop_at:
                t0 = time.perf_counter()
                row = self.train_step()
                if row is None:
                    stopped_by = signal.Signals(self._stop_signal).name if self._stop_signal else "signal"
                    break
                dt = time.perf_counter() - t0
                self.elapsed += dt
                rate = row.pop("_size") / max(dt, 1e-9)
                row.update(tokens_per_s=rate, elapsed=round(self.elapsed, 3))
                progress.update(row["loss"], row["lr"], row["grad_norm"], rate)
                step = self.step
                saving = (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == stop_at
                if saving:  # elsewhere the next step's loss check catches them
                    self._check_weights(f" (loss {row['loss']}, grad norm {row['grad_norm']})")
                # the run's last step, not a --stop-at one: a stopped and resumed run logs what one run logs
                if step % cfg.log_every == 0 or "lambdas" in row or step == cfg.steps:
                    logger.log(row)
                for cb in self.callbacks:
                    if hasattr(cb, "on_step_end"):
                        cb.on_step_end(self, row)
                metrics = {}
                if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                    metrics = self.evaluate("val")
                if metrics:  # nothing to evaluate on (--val-fraction 0): no row holding only the step
                    self.last_eval = {"step": step, **metrics}
                    logger.log(self.last_eval)
                    if "val_loss" in self.last_eval:
                        acc = f", val_acc {self.last_eval['val_acc']:.4f}" if "val_acc" in self.last_eval else ""
                        progress.write(f"step {step}: loss {row['loss']:.4f}, "
                                       f"val_loss {self.last_eval['val_loss']:.4f}{acc}")
                if saving:
                    saved_at = ckpt.save_checkpoint(self, step)
            if self.step == cfg.steps:
                for split in self.domain.eval_splits:
                    # val: evaluated at the last step in the loop, unless no step ran (a run stopped by --stop-at
                    # and resumed with --steps at that step) and the file lacks it (rank 0's file: every process
                    # takes its answer, as evaluating is collective)
                    done = split == "val" and (self.last_eval.get("step") == self.step
                                               or world.broadcast_object(logger.has(self.step, "val_loss")))
                    metrics = self.evaluate(split) if not done else {}
                    if metrics:
                        extra = {"step": self.step, **metrics}
                        if not logger.has(self.step, f"{split}_loss"):  # a finished run resumed: logged once
                            logger.log(extra)
                        self.last_eval.update(extra)
            if stopped_by is not None:
                self._check_weights("")  # the last step's update, which no later step's loss has seen
                saved_at = ckpt.save_checkpoint(self, self.step)
                progress.write(f"stopped by {stopped_by} at step {self.step}; resume with --resume auto")
        finally:
            progress.close()
            logger.close()
            self._restore_signals(handlers)
        return {"run_dir": str(self.run_dir), "step": self.step, "steps": cfg.steps, "checkpoint": str(saved_at)
                if saved_at else None, "elapsed_s": round(self.elapsed, 2), "tokens_seen": self.tokens_seen,
                "stopped_by": stopped_by, "eval_step": self.last_eval.get("step"),
                **{k: v for k, v in self.last_eval.items() if k != "step"}}

    def _install_signals(self) -> dict:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return {}
        old = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            old[sig] = signal.signal(sig, self._on_signal)
        return old

    @staticmethod
    def _restore_signals(handlers: dict) -> None:
        for sig, h in handlers.items():
            signal.signal(sig, h)
