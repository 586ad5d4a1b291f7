"""``dense_over_cache`` (query tiles x visible key tiles) equals one exact attention call.

The explicit example reaches the last tile clamped to end at the capacity (64 = 48 + 16),
where slots the previous tile covered must not count twice.
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import reference
from sparse_attn.cache import init_cache, write
from sparse_attn.cache_attention import dense_over_cache


def _filled_cache(rng, b, hkv, capacity, d, lengths, shuffle_pos):
  """Rows filled to ``lengths``; with ``shuffle_pos`` slots hold positions out of order (as a
  compressed cache does)."""
  n = int(max(lengths))
  k = jnp.asarray(rng.standard_normal((b, hkv, n, d)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, hkv, n, d)), jnp.float32)
  slots = np.stack([np.where(np.arange(n) < ln, np.arange(n), -1) for ln in lengths])
  tok = np.stack([rng.permutation(n) if shuffle_pos else np.arange(n) for _ in lengths])
  return write(init_cache(b, hkv, capacity, d, 16), k, v, jnp.asarray(slots, jnp.int32),
               jnp.asarray(tok, jnp.int32))


@hypothesis.given(
    capacity=st.sampled_from([48, 64, 96, 160]), key_tile=st.sampled_from([16, 32, 48, 1000]),
    g=st.sampled_from([1, 3]), s=st.integers(1, 20), fill=st.floats(0.0, 1.0),
    shuffle_pos=st.booleans(), seed=st.integers(0, 2**16),
    query_tile=st.sampled_from([1, 8, 32]), window=st.sampled_from([None, 7]))
@hypothesis.example(capacity=64, key_tile=48, g=3, s=20, fill=1.0, shuffle_pos=False, seed=0,
                    query_tile=8, window=None)
def test_tiles_equal_one_call(capacity, key_tile, g, s, fill, shuffle_pos, seed, query_tile,
                              window):
  rng = np.random.default_rng(seed)
  b, hkv, d = 2, 2, 8
  lengths = [max(1, int(round(fill * capacity))), capacity // 3 + 1]
  cache = _filled_cache(rng, b, hkv, capacity, d, lengths, shuffle_pos)
  q = jnp.asarray(rng.standard_normal((b, hkv * g, s, d)), jnp.float32)
  # queries at the newest positions, one row partly before the start (masked rows)
  positions = jnp.asarray(np.stack([np.arange(s) + ln - s for ln in lengths]), jnp.int32)
  want = reference.attention(q, cache.k, cache.v, kv_length=cache.length,
                             q_positions=positions, k_positions=cache.pos, window=window)
  got = dense_over_cache(q, cache, positions, key_tile=key_tile, query_tile=query_tile,
                         window=window)
  np.testing.assert_allclose(got[0], want[0], atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(np.isfinite(got[1]), np.isfinite(want[1]))
  fin = np.isfinite(np.asarray(want[1]))
  np.testing.assert_allclose(np.asarray(got[1])[fin], np.asarray(want[1])[fin], atol=2e-5)


def test_jit_vmap_and_errors():
  rng = np.random.default_rng(0)
  cache = _filled_cache(rng, 2, 1, 64, 8, [40, 9], False)
  q = jnp.asarray(rng.standard_normal((2, 2, 4, 8)), jnp.float32)
  positions = jnp.asarray([[36, 37, 38, 39], [5, 6, 7, 8]], jnp.int32)
  plain = dense_over_cache(q, cache, positions, key_tile=16)
  jitted = jax.jit(lambda *a: dense_over_cache(*a, key_tile=16))(q, cache, positions)
  np.testing.assert_allclose(jitted[0], plain[0], atol=1e-6)
  per_row = jax.vmap(lambda qq, cc, pp: jax.tree.map(
      lambda x: x[0], dense_over_cache(qq[None], jax.tree.map(lambda y: y[None], cc),
                                       pp[None], key_tile=16)))(q, cache, positions)
  np.testing.assert_allclose(per_row[0], plain[0], atol=1e-6)
  with pytest.raises(ValueError, match="key_tile"):
    dense_over_cache(q, cache, positions, key_tile=0)
  with pytest.raises(ValueError, match="query_tile"):
    dense_over_cache(q, cache, positions, query_tile=0)
