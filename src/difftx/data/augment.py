"""Image augmentations as pure functions of their random draws: crop, flip, erasing, mixup / cutmix, smoothing.

Every random number of a training step is drawn up front from a NumPy
generator seeded by ``(seed, step)`` for the *global* batch (:func:`draw`), and
the image operations below only apply those draws.  So a step's batch is a pure
function of the step (exact resume) and does not depend on how many processes
or micro-batches share it: each process applies the draws of its own slice, and
mixing partners (the global batch reversed, as timm's ``Mixup`` flips its batch)
are fetched by index wherever they live.

Conventions (timm's where it has one): random crop pads each side by ``crop``
pixels with zeros (the mean, after normalisation) and cuts back to size;
``flip`` mirrors left-right with probability 1/2; random erasing (probability
``random_erasing``) fills a rectangle of 2%..1/3 of the area, aspect 0.3..3.3,
with zeros; mixup / cutmix draw one lambda per step from Beta(alpha, alpha),
with probability ``mix_prob``, choosing cutmix with probability
``switch_prob`` when both are on; cutmix's lambda is corrected to the box's
true area.  Label smoothing spreads ``label_smoothing`` over all classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

STREAM = 0xA06  # generator stream of the augmentation draws (the sample order uses another)


@dataclass(frozen=True)
class AugmentOptions:
    crop: int = 0                 # random crop with this padding (0: off)
    flip: bool = False            # random horizontal flip
    random_erasing: float = 0.0   # probability of erasing a rectangle
    mixup: float = 0.0            # mixup Beta alpha (0: off)
    cutmix: float = 0.0           # cutmix Beta alpha (0: off)
    mix_prob: float = 1.0         # probability that a step mixes at all
    switch_prob: float = 0.5      # probability of cutmix instead of mixup when both are on
    label_smoothing: float = 0.0

    @property
    def mixing(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0


@dataclass
class Draws:
    """The random numbers of one global batch of ``n`` images of ``h`` x ``w``."""

    crop_dy: np.ndarray
    crop_dx: np.ndarray
    flip: np.ndarray
    erase: np.ndarray            # (n, 4) int: top, left, height, width (height 0: no erasing)
    mix_lam: float = 1.0         # 1: no mixing
    cut_box: Optional[tuple] = None  # (top, left, height, width) for cutmix


def draw(opts: AugmentOptions, seed: int, step: int, n: int, h: int, w: int) -> Draws:
    rng = np.random.default_rng([seed, step, STREAM])
    crop_dy = rng.integers(0, 2 * opts.crop + 1, n)
    crop_dx = rng.integers(0, 2 * opts.crop + 1, n)
    flip = rng.random(n) < 0.5 if opts.flip else np.zeros(n, dtype=bool)
    erase = np.zeros((n, 4), dtype=np.int64)
    if opts.random_erasing > 0:
        on = rng.random(n) < opts.random_erasing
        area = rng.uniform(0.02, 1 / 3, n) * h * w
        aspect = np.exp(rng.uniform(np.log(0.3), np.log(1 / 0.3), n))
        eh = np.clip(np.round(np.sqrt(area * aspect)), 1, h).astype(np.int64)
        ew = np.clip(np.round(np.sqrt(area / aspect)), 1, w).astype(np.int64)
        top = (rng.random(n) * (h - eh + 1)).astype(np.int64)
        left = (rng.random(n) * (w - ew + 1)).astype(np.int64)
        erase = np.stack([top, left, np.where(on, eh, 0), ew], axis=1)
    d = Draws(crop_dy, crop_dx, flip, erase)
    if opts.mixing and rng.random() < opts.mix_prob:
        use_cutmix = opts.cutmix > 0 and (opts.mixup <= 0 or rng.random() < opts.switch_prob)
        alpha = opts.cutmix if use_cutmix else opts.mixup
        lam = float(rng.beta(alpha, alpha))
        if use_cutmix:
            ch, cw = int(h * np.sqrt(1 - lam)), int(w * np.sqrt(1 - lam))
            cy, cx = int(rng.integers(0, h)), int(rng.integers(0, w))
            top, bottom = np.clip([cy - ch // 2, cy + ch // 2], 0, h)
            left, right = np.clip([cx - cw // 2, cx + cw // 2], 0, w)
            d.cut_box = (int(top), int(left), int(bottom - top), int(right - left))
            lam = 1.0 - (bottom - top) * (right - left) / (h * w)
        d.mix_lam = float(lam)
    return d


def apply(images: np.ndarray, d: Draws, positions: np.ndarray, opts: AugmentOptions) -> np.ndarray:
    """Crop, flip and erase ``images`` (normalised, (n, C, H, W)) with the draws at global ``positions``."""
    x = images
    n, c, h, w = x.shape
    if opts.crop > 0:
        p = opts.crop
        padded = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
        rows = d.crop_dy[positions][:, None] + np.arange(h)[None]
        cols = d.crop_dx[positions][:, None] + np.arange(w)[None]
        x = padded[np.arange(n)[:, None, None, None], np.arange(c)[None, :, None, None],
                   rows[:, None, :, None], cols[:, None, None, :]]
    if opts.flip:
        x = np.where(d.flip[positions][:, None, None, None], x[..., ::-1], x)
    if opts.random_erasing > 0:
        x = x.copy()
        for i, (top, left, eh, ew) in enumerate(d.erase[positions]):
            if eh:
                x[i, :, top:top + eh, left:left + ew] = 0.0
    return np.ascontiguousarray(x, dtype=np.float32)


def mix(own: np.ndarray, partner: np.ndarray, d: Draws) -> np.ndarray:
    """Mixup (``own * lam + partner * (1 - lam)``) or cutmix (paste the partner's box)."""
    if d.mix_lam >= 1.0:
        return own
    if d.cut_box is not None:
        top, left, bh, bw = d.cut_box
        out = own.copy()
        out[:, :, top:top + bh, left:left + bw] = partner[:, :, top:top + bh, left:left + bw]
        return out
    return (own * d.mix_lam + partner * (1.0 - d.mix_lam)).astype(np.float32)


def soft_targets(labels: np.ndarray, partner_labels: np.ndarray, lam: float, n_classes: int,
                 smoothing: float) -> np.ndarray:
    """timm's mixup targets: smoothed one-hots, ``lam`` of the own label and ``1 - lam`` of the partner's."""
    off = smoothing / n_classes
    on = 1.0 - smoothing + off

    def one_hot(y):
        t = np.full((len(y), n_classes), off, dtype=np.float32)
        t[np.arange(len(y)), y] = on
        return t

    return (lam * one_hot(labels) + (1.0 - lam) * one_hot(partner_labels)).astype(np.float32)
