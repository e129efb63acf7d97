"""``DifftxConfig``: the transformers config of a difftx LM (cheap to import: no model classes).

Kept apart from :mod:`.hf` so that registering with ``AutoConfig`` needs only
transformers' configuration module, which ``AutoConfig`` has loaded anyway.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

from ..config import ModelConfig
from ..errors import CheckpointError
from .convert import hf_standard_fields, model_config_from_hf

# The config below is a transformers >= 5.4 config (fields declared on the class, derived in __post_init__): on
# 5.0-5.3 every derived field read None and each model refused its config; 4.x has no PreTrainedConfig.
TRANSFORMERS_MIN = "5.4"


def check_transformers_version(version: str) -> None:
    """ImportError naming the fix when ``version`` is older than :data:`TRANSFORMERS_MIN`."""
    if Version(version).release[:2] < Version(TRANSFORMERS_MIN).release:
        raise ImportError(f"difftx's Hugging Face classes (DifftxConfig, DifftxForCausalLM) need transformers >= "
                          f"{TRANSFORMERS_MIN}; this is transformers {version}: pip install -U "
                          f"'transformers>={TRANSFORMERS_MIN}' (difftx.load_model and `difftx convert` read and "
                          "write Hugging Face directories without transformers)")


check_transformers_version(transformers.__version__)

from transformers import AutoConfig, PreTrainedConfig  # noqa: E402


class DifftxConfig(PreTrainedConfig):
    """transformers config of a difftx LM: the ModelConfig dict under ``difftx``.

    ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads`` (difftx's
    ``n_heads``: differential heads for ``diff``), ``num_key_value_heads``,
    ``head_dim``, ``vocab_size``, ``max_position_embeddings`` and
    ``tie_word_embeddings`` are derived from it on every construction.
    """

    model_type = "difftx"
    difftx: dict | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    use_cache: bool = True
    # declared as on transformers' own configs (PreTrainedConfig has no token ids since transformers 5): unset,
    # they read None instead of raising AttributeError
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs):
        cfg = model_config_from_hf({"difftx": self.difftx}, "DifftxConfig") if self.difftx else ModelConfig()
        if cfg.domain != "lm":
            raise ValueError("DifftxConfig holds language models (domain='lm')")
        self.difftx = cfg.to_dict()
        for key, value in hf_standard_fields(cfg).items():
            setattr(self, key, value)
        super().__post_init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> "DifftxConfig":
        """A saved config (``from_pretrained``, ``AutoConfig``) must hold the ``difftx`` object: without it (a Llama
        ``config.json``, a difftx model directory's) the default ModelConfig would be built, and whichever of the
        directory's weights fit it loaded, silently.  ``DifftxConfig()`` alone is still the default config."""
        if not isinstance(config_dict.get("difftx"), dict):
            src = kwargs.get("name_or_path") or config_dict.get("_name_or_path") or "config.json"
            kind = "a difftx model directory" if "difftx_format" in config_dict else \
                f"model_type {config_dict.get('model_type')!r}"
            raise CheckpointError(f"{src}: {kind} with no 'difftx' object: not a DifftxForCausalLM config; load it "
                                  "with difftx.load_model, or write one with `difftx convert SRC DST --to hf-difftx`")
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, **kwargs) -> "DifftxConfig":
        return cls(difftx=cfg.to_dict(), **kwargs)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.difftx)


def register_config() -> None:
    """Register ``model_type='difftx'`` with AutoConfig (idempotent)."""
    try:
        AutoConfig.register(DifftxConfig.model_type, DifftxConfig, exist_ok=True)
    except TypeError:  # older transformers without exist_ok
        try:
            AutoConfig.register(DifftxConfig.model_type, DifftxConfig)
        except ValueError:
            pass


register_config()
