"""difftx.io: save_model / load_model on bad input."""

from __future__ import annotations

import pytest
import torch

import difftx
from difftx import ConfigError, ModelConfig, build_model


def tiny_model():
    return build_model(ModelConfig(attention="diff", d_model=32, n_layers=1, n_heads=2, vocab_size=61,
                                   max_seq_len=16)).eval()


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, 3, object()])
def test_load_model_refuses_a_dtype_that_is_not_a_float_dtype_in_one_error(tmp_path, dtype):
    d = difftx.save_model(tiny_model(), tmp_path / "m")
    with pytest.raises(ConfigError, match="dtype"):
        difftx.load_model(d, dtype=dtype)
    assert difftx.load_model(d, dtype=torch.float16).embed.weight.dtype == torch.float16
