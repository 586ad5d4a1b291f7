"""Compression methods' attention through the Pallas kernels (interpret mode) equals their jnp
path: prompt chunks (``chunk_attention``), decode steps over the compacted cache (the split-K
``dense_decode``, holes and a padding row included) and a chunk read after the prompt
(``extend``), for scorers of attention weights, of queries and of keys, on a sliding-window
layer, and with Ada-KV's flat buffer (Expected Attention's default: its decode steps through
``flat_decode``'s kernel over single slots, its ``extend`` in jnp); a per-head cache's appends
(decode steps and ``extend``) go through ``cache_append``'s kernel."""

import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods
from tests.sparse_attn import helpers

B, HQ, HKV, CAP, D = 2, 4, 2, 64, 16
CASES = [("snapkv", None), ("expected_attention", None), ("knorm", None), ("snapkv", 24),
         ("snapkv:head_budget=adakv", None)]


def _run(spec, window, impl):
  """Prompt chunk, end_prefill, 3 decode steps, a 5-token extend -> every output."""
  m = methods.make(spec, ratio=0.5, impl=impl, interpret=impl == "pallas")
  if window is not None:
    m = m.with_sliding_window(window)
  rng = np.random.default_rng(0)
  lengths = [40, 0]  # a padding row
  pos = np.full((B, 40), -1, np.int32)
  pos[0] = np.arange(40)
  cache, state = m.init_cache(B, HKV, CAP, D), m.init_state(B, HQ, HKV, D, CAP)
  qkv = lambda s: (helpers.normal(rng, (B, HQ, s, D)), helpers.normal(rng, (B, HKV, s, D)),
                   helpers.normal(rng, (B, HKV, s, D)))
  out, cache, state = m.prefill(*qkv(40), cache, state, jnp.asarray(pos))
  outs = [out]
  cache, state = m.end_prefill(cache, state)
  for t in range(3):
    p = jnp.asarray([[n + t if n else -1] for n in lengths], jnp.int32)
    out, cache, state = m.decode(*qkv(1), cache, state, p)
    outs.append(out)
  p = jnp.asarray([np.arange(43, 48), np.full(5, -1)], jnp.int32)
  out, cache, state = m.extend(*qkv(5), cache, state, p)
  return outs + [out]


@pytest.mark.parametrize("spec,window", CASES)
def test_kernel_path_equals_jnp_path(spec, window, monkeypatch):
  want = _run(spec, window, "xla")
  traced = helpers.traced_kernels(monkeypatch)
  got = _run(spec, window, "pallas")
  assert ("chunk", None) in traced, traced  # the prompt chunk
  flat = methods.make(spec).head_budget == "adakv"  # Expected Attention's default too
  # one query without a window: the split-K decode kernel, over blocks of a per-head cache or
  # the single slots of Ada-KV's flat buffer
  assert (("decode", 16) in traced) == (window is None and not flat), traced
  assert (("decode", 1) in traced) == (window is None and flat), traced
  # the decode steps' and extend's appends: one cache_append launch into a per-head cache
  assert (("append", None) in traced) == (not flat), traced
  for a, b in zip(got, want):
    a, b = np.asarray(a), np.asarray(b)
    assert np.all(np.isfinite(a)) and not np.any(a[1])  # the padding row is empty
    np.testing.assert_allclose(a, b, **helpers.tol(jnp.float32))
