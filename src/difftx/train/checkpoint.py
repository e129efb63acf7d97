"""Checkpoints: ``RUN/checkpoints/step_XXXXXXXX/``, each one a loadable model directory.

A checkpoint holds

* ``config.json`` (the run's resolved model + training config; ``difftx.load_model`` reads it),
  ``model.safetensors`` (full weights, no wrapper prefixes), ``tokenizer.json``;
* ``optimizer.pt`` (one process or DDP; read with ``torch.load(weights_only=True)``), or for
  FSDP ``sharded/`` (torch.distributed.checkpoint: model and optimizer tensors, each rank its
  shards) plus ``optimizer_groups.json``;
* ``trainer_state.json`` (step, tokens and samples seen, the data position, elapsed time) and
  ``rng/rank_N.json`` (every RNG state of each process: torch, CUDA, Python, NumPy).

Writes are atomic at two levels: each file goes to a temporary name and is renamed, and the
checkpoint is assembled in ``.step_XXXXXXXX.tmp/`` and renamed to ``step_XXXXXXXX`` only when
complete, so a crash (even SIGKILL) mid-write leaves the previous checkpoints untouched and the
partial one invisible (it is removed on the next start); a checkpoint is deleted the same way in reverse
(renamed to ``.step_XXXXXXXX.del/`` first, :func:`remove_checkpoint`).  Nothing is unpickled as code: the
one pickle-based file format involved (DCP's ``.metadata``) is read with an allow-list
unpickler.

A ``step_*`` directory can still lack files (copied or synced in part, files deleted by hand, a file system that
does not keep renames in order after a power loss): :func:`missing_parts` names what it lacks (a run of N processes
wrote N RNG files).  ``--resume auto`` skips such directories for the newest complete checkpoint
(:func:`resolve_resume`, with a warning; with none complete it refuses) and the run keeps them, renamed out of the
list of checkpoints (``step_XXXXXXXX.incomplete``, :func:`set_aside`), rather than deleting them; an explicit
``--resume PATH`` to one is refused.  ``difftx.load_model(RUN)`` and the divergence error's "last good checkpoint"
take the same newest complete checkpoint (:func:`newest_complete`).  A complete directory whose contents are corrupt
is refused, not skipped (difftx never writes one: its files are renamed into place whole), by a line naming the file
and, for a run's checkpoint, how to resume the one before (:func:`earlier_hint`).
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import math
import os
import pickle
import random
import re
import shutil
import textwrap
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from ..errors import CheckpointError, ConfigError
from ..io import (_STEP_DIR, CHECKPOINTS_DIR, CONFIG_FILE, WEIGHTS_FILE, atomic_write_bytes, atomic_write_text,
                  clean_state_dict, list_checkpoints, load_safetensors, load_state_dict_into, save_safetensors,
                  torch_load_weights_only)

STATE_FILE = "trainer_state.json"
OPTIM_FILE = "optimizer.pt"
SHARDED_DIR = "sharded"
OPTIM_GROUPS_FILE = "optimizer_groups.json"
RNG_DIR = "rng"
TOKENIZER_FILE = "tokenizer.json"  # the LM domain's artifact (Domain.save_artifacts), beside the run's config too
INCOMPLETE_SUFFIX = ".incomplete"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def remove_partial(run_dir: Path) -> list[Path]:
    """Delete checkpoints that were being written or deleted when a process died (``.step_*.tmp``,
    ``.step_*.del``), and settle a re-saved step's old copy (:func:`restore_resaved`)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    gone = [p for suffix in (".tmp", ".del") for p in root.glob(f".step_*{suffix}")] if root.is_dir() else []
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone + restore_resaved(run_dir)


def remove_checkpoint(path: Path) -> None:
    """Delete checkpoint directory ``path``: renamed out of sight first (``.step_*.del``), so that a crash in the
    middle of the deletion leaves no partial directory under a complete checkpoint's name (the next start deletes
    the rest, :func:`remove_partial`)."""
    path = Path(path)
    hidden = path.parent / f".{path.name}.del"
    shutil.rmtree(hidden, ignore_errors=True)
    os.replace(path, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


def remove_later(run_dir: Path, step: int) -> list[Path]:
    """Delete the checkpoints of ``run_dir`` after ``step``: a run resumed from an earlier step of its own directory
    starts another history, and metrics.jsonl is about to drop their rows (so --resume auto must never pick them)."""
    later = [p for p in list_checkpoints(run_dir) if int(p.name.split("_")[1]) > step]
    for p in reversed(later):
        if missing_parts(p):  # not a checkpoint of that history but a damaged directory: kept, out of the way
            set_aside(p)
        else:
            remove_checkpoint(p)
    return later


def missing_parts(path: Path) -> list[str]:
    """What checkpoint directory ``path`` lacks of a complete one (paths relative to it; an empty file counts as
    missing); empty for a complete checkpoint.  Each process of the run that saved it wrote its RNG state: the
    ``rng/rank_N.json`` of every rank below the ``world_size`` of its trainer_state.json is needed (and with FSDP its
    shard file: each one that ``sharded/.metadata`` names).  Only presence is checked: a file with corrupt contents
    is reported by :func:`load_checkpoint`, which names it."""
    path = Path(path)
    need = [CONFIG_FILE, STATE_FILE, WEIGHTS_FILE]
    sharded = (path / SHARDED_DIR).is_dir()
    need.append(f"{SHARDED_DIR}/.metadata" if sharded else OPTIM_FILE)
    run_dir = path.parent.parent if path.parent.name == CHECKPOINTS_DIR else None
    if run_dir is not None and (run_dir / TOKENIZER_FILE).is_file():  # kept by the run: kept in each checkpoint
        need.append(TOKENIZER_FILE)
    shards = _missing_shards(path / SHARDED_DIR) if sharded else []
    return [name for name in need if not _nonempty_file(path / name)] + shards + \
        _missing_rng(path, _saved_world_size(path))


def _missing_shards(sharded: Path, show: int = 3) -> list[str]:
    """The data files (``__R_0.distcp``, one per process that saved it) that the ``.metadata`` of sharded state
    ``sharded`` names and it lacks (an empty one counts as missing): the first ``show``, then one entry counting the
    rest.  None when the metadata is missing (:func:`missing_parts` names it) or unreadable (:func:`load_checkpoint`
    does)."""
    try:
        with open(sharded / ".metadata", "rb") as f:
            files = sorted({str(info.relative_path) for info in _AllowListUnpickler(f).load().storage_data.values()})
    except Exception:  # noqa: BLE001 -- whatever is wrong with it, load_checkpoint reports it by path
        return []
    lacks = [f"{SHARDED_DIR}/{name}" for name in files if not _nonempty_file(sharded / name)]
    if len(lacks) > show:
        lacks[show:] = [f"{SHARDED_DIR}/__N_0.distcp of {len(lacks) - show} more of the {len(files)} shard files"]
    return lacks


def _saved_world_size(path: Path) -> int:
    """The number of processes that saved checkpoint ``path`` (each wrote its ``rng/rank_N.json``): ``world_size``
    of its trainer_state.json; 1 when the file says none (as :func:`load_checkpoint` reads it), or is missing or
    unreadable (missing: :func:`missing_parts` names it; unreadable: :func:`load_checkpoint` does)."""
    try:
        world = json.loads((Path(path) / STATE_FILE).read_text()).get("world_size", 1)
    except (OSError, ValueError, RecursionError, AttributeError):  # ValueError: JSON or UTF-8; AttributeError: no dict
        return 1
    return world if isinstance(world, int) and not isinstance(world, bool) and world >= 1 else 1


def _missing_rng(path: Path, world: int, show: int = 3) -> list[str]:
    """The RNG state files of ranks ``0 .. world - 1`` that checkpoint ``path`` lacks (an empty one counts as
    missing): the first ``show`` by name, then one entry counting the rest (``world`` is read from the checkpoint,
    so a corrupt one may be huge: the ranks are never listed one by one)."""
    rng = Path(path) / RNG_DIR
    try:
        names = {f.name for f in rng.iterdir() if _nonempty_file(f)} if rng.is_dir() else set()
    except OSError:
        names = set()
    present = sum(1 for n in names if (m := _RNG_FILE.match(n)) and int(m.group(1)) < world)
    first = list(itertools.islice((r for r in range(world) if f"rank_{r}.json" not in names), show))
    lacks = [f"{RNG_DIR}/rank_{r}.json" for r in first]
    rest = world - present - len(first)
    if rest > 0:
        lacks.append(f"{RNG_DIR}/rank_N.json of {rest} more of the {world} processes that saved it")
    return lacks


_RNG_FILE = re.compile(r"^rank_(0|[1-9]\d*)\.json$")


def _nonempty_file(path: Path) -> bool:
    try:
        return path.is_file() and path.stat().st_size > 0
    except OSError:
        return False


def set_aside(path: Path) -> Path:
    """Rename damaged checkpoint directory ``path`` to ``step_XXXXXXXX.incomplete`` (``.incomplete-2``, ... when
    taken): no longer a checkpoint that resuming, pruning or a re-save of its step would touch, and nothing of
    it deleted.  Returns the new path."""
    path = Path(path)
    target, n = path.with_name(path.name + INCOMPLETE_SUFFIX), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{INCOMPLETE_SUFFIX}-{n}")
    os.replace(path, target)
    return target


def restore_resaved(run_dir: Path) -> list[Path]:
    """A step being re-saved when the process died (``.step_*.old``, moved aside before its new copy took the
    name) comes back if the new copy never arrived, else goes; returns the ones that went."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    gone = []
    for old in sorted(root.glob(".step_*.old")) if root.is_dir() else []:
        final = root / old.name[1:-len(".old")]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            gone.append(old)
        else:
            os.replace(old, final)
    return gone


# ---------------------------------------------------------------------- RNG state as JSON
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy())


def rng_state() -> dict:
    py = random.getstate()
    npy = np.random.get_state()
    state = {"torch": _b64(torch.get_rng_state()),
             "python": [py[0], list(py[1]), py[2]],
             "numpy": [npy[0], npy[1].tolist(), int(npy[2]), int(npy[3]), float(npy[4])]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


# ---------------------------------------------------------------------- safe DCP reading
_DCP_ALLOWED = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
} | {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
    "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")}


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "pathlib._local":  # Python 3.13 pickles its paths from here; pathlib exports them everywhere,
            module = "pathlib"          # so a checkpoint written on 3.13 reads on 3.10-3.12 too, and the reverse
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _DCP_ALLOWED or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} (not checkpoint metadata)")


def _safe_dcp_reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            meta_path = Path(self.path) / ".metadata"
            try:
                with open(meta_path, "rb") as f:
                    metadata = _AllowListUnpickler(f).load()
            except Exception as e:
                raise CheckpointError(f"{meta_path}: unreadable sharded-checkpoint metadata ({type(e).__name__}: "
                                      f"{str(e)[:100]}); the checkpoint is corrupt, use another") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def _dcp_failure(e: BaseException) -> BaseException:
    """The error behind ``e``: torch.distributed.checkpoint raises a CheckpointException holding the error of each
    process that failed (the same on every process); the lowest rank's that says something (a truncated file can be
    a bare EOFError on one process).  Any other error is itself."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return e
    errors = [failures[rank][0] for rank in sorted(failures)]
    return next((err for err in errors if str(err).strip()), errors[0])


def _safe_dcp_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class TensorsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raise CheckpointError(f"sharded checkpoint entry {read_item.dest_index.fqn!r} is pickled bytes; "
                                  "difftx checkpoints hold tensors only, refusing to unpickle it")

    return TensorsOnlyPlanner()


# ---------------------------------------------------------------------- save
def _json_groups(groups: list[dict]) -> list[dict]:
    out = []
    for g in groups:
        g = dict(g)
        for k, v in g.items():
            if isinstance(v, tuple):
                g[k] = list(v)
            elif isinstance(v, torch.Tensor):
                g[k] = v.item()
        out.append(g)
    return out


def save_checkpoint(trainer, step: int) -> Path:
    """Write checkpoint ``step`` (collective in a distributed run); returns its directory."""
    world, root = trainer.world, trainer.run_dir / CHECKPOINTS_DIR
    final = root / step_dir_name(step)
    tmp = root / f".{step_dir_name(step)}.tmp"
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    world.barrier()

    if trainer.parallel == "fsdp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        optim_sd = get_optimizer_state_dict(trainer.model, trainer.optimizer)
        dcp.save({"model": get_model_state_dict(trainer.model), "optim": optim_sd["state"]},
                 storage_writer=dcp.FileSystemWriter(str(tmp / SHARDED_DIR)))
        full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if world.is_main:
            save_safetensors(clean_state_dict(full), tmp / WEIGHTS_FILE, metadata={"format": "pt"})
            atomic_write_text(tmp / OPTIM_GROUPS_FILE, json.dumps(_json_groups(optim_sd["param_groups"])))
    elif world.is_main:
        save_safetensors(clean_state_dict(trainer.model.state_dict()), tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        buf = io.BytesIO()
        torch.save(trainer.optimizer.state_dict(), buf)
        atomic_write_bytes(tmp / OPTIM_FILE, buf.getvalue())

    atomic_write_text(tmp / RNG_DIR / f"rank_{world.rank}.json", json.dumps(rng_state()))
    if world.is_main:
        atomic_write_text(tmp / CONFIG_FILE, json.dumps(trainer.run_config, indent=2))
        trainer.domain.save_artifacts(tmp)
        atomic_write_text(tmp / STATE_FILE, json.dumps(trainer.state_dict(), indent=2))
    world.barrier()
    if world.is_main:
        old = None
        if final.exists():  # re-saving a step (resumed and stopped at once): swap, then drop the old one
            old = root / f".{step_dir_name(step)}.old"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        # steps after this one belong to a history this run abandoned (Trainer.fit removed them as it resumed; for a
        # caller of this function alone): they go, so that pruning never takes the checkpoint just written
        remove_later(trainer.run_dir, step)
        for stale in list_checkpoints(trainer.run_dir)[:-trainer.cfg.keep_last]:
            remove_checkpoint(stale)
    world.barrier()
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- load
def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: {what} missing; the checkpoint is incomplete, use another")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({e}); the file is corrupt, use another "
                              "checkpoint") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object; the file is corrupt")
    return data


def _torch_load(path: Path, device) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: optimizer state missing; the checkpoint is incomplete, use another")
    try:
        return torch_load_weights_only(path, map_location=device)
    except pickle.UnpicklingError:  # random bytes and pickled code alike: torch does not tell them apart
        raise CheckpointError(f"{path}: not a weights-only torch file (torch.load(weights_only=True) refused it): "
                              "corrupt, or unsafe pickled objects (nothing in it was run); use another "
                              "checkpoint") from None
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{path}: not a readable optimizer state ({type(e).__name__}: "
                              f"{textwrap.shorten(first, 120)}); the file is truncated or corrupt, use another "
                              "checkpoint") from None


_STATE_FIELDS = {"step": int, "tokens_seen": int, "samples_seen": int, "elapsed_s": (int, float), "last_eval": dict}
_STATE_COUNTS = ("world_size", "micro_batches")  # Trainer.load_state_dict compares the sequences per step


def check_trainer_state(state: dict, path: Path) -> dict:
    """``state`` (trainer_state.json at ``path``) with its fields type-checked: a wrong one is a corrupt file."""
    for key, kind in _STATE_FIELDS.items():
        if key not in state and key != "step":
            continue  # optional (defaults in Trainer.load_state_dict)
        v = state.get(key)
        numeric = kind is not dict and isinstance(v, kind) and not isinstance(v, bool)
        if not (numeric and 0 <= v < math.inf or kind is dict and isinstance(v, dict)):
            got = repr(v) if key in state else "missing"
            what = "a JSON object" if kind is dict else "a non-negative integer" if kind is int else \
                "a non-negative number"
            raise CheckpointError(f"{path}: {key!r} is {got}, not {what}; the trainer state is corrupt, use "
                                  "another checkpoint")
    for key in _STATE_COUNTS:  # optional, but when present they size a step: positive integers
        if key in state:
            v = state[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CheckpointError(f"{path}: {key!r} is {v!r}, not a positive integer; the trainer state is "
                                      "corrupt, use another checkpoint")
    return state


def check_optimizer_state(optimizer, model, path: Path) -> None:
    """Each loaded state tensor has its parameter's shape and finite values (``step``: one number).

    torch's ``load_state_dict`` checks the groups' sizes only: a moment smaller than its parameter makes the fused
    AdamW step read and write past it (a segfault), a transposed one trains on silently."""
    names = {id(p): n for n, p in model.named_parameters()}
    for opt in getattr(optimizer, "optimizers", [optimizer]):  # CombinedOptimizer (Muon + AdamW): each part
        for group in opt.param_groups:
            for p in group["params"]:
                for key, v in opt.state.get(p, {}).items():
                    if v is None or (key == "step" and isinstance(v, (int, float)) and not isinstance(v, bool)):
                        continue
                    ok = isinstance(v, torch.Tensor) and (v.numel() == 1 if key == "step" else v.shape == p.shape)
                    if not ok:
                        got = f"shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
                        want = "one number" if key == "step" else f"shape {tuple(p.shape)}"
                        raise CheckpointError(f"{path}: state {key!r} of {names.get(id(p), 'a parameter')!r} is "
                                              f"{got}, not {want}; the file is corrupt, use another checkpoint")
                    if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                        raise CheckpointError(f"{path}: state {key!r} of {names.get(id(p), 'a parameter')!r} holds "
                                              "NaN or inf; the file is corrupt or from a diverged run, use another "
                                              "checkpoint")


def check_sharded_finite(target: dict, world, path: Path) -> None:
    """Every weight and optimizer state tensor of a loaded sharded checkpoint is finite, on every process.

    Each process sees its own shards only, so each one's first bad entry (of the same sorted list of names) is
    all-reduced: all of them raise the same error, or none does (one raising alone would leave the others hanging
    in the next collective).  Shapes need no check here: torch.distributed.checkpoint refuses a size mismatch."""
    entries = sorted((f"weight {k!r}", v) for k, v in target["model"].items())
    entries += sorted((f"state {key!r} of {k!r}", v) for k, state in target["optim"].items()
                      for key, v in state.items())
    first = 0  # 1 + the index of this process's first non-finite entry, 0 for none
    for i, (_, v) in enumerate(entries):
        local = v.to_local() if hasattr(v, "to_local") else v
        if isinstance(local, torch.Tensor) and local.is_floating_point() and not bool(torch.isfinite(local).all()):
            first = i + 1
            break
    found = torch.zeros(world.world_size, dtype=torch.float64, device=world.device)
    found[world.rank] = first
    world.all_reduce_sum(found)
    bad = [int(i) for i in found.tolist() if i > 0]
    if bad:
        raise CheckpointError(f"{path}: {entries[min(bad) - 1][0]} holds NaN or inf; the checkpoint is corrupt or "
                              "from a diverged run, use another checkpoint")


def _read_groups(path: Path, current: list[dict]) -> list[dict]:
    """The optimizer's parameter groups saved beside a sharded checkpoint: one per group of ``current`` (this
    run's), over the same parameters; a hyperparameter it lacks (one a newer torch added) is this run's."""
    try:
        groups = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); the file is corrupt, use another checkpoint") from None
    fits = isinstance(groups, list) and len(groups) == len(current) and all(
        isinstance(g, dict) and g.get("params") == list(c["params"]) for g, c in zip(groups, current))
    if not fits:
        raise CheckpointError(f"{path}: not the {len(current)} parameter group(s) of this run's optimizer; the file "
                              "is corrupt, use another checkpoint")
    groups = [{**c, **g} for g, c in zip(groups, current)]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    return groups


def load_checkpoint(trainer, path: Path) -> dict:
    """Restore model, optimizer, RNG and trainer state from checkpoint ``path``; returns the trainer state."""
    path = Path(path)
    state = check_trainer_state(read_json(path / STATE_FILE, "trainer state"), path / STATE_FILE)
    if state["step"] > trainer.cfg.steps:
        raise ConfigError("steps", f"{trainer.cfg.steps} is before the step of the checkpoint being resumed "
                                   f"({state['step']}, {path}); pass a larger --steps")
    sharded = (path / SHARDED_DIR).is_dir()
    if sharded != (trainer.parallel == "fsdp"):
        saved = "fsdp" if sharded else "a single process or ddp"
        raise CheckpointError(f"{path}: saved with {saved}; resume it with the same --parallel "
                              f"(this run uses {trainer.parallel})")
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        model_sd = get_model_state_dict(trainer.model)
        optim_sd = get_optimizer_state_dict(trainer.model, trainer.optimizer)
        target = {"model": model_sd, "optim": optim_sd["state"]}
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.load(target, storage_reader=_safe_dcp_reader(path / SHARDED_DIR), planner=_safe_dcp_planner())
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # DCP's own is a BaseException wrapping each process's error
            e = _dcp_failure(e)
            if isinstance(e, CheckpointError):
                raise CheckpointError(str(e)) from None
            raise CheckpointError(f"{path / SHARDED_DIR}: cannot read the sharded state ({type(e).__name__}: "
                                  f"{(str(e).splitlines() or [''])[0][:120]})") from None
        check_sharded_finite(target, trainer.world, path / SHARDED_DIR)
        groups = _read_groups(path / OPTIM_GROUPS_FILE, optim_sd["param_groups"]) \
            if (path / OPTIM_GROUPS_FILE).is_file() else optim_sd["param_groups"]
        set_model_state_dict(trainer.model, target["model"])
        set_optimizer_state_dict(trainer.model, trainer.optimizer, {"state": target["optim"], "param_groups": groups})
    else:
        weights = path / WEIGHTS_FILE
        load_state_dict_into(trainer.model, load_safetensors(weights), str(weights))
        optim = _torch_load(path / OPTIM_FILE, trainer.world.device)
        if not isinstance(optim, dict):
            raise CheckpointError(f"{path / OPTIM_FILE}: holds a {type(optim).__name__}, not an optimizer state; the "
                                  "file is corrupt, use another checkpoint")
        try:
            trainer.optimizer.load_state_dict(optim)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise CheckpointError(f"{path / OPTIM_FILE}: does not match this model's optimizer ({e})") from None
        check_optimizer_state(trainer.optimizer, trainer.model, path / OPTIM_FILE)
    rng_file = path / RNG_DIR / f"rank_{trainer.world.rank}.json"
    if rng_file.is_file():
        rng = read_json(rng_file, "RNG state")
        try:
            set_rng_state(rng)
        except Exception as e:
            raise CheckpointError(f"{rng_file}: not a valid RNG state ({type(e).__name__}); the file is corrupt, "
                                  "use another checkpoint") from None
    elif trainer.world.rank < state.get("world_size", 1):  # saved by this rank's process: an incomplete checkpoint
        raise CheckpointError(f"{rng_file}: RNG state missing; the checkpoint is incomplete, use another")
    return state


def resolve_resume(resume: Optional[str], run_dir: Path, restore: bool = True,
                   skipped: Optional[Callable[[list[Path], list[list[str]]], None]] = None) -> Optional[Path]:
    """``--resume auto`` (the newest complete checkpoint in ``run_dir``, or None) or ``--resume PATH`` (a
    checkpoint, or a run directory: its newest complete checkpoint).  ``restore``: first put back a step whose
    re-save a crash interrupted (one process does it; the others wait, then resolve).  Newer ``step_*``
    directories that lack files are passed over: ``skipped(paths, missing)`` hears of them (newest first, each
    with its :func:`missing_parts`).  A checkpoint named explicitly must be complete."""
    if resume is None:
        return None
    if resume == "auto":
        if restore:
            restore_resaved(run_dir)
        return _newest_complete(run_dir, skipped, f"--resume {resume}")
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"--resume {resume}: no such checkpoint or run directory")
    if (path / STATE_FILE).is_file() or (path / WEIGHTS_FILE).is_file() or \
            (_STEP_DIR.match(path.name) and not (path / CHECKPOINTS_DIR).is_dir()):
        missing = missing_parts(path)
        if missing:
            files = ", ".join(str(path / m) for m in missing)
            raise CheckpointError(f"--resume {resume}: incomplete checkpoint ({files} missing); resume another one "
                                  "(--resume auto takes the newest complete checkpoint)")
        return path
    if restore:  # a run directory: its newest step may be a re-save a crash interrupted, as for auto
        try:
            restore_resaved(path)
        except OSError as e:
            raise CheckpointError(f"--resume {resume}: cannot put back a checkpoint whose re-save was interrupted "
                                  f"({e.strerror or e}); rename {CHECKPOINTS_DIR}/.step_*.old to step_*") from None
    if not list_checkpoints(path):
        raise CheckpointError(f"--resume {resume}: no checkpoint in it (expected {CHECKPOINTS_DIR}/step_*/)")
    return _newest_complete(path, skipped, f"--resume {resume}")


def newest_complete(run_dir: Path, before: Optional[int] = None) -> tuple[Optional[Path], list[Path], list[list[str]]]:
    """The newest complete checkpoint of ``run_dir`` (before step ``before``, if given; None when there is none),
    the newer ``step_*`` directories passed over for lacking files (newest first) and what each lacks
    (:func:`missing_parts`).  The one notion of "the newest checkpoint" of a run: ``--resume auto``,
    ``difftx.load_model(RUN)`` and the divergence error's last good checkpoint all take it."""
    passed, missing = [], []
    for ckpt in reversed(list_checkpoints(run_dir)):
        if before is not None and int(ckpt.name.split("_")[1]) >= before:
            continue
        lacks = missing_parts(ckpt)
        if not lacks:
            return ckpt, passed, missing
        passed.append(ckpt)
        missing.append(lacks)
    return None, passed, missing


def describe_missing(passed: list[Path], missing: list[list[str]]) -> str:
    """What the incomplete directories ``passed`` lack, for a message: their missing files' paths."""
    return "; ".join(", ".join(str(p / m) for m in lacks) for p, lacks in zip(passed, missing))


def earlier_hint(err: CheckpointError, ckpt: Path, out: Optional[Path] = None) -> str:
    """What to append to ``err``, an error reading checkpoint ``ckpt`` of a run (a file in it truncated or corrupt,
    which is refused, not passed over): the way to resume the complete checkpoint before it.  ``ckpt`` the newest
    of ``out`` (the run being resumed): rename it out of the list of checkpoints (kept, and ``--resume auto`` takes
    the one before; ``--resume`` of that one would delete it as a later step); else: ``--resume`` the one before.
    Empty when the error is not about a file in ``ckpt`` (the wrong --parallel) or there is no checkpoint before."""
    ckpt = Path(ckpt)
    if ckpt.parent.name != CHECKPOINTS_DIR or not _STEP_DIR.match(ckpt.name) or \
            not str(err).startswith(f"{ckpt}{os.sep}"):
        return ""
    run = ckpt.parent.parent
    prev = newest_complete(run, before=int(ckpt.name.split("_")[1]))[0]
    if prev is None:
        return ""
    newest = newest_complete(run)[0]
    if out is not None and run.resolve() == Path(out).resolve() and newest is not None and \
            newest.resolve() == ckpt.resolve():
        return (f"; to resume from the checkpoint before it, rename {ckpt} to {ckpt.name}.corrupt (kept, and no "
                f"longer a checkpoint): --resume auto then takes {prev}")
    return f"; the checkpoint before it is complete: --resume {prev}"


def _newest_complete(run_dir: Path, skipped, flag: str) -> Optional[Path]:
    """The newest complete checkpoint of ``run_dir`` (None when it has none at all); the newer incomplete ones go to
    ``skipped``.  Only incomplete ones: refused (the run is not started over in their place)."""
    ckpt, passed, missing = newest_complete(run_dir)
    if ckpt is None:
        if passed:
            raise CheckpointError(f"{flag}: no complete checkpoint to resume (missing: "
                                  f"{describe_missing(passed, missing)}); restore those files, or move the incomplete "
                                  "step_* directories away to start the run over")
        return None
    if passed and skipped is not None:
        skipped(passed, missing)
    return ckpt
