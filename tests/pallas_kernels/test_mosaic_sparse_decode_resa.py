"""Mosaic GPU sparse_decode_resa == sparse_decode_resa_reference under Mosaic GPU's interpret
mode (CPU: simulated SMEM, TMA and mbarriers, race detection on), its main path == the Mosaic
sparse_decode, RESA's epilogue after the merge, and its lowering for CUDA (jax.export)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

from pallas_kernels import sparse_decode_resa, sparse_decode_resa_reference
from pallas_kernels.mosaic import sparse_decode
from pk_testutil import Case, assert_attention_close
from test_mosaic_sparse_decode import FIELDS, POOL

reference = jax.jit(sparse_decode_resa_reference,
                    static_argnames=("block_size", "epilogue", "softcap"))


def run(case, *args, **kw):
  gpu_callbacks.reset_gpu_interpret_mode_state()
  out = jax.block_until_ready(
      sparse_decode_resa(*args, block_size=case.block_size, impl="mosaic", interpret=True,
                         num_splits=case.num_splits, **kw))
  assert not gpu_callbacks.get_races().races_found
  return out


def arrays(case, seed):
  q, k, v, idx, n_valid, length, prior = case.arrays()
  # prior logits -inf outside RESA's prior set: the kernel counts the members it attends
  prior = jnp.where(jax.random.bernoulli(jax.random.key(seed), 0.7, prior.shape), prior,
                    -jnp.inf)
  return q, k, v, prior, idx, n_valid, length


@pytest.mark.parametrize("shape", POOL)  # each: f32 (CUDA cores) and bf16 (WGMMA) steps
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), with_pos=st.booleans())
def test_matches_reference(shape, seed, with_pos):
  case = Case(**dict(zip(FIELDS, shape)), seed=seed)
  args = arrays(case, seed)
  pos = None
  if with_pos:  # a compacted cache: holes (-1) below length
    rng = np.random.default_rng(seed)
    pos = jnp.asarray(np.where(rng.random(args[1].shape[:3]) < 0.3, -1,
                               np.arange(case.t)), jnp.int32)
  out, lse, p_out, p_lse, seen = run(case, *args, pos=pos)
  assert out.dtype == p_out.dtype == p_lse.dtype == jnp.float32 and seen.dtype == jnp.int32
  r_out, r_lse, rp_out, rp_lse, r_seen = reference(*args, block_size=case.block_size, pos=pos)
  np.testing.assert_array_equal(seen, r_seen)
  assert_attention_close(out, lse, r_out, r_lse, case.dtype)
  assert_attention_close(p_out, p_lse, rp_out, rp_lse, case.dtype)
  np.testing.assert_array_equal(np.isneginf(p_lse), seen == 0)
  # the main path is the Mosaic sparse_decode's (the same f32 partial, rounded there): the
  # WGMMA step for 16-bit caches, whose tile's free rows carry the prior here, else CUDA cores
  want = sparse_decode(*args[:3], *args[4:], block_size=case.block_size, impl="mosaic",
                       interpret=True, num_splits=case.num_splits, pos=pos)
  np.testing.assert_array_equal(np.asarray(out.astype(case.dtype), np.float32),
                                np.asarray(want[0], np.float32))


def test_epilogue_after_the_merge_and_softcap():
  """RESA's aggregator run on the merged partials == the reference's partials aggregated."""
  from sparse_attn.enhancers import resa  # pylint: disable=g-import-not-at-top
  case = Case(**dict(zip(FIELDS, POOL[0])), seed=5)
  args = arrays(case, 1)
  rng = np.random.default_rng(3)
  b, hq, d = args[0].shape
  extras = (jnp.asarray(rng.standard_normal((b, hq, d)), jnp.float32),  # O_est
            jnp.asarray(rng.standard_normal((b, hq)) + 3, jnp.float32),  # log Z
            jnp.asarray(rng.standard_normal((b, hq)), jnp.float32),  # bias
            jnp.asarray(rng.integers(0, 60, (b, hq)), jnp.int32))  # prior count
  agg = resa.Aggregator(0.5, "renormalised")
  got = run(case, *args, epilogue=agg, extras=extras, softcap=5.0)
  out, lse, p_out, p_lse, seen = reference(*args, block_size=case.block_size, softcap=5.0)
  assert_attention_close(*got, *agg((out, lse), (p_out, p_lse), seen, *extras), case.dtype)


S, I32 = jax.ShapeDtypeStruct, jnp.int32


@pytest.mark.parametrize("dtype,per_head", [(jnp.bfloat16, False), (jnp.float32, True)])
def test_lowers_for_cuda(dtype, per_head):
  """Llama-3.1-8B heads at 32k: Pallas -> Mosaic GPU MLIR (the prior ring's TMA, row-layout
  loads and the extra outputs) runs on the CPU; Mosaic's passes to PTX need the CUDA plugin."""
  b, hq, hkv, d, t, bs, n = 1, 32, 8, 128, 32768, 16, 205
  hs = hq if per_head else hkv
  cache = S((b, hkv, t, d), dtype)
  fn = functools.partial(sparse_decode_resa, block_size=bs, impl="mosaic",
                         softcap=50.0 if per_head else None)
  exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(
      S((b, hq, d), dtype), cache, cache, S((b, hq, t), jnp.float32), S((b, hs, n), I32),
      S((b, hs), I32), S((b,), I32), pos=S((b, hkv, t), I32) if per_head else None)
  text = exported.mlir_module()
  assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {"mosaic_gpu_v2"}
  assert ("wgmma" in text) == (dtype == jnp.bfloat16)  # 16-bit: the prior rides in the tile
