"""``kernels.select_blocks``: on the Pallas path (the ranking inside ``block_select_ranked``, the
count in closed form) it lists exactly what ``selection.select_blocks`` with the Pallas
``top_ids`` lists (masks, ranking and counts in XLA), under budgets with sinks, local windows,
``n_local``, top-p-free fractions and both forced-count rules; the XLA path is
``selection.select_blocks`` itself."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from sparse_attn import kernels, selection
from sparse_attn.budget import Budget
from sparse_attn.cache import KVCache


def _cache(rng, b, nb, bs):
  """Only what block selection reads: the capacity, block size and lengths."""
  t = nb * bs
  z = jnp.zeros((b, 1, t, 1), jnp.float32)
  d = jnp.zeros((b, 1, 0, 1), jnp.float32)
  length = jnp.asarray(rng.integers(0, t + 1, b), jnp.int32)
  return KVCache(k=z, v=z, pos=jnp.zeros((b, 1, t), jnp.int32), length=length, kmin=d,
                 kmax=d, kcen=d, krad=jnp.zeros((b, 1, 0)), kdev=d, block_size=bs)


@settings(deadline=None, max_examples=15)
@given(b=st.integers(1, 3), h=st.sampled_from((1, 4)), nb=st.integers(1, 90),
       bs=st.sampled_from((1, 16)), frac=st.sampled_from((None, 0.05, 0.3, 40)),
       n_sink=st.integers(0, 40), local=st.integers(0, 64), n_local=st.none() | st.integers(0, 3),
       inside=st.booleans(), seed=st.integers(0, 2**16))
def test_pallas_path_lists_what_the_masked_path_lists(b, h, nb, bs, frac, n_sink, local,
                                                      n_local, inside, seed):
  rng = np.random.default_rng(seed)
  cache = _cache(rng, b, nb, bs)
  budget = Budget(budget=frac, p=0.1, n_sink=n_sink, local_window=local, n_local=n_local,
                  forced_count="inside" if inside else "extra")
  scores = jnp.asarray(rng.standard_normal((b, h, nb)), jnp.float32)
  got = kernels.select_blocks(scores, cache, budget, impl="pallas", interpret=True)
  pick = functools.partial(kernels.top_ids, impl="pallas", interpret=True)
  want = selection.select_blocks(scores, cache, budget, pick)
  np.testing.assert_array_equal(got.idx, want.idx)
  np.testing.assert_array_equal(got.n_valid, want.n_valid)
  assert got.granularity == want.granularity == bs
  xla = kernels.select_blocks(scores, cache, budget, impl="xla")
  ref = selection.select_blocks(scores, cache, budget)
  np.testing.assert_array_equal(xla.idx, ref.idx)
  np.testing.assert_array_equal(xla.n_valid, ref.n_valid)
