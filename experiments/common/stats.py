"""Paired statistics for comparing two methods on the same samples (numpy only).

- `wilson`: Wilson score interval of a proportion k/n (Wilson 1927; Brown, Cai & DasGupta 2001
  recommend it over the normal interval for small n or p near 0/1).
- `paired_bootstrap`: percentile bootstrap CI of mean(a - b), resampling samples (pairs) jointly,
  so the correlation between the two methods on the same sample is kept (Efron & Tibshirani 1993,
  ch. 13).
- `mcnemar`: exact (binomial) McNemar test for paired binary outcomes: under H0 the discordant
  pairs split Binomial(n01 + n10, 1/2); two-sided p = min(1, 2 P(X <= min(n01, n10))).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for k successes out of n trials.

    Args:
      k: successes, 0 <= k <= n.
      n: trials, n >= 1.
      z: normal quantile (1.96 for a 95% interval).

    Returns:
      (lo, hi): the p with |k/n - p| <= z sqrt(p (1 - p) / n), clipped to [0, 1].
    """
    k, n = int(k), int(n)
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"wilson needs n >= 1 and 0 <= k <= n, got k={k}, n={n}")
    if z <= 0:
        raise ValueError(f"wilson needs z > 0, got {z}")
    phat = k / n
    z2 = z * z
    centre = (phat + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(phat * (1 - phat) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def _paired(a, b) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape or a.size == 0:
        raise ValueError(
            f"paired statistics need two non-empty 1-D arrays over the same samples, "
            f"got shapes {a.shape} and {b.shape}")
    return a, b


def paired_bootstrap(a, b, n_boot: int = 2000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float, float]:
    """Percentile bootstrap CI of the mean paired difference mean(a - b).

    Args:
      a, b: [N] per-sample scores of two methods on the same N samples (floats or 0/1).
      n_boot: bootstrap resamples.
      seed: numpy Generator seed (the interval is deterministic given it).
      level: two-sided confidence level.

    Returns:
      (mean_diff, lo, hi): the observed mean of a - b and the percentile interval.
    """
    a, b = _paired(a, b)
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    diff = a - b
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, diff.size, size=(n_boot, diff.size))   # [n_boot, N]
    means = diff[idx].mean(axis=1)                                 # [n_boot]
    tail = (1 - level) / 2
    lo, hi = np.quantile(means, [tail, 1 - tail])
    return float(diff.mean()), float(lo), float(hi)


def mcnemar(a, b) -> float:
    """Exact two-sided McNemar p-value for paired binary outcomes.

    Args:
      a, b: [N] bool or 0/1 outcomes (e.g. correct/incorrect) of two methods on the same samples.

    Returns:
      p in (0, 1]; 1.0 when no pair is discordant.
    """
    a, b = _paired(a, b)
    if not (np.isin(a, (0, 1)).all() and np.isin(b, (0, 1)).all()):
        raise ValueError("mcnemar needs binary (bool or 0/1) outcomes")
    only_a = int(np.sum((a == 1) & (b == 0)))
    only_b = int(np.sum((a == 0) & (b == 1)))
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1))
    # Exact rational arithmetic: 2**n overflows a float beyond n ~ 1000 discordant pairs.
    return float(min(Fraction(1), Fraction(2 * tail, 2 ** n)))
