"""difftx: Differential Transformer, DNT and their combinations, in one configurable model zoo.

    import difftx
    cfg = difftx.ModelConfig(attention="diff", d_model=64, n_layers=2, n_heads=2, vocab_size=97)
    model = difftx.build_model(cfg)
    logits = model(input_ids).logits
"""

from .config import ModelConfig, lambda_init_for_layer
from .errors import CheckpointError, ConfigError, DataError, DifftxError
from .io import load_model, save_model
from .models import build_model
from .interop._hooks import install as _install_interop

_install_interop()  # load_model on Hugging Face dirs; lazy AutoModel registration (no transformers import)

__version__ = "0.1.0"

# subpackages and modules reachable as attributes after a plain `import difftx` (difftx.data.load_tokenizer,
# difftx.evals, ...), imported on first use: `import difftx` itself stays light
_SUBMODULES = frozenset({"accounting", "analysis", "benchmarking", "cli", "compare", "data", "evals", "interop",
                         "models", "nn", "optim", "presets", "runtime", "train"})


def __getattr__(name: str):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "ModelConfig", "lambda_init_for_layer", "build_model", "load_model", "save_model",
    "DifftxError", "ConfigError", "CheckpointError", "DataError", "__version__",
]
