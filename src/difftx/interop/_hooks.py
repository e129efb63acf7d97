"""What ``import difftx`` sets up for interop, without importing transformers.

* A :func:`difftx.io.register_resolver` resolver, so ``difftx.load_model(DIR)``
  loads Hugging Face llama / diffllama / difftx directories (JSON + safetensors
  only; no transformers needed, no code from the directory runs).
* Registration of ``DifftxConfig`` / ``DifftxForCausalLM`` with transformers'
  ``AutoConfig`` / ``AutoModelForCausalLM``.  Importing transformers' model
  classes costs seconds, so ``import difftx`` must not do it.  Instead:

  - the config registers when transformers' ``configuration_auto`` is imported
    (first use of ``AutoConfig``): it needs only the configuration module that
    ``AutoConfig`` has just loaded, so it is cheap;
  - the model registers when ``modeling_auto`` is imported (first use of
    ``AutoModelForCausalLM``); this imports transformers' ``PreTrainedModel`` and
    ``GenerationMixin``, which ``from_pretrained`` would import a moment later anyway;
  - a module already imported when difftx is imported registers at once; otherwise
    a post-import hook (a ``sys.meta_path`` finder that watches only these two
    module names and removes itself once they are loaded) does it;
  - importing :mod:`difftx.interop.hf` always registers.

  Cost when transformers is never used: a finder on ``sys.meta_path`` that
  compares a module name per import.  Measured numbers: docs/interop.md.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings

_installed = False
_warned: set = set()  # the config's and the model's registration fail alike on an old transformers: one warning


def _register(module: str):
    def register() -> None:
        try:
            importlib.import_module(module, __package__)  # registers on import
        except Exception as e:  # an incompatible transformers must not break the user's import
            said = f"difftx: could not register with transformers ({type(e).__name__}: {e})"
            if said not in _warned:
                _warned.add(said)
                warnings.warn(said, stacklevel=2)

    return register


# transformers module -> the difftx module whose import registers with it
WATCHED = {
    "transformers.models.auto.configuration_auto": _register(".hf_config"),
    "transformers.models.auto.modeling_auto": _register(".hf"),
}


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Runs ``callbacks[name]`` once, right after module ``name`` has been executed."""

    def __init__(self, callbacks: dict):
        self.callbacks = dict(callbacks)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.callbacks:
            return None
        callback = self.callbacks.pop(fullname)
        if not self.callbacks:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            callback()

        loader.exec_module = exec_then_register  # this spec's own loader instance
        return spec


def install() -> None:
    """Called by ``import difftx``: the load_model resolver and the lazy transformers registration."""
    global _installed
    if _installed:
        return
    _installed = True
    from ..io import register_resolver

    def resolve_hf(path, device=None):
        from .convert import resolve_hf_dir

        return resolve_hf_dir(path, device)

    register_resolver(resolve_hf)
    pending = {}
    for name, callback in WATCHED.items():
        if name in sys.modules:
            callback()
        else:
            pending[name] = callback
    if pending:
        sys.meta_path.insert(0, _PostImportHook(pending))
