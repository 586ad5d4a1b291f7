"""Scores: RULER's string match, binomial confidence intervals, sequence fidelity metrics."""

from __future__ import annotations

import math
import re
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


_ANSWER = re.compile(r"answer\s*(\d+)\s*:", re.IGNORECASE)


def answer_segments(prediction: str, count: int, first_label: bool = True) -> list[str]:
  """The text after each ``Answer i:`` label (up to the next label), for ``i = 1..count``.

  ``first_label``: the prompt's answer prefix already was ``Answer 1:``, so the prediction
  starts inside answer 1. A missing or repeated label leaves that answer empty / the first one.
  """
  text = ("Answer 1:" if first_label else "") + prediction
  marks = list(_ANSWER.finditer(text))
  out = [""] * count
  filled = [False] * count
  for j, mark in enumerate(marks):
    i = int(mark.group(1)) - 1
    end = marks[j + 1].start() if j + 1 < len(marks) else len(text)
    if 0 <= i < count and not filled[i]:
      out[i], filled[i] = text[mark.end():end], True
  return out


def per_question(prediction: str, references: Sequence[Sequence[str]]) -> list[float]:
  """LongGenBench-style scores: ``string_match_part`` of question ``i``'s references within
  the prediction's answer ``i`` (``answer_segments``)."""
  segments = answer_segments(prediction, len(references))
  return [string_match_part(seg, refs) for seg, refs in zip(segments, references)]


def string_match_each(prediction: str, references: Sequence[Sequence[str]]) -> float:
  """The mean of ``per_question``: the fraction of the questions answered correctly."""
  if not references:
    raise ValueError("no references")
  return sum(per_question(prediction, references)) / len(references)


METRICS = {"all": string_match_all, "part": string_match_part, "each": string_match_each}


def score(prediction: str, references: Sequence, metric: str = "all") -> float:
  if metric not in METRICS:
    raise ValueError(f"unknown metric {metric!r}; valid: {sorted(METRICS)}")
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
