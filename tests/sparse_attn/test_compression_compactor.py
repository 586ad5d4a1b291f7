"""Compactor (arXiv 2507.08143, kvpress's CompactorPress) against a brute-force numpy version.

The numpy side follows kvpress's ``score`` step by step on one row (middle slice, centred
sketched keys, explicit inverse of the Gram matrix, dense chunked softmax, ``avg_pool1d``,
z-scores), with the sketch of the same ``jax.random.key(seed)`` draw and the RoPE undone by
an explicit rotation matrix.
"""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods
from sparse_attn.compression import compactor

B, HQ, HKV, D, T = 2, 4, 2, 8, 48
G = HQ // HKV
THETA = 100.0


def unrotate(k, theta):
  """``k [H, n, D]`` (post-RoPE at positions 0..n-1, half-split) rotated back, by matrices."""
  h, n, d = k.shape
  freq = theta ** (-np.arange(0, d, 2) / d)
  out = np.empty_like(k)
  for p in range(n):
    c, s = np.cos(-p * freq), np.sin(-p * freq)
    rot = np.block([[np.diag(c), -np.diag(s)], [np.diag(s), np.diag(c)]])
    out[:, p] = k[:, p] @ rot.T
  return out


def zs(x):
  if x.size == 0:
    return x
  std = np.sqrt(((x - x.mean()) ** 2).sum() / max(x.size - 1, 1))  # ddof=1 (one token: 0)
  return (x - x.mean()) / max(std, 1e-6)


def numpy_scores(q, k, v, n, m, phi):
  """``[HKV, n]`` Compactor scores of one row of ``n`` tokens (+inf = the protected ends)."""
  head = min(m.sink_start, n)
  tail = min(m.sink_end, max(0, n - head))
  sl = slice(head, n - tail)
  km, vm, qm = k[:, sl], v[:, sl], q[:, sl]
  score = np.full((HKV, n), np.inf)
  if km.shape[1] == 0:
    return score
  pre = unrotate(k[:, :n], THETA)[:, sl]
  x = (pre - pre.mean(1, keepdims=True)) @ phi  # [H, M, R]
  lev = np.stack([np.clip(np.diag(xh @ np.linalg.inv(xh.T @ xh + 1e-2 * np.eye(xh.shape[1]))
                                  @ xh.T), 0, None) for xh in x])
  mlen = km.shape[1]
  att = np.zeros((HQ, mlen))
  for c0 in range(0, mlen, m.chunk_size):
    c1 = min(c0 + m.chunk_size, mlen)
    logits = np.einsum("hid,hjd->hij", qm[:, c0:c1], np.repeat(km[:, c0:c1], G, axis=0))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    att[:, c0:c1] = (p / p.sum(-1, keepdims=True)).sum(1)
  att = att.reshape(HKV, G, mlen).mean(1) * np.linalg.norm(vm, axis=-1)
  padded = np.pad(att, ((0, 0), (1, 1)))
  att = (padded[:, :-2] + padded[:, 1:-1] + padded[:, 2:]) / 3
  blend = m.ratio if m.blending is None else m.blending
  score[:, sl] = blend * zs(lev) + zs(att)
  return score


@hypothesis.given(seed=st.integers(0, 2**31 - 1), lengths=st.tuples(st.integers(14, T),
                                                                      st.integers(1, T)),
                  chunk=st.sampled_from([4, 7, 256]), sketch=st.sampled_from([3, 8]),
                  frac=st.floats(0.2, 0.9))
@hypothesis.settings(max_examples=15, deadline=None)
def test_kept_set_matches_brute_force(seed, lengths, chunk, sketch, frac):
  m = methods.make("compactor", ratio=0.5, chunk_size=chunk, sketch_dimension=sketch,
                   head_budget="uniform", rope_theta=THETA, seed=seed % 7)
  rng = np.random.default_rng(seed)
  q, k, v = (rng.normal(size=(B, h, T, D)) for h in (HQ, HKV, HKV))
  pos = np.where(np.arange(T)[None] < np.asarray(lengths)[:, None], np.arange(T)[None], -1)
  cache = m.init_cache(B, HKV, T, D)
  state = m.init_state(B, HQ, HKV, D, T)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  _, cache, state = jax.jit(m.prefill)(f32(q), f32(k), f32(v), cache, state, jnp.asarray(pos))
  score = np.asarray(m.slot_scores(cache, state, None, jnp.asarray(lengths)))
  phi = np.asarray(jax.random.normal(jax.random.key(m.seed), (B, HKV, D, sketch))) / math.sqrt(
      sketch)
  budgets = [max(1, int(frac * n)) for n in lengths]
  keep = np.asarray(m.keep_mask(cache, state, None, jnp.asarray(budgets, jnp.int32)))
  for b, n in enumerate(lengths):
    # a row is scored with the key of its own position in [B, K]: the same draw
    want = numpy_scores(q[b], k[b], v[b], n, m, phi[b])
    fin = np.isfinite(want)
    np.testing.assert_array_equal(np.isinf(score[b, :, :n]), ~fin)
    np.testing.assert_allclose(score[b, :, :n][fin], want[fin], rtol=2e-3, atol=2e-3)
    assert not keep[b, :, n:].any()
    assert (keep[b, :, :n].sum(-1) == budgets[b]).all()
    for h in range(HKV):  # the kept set is the top of the reference up to near-ties
      cut = np.sort(want[h])[::-1][budgets[b] - 1]
      wrong = keep[b, h, :n] != (want[h] >= cut)
      np.testing.assert_allclose(want[h][wrong], cut, atol=5e-3)


def test_sketch_of_full_dimension_is_exact_leverage():
  """With ``R = D`` the sketch is invertible: the leverage is the exact one (up to the
  jitter), whatever the draw, which is why kvpress's torch draw and ours then agree."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(1, 1, 40, D)), jnp.float32) * 3
  mask = jnp.ones((1, 1, 40), bool)
  lev = [compactor.leverage(x, mask, jax.random.normal(jax.random.key(s), (1, 1, D, D)))
         for s in (0, 1)]
  xc = np.asarray(x[0, 0]) - np.asarray(x[0, 0]).mean(0)
  exact = np.diag(xc @ np.linalg.pinv(xc.T @ xc) @ xc.T)
  for got in lev:
    np.testing.assert_allclose(np.asarray(got[0, 0]), exact, atol=2e-3)


def test_jit_vmap_and_options():
  m = methods.make("compactor", ratio=0.5, chunk_size=5, sketch_dimension=4)
  assert m.head_budget == "adakv" and m.sink_start == 8 and m.sink_end == 4
  rng = np.random.default_rng(1)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  q, k, v = f(B, HQ, T, D), f(B, HKV, T, D), f(B, HKV, T, D)
  pos = jnp.tile(jnp.arange(T, dtype=jnp.int32), (B, 1)).at[1, 30:].set(-1)

  def keep(q, k, v, pos):
    cache, state = m.init_cache(B, HKV, T, D), m.init_state(B, HQ, HKV, D, T)
    _, cache, state = m.prefill(q, k, v, cache, state, pos)
    return m.keep_mask(cache, state, None, jnp.full((B,), 12, jnp.int32))

  plain = np.asarray(keep(q, k, v, pos))
  np.testing.assert_array_equal(np.asarray(jax.jit(keep)(q, k, v, pos)), plain)

  def one(q, k, v, pos):
    return keep(*(jnp.repeat(x[None], B, 0) for x in (q, k, v, pos)))[0]

  # vmapped over the batch (each row alone, as batch 1 rows broadcast to B) equals row 0
  np.testing.assert_array_equal(np.asarray(jax.vmap(one)(q, k, v, pos))[0], plain[0])
  with pytest.raises(ValueError, match="prefill"):
    methods.make("compactor", ratio=0.5, phase="both")
  with pytest.raises(ValueError, match="sketch_dimension"):
    methods.make("compactor", ratio=0.5, sketch_dimension=0)
