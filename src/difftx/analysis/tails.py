"""Heavy-tail estimators for gradient entries and gradient noise (NumPy only).

Two different questions, two families of estimators (notes/dnt-and-normalisation-research.md, section 7):

* How spread are the entries |g| of one gradient across a weight matrix (DNT Fig. 1)?
  Log-binned histograms, quantile ratios q99.9/q50 and max/RMS, excess
  kurtosis, and a Hill estimator of the tail index of |g|.
* How heavy-tailed is the mini-batch gradient *noise* g_B - E[g] (Simsekli et
  al., 2019)?  :func:`mohammadi_alpha`, the alpha-stable index estimator of
  Mohammadi et al. (2015, Cor. 2.4) that Simsekli et al. use, on centred samples.

What each one can and cannot tell apart (measured in tests/analysis/test_tails.py):

* ``mohammadi_alpha`` is accurate for alpha-stable data with alpha < 2 but
  saturates near 2: a Gaussian reads about 1.95-2.0, and a finite-variance heavy
  tail (Student-t with 3 degrees of freedom) reads close to a Gaussian.
* ``hill_index`` is uncapped: Gaussian data give large values (~5-10 for
  k = 1% of 65k samples), Student-t(nu) about nu, alpha-stable about alpha.  It
  depends on k (the number of order statistics used).
* Kurtosis is only meaningful for finite fourth moments; with alpha < 2 it
  grows with the sample size.  Reported, with that caveat.

Non-finite values are dropped; a statistic of no (finite) values is NaN.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

# fixed log10 bin edges, so histograms of different models overlay bin for bin
HIST_EDGES = np.arange(-14.0, 2.0 + 1e-9, 0.2)


def _flat(x) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    return a[np.isfinite(a)]


def quantile_ratio(x, hi: float = 0.999, lo: float = 0.5) -> float:
    """q_hi(|x|) / q_lo(|x|): 4.9 for a Gaussian at (0.999, 0.5); larger for heavier tails."""
    a = np.abs(_flat(x))
    if a.size == 0:
        return math.nan
    q_lo, q_hi = np.quantile(a, lo), np.quantile(a, hi)
    if q_lo > 0:
        return float(q_hi / q_lo)
    return math.inf if q_hi > 0 else math.nan  # 0 / 0: no spread (zero noise, a zero gradient), not a heavy tail


def max_over_rms(x) -> float:
    """max |x| / sqrt(mean x^2): about sqrt(2 ln N) for a Gaussian of N entries."""
    a = _flat(x)
    if a.size == 0:
        return math.nan
    rms, top = math.sqrt(float(np.mean(a * a))), float(np.max(np.abs(a)))
    if rms > 0:
        return top / rms
    return math.inf if top > 0 else math.nan  # all zeros: 0 / 0, no spread


def excess_kurtosis(x) -> float:
    """E[(x - mean)^4] / var^2 - 3 (0 for a Gaussian; grows with N when the tail index is below 4)."""
    a = _flat(x)
    if a.size == 0:
        return math.nan
    c = a - a[0]  # shifted first: a constant's deviations are exact zeros, not its mean's rounding error
    c = c - c.mean()
    c2 = c * c
    var = float(np.mean(c2))
    return float(np.mean(c2 * c2) / var ** 2 - 3.0) if var > 0 else math.nan


def hill_index(x, k_frac: float = 0.01, k: Optional[int] = None) -> float:
    """Hill's estimator of the tail index of |x| from its k largest values.

    alpha = k / sum_{i<=k} log(X_(i) / X_(k+1)), X_(1) >= X_(2) >= ... the order
    statistics of the non-zero |x|.  ``k`` defaults to ``k_frac`` of them (at least 10).
    """
    a = np.abs(_flat(x))
    a = a[a > 0]
    if a.size < 20:
        return math.nan
    if k is None:
        k = max(10, int(k_frac * a.size))
    k = min(k, a.size - 1)
    top = np.partition(a, a.size - k - 1)[a.size - k - 1:]  # the k+1 largest, unsorted
    threshold = top.min()
    logs = np.log(top / threshold)
    s = float(logs.sum())
    return float(k / s) if s > 0 else math.inf


def mohammadi_alpha(x, m: Optional[int] = None, shuffle: bool = True, seed: int = 0) -> float:
    """Tail index of symmetric alpha-stable samples (Mohammadi et al. 2015, Cor. 2.4; Simsekli et al. 2019).

    With N = m * n samples X and Y_j the sums of n disjoint blocks of m samples,
    1 / alpha = (mean log|Y| - mean log|X|) / log m.  ``x`` must be centred (the
    estimator assumes symmetry).  m defaults to floor(sqrt(N)); the N mod m
    leftover samples are dropped.  ``shuffle`` (seeded) mixes the samples before
    blocking, so that neighbouring coordinates of a gradient do not share a block.
    The result is in (0, ~2] for stable data; values a little above 2 mean "no
    heavier than Gaussian".  Exact zeros are left out, as :func:`hill_index` does:
    they are coordinates whose noise is identically zero (a dead ReLU unit), and
    each would enter mean log|X| as log(eps), an arbitrary constant that drags
    alpha towards 0 (10% zeros in a Gaussian read 0.9, not 2).  NaN for fewer
    than 16 non-zero samples (identically zero noise has no tail: the logs would
    compare rounding errors and read as an enormous, "extremely light" alpha).
    """
    a = _flat(x)
    a = a[a != 0]
    if a.size < 16:
        return math.nan
    if shuffle:
        a = np.random.default_rng(seed).permutation(a)
    if m is None:
        m = int(math.isqrt(a.size))
    n = a.size // m
    a = a[: n * m]
    scale = np.median(np.abs(a))
    if scale > 0:
        a = a / scale  # the estimator is scale-free; this keeps the log's guard eps negligible for tiny gradients
    eps = np.spacing(1.0)
    y = a.reshape(n, m).sum(axis=1)
    inv = (np.mean(np.log(np.abs(y) + eps)) - np.mean(np.log(np.abs(a) + eps))) / math.log(m)
    return float(1.0 / inv) if inv > 0 else math.inf


def log_histogram(x, edges: np.ndarray = HIST_EDGES) -> dict:
    """Fractions of the non-zero |x| in log10 bins (``edges`` in log10 units), plus the zero fraction and the
    fractions below the first edge and above the last (they sum to 1 with the bins')."""
    a = np.abs(_flat(x))
    nz = a[a > 0]
    logs = np.log10(nz)
    counts, _ = np.histogram(logs, bins=edges) if nz.size else (np.zeros(len(edges) - 1), None)
    total = max(a.size, 1)
    return {"log10_edges": [round(float(e), 6) for e in edges], "fraction": (counts / total).tolist(),
            "zero_fraction": float((a.size - nz.size) / total),
            "below_fraction": float(np.count_nonzero(logs < edges[0]) / total),
            "above_fraction": float(np.count_nonzero(logs > edges[-1]) / total)}


def entry_stats(x, k_frac: float = 0.01) -> dict:
    """Every entry-distribution statistic of one gradient tensor (or a pool of them)."""
    a = _flat(x)
    absx = np.abs(a)
    q = {f"q{p:g}".replace(".", "_"): float(np.quantile(absx, p / 100)) if a.size else math.nan
         for p in (50, 90, 99, 99.9)}
    return {
        "n": int(a.size),
        "rms": float(math.sqrt(np.mean(a * a))) if a.size else math.nan,
        "max_abs": float(absx.max()) if a.size else math.nan,
        **q,
        "q99_9_over_q50": quantile_ratio(a),
        "max_over_rms": max_over_rms(a),
        "excess_kurtosis": excess_kurtosis(a),
        "hill": hill_index(a, k_frac),
    }


def noise_stats(samples, seed: int = 0, k_frac: float = 0.01) -> dict:
    """Tail statistics of gradient noise: ``samples`` (B, n) mini-batch gradients at fixed weights.

    Each row is centred by the mean over the B batches (column-wise), then all
    B * n centred values are pooled, as in Simsekli et al. (2019).  ``n`` counts
    the finite ones, the values the estimators use.  Each column is first shifted
    by its first sample, so that a coordinate whose B gradients are equal has exact
    zero noise (left out, as a dead unit's), not its mean's rounding error in float64.
    """
    s = np.asarray(samples, dtype=np.float64)
    d = s - s[:1]
    noise = (d - d.mean(axis=0, keepdims=True)).reshape(-1)
    return {
        "n": int(np.isfinite(noise).sum()),
        "alpha_mohammadi": mohammadi_alpha(noise, seed=seed),
        "hill": hill_index(noise, k_frac),
        "q99_9_over_q50": quantile_ratio(noise),
        "excess_kurtosis": excess_kurtosis(noise),
    }
