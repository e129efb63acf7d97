"""``import difftx`` registers with transformers' Auto classes lazily, without importing transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from ..conftest import cli_env  # noqa: E402

LAZY = """
import sys, difftx
assert "transformers" not in sys.modules, "import difftx imported transformers"
from transformers import AutoConfig
assert "difftx.interop.hf_config" in sys.modules, "AutoConfig use did not register the config"
assert "transformers.modeling_utils" not in sys.modules, "registering the config imported the model classes"
cfg = AutoConfig.for_model("difftx", difftx={"attention": "diff", "d_model": 32, "n_heads": 1, "n_layers": 1,
                                            "vocab_size": 11})
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_config(cfg)
assert type(model).__name__ == "DifftxForCausalLM", type(model)
print("ok")
"""

EAGER = """
from transformers import AutoModelForCausalLM, AutoConfig
import difftx
cfg = AutoConfig.for_model("difftx")
assert type(AutoModelForCausalLM.from_config(cfg)).__name__ == "DifftxForCausalLM"
print("ok")
"""


@pytest.mark.parametrize("script", [LAZY, pytest.param(EAGER, marks=pytest.mark.slow)], ids=["lazy", "eager"])
def test_auto_registration(script):
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=cli_env(), timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


OLD = """
import warnings
import transformers
transformers.__version__ = "5.3.0"  # a transformers older than the config class below needs
import difftx
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from transformers import AutoConfig  # the registration runs, and fails: a warning, not a broken import
    AutoConfig.for_model("llama")
said = [str(w.message) for w in caught if "difftx" in str(w.message)]
assert len(said) == 1 and "need transformers >= 5.4; this is transformers 5.3.0" in said[0], said
try:
    import difftx.interop.hf
except ImportError as e:
    assert "pip install -U 'transformers>=5.4'" in str(e), e
else:
    raise AssertionError("difftx.interop.hf imported on transformers 5.3")
print("ok")
"""


def test_a_transformers_too_old_for_the_config_class_is_named_with_the_fix():
    """On transformers 5.0-5.3 each DifftxForCausalLM refused its own config (every field derived in __post_init__
    read None), and 4.x failed the import of PreTrainedConfig: the registration warns, once, and importing the
    classes raises ImportError saying which version they need and how to get it."""
    r = subprocess.run([sys.executable, "-c", OLD], capture_output=True, text=True, env=cli_env(), timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
