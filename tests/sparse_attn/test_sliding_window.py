"""Sliding-window masks (Mistral) against brute-force numpy attention.

A query at position p attends keys at positions in (p - window, p]: dense prefill chunks
(``dense_over_cache``, tiled or not), dense decode and sparse decode (selection restricted to the
window, attention masked to it), plain, under ``jax.jit`` and under ``jax.vmap``.
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods, sliding_window
from sparse_attn.cache_attention import dense_over_cache
from tests.sparse_attn.helpers import filled_cache, normal

D = 8


def _np_attention(q, k, v, mask, scale):
  """``q [Hq, D]``, ``k, v [Hkv, T, D]``, ``mask [Hq, T]`` -> ``[Hq, D]`` (float64)."""
  g = q.shape[0] // k.shape[0]
  kk, vv = np.repeat(k, g, axis=0), np.repeat(v, g, axis=0)
  lg = np.einsum("hd,htd->ht", q, kk) * scale
  lg = np.where(mask, lg, -np.inf)
  p = np.exp(lg - lg.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("ht,htd->hd", p, vv)


@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(window=st.integers(1, 40), key_tile=st.sampled_from([16, 1000]),
                  s=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_dense_over_cache_window(window, key_tile, s, seed):
  rng = np.random.default_rng(seed)
  lengths = [48, 30]
  cache = filled_cache(rng, 2, 2, 64, D, lengths)
  q = normal(rng, (2, 4, s, D))
  qpos = np.stack([np.arange(n - s, n) for n in lengths]).astype(np.int32)
  out, _ = dense_over_cache(q, cache, jnp.asarray(qpos), key_tile=key_tile, window=window)
  k, v = np.asarray(cache.k, np.float64), np.asarray(cache.v, np.float64)
  for b, n in enumerate(lengths):
    for i, p in enumerate(qpos[b]):
      kpos = np.arange(64)
      mask = (kpos <= p) & (kpos > p - window) & (kpos < n)
      want = _np_attention(np.asarray(q[b, :, i], np.float64), k[b], v[b],
                           np.broadcast_to(mask, (4, 64)), D ** -0.5)
      np.testing.assert_allclose(out[b, :, i], want, atol=2e-5, rtol=2e-5)


def _decode_case(seed, window):
  rng = np.random.default_rng(seed)
  lengths = [61, 37]
  cache = filled_cache(rng, 2, 2, 64, D, lengths, block_size=4)
  q = normal(rng, (2, 4, D))
  positions = jnp.asarray([n - 1 for n in lengths], jnp.int32)
  in_window = (np.arange(64)[None] > np.asarray(positions)[:, None] - window) & (
      np.arange(64)[None] < np.asarray(lengths)[:, None])
  return cache, q, positions, in_window


@pytest.mark.parametrize("spec, window", [("dense", 20), ("quest", 20), ("topk", 9),
                                          ("arkvale", 33), ("streaming", 20)])
def test_decode_attends_selection_within_window(spec, window):
  cache, q, positions, in_window = _decode_case(0, window)
  sinks = 4 if spec == "streaming" else 0  # sinks are forced, then masked by the window
  opts = {} if spec == "dense" else dict(budget=16, n_sink=sinks, local_window=4)
  m = methods.make(spec, block_size=4, **opts).with_sliding_window(window)
  out, lse = m.attend(q, cache, positions)
  if spec == "dense":
    mask = np.broadcast_to(in_window[:, None], (2, 4, 64))
  else:
    view = sliding_window.visible(cache, positions, window)
    sel = m.select(q, view)
    mask = np.asarray(sel.token_mask(64))
    mask = np.repeat(mask, 4 // mask.shape[1], axis=1) & in_window[:, None]
    # every listed entry holds a key inside the window: the budget is not spent outside it
    g, n = sel.granularity, np.asarray(sel.n_valid)
    visible_entry = in_window.reshape(2, -1, g).any(-1)
    for b in range(2):
      for h in range(sel.idx.shape[1]):
        ids = np.asarray(sel.idx[b, h, :n[b, h]])
        assert visible_entry[b, ids[ids * g >= sinks]].all(), (b, h, ids)
  k, v = np.asarray(cache.k, np.float64), np.asarray(cache.v, np.float64)
  for b in range(2):
    want = _np_attention(np.asarray(q[b], np.float64), k[b], v[b], mask[b], D ** -0.5)
    np.testing.assert_allclose(out[b], want, atol=2e-5, rtol=2e-5)
  assert np.all(np.isfinite(np.asarray(lse)))


def test_windowed_decode_jit_and_vmap():
  cache, q, positions, _ = _decode_case(1, 16)
  m = methods.make("quest", budget=16, block_size=4).with_sliding_window(16)
  plain, _ = m.attend(q, cache, positions)
  jitted, _ = jax.jit(m.attend)(q, cache, positions)
  one = lambda qq, c, p: m.attend(qq[None], jax.tree.map(lambda x: x[None], c), p[None])[0][0]
  vmapped = jax.vmap(one)(q, cache, positions)
  np.testing.assert_allclose(jitted, plain, atol=1e-6)
  np.testing.assert_allclose(vmapped, plain, atol=1e-6)


def test_bad_window_and_enhancers():
  with pytest.raises(ValueError, match="positive int"):
    methods.make("quest").with_sliding_window(0)
  with pytest.raises(NotImplementedError, match="sliding-window"):
    methods.make("quest+retro").with_sliding_window(8)
  assert methods.make("quest+rect").with_sliding_window(8).sliding_window == 8
