"""PyramidKV, ChunkKV, FINCH, CriticalKV / CriticalAdaKV: jit and vmap equal the plain call
(prefill, end_prefill with static ``decode_slots``, a decode step)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods
from sparse_attn.compression import criticalkv
from tests.sparse_attn.test_compression_baselines import (B, D, HKV, HQ, LENGTHS, T, WINDOW,
                                                          make_problem)
from tests.sparse_attn.test_compression_snapkv_family import f32, out_proj


@pytest.mark.parametrize("spec", ["pyramidkv", "chunkkv:chunk_length=4", "finch:chunk_length=8",
                                  "criticalkv", "criticaladakv"])
def test_jit_and_vmap_equal_plain(spec):
  m = methods.make(spec, ratio=0.5, window_size=WINDOW, decode_slots=T - max(LENGTHS))
  if m.name == "pyramidkv":
    m = m.for_layer(1, 3)
  wo = out_proj(0)

  def run(q, k, v, pos, dq, dk, dv):
    b = q.shape[0]
    cache, state = m.init_cache(b, HKV, T, D), m.init_state(b, HQ, HKV, D, T)
    if m.name.startswith("critical"):
      state = criticalkv.set_out_proj(state, wo)
    out, cache, state = m.prefill(q, k, v, cache, state, pos)
    cache, state = m.end_prefill(cache, state)
    o, cache, state = m.decode(dq, dk, dv, cache, state, jnp.full((b, 1), max(LENGTHS)))
    return out, o, cache.valid, cache.pos

  probs = []
  for seed in (1, 2):
    p = make_problem(seed)
    rng = np.random.default_rng(seed)
    dec = [f32(rng.normal(size=(B, h, 1, D))) for h in (HQ, HKV, HKV)]
    probs.append((f32(p["q"]), f32(p["k"]), f32(p["v"]), jnp.asarray(p["pos"]), *dec))
  plain = run(*probs[0])
  jitted = jax.jit(run)(*probs[0])
  stack = lambda *xs: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *xs)
  batched = jax.jit(jax.vmap(run))(*stack(*probs))
  second = jax.jit(run)(*probs[1])
  close = lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  jax.tree_util.tree_map(close, plain, jitted)
  jax.tree_util.tree_map(close, jax.tree_util.tree_map(lambda x: x[0], batched), jitted)
  jax.tree_util.tree_map(close, jax.tree_util.tree_map(lambda x: x[1], batched), second)
  assert np.prod(jitted[2].shape[1:]) < HKV * T  # a smaller buffer (per head or flat)
  for o in (plain[0], plain[1]):
    assert np.all(np.isfinite(np.asarray(o)))
