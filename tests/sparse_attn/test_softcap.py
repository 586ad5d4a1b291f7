"""Attention-logit soft-capping (Gemma 2) in the methods: what follows the cap, what refuses it,
and the attention weights compression scorers read under a cap and a sliding window."""

import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods, reference
from sparse_attn.compression import observe

CAP, SCALE = 1.5, 0.4


def _brute_probs(q, qpos, k, kpos, cap, window):
  """``[B, K, G, W, T]`` softmax of ``cap * tanh(scale q.k / cap)`` over the keys at or
  before each query and inside its window (numpy)."""
  b, w, n, d = q.shape
  kh = k.shape[1]
  qg = q.reshape(b, w, kh, n // kh, d)
  s = np.einsum("bwkgd,bktd->bkgwt", qg, k) * SCALE
  s = cap * np.tanh(s / cap)
  ok = kpos[:, :, None, None, :] <= qpos[:, None, None, :, None]
  ok &= kpos[:, :, None, None, :] > qpos[:, None, None, :, None] - window
  s = np.where(ok, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


def _problem(seed=0, b=1, w=3, n=4, kh=2, t=12, d=8):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, w, n, d)).astype(np.float32) * 3
  k = rng.standard_normal((b, kh, t, d)).astype(np.float32) * 3
  qpos = np.array([[7, 9, 11]], np.int32)
  kpos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, kh, t)).copy()
  return q, k, qpos, kpos


def test_window_probs_are_capped_and_windowed():
  q, k, qpos, kpos = _problem()
  got = observe.window_probs(jnp.asarray(q), jnp.asarray(qpos), jnp.ones(qpos.shape, bool),
                             jnp.asarray(k), jnp.asarray(kpos), jnp.ones(kpos.shape, bool),
                             SCALE, softcap=CAP, window=4)
  np.testing.assert_allclose(got, _brute_probs(q, qpos, k, kpos, CAP, 4), rtol=1e-5, atol=1e-6)
  plain = observe.window_probs(jnp.asarray(q), jnp.asarray(qpos), jnp.ones(qpos.shape, bool),
                               jnp.asarray(k), jnp.asarray(kpos), jnp.ones(kpos.shape, bool),
                               SCALE)
  assert np.abs(np.asarray(plain) - np.asarray(got)).max() > 0.1


def test_column_sums_read_the_capped_windowed_attention():
  """H2O's column sums against the lse of the capped, windowed attention equal the brute-force
  probabilities summed over queries, averaged over each kv head's group."""
  q, k, qpos, kpos = _problem(seed=1)
  qn = jnp.asarray(q.transpose(0, 2, 1, 3))  # [B, N, S, D]
  kj, vj = jnp.asarray(k), jnp.asarray(k)
  _, lse = reference.attention(qn, kj, vj, scale=SCALE, q_positions=jnp.asarray(qpos),
                               k_positions=jnp.asarray(kpos), window=4, softcap=CAP)
  got = observe.column_sums(qn, jnp.asarray(qpos), lse, kj, jnp.asarray(kpos),
                            jnp.ones(kpos.shape, bool), SCALE, block=2, key_tile=4,
                            softcap=CAP, window=4)
  want = _brute_probs(q, qpos, k, kpos, CAP, 4).sum(axis=3).mean(axis=2)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", ["dense", "quest", "arkvale", "topk", "streaming",
                                  "quest+rect", "quest+retro", "snapkv", "h2o", "tova", "knorm"])
def test_methods_that_follow_the_cap(spec):
  m = methods.make(spec).with_softcap(50.0)
  assert m.softcap == 50.0 and m.with_softcap(None).softcap is None


@pytest.mark.parametrize("spec", ["quest+resa", "quest:topp=0.9", "quest:adakv=0.2",
                                  "twilight", "topk:gqa=group", "expected_attention"])
def test_methods_that_refuse_the_cap(spec):
  with pytest.raises(NotImplementedError, match="soft-caps|uncapped"):
    methods.make(spec).with_softcap(50.0)
  with pytest.raises(ValueError, match="softcap"):
    methods.make("quest").with_softcap(-1.0)
