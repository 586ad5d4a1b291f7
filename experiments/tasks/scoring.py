"""Scores: RULER's string match, binomial confidence intervals, sequence fidelity metrics."""

from __future__ import annotations

import math
from typing import Sequence


def string_match_all(prediction: str, references: Sequence[str]) -> float:
  """RULER's ``string_match_all``: the fraction of references found (case-insensitive)."""
  if not references:
    raise ValueError("no references")
  pred = prediction.lower()
  return sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
  """RULER's ``string_match_part``: 1 if any reference is found (QA), else 0."""
  if not references:
    raise ValueError("no references")
  pred = prediction.lower()
  return float(any(r.lower() in pred for r in references))


METRICS = {"all": string_match_all, "part": string_match_part}


def score(prediction: str, references: Sequence[str], metric: str = "all") -> float:
  return METRICS[metric](prediction, references)


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
  """Wilson score interval for a binomial proportion (95% by default).

  Fractional ``successes`` (the mean of partial-credit scores times ``n``) are accepted: the
  interval is then the normal-approximation analogue, which is what a reader needs to judge
  whether two cells differ.
  """
  if n <= 0:
    return (0.0, 1.0)
  p = min(max(successes / n, 0.0), 1.0)
  denom = 1.0 + z * z / n
  centre = (p + z * z / (2 * n)) / denom
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
  return (max(0.0, centre - half), min(1.0, centre + half))


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
  """Tokens before the first position where ``a`` and ``b`` differ (``min(len)`` if none)."""
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return min(len(a), len(b))


def edit_distance(a: Sequence[int], b: Sequence[int]) -> int:
  """Levenshtein distance between two token sequences (O(len(a) * len(b)), two rows)."""
  if len(a) < len(b):
    a, b = b, a
  prev = list(range(len(b) + 1))
  for i, x in enumerate(a, 1):
    cur = [i] + [0] * len(b)
    for j, y in enumerate(b, 1):
      cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
    prev = cur
  return prev[-1]


def edit_similarity(a: Sequence[int], b: Sequence[int]) -> float:
  """Normalised token edit similarity ``1 - lev(a, b) / max(len)`` (Retro Table 11)."""
  n = max(len(a), len(b))
  return 1.0 if n == 0 else 1.0 - edit_distance(a, b) / n
