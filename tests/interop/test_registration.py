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
