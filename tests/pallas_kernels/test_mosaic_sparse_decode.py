"""Mosaic GPU sparse_decode == sparse_decode_reference under Mosaic GPU's interpret mode (CPU:
simulated SMEM, TMA and mbarriers, race detection on), and its lowering for CUDA (jax.export)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

from pallas_kernels import sparse_decode_reference
from pallas_kernels.mosaic import InterpretGPUParams, sparse_decode
from pk_testutil import Case, assert_attention_close

PARAMS = InterpretGPUParams(detect_races=True)
reference = jax.jit(sparse_decode_reference, static_argnames=("block_size", "softcap"))
# Fixed shapes (interpret-mode programs compile once each): batch, hkv, group, head_dim,
# block_size, num_blocks, list_len, per_head, dtype, num_splits. Covers G 1-3, bs 16/32/64
# (4, 2, 1 blocks per 64-token step), f32 and bf16, both list layouts, 1-3 splits.
POOL = [
    (1, 1, 2, 64, 16, 8, 6, False, jnp.float32, 2),
    (2, 1, 3, 64, 32, 4, 3, True, jnp.bfloat16, 1),
    (1, 2, 1, 64, 64, 3, 3, False, jnp.bfloat16, 3),
]
FIELDS = ("batch", "hkv", "group", "head_dim", "block_size", "num_blocks", "list_len",
          "per_head", "dtype", "num_splits")


def run(case, *args, **kw):
  gpu_callbacks.reset_gpu_interpret_mode_state()
  out = sparse_decode(*args, block_size=case.block_size, impl="mosaic", interpret=PARAMS,
                      num_splits=case.num_splits, **kw)
  out = jax.block_until_ready(out)
  assert not gpu_callbacks.get_races().races_found
  return out


@settings(max_examples=3, deadline=None)
@given(shape=st.sampled_from(POOL), seed=st.integers(0, 2**31 - 1), with_pos=st.booleans())
def test_matches_reference(shape, seed, with_pos):
  case = Case(**dict(zip(FIELDS, shape)), seed=seed)
  q, k, v, idx, n_valid, length, _ = case.arrays()
  pos = None
  if with_pos:  # a compacted cache: holes (-1) below length
    rng = np.random.default_rng(seed)
    pos = jnp.asarray(np.where(rng.random(k.shape[:3]) < 0.3, -1,
                               np.arange(case.t)), jnp.int32)
  out, lse = run(case, q, k, v, idx, n_valid, length, pos=pos)
  assert out.shape == q.shape and out.dtype == q.dtype
  ref_out, ref_lse = reference(q, k, v, idx, n_valid, length, block_size=case.block_size,
                               pos=pos)
  assert_attention_close(out, lse, ref_out, ref_lse, case.dtype)


def test_softcap_and_empty_lists():
  case = Case(1, 1, 2, 64, 16, 8, 6, False, jnp.float32, seed=3, num_splits=2)
  q, k, v, idx, n_valid, length, _ = case.arrays()
  n_valid = n_valid.at[0, 0].set(0)
  for nv, cap in ((n_valid, None), (jnp.full_like(n_valid, 6), 5.0)):
    out, lse = run(case, 30.0 * q, k, v, idx, nv, length, softcap=cap)
    ref = reference(30.0 * q, k, v, idx, nv, length, block_size=16, softcap=cap)
    assert_attention_close(out, lse, *ref, case.dtype)


S, I32 = jax.ShapeDtypeStruct, jnp.int32


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("per_head", [False, True])
def test_lowers_for_cuda(dtype, per_head):
  """Llama-3.1-8B heads at 32k: Pallas -> Mosaic GPU MLIR (layouts, TMA shapes, barriers) runs
  on the CPU; what remains (Mosaic's passes to PTX, ptxas) runs inside the custom call."""
  b, hq, hkv, d, t, bs, n = 1, 32, 8, 128, 32768, 16, 205
  hs = hq if per_head else hkv
  cache = S((b, hkv, t, d), dtype)
  fn = functools.partial(sparse_decode, block_size=bs, impl="mosaic",
                         softcap=50.0 if per_head else None)
  exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(
      S((b, hq, d), dtype), cache, cache, S((b, hs, n), I32), S((b, hs), I32), S((b,), I32),
      pos=S((b, hkv, t), I32) if per_head else None)
  text = exported.mlir_module()
  assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {"mosaic_gpu_v2"}


def test_ptx_needs_the_cuda_plugin():
  """Mosaic's passes to PTX and ptxas live in the CUDA plugin's ``_mosaic_gpu_ext``, run by the
  ``mosaic_gpu_v2`` custom call when XLA compiles for a GPU; the CPU jaxlib lacks them."""
  try:
    from jax._src.lib import mosaic_gpu  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    pytest.skip("PTX / ptxas of the Mosaic GPU kernels not checked: jax._src.lib.mosaic_gpu "
                "(the jax-cuda12-plugin's _mosaic_gpu_ext) is not installed with the CPU jaxlib")
  pytest.skip("the CUDA plugin is installed, but compiling to PTX needs a GPU context "
              "(the mosaic_gpu_v2 custom call compiles at XLA compile time on the device)")
