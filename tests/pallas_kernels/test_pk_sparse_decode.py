"""sparse_decode: Pallas (interpret mode) == jnp reference == dense attention on the same mask."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from pallas_kernels import sparse_decode, sparse_decode_reference
from sparse_attn import reference as dense
from pk_testutil import Case, assert_attention_close, cases, pooled_cases

INTERPRET = True
reference = jax.jit(sparse_decode_reference, static_argnames=("block_size", "scale"))
dense_attention = jax.jit(dense.attention)


def run_kernel(case, q, k, v, idx, n_valid, length, **kw):
  return sparse_decode(q, k, v, idx, n_valid, length, block_size=case.block_size, impl="pallas",
                       interpret=INTERPRET, **kw)


def dense_mask(case, idx, n_valid):
  """``[B, Hq, 1, T]`` bool: the slots of the listed blocks (per query head)."""
  b, hs, n = idx.shape
  nb = case.num_blocks
  listed = np.zeros((b, hs, nb), bool)
  for bi in range(b):
    for h in range(hs):
      listed[bi, h, np.asarray(idx[bi, h, :n_valid[bi, h]])] = True
  listed = np.repeat(listed, case.hq // hs, axis=1)
  return jnp.asarray(np.repeat(listed, case.block_size, axis=-1)[:, :, None, :])


def check_kernel(case):
  q, k, v, idx, n_valid, length, _ = case.arrays()
  out, lse = run_kernel(case, q, k, v, idx, n_valid, length, num_splits=case.num_splits)
  assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:2]
  ref_out, ref_lse = reference(q, k, v, idx, n_valid, length, block_size=case.block_size)
  assert_attention_close(out, lse, ref_out, ref_lse, case.dtype)


@settings(max_examples=15, deadline=None)
@given(case=pooled_cases())
def test_kernel_matches_reference(case):
  check_kernel(case)


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(case=cases())
def test_kernel_matches_reference_random_shapes(case):
  check_kernel(case)


@settings(max_examples=10, deadline=None)
@given(case=pooled_cases())
def test_reference_equals_dense_attention_on_mask(case):
  q, k, v, idx, n_valid, length, _ = case.arrays()
  out, lse = reference(q, k, v, idx, n_valid, length, block_size=case.block_size)
  mask = dense_mask(case, idx, n_valid)
  d_out, d_lse = dense_attention(q[:, :, None], k, v, mask, kv_length=length)
  assert_attention_close(out, lse, d_out[:, :, 0], d_lse[:, :, 0], case.dtype)


@pytest.mark.parametrize("per_head", [False, True])
def test_all_blocks_selected_equals_dense(per_head):
  case = Case(batch=2, hkv=3, group=3, head_dim=64, block_size=16, num_blocks=12, list_len=12,
              per_head=per_head, dtype=jnp.float32, seed=7)
  q, k, v, _, _, _, _ = case.arrays()
  rng = np.random.default_rng(1)
  hs = case.sel_heads
  idx = jnp.asarray(np.stack([[rng.permutation(12) for _ in range(hs)] for _ in range(2)]),
                    jnp.int32)
  n_valid = jnp.full((2, hs), 12, jnp.int32)
  length = jnp.asarray([190, 37], jnp.int32)  # partial last blocks
  out, lse = run_kernel(case, q, k, v, idx, n_valid, length)
  d_out, d_lse = dense.attention(q[:, :, None], k, v, kv_length=length)
  assert_attention_close(out, lse, d_out[:, :, 0], d_lse[:, :, 0], jnp.float32)


def test_non_power_of_two_head_dim():
  """D = 80 (padded to 128 inside the kernel, masked loads / stores)."""
  check_kernel(Case(batch=2, hkv=1, group=3, head_dim=80, block_size=16, num_blocks=10,
                    list_len=6, per_head=False, dtype=jnp.float32, seed=17, num_splits=2))


def test_empty_and_length_zero_rows_are_zero_not_nan():
  case = Case(batch=2, hkv=2, group=4, head_dim=64, block_size=32, num_blocks=4, list_len=3,
              per_head=False, dtype=jnp.bfloat16, seed=3)
  q, k, v, idx, _, _, _ = case.arrays()
  n_valid = jnp.asarray([[0, 3], [3, 2]], jnp.int32)
  length = jnp.asarray([128, 0], jnp.int32)  # batch 1: empty cache
  out, lse = run_kernel(case, q, k, v, idx, n_valid, length, num_splits=2)
  lse = np.asarray(lse)
  assert np.isneginf(lse[0, :4]).all() and np.isneginf(lse[1]).all()
  assert np.isfinite(lse[0, 4:]).all()
  assert (np.asarray(out, np.float32)[0, :4] == 0).all() and not np.isnan(
      np.asarray(out, np.float32)).any()


def test_large_bf16_logits_are_finite():
  """|q.k| ~ 1e4 in bf16: logits and lse stay in float32 (docs/architecture.md)."""
  case = Case(batch=1, hkv=1, group=4, head_dim=64, block_size=16, num_blocks=8, list_len=5,
              per_head=False, dtype=jnp.bfloat16, seed=11)
  q, k, v, idx, n_valid, length, _ = case.arrays()
  q, k = q * 30, k * 30
  n_valid = jnp.full_like(n_valid, 5)
  length = jnp.asarray([100], jnp.int32)
  out, lse = run_kernel(case, q, k, v, idx, n_valid, length)
  ref_out, ref_lse = reference(q, k, v, idx, n_valid, length, block_size=16)
  assert np.abs(np.asarray(ref_lse)).max() > 1e3
  assert_attention_close(out, lse, ref_out, ref_lse, jnp.bfloat16)


def test_vmap_and_jit_match_plain_call():
  case = Case(batch=2, hkv=1, group=2, head_dim=64, block_size=16, num_blocks=6, list_len=4,
              per_head=False, dtype=jnp.float32, seed=5)
  q, k, v, idx, n_valid, length, _ = case.arrays()
  plain = run_kernel(case, q, k, v, idx, n_valid, length)
  one = lambda *a: run_kernel(case, *(x[None] for x in a))
  mapped = jax.vmap(lambda *a: jax.tree.map(lambda x: x[0], one(*a)))(
      q, k, v, idx, n_valid, length)
  jitted = jax.jit(functools.partial(run_kernel, case))(q, k, v, idx, n_valid, length)
  for other in (mapped, jitted):
    np.testing.assert_allclose(other[0], plain[0], atol=1e-6)
    np.testing.assert_array_equal(np.isneginf(other[1]), np.isneginf(plain[1]))


def test_xla_impl_is_reference_and_auto_is_xla_on_cpu():
  case = Case(batch=1, hkv=2, group=2, head_dim=64, block_size=16, num_blocks=4, list_len=2,
              per_head=True, dtype=jnp.float32, seed=2)
  q, k, v, idx, n_valid, length, _ = case.arrays()
  want = reference(q, k, v, idx, n_valid, length, block_size=16)
  cpu = jax.default_backend() == "cpu"  # on a GPU "auto" is the kernel (test_kernel_...)
  for impl in ("xla", "auto") if cpu else ("xla",):
    got = sparse_decode(q, k, v, idx, n_valid, length, block_size=16, impl=impl)
    np.testing.assert_allclose(got[0], want[0], rtol=0 if cpu else 1e-6, atol=0 if cpu else 1e-6)
  with pytest.raises(ValueError):
    sparse_decode(q, k, v, idx, n_valid, length, block_size=16, impl="triton")
