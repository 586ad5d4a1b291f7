"""Q-Filters (arXiv 2503.02812) against a brute-force numpy version.

The numpy side: an explicit SVD of each head's queries (the authors' ``make_filters``: sign by
the majority of ``U[:, 0]``, group average) and the score ``-<f, k>`` of every key; the prompt
fallback from the SVD of the prompt's queries with the sign of the mean projection.
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods
from sparse_attn.compression import qfilters

B, HQ, HKV, D, T, LAYERS = 2, 4, 2, 8, 48, 3
TABLE = np.random.default_rng(7).normal(size=(LAYERS, HKV, D))  # one method: one compile
G = HQ // HKV


def anisotropic_queries(rng, n, s):
  """Queries with a dominant direction per head (as real ones: Godey et al., Sec. 3)."""
  u = rng.normal(size=(n, 1, D)) * 3
  return u + rng.normal(size=(n, s, D))


def top_k(score, n):
  keep = np.zeros(score.shape, bool)
  keep[np.argsort(-score, kind="stable")[:n]] = True
  return keep


@hypothesis.given(seed=st.integers(0, 2**31 - 1), frac=st.floats(0.2, 0.9))
@hypothesis.settings(max_examples=8, deadline=None)
def test_calibration_filters_match_explicit_svd(seed, frac):
  rng = np.random.default_rng(seed)
  q = anisotropic_queries(rng, HQ, 30)
  got = qfilters.filters_from_queries(q, HKV, samples=None)
  want = []
  for h in range(HQ):
    u, _, vh = np.linalg.svd(q[h])
    sign = 1.0 if (u[:, 0] > 0).mean() > 0.5 else -1.0
    want.append(-sign * vh[0])
  want = np.asarray(want).reshape(HKV, G, D).mean(1)
  np.testing.assert_allclose(got, want, atol=1e-5)
  # the filter points away from the queries: keys along the queries score high
  assert np.all(np.einsum("hsd,hd->hs", q, np.repeat(got, G, 0)).mean(-1) < 0)
  del frac


@hypothesis.given(seed=st.integers(0, 2**31 - 1), frac=st.floats(0.2, 0.9),
                  layer=st.integers(0, LAYERS - 1))
@hypothesis.settings(max_examples=10, deadline=None)
def test_text_calibration_keeps_top_filter_scores(seed, frac, layer):
  rng = np.random.default_rng(seed)
  table = TABLE
  m = methods.make("qfilters", ratio=0.5).with_filters(table)
  assert m.source == "text"
  k = rng.normal(size=(B, HKV, T, D))
  lengths = (T, 23)
  pos = np.where(np.arange(T)[None] < np.asarray(lengths)[:, None], np.arange(T)[None], -1)
  cache = m.init_cache(B, HKV, T, D)
  state = m.layer_state(m.init_state(B, HQ, HKV, D, T), layer)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  _, cache, state = jax.jit(m.prefill)(f32(rng.normal(size=(B, HQ, T, D))), f32(k),
                                       f32(k), cache, state, jnp.asarray(pos))
  budgets = [max(1, int(frac * n)) for n in lengths]
  keep = np.asarray(m.keep_mask(cache, state, None, jnp.asarray(budgets, jnp.int32)))
  for b, n in enumerate(lengths):
    assert not keep[b, :, n:].any()
    for h in range(HKV):
      score = -k[b, h, :n] @ table[layer, h]  # kvpress's QFilterPress.score
      np.testing.assert_array_equal(keep[b, h, :n], top_k(score, budgets[b]))


@hypothesis.given(seed=st.integers(0, 2**31 - 1), frac=st.floats(0.2, 0.9))
@hypothesis.settings(max_examples=8, deadline=None)
def test_prompt_calibration_is_the_prompts_own_svd(seed, frac):
  rng = np.random.default_rng(seed)
  lengths = (T, 17)
  q = np.stack([anisotropic_queries(rng, HQ, T) for _ in range(B)])
  k = rng.normal(size=(B, HKV, T, D))
  pos = np.where(np.arange(T)[None] < np.asarray(lengths)[:, None], np.arange(T)[None], -1)
  m = methods.make("qfilters", ratio=0.5)
  assert m.source == "prompt"
  cache, state = m.init_cache(B, HKV, T, D), m.init_state(B, HQ, HKV, D, T)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  _, cache, state = jax.jit(m.prefill)(f32(q), f32(k), f32(k), cache, state, jnp.asarray(pos))
  budgets = [max(1, int(frac * n)) for n in lengths]
  keep = np.asarray(m.keep_mask(cache, state, None, jnp.asarray(budgets, jnp.int32)))
  for b, n in enumerate(lengths):
    for h in range(HKV):
      f = []
      for g in range(G):
        qh = q[b, h * G + g, :n]
        v1 = np.linalg.svd(qh)[2][0]
        f.append(-np.sign(qh.mean(0) @ v1) * v1)
      score = -k[b, h, :n] @ np.mean(f, 0)
      got = keep[b, h, :n]
      want = top_k(score, budgets[b])
      cut = np.sort(score)[::-1][budgets[b] - 1]  # only near-ties at the cut may differ
      np.testing.assert_allclose(score[got != want], cut, atol=1e-4)


def test_layer_rows_jit_vmap_and_options():
  rng = np.random.default_rng(0)
  table = rng.normal(size=(LAYERS, HKV, D))
  m = methods.make("qfilters:ratio=0.5").with_filters(table)
  assert m.spec == "qfilters:ratio=0.5" and hash(m)
  st0 = m.init_state(B, HQ, HKV, D, T)
  np.testing.assert_allclose(np.asarray(m.layer_state(st0, 2)["filter"][1]), table[2], rtol=1e-6)
  k = jnp.asarray(rng.normal(size=(B, HKV, T, D)), jnp.float32)
  cache = m.init_cache(B, HKV, T, D)
  pos = jnp.tile(jnp.arange(T, dtype=jnp.int32), (B, 1))
  _, cache, st = m.prefill(jnp.zeros((B, HQ, T, D)), k, k, cache, m.layer_state(st0, 1), pos)
  score = np.asarray(m.scores(cache, st, None, None))
  np.testing.assert_allclose(np.asarray(jax.jit(m.scores, static_argnums=(2,))(
      cache, st, None, None)), score, rtol=1e-6)
  one = jax.vmap(lambda c, s: m.scores(c, s, None, None))(
      jax.tree.map(lambda x: x[:, None], cache), jax.tree.map(lambda x: x[:, None], st))
  np.testing.assert_allclose(np.asarray(one)[:, 0], score, rtol=1e-6)
  with pytest.raises(ValueError, match="needs the filter table"):
    methods.make("qfilters", ratio=0.5, calibration="text")
  with pytest.raises(ValueError, match="calibration"):
    methods.make("qfilters", ratio=0.5, calibration="train")
  with pytest.raises(ValueError, match="layers"):
    m.layer_state(st0, LAYERS)
