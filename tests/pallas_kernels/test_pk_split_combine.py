"""split_combine(_pairs): Pallas (interpret mode) == lse_combine, empty splits and rows included;
several pairs and per-split counts merged in one pass."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from pallas_kernels import lse_combine, split_combine, split_combine_pairs
from pk_testutil import assert_attention_close

# (batch, program heads, splits, rows, head dim): padded and unpadded rows / dims, 2-7 splits.
SHAPES = [(2, 3, 3, 4, 64), (1, 2, 5, 24, 80), (1, 1, 2, 1, 128), (2, 1, 7, 16, 96)]


@settings(max_examples=10, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**31 - 1))
def test_kernel_matches_lse_combine(shape, seed):
  rng = np.random.default_rng(seed)
  b, p, s, r, d = shape
  out = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  lse = rng.standard_normal((b, p, s, r)) * 20
  lse[rng.random(lse.shape) < 0.3] = -np.inf  # empty splits
  lse[0, 0, :, 0] = -np.inf  # a row no split attended
  lse = jnp.asarray(lse, jnp.float32)
  got = split_combine(out, lse, impl="pallas", interpret=True)
  assert got[0].shape == (b, p, r, d) and got[1].shape == (b, p, r)
  assert_attention_close(*got, *lse_combine(out, lse, axis=2), jnp.float32)


def test_one_split_is_passed_through():
  out = jnp.ones((1, 2, 1, 3, 16))
  lse = jnp.zeros((1, 2, 1, 3))
  got_out, got_lse = split_combine(out, lse, impl="pallas", interpret=True)
  np.testing.assert_array_equal(got_out, out[:, :, 0])
  np.testing.assert_array_equal(got_lse, lse[:, :, 0])


def test_pairs_and_counts_merge_in_one_pass():
  rng = np.random.default_rng(7)
  b, p, s, r, d = 2, 3, 4, 5, 32
  pairs = []
  for _ in range(2):
    lse = rng.standard_normal((b, p, s, r)) * 10
    lse[rng.random(lse.shape) < 0.3] = -np.inf
    pairs.append((jnp.asarray(rng.standard_normal((b, p, s, r, d)), jnp.float32),
                  jnp.asarray(lse, jnp.float32)))
  counts = jnp.asarray(rng.integers(0, 50, (b, p, s, r)), jnp.int32)
  merged, total = split_combine_pairs(pairs, counts, impl="pallas", interpret=True)
  for (out, lse), got in zip(pairs, merged):
    assert_attention_close(*got, *lse_combine(out, lse, axis=2), jnp.float32)
  np.testing.assert_array_equal(total, counts.sum(2))
  assert split_combine_pairs(pairs, impl="pallas", interpret=True)[1] is None


@settings(max_examples=6, deadline=None)
@given(shape=st.sampled_from(SHAPES + [(1, 2, 1, 5, 64)]), seed=st.integers(0, 2**31 - 1))
def test_carry_in_is_one_more_split(shape, seed):
  """``carry_in`` (an earlier pass's partial per pair) merges as an extra split: the kernel and
  the reference equal ``lse_combine`` over the S + 1 partials, one split included (S = 1 then
  launches), with rows whose carried partial or whose every split is empty."""
  rng = np.random.default_rng(seed)
  b, p, s, r, d = shape
  pairs, carries = [], []
  for _ in range(2):
    lse = rng.standard_normal((b, p, s + 1, r)) * 20
    lse[rng.random(lse.shape) < 0.3] = -np.inf
    lse[0, 0, :, 0] = -np.inf  # nothing anywhere
    lse[0, -1, :s, -1] = -np.inf  # only the carried partial
    out = jnp.asarray(rng.standard_normal((b, p, s + 1, r, d)), jnp.float32)
    lse = jnp.asarray(lse, jnp.float32)
    pairs.append((out[:, :, :s], lse[:, :, :s]))
    carries.append((out[:, :, s], lse[:, :, s]))
  counts = jnp.asarray(rng.integers(0, 50, (b, p, s, r)), jnp.int32)
  want = [lse_combine(jnp.concatenate([o, c[:, :, None]], 2),
                      jnp.concatenate([l, cl[:, :, None]], 2), axis=2)
          for (o, l), (c, cl) in zip(pairs, carries)]
  for impl in ("pallas", "xla"):
    merged, total = split_combine_pairs(pairs, counts, carry_in=carries, impl=impl,
                                        interpret=True)
    for got, ref in zip(merged, want):
      assert_attention_close(*got, *ref, jnp.float32)
    np.testing.assert_array_equal(total, counts.sum(2))
