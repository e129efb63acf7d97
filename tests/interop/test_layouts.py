"""Re-laying out pairing / RoPE channel order keeps the function; the logical DIFF pieces round-trip."""

from __future__ import annotations

import pytest
import torch

import difftx
from difftx.interop.layouts import diff_components, pack_diff, relayout, rope_channel_index
from difftx.nn.rope import RotaryEmbedding, apply_rope
from .hf_helpers import difftx_model, max_diff, tokens


def _relaid(model, **target):
    cfg, sd = relayout(model.state_dict(), model.config, **target)
    other = difftx.build_model(cfg).eval()
    other.load_state_dict(sd)
    return other


@pytest.mark.parametrize("fields", [
    dict(attention="diff", n_heads=2, n_kv_heads=1, norms="S2", bias=True),   # GQA, QK-norm gains, biases
    dict(attention="diff", n_heads=2, norms="dnt"),
    dict(attention="softmax", n_heads=4, n_kv_heads=2, norms="S2"),
    dict(attention="diff2", n_heads=2, n_kv_heads=1),
])
@pytest.mark.parametrize("target", [dict(pairing="halves"), dict(rope_style="interleaved"),
                                    dict(pairing="halves", rope_style="interleaved")])
def test_relayout_preserves_the_function(fields, target):
    model = difftx_model(**fields)
    x = tokens(97)
    other = _relaid(model, **target)
    with torch.no_grad():
        assert max_diff(other(x).logits, model(x).logits) < 1e-5
    back = _relaid(other, pairing=model.config.pairing, rope_style=model.config.rope_style)
    for k, v in model.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k


def test_relayout_really_moves_rows():
    """Guard: the relaid model must differ from the original when loaded with the old conventions."""
    model = difftx_model(attention="diff", n_heads=2)
    cfg, sd = relayout(model.state_dict(), model.config, pairing="halves", rope_style="interleaved")
    stale = difftx.build_model(model.config).eval()
    stale.load_state_dict(sd)
    with torch.no_grad():
        assert max_diff(stale(tokens(97)).logits, model(tokens(97)).logits) > 1e-2


def test_rope_channel_index_maps_one_rotation_onto_the_other():
    d = 8
    rope = RotaryEmbedding(d)
    cos, sin = rope.cos_sin(torch.arange(5))
    x = torch.randn(1, 1, 5, d)
    idx = rope_channel_index(d, "half", "interleaved")
    assert torch.allclose(apply_rope(x, cos, sin, "half")[..., idx], apply_rope(x[..., idx], cos, sin, "interleaved"))
    back = rope_channel_index(d, "interleaved", "half")
    assert torch.equal(idx[back], torch.arange(d))


@pytest.mark.parametrize("pairing", ["adjacent", "halves"])
def test_diff_components_round_trip(pairing):
    model = difftx_model(attention="diff", n_heads=2, n_kv_heads=1, pairing=pairing)
    parts = diff_components(model.state_dict(), model.config, 1)
    packed = pack_diff(parts, pairing)
    for name, t in packed.items():
        assert torch.equal(t, model.state_dict()[f"layers.1.attn.{name}"]), name
    attn = model.layers[1].attn  # q1 of head 0 is what split() calls q1
    x = torch.randn(1, 3, 64)
    q1, q2, k1, k2, v = attn.split(attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
    assert torch.allclose(q2[0, 1], x[0] @ parts["q2"][1].T, atol=1e-6)
    assert torch.allclose(k1[0, 0], x[0] @ parts["k1"][0].T, atol=1e-6)
    assert torch.allclose(v[0, 0, :, 16:], x[0] @ parts["vb"][0].T, atol=1e-6)
