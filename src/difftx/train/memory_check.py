"""Refuse a training run that cannot fit in memory, before it allocates a model or writes a file.

Without this, a run too large for the machine (a 13B preset on a laptop, ``--seq-len 100000``) is
killed by the operating system's out-of-memory killer on the CPU, with no message, or stops with
CUDA's out-of-memory error, after it has written its run directory.  The check runs once the data
is prepared (the tokenizer decides the vocabulary, so the floor is exact in it; the token shards
are cached, so a corrected rerun does not pay for them again).  :func:`require_fit` compares the run's memory floor
(:func:`difftx.accounting.training_memory_floor`: a lower bound, never above what a run needs;
``benchmarks/memory_floor.py`` measures it against real peaks) with the device's free memory
(:func:`difftx.runtime.free_memory`), and raises :class:`~difftx.errors.InsufficientMemory`, one
line naming the sizes and the fix, when the floor does not fit.  Because the floor is a lower
bound, a run that passes may still not fit; one that fails cannot.

Processes that share the memory count together: ``copies`` (``difftx compare``'s parallel jobs,
or the ``LOCAL_WORLD_SIZE`` processes ``torchrun`` starts on one host's CPU).
Set ``DIFFTX_MEMORY_CHECK=0`` to skip the check (e.g. where swap or memory overcommit is wanted).
"""

from __future__ import annotations

import os

import torch

from ..accounting import training_memory_floor
from ..errors import InsufficientMemory
from ..runtime import free_memory

ENV = "DIFFTX_MEMORY_CHECK"
TYPICAL = 2.0  # a peak this many times the floor is possible: measured: 1.16-1.78x (benchmarks/memory_floor.py)


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def gib(n: float) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


def run_floor(mcfg, tcfg, bf16: bool, shards: int = 1) -> dict:
    """The memory floor of one training process of ``mcfg`` under ``tcfg`` (bytes; see accounting)."""
    return training_memory_floor(mcfg, tcfg.batch_size, tcfg.seq_len or mcfg.max_seq_len, tcfg.optimizer,
                                 tcfg.momentum, bf16=bf16, shards=shards, loss_chunk=tcfg.loss_chunk,
                                 activation_checkpointing=tcfg.activation_checkpointing)


def host_processes(device) -> int:
    """Training processes on this host that share ``device``'s memory: torchrun's local world on a CPU."""
    if torch.device(device).type != "cpu":
        return 1
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def copies_that_fit(floor: dict, device, factor: float = 1.0) -> int | None:
    """How many processes needing ``factor`` x this floor fit in ``device``'s free memory at once (None: unknown
    or unchecked)."""
    free = free_memory(device) if enabled() else None
    return None if free is None else int(free // max(1.0, factor * floor["total"]))


def require_fit(floor: dict, device, what: str, shrink_advice: str, copies: int = 1,
                fewer_advice: str = "run fewer processes at once") -> str | None:
    """Raise InsufficientMemory when ``copies`` x the floor exceeds ``device``'s free memory.

    ``what`` names the run ("this run", "the study's largest job (...)"); ``shrink_advice`` says how to make
    its micro-batch smaller in the caller's own flags (given when the model's weights, gradients and
    optimizer state alone would fit).  Returns a warning line for the caller to show when the floor
    fits but a peak of :data:`TYPICAL` x the floor (above every measured one) would not; else None.
    """
    if not enabled():
        return None
    free = free_memory(device)
    if free is None:
        return None
    device = torch.device(device)
    need = floor["total"] * copies
    where = "the CPU" if device.type == "cpu" else str(device)
    if need <= free:
        if need * TYPICAL <= free:
            return None
        at_once = f" ({copies} processes at once)" if copies > 1 else ""
        return (f"{what}{at_once} needs at least {gib(need)} on {where} and {gib(free)} is free; training can take "
                f"{TYPICAL:g}x that floor, so it may run out of memory ({shrink_advice}"
                f"{f', or {fewer_advice},' if copies > 1 else ''} if it does)")
    times = f"; {copies} processes at once: {gib(need)}" if copies > 1 else ""
    if (floor["state"] + floor["gradients"]) * copies <= free:  # the model fits: its micro-batch does not
        advice = shrink_advice
    else:
        advice = "pick a smaller model" + ("" if device.type == "cpu" else ", or shard it over more GPUs with "
                                                                          "--parallel fsdp")
    if copies > 1:
        advice += f", or {fewer_advice}"
    raise InsufficientMemory(
        f"not enough memory: {what} needs at least {gib(floor['total'])} on {where} (weights and optimizer "
        f"state {gib(floor['state'])}, plus the larger of the gradients, {gib(floor['gradients'])}, and the "
        f"activations of {floor['tokens']:,} tokens per micro-batch, {gib(floor['activations'])}){times}, "
        f"and {gib(free)} is free; {advice}; "
        f"or set {ENV}=0 to try anyway")


def on_rank0(world, check):
    """``check()`` decided by rank 0 for every process: its result, or its InsufficientMemory raised on all ranks.

    The free memory differs between processes (and moments), so checking on each rank could stop some ranks
    and not others, which would then wait for them forever."""
    verdict = None
    if world.is_main:
        try:
            verdict = ("ok", check())
        except InsufficientMemory as e:
            verdict = ("refused", str(e))
    verdict = world.broadcast_object(verdict)
    if verdict[0] == "refused":
        raise InsufficientMemory(verdict[1])
    return verdict[1]


def step_samples_bytes(mcfg, tcfg, world_size: int) -> int:
    """A floor on the CPU memory of one step's samples in one process, all drawn before its first micro-batch runs
    (the domains' ``train_batches``): the int64 window offsets (or image order) of the whole global batch, and the
    process's own rows, each an int64 input and target of ``seq_len`` tokens or a float32 image."""
    rows = tcfg.batch_size * tcfg.accumulation(world_size)
    per_row = 2 * 8 * tcfg.seq_len if mcfg.domain == "lm" else 4 * mcfg.in_channels * mcfg.image_size ** 2
    return rows * per_row + 8 * rows * world_size


def require_bytes(need: int, device, what: str, fix: str) -> None:
    """Raise InsufficientMemory when ``need`` bytes exceed ``device``'s free memory: the one-off checks of the
    evaluations, the bench and grads (a training run's own floor: :func:`require_fit`).  ``what`` names the plural
    that needs them ("1 sequence(s) of ... tokens"), ``fix`` the flags that shrink it."""
    free = free_memory(device) if enabled() else None
    if free is None or need <= free:
        return
    where = "the CPU" if torch.device(device).type == "cpu" else str(device)
    raise InsufficientMemory(f"not enough memory: {what} need at least {gib(need)} on {where} and {gib(free)} is "
                             f"free; {fix}; or set {ENV}=0 to try anyway")


def require_samples_fit(need: int, rows: int, domain: str, copies: int = 1) -> None:
    """Raise InsufficientMemory when ``copies`` processes' step samples (``need`` bytes each) exceed the CPU's free
    memory: a step of ``--grad-accum 10**11`` asked numpy for TiBs, past the model's floor (one micro-batch)."""
    free = free_memory("cpu") if enabled() else None
    if free is None or need * copies <= free:
        return
    what = "sequences" if domain == "lm" else "images"
    raise InsufficientMemory(
        f"not enough memory: a step draws all its {rows:,} {what} at once, at least {gib(need * copies)} in the "
        f"CPU's memory before its first micro-batch runs, and {gib(free)} is free; lower --grad-accum or "
        f"--global-batch (or --batch-size); or set {ENV}=0 to try anyway")


def check_run(world, mcfg, tcfg, parallel: str) -> str | None:
    """The memory check of one ``difftx train`` run (all its processes): a warning line or None."""
    from .trainer import autocast_dtype

    floor = run_floor(mcfg, tcfg, autocast_dtype(tcfg.dtype, world.device) is not None,
                      world.world_size if parallel == "fsdp" else 1)
    shrink = "lower --batch-size (--grad-accum keeps the batch per step)" + (" or --seq-len" if tcfg.domain == "lm"
                                                                               else "")
    if tcfg.activation_checkpointing != 1:
        shrink += ", or recompute activations with --activation-checkpointing 1"
    samples = step_samples_bytes(mcfg, tcfg, world.world_size)
    rows = tcfg.batch_size * tcfg.accumulation(world.world_size) * world.world_size

    def check():
        warning = require_fit(floor, world.device, "this run", shrink, copies=host_processes(world.device))
        require_samples_fit(samples, rows, mcfg.domain, copies=host_processes("cpu"))
        return warning

    return on_rank0(world, check)

