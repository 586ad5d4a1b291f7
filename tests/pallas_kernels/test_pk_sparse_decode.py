"""sparse_decode: Pallas (interpret mode) == jnp reference == dense attention on the same mask."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import sparse_decode, sparse_decode_reference
from sparse_attn import reference as dense
from pk_testutil import TOKEN_POOL, Case, assert_attention_close, cases, pooled_cases

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


@settings(max_examples=8, deadline=None)
@given(case=pooled_cases(pool=TOKEN_POOL), hole_share=st.sampled_from((0.0, 0.2)))
def test_token_lists_match_reference(case, hole_share):
  """Lists of single slots (TidalDecode, RocketKV, Twilight, the oracle top-k): the kernel
  gathers a tile of scattered slots; empty slots (``pos < 0``, a compacted cache's holes)
  are never attended."""
  q, k, v, idx, n_valid, length, _ = case.arrays()
  rng = np.random.default_rng(case.seed)
  pos = np.where(rng.random(k.shape[:3]) < hole_share, -1, np.arange(case.t))
  pos = jnp.asarray(pos, jnp.int32)
  out, lse = run_kernel(case, q, k, v, idx, n_valid, length, num_splits=case.num_splits,
                        pos=pos)
  ref_out, ref_lse = reference(q, k, v, idx, n_valid, length, block_size=1, pos=pos)
  assert_attention_close(out, lse, ref_out, ref_lse, case.dtype)


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


SOFTCAP_CASES = [  # (case fields as POOL, softcap): both layouts and dtypes, splits
    (Case(batch=2, hkv=2, group=3, head_dim=64, block_size=16, num_blocks=12, list_len=7,
          per_head=False, dtype=jnp.float32, seed=31, num_splits=3), 5.0),
    (Case(batch=1, hkv=2, group=2, head_dim=128, block_size=32, num_blocks=8, list_len=5,
          per_head=True, dtype=jnp.bfloat16, seed=32), 3.0),
]


@pytest.mark.parametrize("case,cap", SOFTCAP_CASES)
def test_softcap_kernel_reference_and_dense_agree(case, cap):
  """Gemma 2's soft-cap in the kernel (interpret mode) == the reference == dense attention with
  the cap; logits are scaled up so the cap bends them (the outputs differ from uncapped)."""
  q, k, v, idx, n_valid, length, _ = case.arrays()
  q = q * 4
  # Row 0: full lists of distinct blocks over a full cache.
  full = np.stack([np.random.default_rng(h).permutation(case.num_blocks)[:case.list_len]
                   for h in range(idx.shape[1])])
  idx, n_valid = idx.at[0].set(full), n_valid.at[0].set(case.list_len)
  length = length.at[0].set(case.t)
  out, lse = run_kernel(case, q, k, v, idx, n_valid, length, num_splits=case.num_splits,
                        softcap=cap)
  ref_out, ref_lse = sparse_decode_reference(q, k, v, idx, n_valid, length,
                                             block_size=case.block_size, softcap=cap)
  assert_attention_close(out, lse, ref_out, ref_lse, case.dtype)
  d_out, d_lse = dense.attention(q[:, :, None], k, v, dense_mask(case, idx, n_valid),
                                 kv_length=length, softcap=cap)
  assert_attention_close(ref_out, ref_lse, d_out[:, :, 0], d_lse[:, :, 0], case.dtype)
  plain = sparse_decode_reference(q, k, v, idx, n_valid, length, block_size=case.block_size)[1]
  finite = np.isfinite(np.asarray(ref_lse))
  assert finite.any()
  assert np.abs(np.asarray(plain)[finite] - np.asarray(ref_lse)[finite]).max() > 0.1


def test_softcap_is_tanh_of_the_scaled_logits():
  """dense attention with ``softcap`` is the softmax of ``cap * tanh(scale q.k / cap)``."""
  rng = np.random.default_rng(0)
  q = rng.standard_normal((1, 2, 3, 16)).astype(np.float32) * 3
  k = rng.standard_normal((1, 1, 5, 16)).astype(np.float32) * 3
  v = rng.standard_normal((1, 1, 5, 16)).astype(np.float32)
  cap, scale = 2.5, 0.3
  s = cap * np.tanh(np.einsum("bhsd,btd->bhst", q, k[:, 0]) * scale / cap)
  p = np.exp(s - s.max(-1, keepdims=True))
  want = np.einsum("bhst,btd->bhsd", p / p.sum(-1, keepdims=True), v[:, 0])
  want_lse = np.log(np.exp(s).sum(-1))
  out, lse = dense.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=scale,
                             softcap=cap)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="softcap"):
    dense.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), softcap=0.0)
