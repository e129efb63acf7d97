"""Reading and writing Hugging Face model directories without transformers and without running code.

A Hugging Face directory is ``config.json`` plus weights in ``model.safetensors``,
sharded safetensors (``model.safetensors.index.json``) or, for old checkpoints,
``pytorch_model.bin`` (read with ``torch.load(weights_only=True)``, which cannot
execute code).  ``auto_map`` / custom code in the directory is never imported:
loading is JSON + tensors only, the equivalent of ``trust_remote_code=False``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..io import (atomic_copyfile, atomic_write_files, load_safetensors, make_out_dir, safetensors_bytes,
                  torch_load_weights_only)

CONFIG_FILE = "config.json"
SAFE_FILE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
# tokenizer files that travel unchanged between Hugging Face directories (transformers >= 4.43 saves a chat
# template as chat_template.jinja, further ones in the folder additional_chat_templates/; slow tokenizers keep
# added_tokens.json)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "vocab.json", "merges.txt", "generation_config.json", "added_tokens.json",
                      "chat_template.jinja", "additional_chat_templates")
HF_FILES_BESIDE_TOKENIZER = tuple(n for n in HF_TOKENIZER_FILES if n != "tokenizer.json")  # beside a difftx one
# a difftx tokenizer inside a Hugging Face directory (tokenizer.json there means the HF format); beside a Hugging
# Face tokenizer.json it travels under this name, through a difftx directory too (convert._copy_tokenizer)
DIFFTX_TOKENIZER_IN_HF = "difftx_tokenizer.json"


def read_json(path: Path, what: str = "config") -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); the file is corrupt") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def read_hf_config(path) -> dict:
    """``config.json`` of a Hugging Face directory; it must name a ``model_type``."""
    cfg = read_json(Path(path) / CONFIG_FILE)
    if "model_type" not in cfg:
        raise CheckpointError(f"{Path(path) / CONFIG_FILE}: no 'model_type'; not a Hugging Face model config")
    if not isinstance(cfg["model_type"], str):  # a list or object: unhashable where formats are looked up
        raise CheckpointError(f"{Path(path) / CONFIG_FILE}: 'model_type' must be a string; got "
                              f"{cfg['model_type']!r}: the file is corrupt")
    return cfg


def is_hf_dir(path) -> bool:
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        return False
    try:
        data = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except Exception:
        return False
    return isinstance(data, dict) and "model_type" in data and "difftx_format" not in data


def _load_bin(path: Path) -> dict:
    try:
        state = torch_load_weights_only(path)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read as a weights-only torch file ({type(e).__name__}); "
                              "re-save it as safetensors") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a state dict of named tensors; "
                              "the file is corrupt or not a model's weights")
    for k, v in state.items():
        if not isinstance(k, str):
            raise CheckpointError(f"{path}: key {k!r} is a {type(k).__name__}, not a tensor name; "
                                  "the file is corrupt or not a model's weights")
        if not isinstance(v, torch.Tensor):
            raise CheckpointError(f"{path}: entry '{k}' is a {type(v).__name__}, not a tensor; "
                                  "the file is corrupt or not a model's weights")
    return state


def read_hf_weights(path) -> dict:
    """All tensors of a Hugging Face directory (single file or shards), on CPU.

    The files are tried in transformers' order (``model.safetensors``, its shards, ``pytorch_model.bin``, its
    shards), so a directory holding several (older shards beside a ``model.safetensors`` written over them) gives
    the weights transformers loads."""
    path = Path(path)
    for name, loader in ((SAFE_FILE, load_safetensors), (SAFE_INDEX, load_safetensors), (BIN_FILE, _load_bin),
                         (BIN_INDEX, _load_bin)):
        if name in (SAFE_FILE, BIN_FILE):
            if (path / name).is_file():
                return loader(path / name)
            continue
        index = path / name
        if index.is_file():
            weight_map = read_json(index, "weight index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map'; the index is corrupt")
            state: dict = {}
            if not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names; "
                                      "the index is corrupt")
            for shard in sorted(set(weight_map.values())):
                # a plain file name in the directory, judged by name: a Hugging Face hub cache snapshot's files
                # are symlinks into ../../blobs, which resolving them would take for a shard outside the directory
                if Path(shard).name != shard or shard in (".", ".."):
                    raise CheckpointError(f"{index}: shard {shard!r} lies outside the model directory")
                state.update(loader(path / shard))
            return state
    raise CheckpointError(f"{path}: no weights ({SAFE_FILE}, {SAFE_INDEX} or {BIN_FILE})")


def write_hf_dir(path, config: dict, state: dict) -> Path:
    """Write ``config.json`` + ``model.safetensors`` into directory ``path``, both or neither (new weights beside an
    earlier config, a write that failed midway, would not load), tensors as given (a caller casts them:
    :func:`difftx.io.cast_state` keeps DIFF's lambdas float32)."""
    path = make_out_dir(path, flag="DST")
    atomic_write_files({path / SAFE_FILE: safetensors_bytes(state, {"format": "pt"}),
                        path / CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True).encode("utf-8")})
    return path


def copy_files(src, dst, names) -> list[str]:
    """Copy whichever of ``names`` exist in ``src`` to ``dst`` (a folder with its files); returns the names copied."""
    copied = []
    for name in names:
        if (Path(src) / name).is_file():
            atomic_copyfile(Path(src) / name, Path(dst) / name)
            copied.append(name)
        elif (Path(src) / name).is_dir():
            shutil.copytree(Path(src) / name, Path(dst) / name, dirs_exist_ok=True)
            copied.append(name)
    return copied
