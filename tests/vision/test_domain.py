"""The vision domain's batches: a pure function of the step, the same for any split over processes and
micro-batches; augmentations applied as drawn."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from difftx.data import augment as aug
from difftx.errors import ConfigError
from difftx.train import TrainConfig
from difftx.train.distributed import World
from difftx.train.vision import VisionDomain, parse_options

AUGMENT = dict(crop=1, flip=True, random_erasing=0.5, mixup=0.8, cutmix=1.0, label_smoothing=0.1)


def _domain(npz, rank=0, world_size=1, batch_size=8, **options):
    cfg = TrainConfig(domain="vision", data=str(npz), batch_size=batch_size, seed=3, domain_options=options)
    d = VisionDomain(cfg, World(rank=rank, world_size=world_size))
    d.prepare()
    return d


def _cat(batches):
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def test_batches_are_a_function_of_the_step(npz_data):
    a, b = _domain(npz_data, **AUGMENT), _domain(npz_data, **AUGMENT)
    for step in (0, 5, 3):
        x, y = _cat(a.train_batches(step, 2)), _cat(b.train_batches(step, 2))
        for k in x:
            assert torch.equal(x[k], y[k]), k
    assert not torch.equal(_cat(a.train_batches(0, 2))["images"], _cat(a.train_batches(1, 2))["images"])


@pytest.mark.parametrize("options", [{}, AUGMENT])
def test_batches_do_not_depend_on_processes_or_micro_batches(npz_data, options):
    whole = _cat(_domain(npz_data, batch_size=8, **options).train_batches(4, 2))  # 16 images in 2 micro-batches
    one = _cat(_domain(npz_data, batch_size=16, **options).train_batches(4, 1))
    ranks = [_cat(_domain(npz_data, rank=r, world_size=4, batch_size=2, **options).train_batches(4, 2))
             for r in range(4)]
    split = {k: torch.cat([r[k] for r in ranks]) for k in whole}
    for other in (one, split):
        assert other.keys() == whole.keys()
        for k in whole:
            assert torch.equal(other[k], whole[k]), k


def test_epochs_visit_every_training_image_once(npz_data):
    d = _domain(npz_data, batch_size=4)
    n = len(d.split["train"][1])
    seen = np.concatenate([d._order(i * 4, 4) for i in range(-(-2 * n // 4))])
    assert sorted(seen[:n].tolist()) == list(range(n)) and sorted(seen[n:2 * n].tolist()) == list(range(n))
    assert not np.array_equal(seen[:n], seen[n:2 * n])  # a new permutation each epoch


def test_crop_and_flip_apply_the_draws():
    x = np.arange(2 * 1 * 4 * 4, dtype=np.float32).reshape(2, 1, 4, 4)
    opts = aug.AugmentOptions(crop=1, flip=True)
    d = aug.Draws(crop_dy=np.array([1, 0]), crop_dx=np.array([1, 2]), flip=np.array([False, True]),
                  erase=np.zeros((2, 4), dtype=np.int64))
    out = aug.apply(x, d, np.arange(2), opts)
    np.testing.assert_array_equal(out[0], x[0])  # offset (1, 1) with padding 1: the image itself
    padded = np.pad(x[1], ((0, 0), (1, 1), (1, 1)))
    np.testing.assert_array_equal(out[1], padded[:, 0:4, 2:6][..., ::-1])  # shifted, then mirrored


def test_mixup_and_cutmix_targets():
    opts = aug.AugmentOptions(mixup=0.8, cutmix=1.0, label_smoothing=0.1)
    lams, cuts = [], 0
    for step in range(40):
        d = aug.draw(opts, 0, step, 8, 8, 8)
        lams.append(d.mix_lam)
        if d.cut_box is not None:
            cuts += 1
            top, left, bh, bw = d.cut_box
            assert d.mix_lam == pytest.approx(1 - bh * bw / 64)  # lambda is the kept area
    assert 5 < cuts < 35 and all(0 <= v <= 1 for v in lams)
    t = aug.soft_targets(np.array([0, 1]), np.array([2, 1]), 0.7, 4, 0.1)
    np.testing.assert_allclose(t.sum(1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(t[0], [0.7 * 0.925 + 0.3 * 0.025, 0.025, 0.3 * 0.925 + 0.7 * 0.025, 0.025],
                               rtol=1e-6)


def test_soft_target_loss_matches_label_smoothing(npz_data):
    """With mixing drawn off, the soft-target loss equals cross-entropy with label smoothing."""
    from difftx import ModelConfig, build_model

    model = build_model(ModelConfig(domain="vision", d_model=16, n_layers=1, n_heads=2, image_size=8, patch_size=4,
                                    in_channels=1, num_classes=3))
    off = _domain(npz_data, mixup=0.5, mix_prob=0.0, label_smoothing=0.1)
    batch = off.train_batches(0, 1)[0]
    plain = model(batch["images"], targets=batch["labels"], label_smoothing=0.1, loss_reduction="sum").loss
    torch.testing.assert_close(off.loss(model, batch), plain)


def test_options_are_checked():
    with pytest.raises(ConfigError, match="unknown vision option 'crops'"):
        parse_options({"crops": 1})
    with pytest.raises(ConfigError, match="crop must be a non-negative integer"):
        parse_options({"crop": -1})
    with pytest.raises(ConfigError, match="flip must be true or false"):
        parse_options({"flip": "yes"})
    with pytest.raises(ConfigError, match="mix_prob must be a probability"):
        parse_options({"mix_prob": 2})
    with pytest.raises(ConfigError, match="loss_chunk: .*drop --loss-chunk"):  # a language-model option
        VisionDomain(TrainConfig(domain="vision", loss_chunk=64), World())


def test_recipe_options_not_implemented_warn(capsys):
    parse_options({"randaugment": [9, 0.5], "stochastic_depth": 0.1, "random_erasing": 0.0})
    assert "randaugment, stochastic_depth are not implemented" in capsys.readouterr().err


class _Reduced(World):
    """A rank of a fake process group: all_reduce_sum adds the other ranks' totals (recorded beforehand)."""

    def __init__(self, rank, world_size, others=None):
        super().__init__(rank=rank, world_size=world_size)
        self.others, self.seen = others or [], None

    def all_reduce_sum(self, t):
        self.seen = t.clone()
        for o in self.others:
            t += o
        return t


def _pixel_model(images, targets, loss_reduction):
    """A stand-in classifier whose logits are the first pixels; like the real model it cannot take 0 images."""
    assert len(images) > 0, "an empty evaluation batch"
    logits = images.flatten(1)[:, :2].float()
    from types import SimpleNamespace
    return SimpleNamespace(logits=logits, loss=torch.nn.functional.cross_entropy(logits, targets % 2, reduction="sum"))


@pytest.mark.parametrize("world_size, eval_batch", [(2, 1), (3, 7), (4, 1000)])
def test_evaluation_does_not_depend_on_processes(npz_data, world_size, eval_batch):
    """The same evaluation batches whatever the process count (fewer batches than processes included), each
    image counted once; processes past the last batch run an uncounted forward."""
    ref = _domain(npz_data, eval_batch_size=eval_batch).evaluate(_pixel_model)
    others = []
    for r in range(1, world_size):
        d = _domain(npz_data, eval_batch_size=eval_batch)
        d.world = _Reduced(r, world_size)
        d.evaluate(_pixel_model)
        others.append(d.world.seen)
    d = _domain(npz_data, eval_batch_size=eval_batch)
    d.world = _Reduced(0, world_size, others)
    got = d.evaluate(_pixel_model)
    assert got.keys() == ref.keys() and got == pytest.approx(ref, rel=1e-12, abs=0)
    assert int(d.world.seen[2] + sum(o[2] for o in others)) == len(d.split["val"][1])
