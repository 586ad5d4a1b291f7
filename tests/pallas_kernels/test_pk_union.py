"""Per-head selection through the union of a group's lists, and the new kernel shapes of issue 17
(G = 7 as in Qwen, D = 96 and 256, retro windows with G * W = 64 rows, many blocks per split)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import (_union, sparse_decode, sparse_decode_multiquery,
                            sparse_decode_multiquery_reference, sparse_decode_reference,
                            sparse_decode_resa, sparse_decode_resa_reference)
from pk_testutil import Case, assert_attention_close


def test_union_lists_is_the_set_union_with_per_head_words():
  rng = np.random.default_rng(0)
  b, hkv, g, n, nb = 2, 2, 3, 5, 12
  idx = np.stack([[rng.permutation(nb)[:n] for _ in range(hkv * g)] for _ in range(b)])
  n_valid = rng.integers(0, n + 1, (b, hkv * g))
  idx[0, 0, n_valid[0, 0]:] = -3  # junk past n_valid is ignored
  # nonzero int32 words, some with bit 31 set (negative: a 32-query window's last step)
  payload = rng.integers(1, 100, (b, hkv * g, n)) * rng.choice([1, -(2**24)], (b, hkv * g, n))
  u, nu, words = _union.union_lists(jnp.asarray(idx, jnp.int32), jnp.asarray(n_valid, jnp.int32),
                                    g, nb, jnp.asarray(payload, jnp.int32))
  u, nu, words = map(np.asarray, (u, nu, words))
  for bi in range(b):
    for k in range(hkv):
      want = {}
      for gi in range(g):
        h = k * g + gi
        for e in range(n_valid[bi, h]):
          want.setdefault(int(idx[bi, h, e]), {})[gi] = int(payload[bi, h, e])
      assert nu[bi, k] == len(want)
      assert list(u[bi, k, :nu[bi, k]]) == sorted(want)
      for e, blk in enumerate(u[bi, k, :nu[bi, k]]):
        assert {gi: int(w) for gi, w in enumerate(words[bi, k, e]) if w} == want[blk]
  bits = np.asarray(_union.head_bits(jnp.asarray(words)))[..., 0]
  assert ((bits >> np.arange(g)[:, None, None, None]) & 1).transpose(1, 2, 3, 0).astype(bool).tolist() \
      == (words != 0).tolist()



@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 2), hkv=st.integers(1, 3), g=st.integers(1, 5), n=st.integers(1, 9),
       nb=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_union_lists_equals_a_brute_force_with_duplicates(b, hkv, g, n, nb, seed):
  """Random lists (ids repeated within a list, out of range, junk past n_valid): the union is
  the ascending set of listed blocks, each (block, head) word one of that pair's payloads, the
  tail past ``n_union`` block ``nb - 1`` with zero words (every array compared whole)."""
  rng = np.random.default_rng(seed)
  idx = rng.integers(-2, nb + 2, (b, hkv * g, n))
  n_valid = rng.integers(0, n + 1, (b, hkv * g))
  payload = rng.integers(1, 2**31 - 1, (b, hkv * g, n)) * rng.choice([1, -1], (b, hkv * g, n))
  u, nu, words = map(np.asarray, _union.union_lists(
      jnp.asarray(idx, jnp.int32), jnp.asarray(n_valid, jnp.int32), g, nb,
      jnp.asarray(payload, jnp.int32)))
  assert u.shape == (b, hkv, g * n) and words.shape == (b, hkv, g * n, g)
  for bi in range(b):
    for k in range(hkv):
      pairs = {}
      for gi in range(g):
        for e in range(n_valid[bi, k * g + gi]):
          pairs.setdefault((int(np.clip(idx[bi, k * g + gi, e], 0, nb - 1)), gi), set()).add(
              int(payload[bi, k * g + gi, e]))
      blocks = sorted({blk for blk, _ in pairs})
      m = len(blocks)
      assert nu[bi, k] == m
      assert list(u[bi, k, :m]) == blocks and (u[bi, k, m:] == nb - 1).all()
      assert not words[bi, k, m:].any()
      for e, blk in enumerate(blocks):
        for gi in range(g):
          w = int(words[bi, k, e, gi])
          assert w in pairs[(blk, gi)] if (blk, gi) in pairs else w == 0


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 2), hkv=st.integers(1, 3), g=st.integers(1, 8), n=st.integers(1, 9),
       nb=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_union_head_bits_is_union_lists_as_bits(b, hkv, g, n, nb, seed):
  """The single-query kernels' union (bits only, no per-head word map) is ``union_lists``'
  union with ``head_bits`` of its words, every array whole (duplicates, junk past n_valid)."""
  rng = np.random.default_rng(seed)
  idx = jnp.asarray(rng.integers(-2, nb + 2, (b, hkv * g, n)), jnp.int32)
  n_valid = jnp.asarray(rng.integers(0, n + 1, (b, hkv * g)), jnp.int32)
  u, nu, words = _union.union_lists(idx, n_valid, g, nb)
  got = _union.union_head_bits(idx, n_valid, g, nb)
  for a, want in zip(got, (u, nu, _union.head_bits(words))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(want))


# batch, hkv, group, head_dim, block_size, num_blocks, list_len, per_head, dtype, num_splits
SHAPES = [
    (1, 2, 7, 96, 16, 80, 40, True, jnp.bfloat16, None),  # Qwen's G = 7, D = 96, 2 splits
    (1, 1, 2, 256, 16, 40, 20, True, jnp.float32, 2),  # D = 256
    (2, 1, 7, 64, 32, 24, 10, False, jnp.bfloat16, None),
]


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_and_resa_new_shapes(shape):
  case = Case(*shape[:9], seed=3, num_splits=shape[9])
  q, k, v, idx, n_valid, length, prior = case.arrays()
  kw = dict(block_size=case.block_size)
  out, lse = sparse_decode(q, k, v, idx, n_valid, length, **kw, impl="pallas", interpret=True,
                           num_splits=case.num_splits)
  assert_attention_close(out, lse, *sparse_decode_reference(q, k, v, idx, n_valid, length, **kw),
                         case.dtype)
  got = sparse_decode_resa(q, k, v, prior, idx, n_valid, length, **kw, impl="pallas",
                           interpret=True, num_splits=case.num_splits)
  want = sparse_decode_resa_reference(q, k, v, prior, idx, n_valid, length, **kw)
  assert_attention_close(got[0], got[1], want[0], want[1], case.dtype)
  assert_attention_close(got[2], got[3], want[2], want[3], jnp.float32 if case.dtype == jnp.float32
                         else jnp.bfloat16)
  np.testing.assert_array_equal(got[4], want[4])


@pytest.mark.slow
@pytest.mark.parametrize("per_head", [False, True])
def test_multiquery_64_rows(per_head):
  """G = 8 heads x W = 8 window queries: 64 rows per kv-head program."""
  case = Case(1, 1, 8, 64, 16, 32, 12, per_head, jnp.bfloat16, seed=5, window=8, multi=True)
  q, k, v, idx, n_valid, length, _ = case.arrays()
  rng = np.random.default_rng(1)
  block_mask = jnp.asarray(rng.random((1, case.sel_heads, 8, case.list_len)) < 0.7)
  q_limit = jnp.asarray(rng.integers(-1, case.t + 2, (1, 8)), jnp.int32)
  args = (q, k, v, idx, n_valid, block_mask, q_limit, length)
  out, lse = sparse_decode_multiquery(*args, block_size=16, impl="pallas", interpret=True)
  ref = sparse_decode_multiquery_reference(*args, block_size=16)
  assert_attention_close(out, lse, *ref, case.dtype)
