"""The vision model's own parts: patch embedding against a strided convolution, patch-size checks, and
the attention path equal to the language model's with the causal mask removed (same weights)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import difftx.models.lm as lm_module
from difftx import ModelConfig, build_model
from difftx.errors import ConfigError
from difftx.models.vision import patchify
from difftx.nn.backends import flex_available
from difftx.nn.mask import AttnMask


@pytest.mark.parametrize("image_size,patch,channels,pooling", [(8, 2, 1, "cls"), (12, 4, 3, "mean"),
                                                                 (6, 3, 2, "cls"), (8, 8, 1, "mean"),
                                                                 (4, 1, 3, "cls")])
def test_patch_embedding_is_a_strided_convolution(image_size, patch, channels, pooling):
    cfg = ModelConfig(domain="vision", d_model=16, n_layers=1, n_heads=2, image_size=image_size, patch_size=patch,
                      in_channels=channels, num_classes=7, pooling=pooling)
    model = build_model(cfg)
    images = torch.randn(3, channels, image_size, image_size)
    n = (image_size // patch) ** 2
    assert cfg.n_patches == n
    tokens = model.patch_embed(patchify(images, patch))
    assert tokens.shape == (3, n, 16)
    conv = nn.Conv2d(channels, 16, patch, stride=patch)
    with torch.no_grad():
        conv.weight.copy_(model.patch_embed.weight.view(16, channels, patch, patch))
        conv.bias.copy_(model.patch_embed.bias)
        ref = conv(images).flatten(2).transpose(1, 2)  # (B, n, d), patches in row-major order
    torch.testing.assert_close(tokens, ref, rtol=1e-5, atol=1e-5)
    feats = model.features(images)
    assert feats.shape == (3, n + (pooling == "cls"), 16)
    assert model(images).logits.shape == (3, 7)


@pytest.mark.parametrize("image_size,patch", [(8, 3), (10, 4), (7, 2)])
def test_patch_size_must_divide_the_image(image_size, patch):
    with pytest.raises(ConfigError, match=rf"patch_size: image_size {image_size} is not divisible by patch_size "
                                          rf"{patch}"):
        ModelConfig(domain="vision", image_size=image_size, patch_size=patch)
    with pytest.raises(ConfigError, match="patch_size"):
        ModelConfig.from_preset("vit-tiny", patch_size=3)


def _twins(attention: str, positions: str, norms: str, norm: str, vocab: int, side: int):
    """A DecoderLM and a VisionEncoder (patch 1, one-hot channels, mean pooling) with the same blocks."""
    n = side * side
    common = dict(attention=attention, d_model=32, n_layers=2, n_heads=2 if attention == "diff" else 4,
                  positions=positions, norms=norms, norm=norm, max_seq_len=n, bias=True)
    lm = build_model(ModelConfig(domain="lm", vocab_size=vocab, **common)).eval()
    vis = build_model(ModelConfig(domain="vision", image_size=side, patch_size=1, in_channels=vocab,
                                  num_classes=3, pooling="mean", **common)).eval()
    src, dst = lm.state_dict(), vis.state_dict()
    for k in dst:
        if k.startswith(("layers.", "input_norm.", "final_norm.")):
            dst[k] = src[k]
    # the patch embedding of a one-hot pixel is the token embedding of its id
    dst["patch_embed.weight"] = src["embed.weight"].T.clone()
    dst["patch_embed.bias"] = torch.zeros_like(dst["patch_embed.bias"])
    if positions == "learned":
        dst["pos_embed"] = src["pos_embed.weight"][:n][None].clone()
    vis.load_state_dict(dst)
    return lm, vis


def _lm_hidden(lm, ids):
    """What the LM head sees (after the final norm)."""
    seen = {}
    handle = lm.lm_head.register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0]))
    try:
        lm(ids)
    finally:
        handle.remove()
    return seen["x"]


# (backend, DIFF/softmax sdpa variant): the fused CPU kernel is only chosen for training by ``auto``, so force it
BACKENDS = [("eager", None), ("sdpa", "sdpa"), ("sdpa", "fused")] + ([("flex", None)] if flex_available() else [])


@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
@pytest.mark.parametrize("positions,norms,norm", [("rope", "S1", "rms"), ("learned", "dnt", "rms"),
                                                  ("sinusoidal", "S2", "layer"), ("none", "post", "layer"),
                                                  ("learned", "S3", "rms"), ("rope", "S4", "layer"),
                                                  ("sinusoidal", "S5", "rms"), ("none", "pre", "rms")])
def test_vision_path_equals_language_path_without_causal_mask(monkeypatch, attention, positions, norms, norm):
    vocab, side = 6, 4
    lm, vis = _twins(attention, positions, norms, norm, vocab, side)
    ids = torch.randint(vocab, (2, side * side))
    images = F.one_hot(ids, vocab).float().transpose(1, 2).reshape(2, vocab, side, side)  # row-major pixels
    with torch.no_grad():
        causal = _lm_hidden(lm, ids)
        monkeypatch.setattr(lm_module, "AttnMask", lambda causal, **kw: AttnMask(causal=False, **kw))
        for backend, variant in BACKENDS:
            lm.set_attention_backend(backend, variant)
            vis.set_attention_backend(backend, variant)
            bidirectional = _lm_hidden(lm, ids)
            feats = vis.features(images)
            torch.testing.assert_close(feats, bidirectional, rtol=1e-5, atol=1e-5,
                                       msg=f"backend {backend} {variant or ''}")
    # the causal mask does matter here, so the comparison above can fail
    assert not torch.allclose(causal, feats, atol=1e-3)


@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
@pytest.mark.parametrize("norms,norm", [("S1", "layer"), ("S1", "rms"), ("dnt", "rms")])  # vit-, -, vdnt-tiny
def test_residual_stream_stays_in_the_weights_dtype_under_autocast(attention, norms, norm):
    """As the language model's: bf16 autocast computes the products in bf16, but the residual stream (the blocks'
    outputs) stays float32 with float32 weights (it was bf16 from the patch embedding on, every residual addition
    rounded to bf16)."""
    common = dict(attention=attention, d_model=32, n_layers=2, n_heads=2, norms=norms, norm=norm)
    vis = build_model(ModelConfig(domain="vision", image_size=4, patch_size=2, in_channels=3, num_classes=3,
                                  **common)).eval()
    lm = build_model(ModelConfig(domain="lm", vocab_size=8, **common)).eval()
    seen = {}
    for name, model in (("vision", vis), ("lm", lm)):
        for i, block in enumerate(model.layers):
            block.register_forward_hook(lambda m, a, out, key=(name, i): seen.__setitem__(key, out.dtype))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        feats = vis.features(torch.randn(2, 3, 4, 4))
        lm(torch.randint(8, (2, 5)))
    assert seen == {(n, i): torch.float32 for n in ("vision", "lm") for i in range(2)}
    assert feats.dtype == torch.float32
