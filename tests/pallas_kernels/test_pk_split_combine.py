"""split_combine(_pairs): Pallas (interpret mode) == lse_combine, empty splits and rows included;
several pairs and per-split counts merged in one pass; programs over tiles of rows, which keep
the sm_90 build of a window's combine out of local memory."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import lse_combine, split_combine, split_combine_pairs
from pallas_kernels.shapes import F32, I32, S
from pallas_kernels.split_combine import TILE_ELEMENTS, row_tile
from pk_testutil import assert_attention_close

# (batch, program heads, splits, rows, head dim): padded and unpadded rows / dims, 2-33 splits;
# row tiles of 4 rows (6 of 24 rows), 1 (5 of 5, 7 of 7, 12 of 12 rows of 33 splits).
SHAPES = [(2, 3, 3, 4, 64), (1, 2, 5, 24, 80), (1, 1, 2, 1, 128), (2, 1, 7, 16, 96),
          (1, 1, 33, 12, 64)]


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


@pytest.mark.parametrize("splits,rows,head_dim,tile", [
    (33, 32, 128, 1), (33, 4, 128, 1), (5, 24, 80, 4), (3, 4, 64, 4), (33, 12, 64, 1),
    (2, 7, 128, 1), (1, 64, 32, 64), (2, 64, 64, 32)])
def test_row_tile_divides_the_rows_within_the_budget(splits, rows, head_dim, tile):
  got = row_tile(splits, rows, head_dim)
  assert got == tile and rows % got == 0
  per_row = (1 << (splits - 1).bit_length()) * (1 << (head_dim - 1).bit_length())
  assert got == 1 or got * per_row <= TILE_ELEMENTS


@pytest.mark.parametrize("pairs", (1, 2))
def test_window_combine_compiles_for_sm90_without_spills(pairs, tmp_path):
  """(``ptx`` extra) RetroAttention's w = 8 window at Llama-3.1-8B's shape (4 x 8 rows a kv
  head, 33 splits, a carried partial and a count per pair; two pairs with RESA): one program a
  row, no local memory. One program per head held [64, 32, 128] partials and spilled 17,980
  (one pair) / 47,708 (two) bytes a thread (2026-12-04, before the row tiles)."""
  pytest.importorskip("triton")
  from pallas_kernels import ptx  # pylint: disable=g-import-not-at-top

  def combine(*xs):
    merged = [(xs[2 * i], xs[2 * i + 1]) for i in range(pairs)]
    carry = [(xs[3 * pairs + 2 * i], xs[3 * pairs + 2 * i + 1]) for i in range(pairs)]
    return split_combine_pairs(merged, tuple(xs[2 * pairs:3 * pairs]), carry_in=carry,
                               impl="pallas")

  b, p, s, r, d = 1, 8, 33, 32, 128
  avals = ([S((b, p, s, r, d), F32), S((b, p, s, r), F32)] * pairs + [S((b, p, s, r), I32)] * pairs
           + [S((b, p, r, d), F32), S((b, p, r), F32)] * pairs)
  [mod] = ptx.triton_modules(combine, *avals)
  assert mod.grid == (b, p, r)
  usage = ptx.register_usage(ptx.compile_sm90(mod, str(tmp_path)), str(tmp_path))
  assert usage["spill_bytes"] == 0, usage
