"""Saving and loading models as directories: ``config.json`` + ``model.safetensors``.

Nothing here unpickles: weights are safetensors, the config is JSON.  Writes are
atomic (temporary file in the same directory, fsync, rename), so a crash leaves
either the old file or the new one.  State-dict keys never carry wrapper
prefixes (``_orig_mod.`` from torch.compile, ``module.`` from DDP).

:func:`load_model` accepts a model directory, a training run or checkpoint
directory (of a run, its newest complete checkpoint is used) or, through
registered resolvers (e.g. :mod:`difftx.interop`), other layouts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from .config import ModelConfig
from .errors import CheckpointError, ConfigError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_KEY = "difftx_format"
FORMAT_VERSION = 1
DTYPE_KEY = "dtype"  # config.json: the weights' dtype, when they share one
STORED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float64": torch.float64}
# DIFF's lambda vectors: float32 in a model of a lower dtype (as DiffAttention builds them, as the trainer and the
# transformers wrapper keep them); lambda_full computes in float32 from them
FP32_PARAMETERS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
CHECKPOINTS_DIR = "checkpoints"  # a training run's checkpoints: RUN/checkpoints/step_XXXXXXXX/
_STEP_DIR = re.compile(r"^step_(\d{8,})$")

# resolvers: fn(path) -> model or None; tried in order for directories that are not difftx model dirs
_RESOLVERS: list[Callable[[Path, Optional[str]], Optional[torch.nn.Module]]] = []


def register_resolver(fn: Callable) -> Callable:
    """Register ``fn(path, device) -> model | None`` for load_model on other directory layouts."""
    _RESOLVERS.append(fn)
    return fn


def clean_state_dict(sd: dict) -> dict:
    """Strip torch.compile / DDP / FSDP wrapper prefixes from keys (whole key parts, at any depth)."""
    wrappers = ("_orig_mod", "module", "_fsdp_wrapped_module")
    return {".".join(part for part in k.split(".") if part not in wrappers): v for k, v in sd.items()}


_UMASK = os.umask(0o022)
os.umask(_UMASK)


def make_out_dir(path, flag: str = "--out") -> Path:
    """``mkdir -p path`` for a command's output; a path that cannot be a directory is one
    :class:`~difftx.errors.DifftxError` naming ``flag``, the path and the fix (no traceback)."""
    from .errors import DifftxError

    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DifftxError(f"{flag} {path}: a file of that name exists; pick a directory path") from None
    except NotADirectoryError:
        raise DifftxError(f"{flag} {path}: part of the path is a file, not a directory; pick another path") from None
    except PermissionError:
        raise DifftxError(f"{flag} {path}: permission denied; pick a directory you can write to") from None
    except OSError as e:
        raise DifftxError(f"{flag} {path}: cannot create the directory ({e.strerror}); pick another path") from None
    return path


def refuse_old_results(out, names, force: bool, flag: str = "--out") -> None:
    """An earlier run's result files (``names``) in ``out`` are kept unless ``force``: one DifftxError naming
    the first one and the fix (how ``difftx eval``, ``bench`` and ``grads`` treat a reused output directory)."""
    from .errors import DifftxError

    old = [n for n in names if (Path(out) / n).exists()]
    if old and not force:
        raise DifftxError(f"{flag} {out}: {old[0]} already exists (an earlier result); pass --force to overwrite "
                          f"it, or choose another {flag} (nothing was changed)")


def torch_load_weights_only(path, map_location="cpu"):
    """``torch.load(weights_only=True)``: tensors and plain containers, never code.  torch's warning about a
    file it refuses is silenced (callers turn the exception into their own one-line error)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, map_location=map_location, weights_only=True)


def _write_temp(path: Path, data: bytes) -> str:
    """``data`` written and fsynced to a temporary file beside ``path`` (removed again if that fails); its name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the usual permissions
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return tmp


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM that arrive inside the block act only once it ends (each raised again then, for the
    handler it would have met: KeyboardInterrupt, the trainer's stop, or the default's exit).  Outside the main
    thread, where handlers cannot be set, nothing is held."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending, old = [], {}

    def hold(signum, frame):
        pending.append(signum)

    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is not None:  # None: a handler not set from Python, which cannot be restored
                old[sig] = signal.signal(sig, hold)
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(pending):
            signal.raise_signal(sig)


def atomic_write_files(files: dict) -> None:
    """Write ``{path: bytes}`` so that a failed write changes none of them: every file is written in full to a
    temporary name first, then each is renamed over its path."""
    tmps = {}
    if not files:
        return
    try:
        for path, data in files.items():
            tmps[Path(path)] = _write_temp(path, data)
        with _signals_held():  # Ctrl-C between two renames would leave a new file beside an old one
            for path, tmp in list(tmps.items()):
                os.replace(tmp, path)
                del tmps[path]
    except OSError as e:
        # a failed write() or fsync() names no file, and a failed mkstemp() or rename the temporary one (never made,
        # or deleted below): the error names the file it was for ("difftx eval: error: OUT/lm.json: No space ...")
        name = os.path.basename(os.fsdecode(e.filename)) if isinstance(e.filename, (str, bytes)) else None
        temporary = name is not None and name.startswith(f".{Path(path).name}.") and name.endswith(".tmp")
        if e.errno is not None and (name is None or temporary):
            raise type(e)(e.errno, e.strerror, str(path)) from None
        raise
    finally:
        for tmp in tmps.values():
            if os.path.exists(tmp):
                os.unlink(tmp)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write_files({Path(path): data})


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_copyfile(src, dst) -> None:
    """``shutil.copyfile(src, dst)`` through a temporary file beside ``dst`` renamed over it: an interrupt or a full
    disk midway leaves the earlier ``dst`` (or none), never a truncated copy under its name."""
    import shutil

    dst = Path(dst)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_savefig(fig, path, **kwargs) -> None:
    """``fig.savefig(path, **kwargs)``, atomically: the image is drawn in memory and written like any other file
    here, so an interrupt or a full disk leaves the earlier file (or none), never a truncated one under ``path``."""
    from io import BytesIO

    buf = BytesIO()
    fig.savefig(buf, format=kwargs.pop("format", None) or Path(path).suffix.lstrip(".") or "png", **kwargs)
    atomic_write_bytes(Path(path), buf.getvalue())


def safetensors_bytes(tensors: dict, metadata: Optional[dict] = None) -> bytes:
    """``tensors`` (as contiguous CPU copies) serialised as a safetensors file."""
    from safetensors.torch import save

    return save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, metadata=metadata)


def save_safetensors(tensors: dict, path: Path, metadata: Optional[dict] = None) -> None:
    """Atomically write ``tensors`` (contiguous CPU copies) as safetensors."""
    atomic_write_bytes(Path(path), safetensors_bytes(tensors, metadata))


def load_safetensors(path: Path) -> dict:
    """Read a safetensors file; a truncated or corrupt file raises CheckpointError naming it."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: weights file not found")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for bad headers / truncation
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
            "the file is truncated or corrupt, use another checkpoint"
        ) from None


def is_fp32_parameter(name: str) -> bool:
    """Whether tensor ``name`` (any prefix: difftx, hf-difftx, DiffLlama, unilm) is one of :data:`FP32_PARAMETERS`."""
    return name.rsplit(".", 1)[-1] in FP32_PARAMETERS


def cast_state(state: dict, dtype: torch.dtype) -> dict:
    """``state`` with its floating tensors in ``dtype``, except that :data:`FP32_PARAMETERS` are never put below
    float32 (as :func:`cast_model` keeps them): written as float32, their values are not rounded on disk."""
    def cast(name, t):
        if not (torch.is_tensor(t) and t.is_floating_point()):
            return t
        if is_fp32_parameter(name) and dtype.itemsize < 4:
            return t.to(torch.float32)  # exact: an upcast, or float32 kept
        return t.to(dtype)

    return {k: cast(k, v) for k, v in state.items()}


def model_dtype(state: dict) -> Optional[torch.dtype]:
    """The dtype of the model ``state`` holds: the one dtype of its floating tensors, or, in a bf16 / fp16 model,
    of those other than :data:`FP32_PARAMETERS` kept in float32.  None if there are none, or several."""
    floats = {k: v.dtype for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()}
    dtypes = set(floats.values())
    if len(dtypes) > 1:
        rest = {d for k, d in floats.items() if not is_fp32_parameter(k)}
        lower = rest.pop() if len(rest) == 1 else None
        if lower is not None and lower.itemsize < 4 and dtypes == {lower, torch.float32}:
            return lower  # every float32 tensor is an FP32_PARAMETERS one
    return dtypes.pop() if len(dtypes) == 1 else None


def model_config_dict(cfg: ModelConfig) -> dict:
    return {FORMAT_KEY: FORMAT_VERSION, "model": cfg.to_dict()}


def training_run_reason(path: Path) -> Optional[str]:
    """Why directory ``path`` is a training run or one of its checkpoints (None when it is neither): what
    ``save_model`` and ``difftx convert --force`` refuse to overwrite (a model written there dropped the run's
    ``train`` / ``data`` config, so the run no longer resumed, or sat beside its checkpoints)."""
    if (path / CHECKPOINTS_DIR).exists():
        return f"it has {CHECKPOINTS_DIR}/: a training run"
    if (path / "trainer_state.json").is_file():
        return "it holds trainer_state.json: a training run's checkpoint"
    try:
        data = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and FORMAT_KEY in data and "train" in data:
        return f"its {CONFIG_FILE} is a training run's"
    return None


def _refuse_a_run(path: Path) -> None:
    why = training_run_reason(path)
    if why is not None:
        raise ConfigError(None, f"save_model: {path} is not a model directory to overwrite ({why}, which would no "
                          "longer resume); save into a new directory (nothing was changed)")


def refuse_unplain_state(state: dict, cfg: ModelConfig, who: str) -> None:
    """DifftxError unless ``state`` (wrapper prefixes stripped) holds the tensor names of the model ``cfg`` describes,
    before anything is written: a parametrization (torch.nn.utils.parametrize, weight_norm), pruning
    (torch.nn.utils.prune), an adapter (peft's LoRA) or a quantized layer renames a module's tensors, and a checkpoint
    of those names is refused only when it is loaded."""
    from .errors import DifftxError
    from .models import build_model

    own = build_model(cfg, device="meta").state_dict()
    odd = [k for k in state if k not in own] or [k for k in own if k not in state]
    if odd:
        raise DifftxError(
            f"{who}: tensor '{odd[0]}' is {'not one of' if odd[0] in state else 'missing from'} the tensors of "
            "this model config: a parametrization, pruning, an adapter or quantization changed the model's tensors; "
            "make them plain first (torch.nn.utils.parametrize.remove_parametrizations(module, 'weight'), "
            "torch.nn.utils.prune.remove(module, 'weight'), peft's merge_and_unload())")


def save_model(model: torch.nn.Module, path, extra_config: Optional[dict] = None, tokenizer=None) -> Path:
    """Write ``model`` to directory ``path`` (config.json + model.safetensors, and tokenizer.json when
    ``tokenizer`` -- a :class:`difftx.data.tokenizers.Tokenizer` -- is given, as a training run's checkpoints
    have it: ``difftx eval`` of a text evaluation needs it)."""
    from .data.tokenizers import TOKENIZER_FILE, Tokenizer

    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):  # e.g. DifftxForCausalLM (a transformers config): load_model would refuse it
        raise ConfigError(None, f"save_model: a {type(model).__name__} is not a difftx model (its config is "
                          f"{type(cfg).__name__}, not difftx.ModelConfig); save the difftx model it holds "
                          "(DifftxForCausalLM: .model; DDP: .module), or use save_pretrained")
    if tokenizer is not None:  # before anything is written
        if not isinstance(tokenizer, Tokenizer):
            raise ConfigError("tokenizer", f"save_model: must be a difftx tokenizer (difftx.data.ByteTokenizer(), "
                                           f"difftx.data.load_tokenizer(...)); got {type(tokenizer).__name__}")
        if cfg.domain != "lm":
            raise ConfigError("tokenizer", f"save_model: a {cfg.domain} model reads no text; drop tokenizer=")
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ConfigError("tokenizer", f"save_model: the tokenizer has {tokenizer.vocab_size} ids and the "
                                           f"model's vocab_size is {cfg.vocab_size}; give the model's own tokenizer")
    _refuse_a_run(Path(path))
    path = make_out_dir(path, flag="save_model")  # a path that is (or is under) a file: one DifftxError
    cfg_dict = model_config_dict(model.config)
    state = clean_state_dict(model.state_dict())
    refuse_unplain_state(state, cfg, "save_model")
    stored = model_dtype(state)
    if stored is not None:  # the dtype load_model gives the model back in (DIFF's lambdas float32 below float32)
        cfg_dict[DTYPE_KEY] = str(stored).removeprefix("torch.")
    if extra_config:
        cfg_dict.update(extra_config)
    # both files or neither: new weights beside the old config (a write that failed midway) would not load
    weights = safetensors_bytes(state, {"format": "pt"})
    config = json.dumps(cfg_dict, indent=2).encode("utf-8")
    files = {path / WEIGHTS_FILE: weights, path / CONFIG_FILE: config}
    if tokenizer is not None:
        files[path / TOKENIZER_FILE] = tokenizer.to_json().encode("utf-8")
    atomic_write_files(files)
    return path


def read_model_config(path) -> ModelConfig:
    return _read_model_config(path)[0]


def _read_model_config(path) -> tuple[ModelConfig, dict]:
    """The model config at ``path`` (a model directory or its config.json) and the file's whole JSON object."""
    path = Path(path)
    cfg_path = path / CONFIG_FILE if path.is_dir() else path
    try:
        data = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{cfg_path}: config not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e}); the file is corrupt") from None
    if not isinstance(data, dict) or FORMAT_KEY not in data or "model" not in data:
        raise CheckpointError(f"{cfg_path}: not a difftx model config (no '{FORMAT_KEY}' / 'model' keys)")
    if data[FORMAT_KEY] != FORMAT_VERSION:
        raise CheckpointError(f"{cfg_path}: {FORMAT_KEY} {data[FORMAT_KEY]!r}, but this difftx reads format "
                              f"{FORMAT_VERSION}; use the difftx version that wrote it")
    if not isinstance(data["model"], dict):
        raise CheckpointError(f"{cfg_path}: 'model' must be an object of config fields; got "
                              f"{type(data['model']).__name__}: the file is corrupt")
    try:
        return ModelConfig.from_dict(data["model"]), data
    except ConfigError as e:
        raise CheckpointError(f"{cfg_path}: invalid model config: {e}") from None


def load_state_dict_into(model: torch.nn.Module, state: dict, source: str) -> None:
    """Load ``state`` strictly; a missing, unexpected or mis-shaped tensor raises CheckpointError naming it."""
    state = clean_state_dict(state)
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing:
        raise CheckpointError(f"{source}: tensor '{missing[0]}' is missing ({len(missing)} missing in all); "
                              "the checkpoint does not match this model config")
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor '{unexpected[0]}' ({len(unexpected)} in all); "
                              "the checkpoint does not match this model config")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise CheckpointError(f"{source}: tensor '{k}' has shape {tuple(v.shape)}, "
                                  f"the model expects {tuple(own[k].shape)}")
        if own[k].is_floating_point() and not v.is_floating_point():  # load_state_dict would cast it silently
            raise CheckpointError(f"{source}: tensor '{k}' is {str(v.dtype).removeprefix('torch.')}, not floating "
                                  "point; the weights are corrupt")
        if v.is_floating_point() and v.dtype not in STORED_DTYPES.values():  # float8: isfinite is not implemented
            raise CheckpointError(f"{source}: tensor '{k}' is {str(v.dtype).removeprefix('torch.')}; difftx reads "
                                  f"{', '.join(STORED_DTYPES)} weights: convert them to one of those")
        check_finite(k, v, source)
    model.load_state_dict(state, strict=True)


def check_finite(name: str, tensor: torch.Tensor, source: str) -> None:
    """CheckpointError if a floating ``tensor`` holds NaN or inf (the trainer never saves one: it stops first)."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise CheckpointError(f"{source}: tensor '{name}' holds {bad} non-finite value{'s' if bad > 1 else ''} "
                              "(NaN or inf); the weights are corrupt or from a diverged run: use an earlier checkpoint")


def _restore_dtypes(model: torch.nn.Module, state: dict) -> None:
    """Give each floating parameter and buffer of ``model`` the dtype of its tensor in ``state``."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in tensors:
        s = state.get(name)
        if s is not None and t.is_floating_point() and s.is_floating_point() and s.dtype != t.dtype:
            t.data = t.data.to(s.dtype)


def saved_dtype(model: torch.nn.Module, state: dict, stored) -> Optional[torch.dtype]:
    """The dtype to give ``model`` (just loaded from ``state``, in float32) back in: the one its config names
    (``stored``: ``"bfloat16"``, ...; None for ``"float32"``).  When the config names none (a mixed model, e.g.
    bf16 weights with float32 DIFF lambdas), each tensor gets its dtype in ``state`` here, and None is returned."""
    if isinstance(stored, str) and stored in STORED_DTYPES:
        return STORED_DTYPES[stored] if stored != "float32" else None
    _restore_dtypes(model, state)
    return None


def cast_model(model: torch.nn.Module, device=None, dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """``model.to(device, dtype)``, except that :data:`FP32_PARAMETERS` are never put below float32: in a bf16 or
    fp16 model they keep their float32 values (ones stored in a lower dtype are upcast, exactly)."""
    def fp32(name, p):
        return is_fp32_parameter(name) and p.is_floating_point()

    before = {n: p.detach() for n, p in model.named_parameters() if fp32(n, p) and p.dtype.itemsize >= 4}
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    for name, p in model.named_parameters():
        if fp32(name, p) and p.dtype.itemsize < 4:
            p.data = before.get(name, p.data).to(device=p.device, dtype=torch.float32)
    return model


def list_checkpoints(run_dir) -> list[Path]:
    """The checkpoint directories (``step_XXXXXXXX``) of a training run, oldest first.

    The trainer assembles a checkpoint under a temporary name and renames it to
    ``step_XXXXXXXX`` when complete, so a directory of that name is whole unless
    something else damaged it (a partial copy, files deleted by hand):
    ``difftx.train.checkpoint.missing_parts`` tells, and ``--resume auto``,
    :func:`load_model` and the divergence error pass such a directory over
    (``difftx.train.checkpoint.newest_complete``).
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def _newest_complete_checkpoint(run_dir: Path) -> Path:
    """The checkpoint ``load_model(run_dir)`` loads: the newest complete one, as ``--resume auto`` takes it
    (``difftx.train.checkpoint.newest_complete``); newer ``step_*`` directories that lack files are passed over with
    a warning, and a run with no complete checkpoint is one CheckpointError naming what each one lacks."""
    import warnings

    from .train.checkpoint import describe_missing, newest_complete

    ckpt, passed, missing = newest_complete(run_dir)
    if ckpt is None:
        raise CheckpointError(f"{run_dir}: no complete checkpoint in {CHECKPOINTS_DIR}/ (missing: "
                              f"{describe_missing(passed, missing)}); restore those files, or load one of them by its "
                              f"path (a step_* directory needs only {CONFIG_FILE} and {WEIGHTS_FILE})")
    if passed:
        warnings.warn(f"difftx.load_model: skipped incomplete checkpoint(s) of {run_dir} (missing: "
                      f"{describe_missing(passed, missing)}); loading {ckpt}", stacklevel=3)
    return ckpt


def is_model_dir(path: Path) -> bool:
    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        return False
    try:
        data = json.loads((path / CONFIG_FILE).read_text())
    except Exception:
        return True  # looks like one; read_model_config will report the corruption
    return isinstance(data, dict) and FORMAT_KEY in data


def load_model(path, device: Optional[str] = None, dtype=None) -> torch.nn.Module:
    """Load a difftx model from a model directory, a checkpoint directory or a training run.

    Other layouts (e.g. a converted Hugging Face directory) load through
    registered resolvers.  Raises CheckpointError with the offending path.
    In a bf16 or fp16 model DIFF's lambda vectors stay float32 (:data:`FP32_PARAMETERS`).
    """
    from .models import build_model

    if isinstance(dtype, str):  # "bfloat16", "float32", ... as config.json names them
        if dtype not in STORED_DTYPES:
            raise ConfigError("dtype", f"must be a torch dtype or one of {', '.join(STORED_DTYPES)}; got {dtype!r}")
        dtype = STORED_DTYPES[dtype]
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError("dtype", f"must be a floating torch dtype or one of {', '.join(STORED_DTYPES)}; "
                          f"got {dtype!r}")
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory; pass a difftx model, checkpoint or run directory")
    given = path
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path}: expected a directory or a .safetensors file")
        if path.name != WEIGHTS_FILE and is_model_dir(path.parent):  # the directory's model is another file
            raise CheckpointError(f"{path}: not this directory's weights ({WEIGHTS_FILE}, which load_model reads "
                                  f"with its {CONFIG_FILE}); pass {path.parent}, or a directory holding the "
                                  f"file as {WEIGHTS_FILE} beside its {CONFIG_FILE}")
        path = path.parent  # its directory: a difftx model, or a layout a resolver reads (sharded HF weights)
    run = None
    if not is_model_dir(path) and list_checkpoints(path):  # a training run: its newest complete checkpoint
        run, path = path, _newest_complete_checkpoint(path)
    if not is_model_dir(path):
        for fn in _RESOLVERS:
            model = fn(path, device)
            if model is not None:
                return cast_model(model, dtype=dtype) if dtype is not None else model
        where = f"{given} (in {path})" if given != path else f"{path}"
        raise CheckpointError(
            f"{where}: no difftx model here (need {CONFIG_FILE} with '{FORMAT_KEY}' and {WEIGHTS_FILE}, "
            "or a training run / checkpoint directory)"
        )
    try:
        cfg, data = _read_model_config(path)
        try:
            model = build_model(cfg)
        except (RuntimeError, TypeError, MemoryError) as e:  # a size no memory (or no 64-bit count) holds
            if not isinstance(e, MemoryError) and not re.search(r"overflow|allocate", str(e), re.I):
                raise
            raise CheckpointError(f"{path / CONFIG_FILE}: cannot build the model it describes (vocab_size "
                                  f"{cfg.vocab_size}, d_model {cfg.d_model}, ffn_dim {cfg.ffn_dim}, max_seq_len "
                                  f"{cfg.max_seq_len}: {str(e).splitlines()[0][:200]}); the config is corrupt or "
                                  "the model does not fit in memory") from None
        state = load_safetensors(path / WEIGHTS_FILE)
        load_state_dict_into(model, state, str(path / WEIGHTS_FILE))
    except CheckpointError as e:  # a corrupt file is refused, not passed over: say which checkpoint loads instead
        if run is None:
            raise
        from .train.checkpoint import newest_complete

        prev = newest_complete(run, before=int(_STEP_DIR.match(path.name).group(1)))[0]
        if prev is None:
            raise
        raise CheckpointError(f"{e}; {path} is the newest complete checkpoint of {run}: load the one before it, "
                              f"{prev}, by its path") from None
    if dtype is None:  # the dtype it was saved in (a bf16 conversion stays bf16)
        dtype = saved_dtype(model, clean_state_dict(state), data.get(DTYPE_KEY))
    model = cast_model(model, device, dtype)  # lambdas stay float32 in a bf16 model, as the HF wrapper keeps them
    model.eval()
    return model
