"""``ordering.after`` changes no value, and the read-then-write steps stay in place.

The in-place checks read XLA's compiled HLO for a copy of a cache-sized buffer: a structural
property of the program (no timing), which is what regressed RESA's decode step 15x.
"""

import jax
import jax.numpy as jnp
import numpy as np

from sparse_attn import methods
from sparse_attn.cache import init_cache, scatter_set, write
from sparse_attn.ordering import after

T, HKV, D = 4096, 2, 32


def _copies_of(fn, args, shape) -> int:
  txt = jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile().as_text()
  dims = ",".join(str(x) for x in shape)
  return sum(1 for line in txt.splitlines() if " copy(" in line and f"[{dims}]" in line)


def test_after_is_identity():
  x = jnp.arange(6, dtype=jnp.float32)
  for reads in ([jnp.inf], [jnp.nan], [-jnp.inf, jnp.ones(3)], []):
    np.testing.assert_array_equal(after(x, *[jnp.asarray(r) for r in reads]), x)
  i = jnp.arange(4, dtype=jnp.int32)
  np.testing.assert_array_equal(after(i, jnp.asarray(jnp.nan)), i)
  assert after(x.astype(jnp.bfloat16), x).dtype == jnp.bfloat16


def test_scatter_set_matches_at_set():
  for dt in (jnp.float32, jnp.bfloat16, jnp.float16):
    arr = jnp.arange(24, dtype=jnp.float32).reshape(2, 12).astype(dt)
    vals = jnp.full((2, 2), -3.5, dt)
    idx = (jnp.arange(2)[:, None], jnp.array([[1, 11], [0, 99]]))  # 99: dropped
    want = arr.at[idx].set(vals, mode="drop")
    got = scatter_set(arr, idx, vals)
    assert got.dtype == dt
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_resa_decode_writes_in_place():
  m = methods.make("quest:gqa=group+resa", budget=0.1)
  rng = np.random.default_rng(0)
  n = T - 16
  cache = write(init_cache(1, HKV, T, D, 16), *(jnp.asarray(
      rng.standard_normal((1, HKV, n, D)), jnp.float32) for _ in range(2)),
      jnp.arange(n, dtype=jnp.int32)[None])
  state = m.init_state(1, 2 * HKV, HKV, D, T)
  q = jnp.asarray(rng.standard_normal((1, 2 * HKV, 8, D)), jnp.float32)
  pos = jnp.arange(n - 8, n, dtype=jnp.int32)[None]
  _, cache, state = m.prefill(q, cache.k[:, :, -24:-16], cache.v[:, :, -24:-16], cache, state,
                              pos)
  cache, state = m.end_prefill(cache, state)
  new = jnp.ones((1, HKV, 1, D), jnp.float32)
  step = lambda c, s: m.decode(q[:, :, :1], new, new, c, s, jnp.array([[n]], jnp.int32))
  assert _copies_of(step, (cache, state), (1, HKV, T, D)) == 0
  # without the ordering the same step copies the cache (the check can fail)
  bare = lambda c, s: (write(c, new, new, jnp.array([[n]], jnp.int32)), c.k[0, :, n].sum())
  assert _copies_of(bare, (cache, state), (1, HKV, T, D)) > 0
