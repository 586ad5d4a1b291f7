"""split_combine: Pallas (interpret mode) == lse_combine, empty splits and rows included."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from pallas_kernels import lse_combine, split_combine
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
