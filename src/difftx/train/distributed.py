"""Everything about processes and devices, in one place; model code stays single-device.

* :func:`init_world` reads the ``torchrun`` environment (RANK, WORLD_SIZE,
  LOCAL_RANK) and starts the process group: ``nccl`` on GPUs, ``gloo`` on CPUs.
* :func:`parallelize` wraps a model for training: DDP, or FSDP2
  (``fully_shard`` on each block, then the root), optionally compiled.  The
  unwrapped model is kept by the trainer for state dicts (no ``module.`` or
  ``_orig_mod.`` prefixes ever reach a checkpoint).
* :func:`sync_gradients` turns gradient all-reduce off for all micro-batches
  but the last of a step (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``).
* :func:`full_tensor` / :func:`gathered_params` read sharded (DTensor)
  parameters and gradients whole, for diagnostics.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError


@dataclass
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # this World started the process group (and so ends it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over processes (a no-op on one process); returns ``t``."""
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def broadcast_object(self, obj):
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def pick_device(pref: str = "auto", local_rank: int = 0) -> torch.device:
    if pref == "auto":
        pref = "cuda" if torch.cuda.is_available() else "cpu"
    if pref.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("device", "cuda was asked for but torch sees no GPU; use --device cpu")
        if pref == "cuda":
            pref = f"cuda:{local_rank}"
        device = torch.device(pref)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _env_int(name: str, default: int) -> int:
    """An integer of the torchrun environment; a value that is not one is the user's, named in one line."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(None, f"the environment variable {name}={value!r} is not a whole number; unset it for one "
                                "process, or launch with torchrun (which sets it)") from None


def init_world(device: str = "auto") -> World:
    """The process group from the torchrun environment (or a single process)."""
    world_size, rank, local_rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if not dist.is_initialized() and (world_size < 1 or not 0 <= rank < world_size or local_rank < 0):
        raise ConfigError(None, f"the environment has WORLD_SIZE={world_size}, RANK={rank}, LOCAL_RANK={local_rank}; "
                                "torchrun sets 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0: unset them for one "
                                "process, or launch with torchrun")
    dev = pick_device(device, local_rank)
    owns = False
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo",
                                device_id=dev if dev.type == "cuda" else None)
        owns = True
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return World(rank, world_size, local_rank, dev, owns)


_ENDED_A_GROUP = False


def shutdown_world(world: World) -> None:
    """End the process group if :func:`init_world` started it (a caller's own group is left alone)."""
    global _ENDED_A_GROUP
    if world.owns_group and dist.is_initialized():
        dist.destroy_process_group()
        _ENDED_A_GROUP = True


def ended_a_group() -> bool:
    """Whether this process started and destroyed a process group (see ``difftx.cli.entry``)."""
    return _ENDED_A_GROUP


def resolve_parallel(mode: str, world: World) -> str:
    if mode == "auto":
        return "ddp" if world.distributed else "none"
    if mode in ("ddp", "fsdp") and not world.distributed:
        return "none"  # one process: nothing to wrap, same code path otherwise
    if mode == "none" and world.distributed:
        raise ConfigError("parallel", f"{world.world_size} processes need --parallel ddp or fsdp")
    return mode


def parallelize(model: nn.Module, world: World, mode: str, compile: bool = False) -> nn.Module:
    """The module the training loop calls: ``model`` itself, DDP(model) or the FSDP2-sharded model."""
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(world.device.type, (world.world_size,))
        for block in model.layers:
            if compile:
                block.compile()
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if compile:
        model.compile()  # in place: state-dict keys stay clean
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [world.device.index] if world.device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    return model


def sync_gradients(wrapped: nn.Module, mode: str, sync: bool):
    """Context for one micro-batch: reduce gradients across processes only when ``sync``."""
    if mode == "ddp" and not sync:
        return wrapped.no_sync()
    if mode == "fsdp":
        wrapped.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (collective: every rank must call it); plain tensors unchanged."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@contextlib.contextmanager
def gathered_params(model: nn.Module, mode: str):
    """Parameters unsharded for the duration (FSDP2); a no-op otherwise."""
    if mode != "fsdp":
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    shards = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in shards:
        m.unshard()
    try:
        yield
    finally:
        for m in shards:
            m.reshard()


def reshard(model: nn.Module, mode: str) -> None:
    """Return FSDP2 parameters to their sharded form (a no-grad forward leaves the root unsharded)."""
    if mode != "fsdp":
        return
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
