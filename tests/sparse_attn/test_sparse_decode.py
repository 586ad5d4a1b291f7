"""Sparse decode over a selection equals exact attention over the selected tokens."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

from sparse_attn import budget as budget_lib
from sparse_attn import kernels, reference
from tests.sparse_attn import helpers

SELECT = {
    "quest": lambda q, c, b: helpers.select("quest", q, c, b),
    "quest_group": lambda q, c, b: helpers.select("quest", q, c, b, gqa="group"),
    "arkvale": lambda q, c, b: helpers.select("arkvale", q, c, b),
    "arkvale_cuboid": lambda q, c, b: helpers.select("arkvale", q, c, b, variant="cuboid"),
    "arkvale_sphere": lambda q, c, b: helpers.select("arkvale", q, c, b, variant="sphere"),
    "topk": lambda q, c, b: helpers.select("topk", q, c, b),
    "topk_group": lambda q, c, b: helpers.select("topk", q, c, b, gqa="group"),
    "streaming": lambda q, c, b: helpers.select("streaming", q, c, b),
}


@given(seed=st.integers(0, 2**31 - 1), name=st.sampled_from(sorted(SELECT)),
       g=st.sampled_from([1, 2, 3]), bs=st.sampled_from([4, 16]),
       frac=st.sampled_from([0.1, 0.3, 1.0]),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_sparse_decode_equals_masked_dense_attention(seed, name, g, bs, frac, dtype):
  rng = np.random.default_rng(seed)
  b, hkv, d, t = 2, 2, 16, bs * 8
  lengths = [int(rng.integers(0, t + 1)), int(rng.integers(1, t + 1))]
  c = helpers.filled_cache(rng, b, hkv, t, d, lengths, block_size=bs, dtype=dtype)
  q = helpers.normal(rng, (b, hkv * g, d), dtype)
  bud = budget_lib.Budget(budget=frac, n_sink=4, local_window=8)
  sel = SELECT[name](q, c, bud)
  out, lse = kernels.sparse_decode(q, c, sel)
  mask = sel.token_mask(t)  # [B, H, T]
  mask = jnp.repeat(mask, (hkv * g) // mask.shape[1], axis=1)[:, :, None, :]
  want_o, want_l = reference.attention(q[:, :, None], c.k, c.v, mask=mask, kv_length=c.length)
  assert not np.isnan(np.asarray(out, np.float32)).any()
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_o[:, :, 0], np.float32),
                             **helpers.tol(dtype))
  np.testing.assert_allclose(lse, want_l[:, :, 0], **helpers.tol(dtype))
  if frac == 1.0 and name != "streaming":  # a full budget is dense
    dense_o, dense_l = reference.attention(q[:, :, None], c.k, c.v, kv_length=c.length)
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(dense_o[:, :, 0], np.float32), **helpers.tol(dtype))
    np.testing.assert_allclose(lse, dense_l[:, :, 0], **helpers.tol(dtype))


def test_empty_selection_gives_zero_and_minus_inf():
  rng = np.random.default_rng(0)
  c = helpers.filled_cache(rng, 1, 1, 32, 8, [0], block_size=16)
  q = helpers.normal(rng, (1, 2, 8))
  for name, fn in SELECT.items():
    out, lse = kernels.sparse_decode(q, c, fn(q, c, budget_lib.Budget(budget=0.5)))
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(lse)), name
