"""The vision encoder builds for every attention kind and norm placement and classifies."""

from __future__ import annotations

import pytest
import torch

from difftx import DifftxError, ModelConfig, build_model
from difftx.models.vision import patchify


@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
@pytest.mark.parametrize("pooling,positions", [("cls", "learned"), ("mean", "rope")])
def test_vision_forward_backward(attention, pooling, positions):
    cfg = ModelConfig(domain="vision", attention=attention, d_model=32, n_layers=2,
                      n_heads=2 if attention == "diff" else 4, image_size=8, patch_size=2, in_channels=1,
                      num_classes=5, pooling=pooling, positions=positions, norms="dnt")
    model = build_model(cfg)
    images = torch.randn(3, 1, 8, 8)
    targets = torch.tensor([0, 1, 4])
    out = model(images, targets=targets)
    assert out.logits.shape == (3, 5)
    # the classifier reads the class token's features ("cls") or the mean of the patches' ("mean")
    with torch.no_grad():
        feats = model.features(images)
        assert feats.shape[1] == 16 + (pooling == "cls")
        pooled = feats[:, 0] if pooling == "cls" else feats.mean(1)
        ref = torch.nn.functional.linear(pooled, model.head.weight, model.head.bias)
    torch.testing.assert_close(out.logits.detach(), ref)
    torch.testing.assert_close(out.loss.detach(), torch.nn.functional.cross_entropy(ref, targets))
    out.loss.backward()
    assert model.patch_embed.weight.grad is not None


def test_patchify_layout():
    img = torch.arange(2 * 4 * 4, dtype=torch.float32).reshape(1, 2, 4, 4)
    p = patchify(img, 2)
    assert p.shape == (1, 4, 8)
    # first patch: channel 0 rows 0-1 cols 0-1, then channel 1 the same
    assert p[0, 0].tolist() == [0, 1, 4, 5, 16, 17, 20, 21]
    assert p[0, 1].tolist() == [2, 3, 6, 7, 18, 19, 22, 23]


def test_vision_rejects_wrong_image_shape():
    cfg = ModelConfig(domain="vision", d_model=32, n_layers=1, n_heads=4, image_size=8, patch_size=2,
                      in_channels=1, num_classes=3)
    with pytest.raises(DifftxError, match="images must be"):
        build_model(cfg)(torch.randn(2, 1, 10, 10))


@pytest.mark.parametrize("swap", ["wrapper", "quantize_dynamic"])
def test_a_patch_embedding_without_a_weight_tensor_runs(swap):
    # features() read patch_embed.weight.dtype: a swapped-in layer without a weight tensor (a wrapping module;
    # quantize_dynamic's Linear, whose weight() is a method) raised AttributeError
    torch.manual_seed(0)
    cfg = ModelConfig(domain="vision", attention="diff", d_model=32, n_layers=1, n_heads=2, image_size=8,
                      patch_size=4, num_classes=5)
    model = build_model(cfg).eval()
    images = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        ref = model(images).logits
        if swap == "wrapper":
            model.patch_embed = torch.nn.Sequential(model.patch_embed)
            torch.testing.assert_close(model(images).logits, ref)
        else:
            q = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
            assert type(q.patch_embed) is not torch.nn.Linear
            torch.testing.assert_close(q(images).logits, ref, atol=0.05, rtol=0.05)  # int8 weights
