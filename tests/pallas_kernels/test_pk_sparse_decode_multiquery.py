"""sparse_decode_multiquery: Pallas (interpret mode) == jnp reference == masked dense attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from pallas_kernels import (sparse_decode, sparse_decode_multiquery,
                            sparse_decode_multiquery_reference)
from pallas_kernels.sparse_decode_multiquery import merge_carry
from sparse_attn import reference as dense
from pk_testutil import TOKEN_POOL, Case, assert_attention_close, cases, pooled_cases

INTERPRET = True
reference = jax.jit(sparse_decode_multiquery_reference,
                    static_argnames=("block_size", "scale", "count_attended"))
dense_attention = jax.jit(dense.attention)


def window_inputs(case, seed):
  """Random ``block_mask [B, H, W, n]`` and ``q_limit [B, W]`` (some negative: attends nothing)."""
  rng = np.random.default_rng(seed + 1)
  w = case.window
  block_mask = rng.random((case.batch, case.sel_heads, w, case.list_len)) < 0.7
  q_limit = rng.integers(-1, case.t + 2, (case.batch, w))
  q_limit[0, 0] = -1
  return jnp.asarray(block_mask), jnp.asarray(q_limit, jnp.int32)


def listed_mask(case, idx, n_valid, block_mask):
  """``[B, N, W, T]`` bool: the slots of the blocks each window query may use (brute force)."""
  mask = np.zeros((case.batch, case.hq, case.window, case.t), bool)
  for bi in range(case.batch):
    for h in range(case.hq):
      hl = h if case.per_head else h // case.group
      for i in range(int(n_valid[bi, hl])):
        blk = int(idx[bi, hl, i])
        mask[bi, h, :, blk * case.block_size:(blk + 1) * case.block_size] = (
            np.asarray(block_mask[bi, hl, :, i])[:, None])
  return mask


def attended_bruteforce(case, idx, n_valid, block_mask, q_limit, length):
  """``[B, N, W]``: the keys each window query attends (listed, usable, below the length and
  at or before its limit), counted slot by slot."""
  slot = np.arange(case.t)
  ok = (listed_mask(case, idx, n_valid, block_mask)
        & (slot < np.asarray(length)[:, None, None, None])
        & (slot <= np.asarray(q_limit)[:, None, :, None]))
  return ok.sum(-1)


def carried(case, q, pairs: int):
  """Random cached partials per output pair (RetroAttention's past outputs), some -inf."""
  rng = np.random.default_rng(case.seed + 2)
  lse = rng.standard_normal((pairs,) + q.shape[:3]) * 5
  lse[rng.random(lse.shape) < 0.3] = -np.inf
  out = rng.standard_normal((pairs,) + q.shape)
  return [(jnp.asarray(o, jnp.float32), jnp.asarray(l, jnp.float32)) for o, l in zip(out, lse)]


def run_kernel(case, *arrays, **kw):
  return sparse_decode_multiquery(*arrays, block_size=case.block_size, impl="pallas",
                                  interpret=INTERPRET, **kw)


def check_kernel(case):
  q, k, v, idx, n_valid, length, _ = case.arrays()
  block_mask, q_limit = window_inputs(case, case.seed)
  args = (q, k, v, idx, n_valid, block_mask, q_limit, length)
  out, lse, attended = run_kernel(case, *args, num_splits=case.num_splits, count_attended=True)
  assert out.shape == q.shape and out.dtype == jnp.float32 and lse.shape == q.shape[:3]
  ref_out, ref_lse, ref_attended = reference(*args, block_size=case.block_size,
                                             count_attended=True)
  assert_attention_close(out, lse, ref_out, ref_lse, case.dtype)
  carry = carried(case, q, 1)  # cached partials merged in the split combine == after it
  got = run_kernel(case, *args, num_splits=case.num_splits, carry_in=carry)
  assert_attention_close(*got, *merge_carry((ref_out, ref_lse), carry), case.dtype)
  want = attended_bruteforce(case, idx, n_valid, block_mask, q_limit, length)
  np.testing.assert_array_equal(ref_attended, want)
  np.testing.assert_array_equal(attended, want)


@settings(max_examples=12, deadline=None)
@given(case=pooled_cases(windows=(3,)))
def test_kernel_matches_reference(case):
  check_kernel(case)


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(case=cases(windows=(1, 2, 4, 5), max_list=8))
def test_kernel_matches_reference_random_shapes(case):
  check_kernel(case)


@settings(max_examples=5, deadline=None)
@given(case=pooled_cases(windows=(3,), pool=TOKEN_POOL))
def test_token_lists_match_reference(case):
  """RetroAttention's window over a token selection: one slot an entry."""
  check_kernel(case)


@settings(max_examples=8, deadline=None)
@given(case=pooled_cases(windows=(3,)))
def test_reference_equals_dense_attention(case):
  """Listed blocks x block_mask as a dense mask, q_limit as causal query positions."""
  q, k, v, idx, n_valid, length, _ = case.arrays()
  block_mask, q_limit = window_inputs(case, case.seed)
  out, lse = reference(q, k, v, idx, n_valid, block_mask, q_limit, length,
                       block_size=case.block_size)
  mask = listed_mask(case, idx, n_valid, block_mask)
  d_out, d_lse = dense_attention(q, k, v, jnp.asarray(mask), kv_length=length,
                                 q_positions=q_limit)
  assert_attention_close(out, lse, d_out, d_lse, case.dtype)


def test_single_query_unmasked_equals_sparse_decode():
  case = Case(batch=2, hkv=2, group=4, head_dim=128, block_size=16, num_blocks=9, list_len=5,
              per_head=False, dtype=jnp.float32, seed=4, window=1, multi=True)
  q, k, v, idx, n_valid, length, _ = case.arrays()
  block_mask = jnp.ones((2, 2, 1, 5), bool)
  q_limit = jnp.full((2, 1), case.t, jnp.int32)
  out, lse = run_kernel(case, q, k, v, idx, n_valid, block_mask, q_limit, length)
  want = sparse_decode(q[:, :, 0], k, v, idx, n_valid, length, block_size=16, impl="pallas",
                       interpret=INTERPRET)
  assert_attention_close(out[:, :, 0], lse[:, :, 0], want[0], want[1], jnp.float32)


def test_unpadded_rows_and_head_dim():
  """G x W = 16 rows and D = 128: the kernel's unmasked load / store paths."""
  case = Case(batch=1, hkv=2, group=4, head_dim=128, block_size=32, num_blocks=8, list_len=6,
              per_head=False, dtype=jnp.bfloat16, seed=9, window=4, multi=True)
  check_kernel(case)


def check_kernel_with_prior(case):
  q, k, v, idx, n_valid, length, prior = case.arrays()
  block_mask, q_limit = window_inputs(case, case.seed)
  # prior logits -inf outside RESA's prior set (the unselected-at-prefill positions)
  prior = jnp.where(jax.random.bernoulli(jax.random.key(case.seed), 0.6, prior.shape), prior,
                    -jnp.inf)
  args = (q, k, v, idx, n_valid, block_mask, q_limit, length)
  carry = carried(case, q, 2)  # both pairs continue cached partials
  got = run_kernel(case, *args, num_splits=case.num_splits, prior=prior, count_attended=True,
                   carry_in=carry)
  want = reference(*args, block_size=case.block_size, prior=prior, count_attended=True,
                   carry_in=carry)
  assert len(got) == 6 and got[2].shape == q.shape and got[3].shape == q.shape[:3]
  assert_attention_close(got[0], got[1], want[0], want[1], case.dtype)
  assert_attention_close(got[2], got[3], want[2], want[3], case.dtype)
  np.testing.assert_array_equal(got[4], want[4])  # prior members each window query attended
  np.testing.assert_array_equal(got[5], attended_bruteforce(case, idx, n_valid, block_mask,
                                                            q_limit, length))


@settings(max_examples=10, deadline=None)
@given(case=pooled_cases(windows=(3,)))
def test_kernel_with_prior_matches_reference(case):
  """RESA + retro: the prior statistics of every window query in the same pass."""
  check_kernel_with_prior(case)


def test_reference_prior_of_one_query_is_sparse_decode_resa():
  from pallas_kernels import sparse_decode_resa_reference  # pylint: disable=g-import-not-at-top
  case = Case(batch=2, hkv=2, group=3, head_dim=64, block_size=16, num_blocks=12, list_len=7,
              per_head=True, dtype=jnp.float32, seed=4, window=1, multi=True)
  q, k, v, idx, n_valid, length, prior = case.arrays()
  ones = jnp.ones((case.batch, case.sel_heads, 1, case.list_len), bool)
  limit = jnp.full((case.batch, 1), case.t, jnp.int32)
  got = reference(q, k, v, idx, n_valid, ones, limit, length, block_size=16, prior=prior)
  want = sparse_decode_resa_reference(q[:, :, 0], k, v, prior, idx, n_valid, length,
                                      block_size=16)
  assert_attention_close(got[2][:, :, 0], got[3][:, :, 0], want[2], want[3], jnp.float32)


@pytest.mark.parametrize("per_head", [False, True])
def test_softcap_kernel_matches_reference(per_head):
  """Gemma 2's soft-cap through the window kernel (interpret mode) == the reference, and the
  cap changes the result (logits scaled past it)."""
  case = Case(batch=1, hkv=2, group=2, head_dim=64, block_size=16, num_blocks=8, list_len=5,
              per_head=per_head, dtype=jnp.float32, seed=41, window=3, multi=True)
  q, k, v, idx, n_valid, length, _ = case.arrays()
  full = np.stack([np.random.default_rng(h).permutation(case.num_blocks)[:case.list_len]
                   for h in range(idx.shape[1])])
  idx, n_valid = idx.at[0].set(full), n_valid.at[0].set(case.list_len)
  block_mask, q_limit = window_inputs(case, case.seed)
  args = (q * 4, k, v, idx, n_valid, block_mask, q_limit.at[0].set(case.t),
          jnp.full_like(length, case.t))
  out, lse = run_kernel(case, *args, num_splits=2, softcap=3.0)
  ref_out, ref_lse = sparse_decode_multiquery_reference(*args, block_size=case.block_size,
                                                        softcap=3.0)
  assert_attention_close(out, lse, ref_out, ref_lse, case.dtype)
  plain = sparse_decode_multiquery_reference(*args, block_size=case.block_size)[1]
  finite = np.isfinite(np.asarray(ref_lse))
  assert np.abs(np.asarray(plain)[finite] - np.asarray(ref_lse)[finite]).max() > 0.1
