"""RULER's key pool (``haystack.SortedPairs``) equals the sorted set of pairs it stands for."""

import bisect

import hypothesis
from hypothesis import strategies as st
import pytest

from experiments.tasks import haystack as hs

# Words over a tiny alphabet with hyphens: nested prefixes (``a-`` / ``a-b-``), duplicates and
# pairs that coincide (``a`` + ``b-c`` and ``a-b`` + ``c``) are frequent.
WORDS = st.lists(st.text(alphabet="ab-A", min_size=1, max_size=4), min_size=1, max_size=12)


@hypothesis.given(WORDS, WORDS)
def test_equals_the_sorted_set_of_pairs(firsts, seconds):
  want = sorted({f"{a}-{b}" for a in firsts for b in seconds})
  got = hs.SortedPairs(firsts, seconds)
  assert len(got) == len(want) and list(got) == want
  assert got[-1] == want[-1] and got[1:3] == want[1:3]
  with pytest.raises(IndexError):
    got[len(want)]  # pylint: disable=pointless-statement


def test_rulers_pool_at_pinned_indices():
  # From the materialised ``sorted({f"{a}-{n}" ...})`` of the wonderwords lists (checked equal
  # at all 6,175,260 indices when SortedPairs replaced it), so the drawn keys stay RULER's.
  pool = hs.key_words()
  assert len(pool) == 6_175_260
  assert {i: pool[i] for i in (0, 1, 2_058_420, 3_087_630, 4_000_000, 6_175_259)} == {
      0: "Early-ATM", 1: "Early-CD", 2_058_420: "friendly-fallacy", 3_087_630: "level-ATM",
      4_000_000: "permissible-igloo", 6_175_259: "zonked-zucchini"}
  lo, hi = bisect.bisect_left(pool, "high-"), bisect.bisect_left(pool, "high.")
  high = pool[lo - 1:hi + 1]  # a nested group (high- and high-pitched-) and its neighbours
  assert high == sorted(set(high)) and "high-pitched-zucchini" in high
  assert len(high) == 2 * 6786 + 2 and not high[0].startswith("high-") and high[-1] >= "high."
