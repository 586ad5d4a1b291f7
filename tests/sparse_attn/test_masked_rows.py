"""The empty-row contract on the decode path: a padding row (position -1) attends nothing.

A decode step whose row ``b`` carries position -1 returns ``out = 0`` there (``lse = -inf`` from
``Method.attend``), for every method the registry builds, while the other rows equal a call
without the padding row.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import compression, methods
from tests.sparse_attn import helpers

B, HQ, HKV, D, PROMPT = 2, 4, 2, 16, 40
BUDGET = dict(budget=0.25, block_size=4)
SPECS = (["dense"]
         + [f"{s}" for s in ("quest", "quest:gqa=group", "arkvale", "topk", "streaming")]
         + ["quest+resa", "arkvale+resa:lam=0.5", "quest+rect:f=4", "quest+retro:w=2",
            "quest+resa+retro:w=3", "topk+resa"]
         + [f"{c}:ratio=0.5" for c in sorted(compression.BUILDERS)])


def _make(spec, **extra):
  if spec == "dense" or spec.split(":")[0] in compression.BUILDERS:
    return methods.make(spec, **extra)
  return methods.make(spec, **{**BUDGET, **extra})


def _prefilled(m, rng):
  cap = m.round_capacity(PROMPT + 8)
  cache = m.init_cache(B, HKV, cap, D)
  state = m.init_state(B, HQ, HKV, D, cap)
  mk = lambda *shape: helpers.normal(rng, shape)
  pos = jnp.broadcast_to(jnp.arange(PROMPT, dtype=jnp.int32), (B, PROMPT))
  _, cache, state = m.prefill(mk(B, HQ, PROMPT, D), mk(B, HKV, PROMPT, D),
                              mk(B, HKV, PROMPT, D), cache, state, pos)
  return m.end_prefill(cache, state)


def _step_inputs(m, rng):
  w = m.window
  mk = lambda *shape: helpers.normal(rng, shape)
  q, k, v = mk(B, HQ, w, D), mk(B, HKV, w, D), mk(B, HKV, w, D)
  live = jnp.arange(PROMPT - w + 1, PROMPT + 1, dtype=jnp.int32)  # the window, newest last
  return q, k, v, live


@pytest.mark.parametrize("spec", SPECS)
def test_padding_row_of_a_decode_step_returns_zero(spec):
  m = _make(spec)
  rng = np.random.default_rng(0)
  cache, state = _prefilled(m, rng)
  q, k, v, live = _step_inputs(m, rng)
  both = jnp.stack([live, live])
  padded = jnp.stack([live, jnp.full_like(live, -1)])
  step = jax.jit(m.decode)
  ref, _, _ = step(q, k, v, cache, state, both)
  out, new_cache, _ = step(q, k, v, cache, state, padded)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
  np.testing.assert_allclose(out[0], ref[0], atol=1e-6, rtol=1e-6)
  assert int(new_cache.length[1]) == int(cache.length[1])  # nothing written for the padding row


@pytest.mark.parametrize("spec", SPECS)
def test_a_padding_row_leaves_its_cache_and_state_as_they_were(spec):
  """A decode step whose row 1 is all padding (a finished or idle sequence) changes nothing of
  that row: every cache and state leaf with a batch axis keeps its row 1, so the row decodes on
  later as if the step had not been (RetroAttention's output ring once relabelled its slots)."""
  m = _make(spec)
  rng = np.random.default_rng(0)
  cache, state = _prefilled(m, rng)
  q, k, v, live = _step_inputs(m, rng)
  padded = jnp.stack([live, jnp.full_like(live, -1)])
  _, new_cache, new_state = jax.jit(m.decode)(q, k, v, cache, state, padded)
  before = jax.tree_util.tree_leaves_with_path((cache, state))
  after = jax.tree_util.tree_leaves((new_cache, new_state))
  for (path, x), y in zip(before, after):
    if np.ndim(x) and np.shape(x)[0] == B:
      np.testing.assert_array_equal(np.asarray(y[1]), np.asarray(x[1]),
                                    err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("spec", ["dense", "quest", "quest:gqa=group", "arkvale", "topk",
                                  "streaming"])
def test_attend_of_a_padding_row_is_empty(spec):
  m = _make(spec)
  rng = np.random.default_rng(1)
  cache, _ = _prefilled(m, rng)
  q = helpers.normal(rng, (B, HQ, D))
  out, lse = jax.jit(m.attend)(q, cache, jnp.asarray([PROMPT - 1, -1], jnp.int32))
  np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
  assert np.all(np.isneginf(np.asarray(lse[1])))
  assert np.isfinite(np.asarray(lse[0])).all() and np.abs(np.asarray(out[0])).max() > 0


@pytest.mark.parametrize("spec", ["quest", "quest+resa"])
def test_padding_row_on_the_pallas_path(spec):
  m = _make(spec, impl="pallas", interpret=True, block_size=16)
  rng = np.random.default_rng(2)
  cache, state = _prefilled(m, rng)
  q, k, v, live = _step_inputs(m, rng)
  out, _, _ = m.decode(q, k, v, cache, state, jnp.stack([live, jnp.full_like(live, -1)]))
  np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
  assert np.abs(np.asarray(out[0])).max() > 0
