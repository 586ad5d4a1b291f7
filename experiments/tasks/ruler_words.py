"""RULER's aggregation tasks: common-words (cwe) and frequent-words (fwe) extraction.

cwe (RULER ``common_words_extraction.py``): a numbered list of words in which 10 common words
repeat 30 times and the others 3 times (6 and 1 below 4k tokens), after a one-shot example of
40 words (10 / 3 repeats; 20 words, 3 / 1 below 4k) with its answer. The words are the
``wonderwords`` nouns, adjectives and verbs.

fwe (RULER ``freq_words_extraction.py``): coded words of 6 random letters from a vocabulary of
``(target - 50) // 50`` words (80 at 4k), word ``k`` repeated ``int(N k^-alpha / zeta(alpha))``
times (alpha = 2) and shuffled; the most frequent word is ``'...'``, which the prompt says to
ignore, so the answers are the words of frequency rank 2-4.
"""

from __future__ import annotations

import numpy as np

from experiments.tasks import haystack as hs
from experiments.tasks import ruler_templates as tpl
from experiments.tasks.ruler_built import Built, split_template

NUM_COMMON = 10
FWE_ALPHA = 2.0
CODED_LETTERS = 6


def _numbered(words) -> str:
  return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _word_list(seed: int, num_words: int, common_repeats: int, rare_repeats: int):
  """``(numbered list, the common words)``: ``num_words`` distinct words, the first 10 common."""
  vocab = hs.common_words()
  if num_words > len(vocab):
    raise ValueError(f"cwe: {num_words} distinct words exceed the {len(vocab)} wonderwords "
                     "words (RULER then switches to an English word list not available offline)")
  rng = np.random.default_rng((seed, num_words, common_repeats))
  picked = [vocab[i] for i in rng.choice(len(vocab), size=num_words, replace=False)]
  common, rare = picked[:NUM_COMMON], picked[NUM_COMMON:]
  listed = common * common_repeats + rare * rare_repeats
  return _numbered(listed[i] for i in rng.permutation(len(listed))), common


def cwe(rng, target, depth, **_) -> Built:
  del depth
  seed = int(rng.integers(2 ** 31))
  short = target < 4096
  ex_words, ex_common, ex_rare = (20, 3, 1) if short else (40, 10, 3)
  common_repeats, rare_repeats = (6, 1) if short else (30, 3)
  head, tail = split_template(tpl.CWE)
  ex_list, ex_answer = _word_list(seed + 1, ex_words, ex_common, ex_rare)
  example = head + ex_list + tail + tpl.CWE_PREFIX + " " + _numbered(ex_answer)
  context = lambda n: (_word_list(seed, n, common_repeats, rare_repeats)[0], [])
  answers = lambda n: _word_list(seed, n, common_repeats, rare_repeats)[1]
  hi = min(len(hs.common_words()), max(NUM_COMMON + 1, target // rare_repeats // 3))
  return Built(example + "\n" + head, tail, tpl.CWE_PREFIX, context, answers, hi, None,
                     min_units=NUM_COMMON + 1)


def _coded_vocab(rng, size: int) -> list[str]:
  letters = list("abcdefghijklmnopqrstuvwxyz")
  vocab: set[str] = set()
  while len(vocab) < size:
    vocab.add("".join(rng.choice(letters, size=CODED_LETTERS)))
  out = sorted(vocab)
  out = [out[i] for i in rng.permutation(size)]
  out[0] = "..."  # the top-ranked word is noise
  return out


def zipf_counts(num_words: int, vocab_size: int, alpha: float = FWE_ALPHA) -> np.ndarray:
  """RULER's deterministic counts: ``int(N k^-alpha / zeta(alpha))`` for ranks ``k = 1..V``."""
  k = np.arange(1, vocab_size + 1, dtype=np.float64)
  return (num_words * k ** -alpha / hs.zeta(alpha)).astype(int)


def fwe(rng, target, depth, **_) -> Built:
  del depth
  vocab = _coded_vocab(rng, max(8, (target - tpl.TOKENS_TO_GENERATE["fwe"]) // 50))
  seed = int(rng.integers(2 ** 31))

  def context(n):
    counts = zipf_counts(n, len(vocab))
    words = [w for w, c in zip(vocab, counts) for _ in range(c)]
    order = np.random.default_rng((seed, n)).permutation(len(words))
    return " ".join(words[i] for i in order), []

  head, tail = split_template(tpl.FWE)
  # the answers need distinct counts: ranks 2, 3, 4, 5 strictly decreasing
  floor = next(n for n in range(1, 10 ** 4) if np.all(np.diff(zipf_counts(n, 5)[1:]) < 0))
  return Built(head, tail, tpl.FWE_PREFIX, context, lambda n: tuple(vocab[1:4]),
                     4 * target, None, min_units=floor)
