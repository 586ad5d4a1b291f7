"""Exact attention and the merge identity."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

from sparse_attn import merge as merge_lib
from sparse_attn import reference
from tests.sparse_attn import helpers


def _np_attention(q, k, v, mask, scale):
  """Brute force in float64: softmax over the allowed keys; empty rows -> (0, -inf)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, hq, s, d = q.shape
  g = hq // k.shape[1]
  out = np.zeros((b, hq, s, d)); lse = np.full((b, hq, s), -np.inf)
  for i in range(b):
    for h in range(hq):
      for r in range(s):
        allowed = np.asarray(mask[i, h, r])
        if not allowed.any():
          continue
        lg = scale * k[i, h // g, allowed] @ q[i, h, r]
        m = lg.max()
        p = np.exp(lg - m)
        out[i, h, r] = p @ v[i, h // g, allowed] / p.sum()
        lse[i, h, r] = m + np.log(p.sum())
  return out, lse


problems = dict(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 2), hkv=st.integers(1, 2),
                g=st.sampled_from([1, 2, 3]), s=st.integers(1, 5), t=st.integers(1, 40),
                dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))


@given(**problems)
def test_attention_matches_bruteforce_with_causal_and_length_masks(seed, b, hkv, g, s, t, dtype):
  rng = np.random.default_rng(seed)
  d = 8
  q = helpers.normal(rng, (b, hkv * g, s, d), dtype)
  k = helpers.normal(rng, (b, hkv, t, d), dtype)
  v = helpers.normal(rng, (b, hkv, t, d), dtype)
  length = jnp.asarray(rng.integers(0, t + 1, size=b), jnp.int32)
  qpos = jnp.asarray(rng.integers(-1, t, size=(b, s)), jnp.int32)
  out, lse = reference.attention(q, k, v, kv_length=length, q_positions=qpos)
  slots = np.arange(t)
  mask = ((slots[None, None, :] < np.asarray(length)[:, None, None])
          & (slots[None, None, :] <= np.asarray(qpos)[:, :, None]))[:, None]
  mask = np.broadcast_to(mask, (b, hkv * g, s, t))
  want_o, want_l = _np_attention(q, k, v, mask, 1 / np.sqrt(d))
  assert out.dtype == dtype and lse.dtype == jnp.float32
  assert not np.isnan(np.asarray(out, np.float32)).any()
  np.testing.assert_allclose(np.asarray(out, np.float64), want_o, **helpers.tol(dtype))
  np.testing.assert_allclose(np.asarray(lse, np.float64), want_l, **helpers.tol(dtype))


def test_empty_rows_are_zero_and_minus_inf():
  q = jnp.ones((2, 2, 1, 4)); k = jnp.ones((2, 1, 3, 4))
  out, lse = reference.attention(q, k, k, kv_length=jnp.array([0, 2]))
  assert np.all(np.asarray(out[0]) == 0) and np.all(np.isneginf(lse[0]))
  assert np.all(np.isfinite(lse[1]))


def test_bf16_large_logits_are_finite():
  rng = np.random.default_rng(0)
  q = helpers.normal(rng, (1, 4, 1, 64), jnp.bfloat16, scale=30.0)
  k = helpers.normal(rng, (1, 2, 50, 64), jnp.bfloat16, scale=30.0)  # |q.k| ~ 1e4
  out, lse = reference.attention(q, k, k)
  assert np.isfinite(np.asarray(out, np.float32)).all() and np.isfinite(lse).all()
  assert float(jnp.max(jnp.abs(lse))) > 1e3


@given(seed=st.integers(0, 2**31 - 1), t=st.integers(1, 60), parts=st.integers(1, 5),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_merge_of_any_partition_equals_attending_all(seed, t, parts, dtype):
  """Randomly partition the keys (parts may be empty): n-way and pairwise merges are exact."""
  rng = np.random.default_rng(seed)
  q = helpers.normal(rng, (1, 4, 2, 8), dtype)
  k = helpers.normal(rng, (1, 2, t, 8), dtype)
  v = helpers.normal(rng, (1, 2, t, 8), dtype)
  owner = rng.integers(0, parts, size=t)
  pieces = [reference.attention(q, k, v, mask=jnp.asarray(owner == p)[None, None, None])
            for p in range(parts)]
  full = reference.attention(q.astype(jnp.float32), k.astype(jnp.float32),
                             v.astype(jnp.float32))
  outs = jnp.stack([o.astype(jnp.float32) for o, _ in pieces])
  lses = jnp.stack([l for _, l in pieces])
  o_n, l_n = merge_lib.merge_n(outs, lses)
  acc = pieces[0]
  for p in pieces[1:]:
    acc = merge_lib.merge(acc, p)
  for o, l in ((o_n, l_n), acc):
    np.testing.assert_allclose(np.asarray(o, np.float32), full[0], **helpers.tol(dtype))
    np.testing.assert_allclose(l, full[1], **helpers.tol(dtype))


def test_merge_with_empty_parts_and_jit_vmap():
  o = jnp.ones((3, 2, 4)); l = jnp.array([[0.5, -jnp.inf]] * 3)
  empty = (jnp.zeros((3, 2, 4)), jnp.full((3, 2), -jnp.inf))
  out, lse = merge_lib.merge((o, l), empty)
  np.testing.assert_array_equal(out, jnp.where(jnp.isfinite(l)[..., None], o, 0.0))
  np.testing.assert_array_equal(lse, l)
  assert not np.isnan(np.asarray(out)).any()
  vm = jax.jit(jax.vmap(merge_lib.merge))((o, l), empty)
  np.testing.assert_array_equal(vm[0], out)
  np.testing.assert_array_equal(vm[1], lse)


def test_attention_jit_vmap_equal_plain():
  rng = np.random.default_rng(3)
  q = helpers.normal(rng, (3, 1, 4, 2, 8)); k = helpers.normal(rng, (3, 1, 2, 9, 8))
  ln = jnp.array([[4], [9], [0]])
  plain = [reference.attention(q[i], k[i], k[i], kv_length=ln[i]) for i in range(3)]
  f = jax.jit(jax.vmap(lambda a, b, c: reference.attention(a, b, b, kv_length=c)))
  vo, vl = f(q, k, ln)
  for i in range(3):
    np.testing.assert_allclose(vo[i], plain[i][0], atol=1e-6)
    np.testing.assert_allclose(vl[i], plain[i][1], atol=1e-6)
