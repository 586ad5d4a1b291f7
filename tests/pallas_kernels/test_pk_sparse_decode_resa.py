"""sparse_decode_resa: Pallas (interpret mode) == jnp reference (the prior-member count exactly);
its main path == sparse_decode; the reference's prior and count == a dense softmax of the prior
and a brute-force count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from pallas_kernels import sparse_decode, sparse_decode_resa, sparse_decode_resa_reference
from sparse_attn import reference as dense
from pk_testutil import TOKEN_POOL, Case, assert_attention_close, cases, pooled_cases

INTERPRET = True
reference = jax.jit(sparse_decode_resa_reference, static_argnames=("block_size", "scale"))
dense_softmax = jax.jit(dense.softmax_sum)


def run_kernel(case, *arrays, **kw):
  return sparse_decode_resa(*arrays, block_size=case.block_size, impl="pallas",
                            interpret=INTERPRET, **kw)


def check_kernel(case):
  q, k, v, idx, n_valid, length, prior = case.arrays()
  # prior logits -inf outside RESA's prior set: the kernel counts the members it attends
  prior = jnp.where(jax.random.bernoulli(jax.random.key(case.seed), 0.7, prior.shape), prior,
                    -jnp.inf)
  out, lse, p_out, p_lse, seen = run_kernel(case, q, k, v, prior, idx, n_valid, length,
                                            num_splits=case.num_splits)
  assert out.dtype == p_out.dtype == p_lse.dtype == jnp.float32  # partials, merged by RESA
  r_out, r_lse, rp_out, rp_lse, r_seen = reference(q, k, v, prior, idx, n_valid, length,
                                                   block_size=case.block_size)
  assert seen.dtype == jnp.int32
  np.testing.assert_array_equal(seen, r_seen)
  assert_attention_close(out, lse, r_out, r_lse, case.dtype)
  # The prior path feeds v-dtype probabilities to the p.v matmul too: v's dtype tolerance.
  assert_attention_close(p_out, p_lse, rp_out, rp_lse, case.dtype)
  # The prior is empty exactly where no prior member was attended.
  np.testing.assert_array_equal(np.isneginf(p_lse), seen == 0)


@settings(max_examples=12, deadline=None)
@given(case=pooled_cases())
def test_kernel_matches_reference(case):
  check_kernel(case)


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(case=cases())
def test_kernel_matches_reference_random_shapes(case):
  check_kernel(case)


@settings(max_examples=6, deadline=None)
@given(case=pooled_cases(pool=TOKEN_POOL))
def test_token_lists_match_reference(case):
  """RESA over a token selection (``topk+resa``): one slot an entry."""
  check_kernel(case)


def test_main_path_is_sparse_decode():
  case = Case(batch=2, hkv=3, group=3, head_dim=64, block_size=32, num_blocks=10, list_len=6,
              per_head=False, dtype=jnp.bfloat16, seed=21)
  q, k, v, idx, n_valid, length, prior = case.arrays()
  out, lse, _, _, _ = run_kernel(case, q, k, v, prior, idx, n_valid, length, num_splits=2)
  want = sparse_decode(q, k, v, idx, n_valid, length, block_size=32, impl="pallas",
                       interpret=INTERPRET, num_splits=2)
  # the same float32 partial, which sparse_decode rounds to q.dtype
  np.testing.assert_array_equal(np.asarray(out.astype(q.dtype), np.float32),
                                np.asarray(want[0], np.float32))
  np.testing.assert_array_equal(lse, want[1])


@settings(max_examples=8, deadline=None)
@given(case=pooled_cases())
def test_reference_prior_equals_dense_softmax_of_prior(case):
  """prior_lse / prior_out == a masked softmax of P over the listed slots, on the full cache."""
  q, k, v, idx, n_valid, length, prior = case.arrays()
  prior = jnp.where(jax.random.bernoulli(jax.random.key(case.seed), 0.7, prior.shape), prior,
                    -jnp.inf)
  _, _, p_out, p_lse, seen = reference(q, k, v, prior, idx, n_valid, length,
                                       block_size=case.block_size)
  b, hs = idx.shape[:2]
  listed = np.zeros((b, case.hq, case.t), bool)
  for bi in range(b):
    for h in range(case.hq):
      hl = h if case.per_head else h // case.group
      for blk in np.asarray(idx[bi, hl, :n_valid[bi, hl]]):
        listed[bi, h, blk * case.block_size:(blk + 1) * case.block_size] = True
  listed &= np.arange(case.t)[None, None, :] < np.asarray(length)[:, None, None]
  np.testing.assert_array_equal(seen, (listed & np.isfinite(np.asarray(prior))).sum(-1))
  logits = jnp.where(listed, prior, -jnp.inf).reshape(b, case.hkv, case.group, 1, case.t)
  want_out, want_lse = dense_softmax(logits, v)
  assert_attention_close(p_out, p_lse, want_out.reshape(p_out.shape),
                         want_lse.reshape(p_lse.shape), case.dtype)


def test_unpadded_group_of_16():
  """G = 16 rows and D = 64: the kernel's unmasked q / prior / output paths."""
  check_kernel(Case(batch=1, hkv=1, group=16, head_dim=64, block_size=16, num_blocks=10,
                    list_len=7, per_head=False, dtype=jnp.float32, seed=13, num_splits=2))


@pytest.mark.parametrize("lam, form, num_splits", [(1.0, "renormalised", 3),
                                                   (0.25, "renormalised", 2),
                                                   (0.5, "literal", 1)])
def test_epilogue_runs_inside_the_split_combine(lam, form, num_splits):
  """RESA's aggregator as the combine's epilogue == the reference's partials aggregated after."""
  from sparse_attn.enhancers import resa  # pylint: disable=g-import-not-at-top
  case = Case(batch=2, hkv=2, group=4, head_dim=64, block_size=16, num_blocks=12, list_len=9,
              per_head=True, dtype=jnp.float32, seed=5, num_splits=num_splits)
  q, k, v, idx, n_valid, length, prior = case.arrays()
  prior = jnp.where(jax.random.bernoulli(jax.random.key(1), 0.7, prior.shape), prior, -jnp.inf)
  rng = np.random.default_rng(3)
  b, hq, d = q.shape
  extras = (jnp.asarray(rng.standard_normal((b, hq, d)), jnp.float32),  # O_est
            jnp.asarray(rng.standard_normal((b, hq)) + 3, jnp.float32),  # log Z
            jnp.asarray(rng.standard_normal((b, hq)), jnp.float32),  # bias
            jnp.asarray(rng.integers(0, 60, (b, hq)), jnp.int32))  # prior count
  agg = resa.Aggregator(lam, form)
  args = (q, k, v, prior, idx, n_valid, length)
  got = run_kernel(case, *args, num_splits=num_splits, epilogue=agg, extras=extras)
  out, lse, p_out, p_lse, seen = reference(*args, block_size=case.block_size)
  want = agg((out, lse), (p_out, p_lse), seen, *extras)
  assert_attention_close(*got, *want, case.dtype)


@pytest.mark.parametrize("impl", ["pallas", "mosaic", "xla"])
def test_empty_lists_attend_nothing_on_every_backend(impl):
  """No listed block: every backend returns ``0`` / ``-inf`` partials and ``seen`` 0, as the
  reference does (``attends_nothing``)."""
  case = Case(batch=2, hkv=2, group=2, head_dim=32, block_size=16, num_blocks=4, list_len=2,
              per_head=False, dtype=jnp.float32, num_splits=1, seed=3)
  q, k, v, idx, n_valid, length, prior = case.arrays()
  got = sparse_decode_resa(q, k, v, prior, idx[..., :0], n_valid, length,
                           block_size=case.block_size, impl=impl, interpret=True)
  want = reference(q, k, v, prior, idx[..., :0], n_valid, length, block_size=case.block_size)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  assert not np.any(got[0]) and np.all(np.isneginf(got[1])) and not np.any(got[4])
