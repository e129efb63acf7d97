"""Hugging Face and official-code interop: converters, transformers classes, lm-evaluation-harness.

Light to import: nothing here imports transformers, and the names below load
their module on first use.  The transformers classes live in
:mod:`difftx.interop.hf` (``DifftxConfig``, ``DifftxForCausalLM``) and are
registered with ``AutoConfig`` / ``AutoModelForCausalLM`` automatically once
transformers' auto classes are used after ``import difftx`` (see :mod:`._hooks`).

    from difftx.interop import convert_checkpoint, save_hf, llama_to_diff
    convert_checkpoint("llama_dir", "out_dir")       # HF Llama -> difftx; difftx.load_model("out_dir") works
    save_hf(model, "hf_dir", "hf-diffllama")         # transformers' AutoModelForCausalLM loads hf_dir
"""

import importlib

_EXPORTS = {
    "FORMATS": ".convert", "convert_checkpoint": ".convert", "detect_format": ".convert", "difftx_to_hf": ".convert",
    "load_hf_model": ".convert", "read_hf_as_difftx": ".convert", "save_hf": ".convert",
    "relayout": ".layouts",
    "DIFF_INIT_MODES": ".llama_to_diff", "llama_to_diff": ".llama_to_diff",
    "load_unilm_attention": ".unilm", "unilm_to_difftx": ".unilm",
    "run_lm_eval": ".lm_eval", "DifftxLM": ".lm_eval",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        attr = "convert" if name == "convert_checkpoint" else name  # the module difftx.interop.convert owns the name
        return getattr(importlib.import_module(_EXPORTS[name], __name__), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
