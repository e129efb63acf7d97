"""Heavy-tail estimators on seeded samples whose tails are known.

Samples (N = 65,536 each): Gaussian, Student-t with 10 and 3 degrees of freedom
(tail index 10 and 3, finite variance), and symmetric alpha-stable with alpha =
1.8, 1.5, 1.1 (infinite variance).  Stated tolerances:

* Mohammadi alpha: within 0.1 of alpha for the stable samples; >= 1.85 for the
  Gaussian; orders stable 1.1 < 1.5 < 1.8 < Gaussian, and t3 < Gaussian.
* Hill (top 1%): within 0.5 of 3 for t3, 0.25 of alpha for stable 1.5 and 1.1;
  orders Gaussian > t10 > t3 > stable 1.5 > stable 1.1.
* q99.9/q50: within 5% of the Gaussian's exact 4.88; increasing in heaviness.
* Excess kurtosis: |k| < 0.1 for the Gaussian, 0.6-1.8 for t10 (exact 1.0), large beyond.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from difftx.analysis import tails

stats = pytest.importorskip("scipy.stats")
N = 65536


@pytest.fixture(scope="module")
def samples():
    return {
        "gauss": np.random.default_rng(0).standard_normal(N),
        "t10": stats.t.rvs(10, size=N, random_state=1),
        "t3": stats.t.rvs(3, size=N, random_state=2),
        "st1.8": stats.levy_stable.rvs(1.8, 0.0, size=N, random_state=5),
        "st1.5": stats.levy_stable.rvs(1.5, 0.0, size=N, random_state=3),
        "st1.1": stats.levy_stable.rvs(1.1, 0.0, size=N, random_state=4),
    }


def test_mohammadi_alpha_recovers_stable_index_and_saturates_for_gaussian(samples):
    a = {k: tails.mohammadi_alpha(v) for k, v in samples.items()}
    for name, true in (("st1.1", 1.1), ("st1.5", 1.5), ("st1.8", 1.8)):
        assert abs(a[name] - true) <= 0.1, (name, a[name])
    assert a["gauss"] >= 1.85
    assert a["st1.1"] < a["st1.5"] < a["st1.8"] < a["gauss"]
    assert a["t3"] < a["gauss"]


def test_mohammadi_alpha_is_scale_free_and_seeded(samples):
    x = samples["st1.5"]
    assert tails.mohammadi_alpha(x * 1e-7) == pytest.approx(tails.mohammadi_alpha(x), rel=1e-9)
    assert tails.mohammadi_alpha(x, seed=3) == tails.mohammadi_alpha(x, seed=3)
    assert math.isnan(tails.mohammadi_alpha(np.ones(5)))


def test_hill_orders_and_recovers_tail_index(samples):
    h = {k: tails.hill_index(v) for k, v in samples.items()}
    assert h["gauss"] > h["t10"] > h["t3"] > h["st1.5"] > h["st1.1"]
    assert h["gauss"] > 6
    assert abs(h["t3"] - 3.0) <= 0.5
    assert abs(h["st1.5"] - 1.5) <= 0.25
    assert abs(h["st1.1"] - 1.1) <= 0.25


def test_hill_on_exact_pareto():
    """|x| Pareto with index 2.5: Hill is unbiased there (k large, threshold in the tail)."""
    x = np.random.default_rng(9).pareto(2.5, size=N) + 1.0
    assert abs(tails.hill_index(x, k_frac=0.05) - 2.5) <= 0.15


def test_quantile_ratios_and_kurtosis_order_heaviness(samples):
    qr = {k: tails.quantile_ratio(v) for k, v in samples.items()}
    exact = 3.2905267 / 0.6744898  # Phi^-1(0.9995) / Phi^-1(0.75)
    assert abs(qr["gauss"] / exact - 1) <= 0.05
    assert qr["gauss"] < qr["t10"] < qr["t3"] < qr["st1.5"] < qr["st1.1"]
    mr = {k: tails.max_over_rms(v) for k, v in samples.items()}
    assert mr["gauss"] < mr["t10"] < mr["t3"] < min(mr["st1.5"], mr["st1.1"])
    assert mr["gauss"] <= math.sqrt(2 * math.log(N)) + 0.5
    k = {kk: tails.excess_kurtosis(v) for kk, v in samples.items()}
    assert abs(k["gauss"]) < 0.1
    assert 0.6 <= k["t10"] <= 1.8
    assert k["t3"] > 10 and k["st1.5"] > 100


def test_entry_stats_ratios_are_scale_invariant(samples):
    a, b = tails.entry_stats(samples["t3"]), tails.entry_stats(samples["t3"] * 1e-6)
    for key in ("q99_9_over_q50", "max_over_rms", "excess_kurtosis", "hill"):
        assert a[key] == pytest.approx(b[key], rel=1e-6), key
    assert b["rms"] == pytest.approx(a["rms"] * 1e-6, rel=1e-9)


def test_noise_stats_centres_each_coordinate():
    """Large per-coordinate means (the true gradient) must not leak into the noise estimate."""
    rng_means = np.random.default_rng(1).normal(0, 50, size=4096)
    noise = stats.levy_stable.rvs(1.5, 0.0, size=(16, 4096), random_state=2)
    s = tails.noise_stats(rng_means + noise)
    assert abs(s["alpha_mohammadi"] - 1.5) <= 0.1
    assert s["n"] == 16 * 4096
    # the same samples without centring look light-tailed: the estimator needs centred input
    assert tails.mohammadi_alpha((rng_means + noise).reshape(-1)) > 1.8


def test_log_histogram_bins_and_shift():
    x = np.concatenate([np.random.default_rng(0).standard_normal(10000), np.zeros(100)])
    h = tails.log_histogram(x)
    assert len(h["fraction"]) == len(h["log10_edges"]) - 1
    assert h["zero_fraction"] == pytest.approx(100 / 10100)
    assert sum(h["fraction"]) + h["zero_fraction"] == pytest.approx(1.0)
    # entries outside the bins' 1e-14..1e2 range were dropped without a word; they are counted apart now
    far = tails.log_histogram(np.array([1e-20, 1e-16, 1e-3, 1e3, 1e5, 0.0, 50.0]))
    assert far["below_fraction"] == pytest.approx(2 / 7) and far["above_fraction"] == pytest.approx(2 / 7)
    assert sum(far["fraction"]) + far["zero_fraction"] + far["below_fraction"] + far["above_fraction"] \
        == pytest.approx(1.0)
    h10 = tails.log_histogram(x * 10.0)  # one decade = 5 bins of 0.2 dex
    assert np.argmax(h10["fraction"]) - np.argmax(h["fraction"]) == 5


def test_statistics_of_no_finite_values_are_nan():
    """A gradient that is all NaN/inf (or empty) gives NaN statistics, not an IndexError from np.quantile."""
    for x in (np.zeros(0), np.array([np.nan, np.inf, -np.inf])):
        for f in (tails.quantile_ratio, tails.max_over_rms, tails.excess_kurtosis, tails.hill_index,
                  tails.mohammadi_alpha):
            assert math.isnan(f(x)), f.__name__
        s = tails.entry_stats(x)
        assert s["n"] == 0
        assert all(math.isnan(v) for k, v in s.items() if k != "n"), s


def test_mohammadi_alpha_of_zero_noise_is_nan_not_extremely_light():
    """Identically zero noise (a dead unit) has no tail index; one non-zero value among zeros neither."""
    assert math.isnan(tails.mohammadi_alpha(np.zeros(1000)))
    assert math.isnan(tails.mohammadi_alpha(np.r_[np.zeros(999), 1e-3]))
    assert math.isnan(tails.noise_stats(np.ones((4, 256)) * np.arange(256))["alpha_mohammadi"])
    assert math.isnan(tails.mohammadi_alpha(np.r_[np.zeros(998), 1.0, -2.0]))  # two non-zero: too few
    assert np.isfinite(tails.mohammadi_alpha(np.r_[np.zeros(984), np.arange(1.0, 17.0)]))  # 16 non-zero: an estimate


def test_mohammadi_alpha_ignores_exact_zeros():
    """Exact zeros (dead units' identically zero noise) do not drag a Gaussian's alpha towards 0: before, 10%
    zeros read 0.89 and 60% read 0.24, each zero entering mean log|X| as log(eps)."""
    g = np.random.default_rng(0).standard_normal(65536)
    clean = tails.mohammadi_alpha(g)
    for frac in (0.01, 0.1, 0.6):
        x = g.copy()
        x[: int(frac * x.size)] = 0.0
        alpha = tails.mohammadi_alpha(x)
        assert 1.85 <= alpha <= 2.2 and abs(alpha - clean) < 0.15, (frac, alpha, clean)


def test_noise_stats_counts_the_finite_entries_it_uses():
    s = np.random.default_rng(0).standard_normal((4, 100))
    s[:, 7] = np.nan  # one coordinate's samples unusable: its 4 centred values are dropped
    assert tails.noise_stats(s)["n"] == 4 * 99


def test_constant_float64_data_has_no_spread_not_rounding_noise():
    """float64 values that do not divide exactly (0.1, most of them) have a mean a rounding error off: a constant
    tensor read as a kurtosis of -2 (the lightest possible tail), and coordinates whose 12 gradients are all equal
    read as noise, its tail index that of the rounding errors (alpha 1.87, Hill 9.4) where there is none."""
    assert math.isnan(tails.excess_kurtosis(np.full(1000, 0.1)))
    v = np.random.default_rng(0).normal(size=4096)
    const = tails.noise_stats(np.tile(v, (12, 1)))
    assert math.isnan(const["alpha_mohammadi"]) and math.isnan(const["hill"]), const
    assert math.isnan(const["excess_kurtosis"]), const
    s = np.random.default_rng(1).standard_normal((12, 4096))
    zero, flat = s.copy(), s.copy()
    zero[:, :2048], flat[:, :2048] = 0.0, v[:2048]  # no noise there, either way
    a, b = tails.noise_stats(zero), tails.noise_stats(flat)
    for key in ("alpha_mohammadi", "hill", "q99_9_over_q50", "excess_kurtosis"):
        assert b[key] == pytest.approx(a[key], rel=1e-9), (key, a, b)


def test_all_zero_data_has_no_spread_not_an_infinitely_heavy_tail():
    """q99.9/q50 and max/RMS of all-zero values (identically zero noise, a zero gradient) are 0/0; they read inf,
    the heaviest tail, where the other statistics say NaN.  More than half zeros with a spread stays inf."""
    for x in (np.zeros(1000), np.zeros((4, 8))):
        assert math.isnan(tails.quantile_ratio(x)) and math.isnan(tails.max_over_rms(x))
    assert math.isnan(tails.noise_stats(np.tile(np.arange(64.0), (12, 1)))["q99_9_over_q50"])
    assert tails.quantile_ratio(np.r_[np.zeros(600), np.ones(400)]) == math.inf
