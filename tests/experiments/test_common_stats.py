"""Paired statistics against hand-computed values and brute-force enumerations."""

import itertools

import numpy as np
import pytest

from experiments.common import stats


@pytest.mark.parametrize("k,n,expected", [
    (0, 10, (0.0, 1.96**2 / (10 + 1.96**2))),     # k = 0: hi = z^2 / (n + z^2)
    (10, 10, (10 / (10 + 1.96**2), 1.0)),         # k = n: lo = n / (n + z^2)
    # centre 1/2, half-width z / (1 + z^2/n) sqrt(1/(4n) + z^2/(4n^2))
    (5, 10, (0.5 - 0.26341, 0.5 + 0.26341)),
])
def test_wilson_hand_values(k, n, expected):
    assert stats.wilson(k, n) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("k,n", [(0, 3), (2, 7), (13, 50), (50, 50)])
def test_wilson_is_the_score_test_inversion(k, n):
    # Brute force: the p on a fine grid that the score test does not reject.
    p = np.linspace(0, 1, 200_001)
    accepted = p[np.abs(k / n - p) <= 1.96 * np.sqrt(p * (1 - p) / n)]
    lo, hi = stats.wilson(k, n)
    assert lo == pytest.approx(accepted.min(), abs=1e-5)
    assert hi == pytest.approx(accepted.max(), abs=1e-5)


def test_wilson_rejects_bad_counts():
    with pytest.raises(ValueError, match="0 <= k <= n"):
        stats.wilson(3, 2)
    with pytest.raises(ValueError, match="n >= 1"):
        stats.wilson(0, 0)


def _exact_two_sided(only_a, only_b):
    """Enumerate every split of the discordant pairs; count those at least as extreme."""
    n = only_a + only_b
    observed = abs(only_a - n / 2)
    extreme = sum(abs(sum(s) - n / 2) >= observed for s in itertools.product((0, 1), repeat=n))
    return extreme / 2 ** n


def _pairs(only_a, only_b, both=3, neither=2):
    a = [1] * only_a + [0] * only_b + [1] * both + [0] * neither
    b = [0] * only_a + [1] * only_b + [1] * both + [0] * neither
    return np.array(a, bool), np.array(b, bool)


@pytest.mark.parametrize("only_a,only_b", [(0, 5), (1, 9), (4, 4), (2, 7), (6, 3), (0, 1)])
def test_mcnemar_matches_enumeration(only_a, only_b):
    a, b = _pairs(only_a, only_b)
    assert stats.mcnemar(a, b) == pytest.approx(_exact_two_sided(only_a, only_b), rel=1e-12)


def test_mcnemar_hand_values():
    assert stats.mcnemar(*_pairs(0, 5)) == pytest.approx(2 / 32)
    assert stats.mcnemar(*_pairs(1, 9)) == pytest.approx(22 / 1024)
    assert stats.mcnemar(*_pairs(0, 0)) == 1.0
    # Many discordant pairs: no float overflow, symmetric in the two methods.
    a, b = _pairs(600, 560)
    assert 0 < stats.mcnemar(a, b) == stats.mcnemar(b, a) < 1


def test_mcnemar_rejects_non_binary_and_unpaired():
    with pytest.raises(ValueError, match="binary"):
        stats.mcnemar([0, 2], [1, 0])
    with pytest.raises(ValueError, match="same samples"):
        stats.mcnemar([0, 1], [1, 0, 1])


def test_paired_bootstrap_matches_exact_bootstrap_distribution():
    a = np.array([0.9, 0.2, 0.5, 0.7])
    b = np.array([0.1, 0.4, 0.5, 0.2])
    diff = a - b
    # Exact bootstrap distribution: all 4**4 equally likely resamples.
    exact = np.array([diff[list(i)].mean() for i in itertools.product(range(4), repeat=4)])
    mean, lo, hi = stats.paired_bootstrap(a, b, n_boot=20_000, seed=1)
    assert mean == pytest.approx(diff.mean())
    # Each end's tail mass under the exact distribution is ~2.5% (discrete: bracket it).
    assert np.mean(exact < lo) <= 0.025 + 0.01 and np.mean(exact <= lo) >= 0.025 - 0.01
    assert np.mean(exact > hi) <= 0.025 + 0.01 and np.mean(exact >= hi) >= 0.025 - 0.01


def test_paired_bootstrap_constant_difference_and_determinism():
    a = np.arange(10.0)
    assert stats.paired_bootstrap(a + 0.5, a) == pytest.approx((0.5, 0.5, 0.5))
    x = np.random.default_rng(0).random(30) > 0.4
    y = np.random.default_rng(1).random(30) > 0.6
    assert stats.paired_bootstrap(x, y, seed=3) == stats.paired_bootstrap(x, y, seed=3)
    mean, lo, hi = stats.paired_bootstrap(x, y)
    assert lo <= mean <= hi
