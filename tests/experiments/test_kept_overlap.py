"""The kvpress parity scripts' overlap: |ours & theirs| / max(|ours|, |theirs|) per (layer, kv
head), 1 exactly for equal kept sets."""

import numpy as np

from experiments.common import kept_overlap


def test_per_layer_counts_shared_kept_tokens_against_a_loop():
  rng = np.random.default_rng(0)
  ours, theirs = rng.random((2, 3, 2, 16)) < 0.5  # [layers, K, S]
  theirs[..., 0] = True  # no empty kept set
  o = kept_overlap.per_layer(3, lambda layer: (ours[layer], theirs[layer]))
  want = [sum(a and b for a, b in zip(ours[l, h], theirs[l, h]))
          / max(ours[l, h].sum(), theirs[l, h].sum()) for l in range(3) for h in range(2)]
  np.testing.assert_allclose(o, want)


def test_a_superset_on_either_side_is_not_identical():
  theirs = np.zeros((2, 8), bool)
  theirs[:, :4] = True
  everything = np.ones_like(theirs)
  np.testing.assert_allclose(kept_overlap.overlap(everything, theirs), 0.5)
  np.testing.assert_allclose(kept_overlap.overlap(theirs, everything), 0.5)
  np.testing.assert_array_equal(kept_overlap.overlap(theirs, theirs.copy()), 1.0)
  none = np.zeros_like(theirs)
  np.testing.assert_array_equal(kept_overlap.overlap(none, none), 1.0)


def test_table_row_reports_min_mean_and_identical_share():
  row = kept_overlap.table_row("snapkv", "SnapKVPress", np.array([1.0, 0.5, 1.0, 1.0]))
  assert row == "| snapkv | SnapKVPress | 0.5000 | 0.8750 | 75.0% of 4 |"
  assert kept_overlap.TABLE_HEAD.splitlines()[0].count("|") == row.count("|")  # one column each
