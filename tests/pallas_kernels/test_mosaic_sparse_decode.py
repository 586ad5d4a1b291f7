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
from pallas_kernels.mosaic.sparse_decode import decode_partials, mma_usable
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


# 16-bit shapes for the tensor-core step (``mma``) and the CUDA-core one on the same problems:
# G 4 (Llama-3.1-8B's group) and 3, D 128 and 64, blocks of 16 / 32 / 64, group and per-head
# lists (per-(entry, row) bits), 1-3 splits.
POOL_16 = [
    (1, 2, 4, 128, 16, 12, 9, False, jnp.bfloat16, 2),
    (2, 1, 3, 64, 32, 6, 5, True, jnp.bfloat16, 1),
    (1, 1, 2, 64, 64, 4, 4, False, jnp.float16, 3),
]


def poisoned(case, k, v, length, seed):
  """Holes (-1) in ``pos``, and inf keys / NaN values in every slot a row may not attend (the
  holes and the slots past ``length``): a kernel must mask them, not multiply them by 0."""
  rng = np.random.default_rng(seed)
  pos = np.where(rng.random(k.shape[:3]) < 0.3, -1, np.arange(case.t))
  bad = jnp.asarray((pos < 0) | (np.arange(case.t)[None, None] >= np.asarray(length)[:, None,
                                                                                       None]))
  return (jnp.asarray(pos, jnp.int32), jnp.where(bad[..., None], jnp.inf, k),
          jnp.where(bad[..., None], jnp.nan, v))


@pytest.mark.parametrize("mma", [True, False])
@pytest.mark.parametrize("shape", POOL_16)
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), with_pos=st.booleans())
def test_16_bit_steps_match_reference(shape, mma, seed, with_pos):
  """Both step bodies (tensor-core WGMMA products, CUDA-core rows) equal the reference; with a
  compacted cache its holes and the slots past the length hold inf / NaN, which neither reads
  (the reference sees the clean cache)."""
  case = Case(**dict(zip(FIELDS, shape)), seed=seed)
  q, k, v, idx, n_valid, length, _ = case.arrays()
  pos, k_bad, v_bad = poisoned(case, k, v, length, seed) if with_pos else (None, k, v)
  b, hq, d = q.shape
  u_idx, u_nv, bits = _group_lists(case, idx, n_valid)
  gpu_callbacks.reset_gpu_interpret_mode_state()
  out, lse = jax.block_until_ready(decode_partials(
      q.reshape(b, case.hkv, case.group, d), k_bad, v_bad, u_idx, u_nv, length, pos=pos,
      row_bits=bits, block_size=case.block_size, scale=d ** -0.5,
      num_splits=case.num_splits, num_stages=3, softcap=None, interpret=PARAMS, mma=mma))
  assert not gpu_callbacks.get_races().races_found
  ref_out, ref_lse = reference(q, k, v, idx, n_valid, length, block_size=case.block_size,
                               pos=pos)
  assert_attention_close(out.reshape(b, hq, d).astype(q.dtype), lse.reshape(b, hq), ref_out,
                         ref_lse, case.dtype)


def _group_lists(case, idx, n_valid):
  """``decode_partials``' lists: group lists as given, per-head ones as their union with a
  per-(entry, row) bit (what ``sparse_decode`` hands it)."""
  from pallas_kernels.sparse_decode import checked_lists  # pylint: disable=g-import-not-at-top
  q_dummy = jnp.zeros((case.batch, case.hq, case.head_dim), case.dtype)
  k_dummy = jnp.zeros((case.batch, case.hkv, case.t, case.head_dim), case.dtype)
  _, lists = checked_lists(q_dummy, k_dummy, idx, n_valid, case.block_size, None)
  u_idx, u_nv, bits = lists
  return u_idx, u_nv, None if bits is None else bits[..., 0]


def test_mma_is_for_16_bit_plain_steps():
  """The tensor-core step runs where it is exact enough and has every input it needs: 16-bit
  q/k/v of one dtype (f32 stays on CUDA cores: a WGMMA rounds it to TF32), W and D <= 256, no
  multi-query limit, and with RESA's prior at most 32 rows (its rows fill the tile's free half);
  forcing it elsewhere is an error, not a silent fallback."""
  bf, f32 = jnp.bfloat16, jnp.float32
  plain = dict(w=64, d=128, with_limit=False, with_prior=False)
  assert mma_usable(bf, bf, bf, **plain)
  assert mma_usable(jnp.float16, jnp.float16, jnp.float16, **plain)
  assert not mma_usable(f32, f32, f32, **plain)
  assert not mma_usable(bf, f32, bf, **plain)
  assert mma_usable(bf, bf, bf, **{**plain, "with_prior": True, "rows": 32})
  assert not mma_usable(bf, bf, bf, **{**plain, "with_prior": True, "rows": 33})
  assert not mma_usable(bf, bf, bf, **{**plain, "with_limit": True})
  assert not mma_usable(bf, bf, bf, **{**plain, "w": 512})
  case = Case(*POOL[0][:9], seed=0, num_splits=1)
  q, k, v, idx, n_valid, length, _ = case.arrays()
  with pytest.raises(ValueError, match="mma needs 16-bit"):
    decode_partials(q.reshape(1, 1, 2, 64), k, v, idx, n_valid, length, block_size=16,
                    scale=0.125, num_splits=1, num_stages=3, softcap=None, interpret=PARAMS,
                    mma=True)


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
  # The embedded Mosaic GPU module: a 16-bit step's two products are WGMMAs; f32 has none.
  assert ("wgmma" in text) == (dtype == jnp.bfloat16)


@pytest.mark.parametrize("mma,tokens", [(None, None), (False, None), (None, 128)])
def test_dense_128k_lowers(mma, tokens):
  """The dense step at Llama-3.1-8B's 128k (``pallas_kernels.dense_decode`` on the Mosaic
  backend: the identity mode, no list) lowers to one Mosaic GPU call, whose step runs on the
  tensor cores unless told otherwise, and no XLA op touches the 128k slots."""
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  from pallas_kernels import mosaic  # pylint: disable=g-import-not-at-top
  b, hq, hkv, d, t, bs = 1, 32, 8, 128, 131072, 16
  cache = S((b, hkv, t, d), jnp.bfloat16)
  if tokens is None and mma is None:
    fn = functools.partial(pallas_kernels.dense_decode, block_size=bs, impl="mosaic")
  else:
    fn = functools.partial(mosaic.dense_decode, block_size=bs, impl="mosaic", mma=mma,
                           tokens_per_step=tokens)
  text = jax.export.export(jax.jit(fn), platforms=["cuda"])(
      S((b, hq, d), jnp.bfloat16), cache, cache, S((b,), I32),
      pos=S((b, hkv, t), I32)).mlir_module()
  assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {"mosaic_gpu_v2"}
  assert ("wgmma" in text) == (mma is not False)
  # No XLA op over the cache's slots: no list, and pos goes to the kernel as it is (its
  # windows by TMA), not through a slot-word pass (the list path has three such ops).
  main = text[text.index("func.func public @main"):]
  assert not [line for line in main.splitlines()
              if "stablehlo." in line and "custom_call" not in line and str(t) in line]


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


@pytest.mark.parametrize("mma", [True, False])
def test_tokens_per_step(mma):
  """128 tokens a step (8 blocks of 16) gives the reference's answer on either body; a step that
  is not whole 64-row tiles of whole blocks, needs more barriers than a group has, or whose
  two-step ring does not fit in shared memory is refused."""
  case = Case(1, 2, 4, 128, 16, 20, 17, True, jnp.bfloat16, seed=11, num_splits=2)
  q, k, v, idx, n_valid, length, _ = case.arrays()
  out, lse = run(case, q, k, v, idx, n_valid, length, mma=mma, tokens_per_step=128)
  assert_attention_close(out, lse, *reference(q, k, v, idx, n_valid, length, block_size=16),
                         case.dtype)
  for bad in (96, 32 * 16 + 64, 512):  # not whole tiles; 36 blocks; 256 KB for two steps
    with pytest.raises(ValueError, match="tokens_per_step"):
      sparse_decode(q, k, v, idx, n_valid, length, block_size=16, impl="mosaic",
                    interpret=PARAMS, tokens_per_step=bad)


# Dense shapes: batch, hkv, group, head_dim, block_size, num_blocks, dtype, splits, W. T = 80
# blocks x 16 is not a multiple of W = 64 (the last window moves back to end at T); T = 48
# slots is under W (explicit lists instead).
DENSE_POOL = [
    (2, 2, 4, 128, 16, 21, jnp.bfloat16, 3, 64),
    (1, 1, 3, 64, 32, 5, jnp.bfloat16, 2, 128),
    (2, 1, 2, 64, 16, 3, jnp.float32, 1, 64),
    (1, 2, 2, 32, 16, 13, jnp.float32, 2, 64),
]


@pytest.mark.parametrize("shape", DENSE_POOL)
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), with_pos=st.booleans())
def test_dense_identity_mode(shape, seed, with_pos):
  """``dense_decode`` (no list: one W-token TMA a step) == the reference over every block, with
  lengths 0 / partial / whole, holes, and inf / NaN in every slot it may not read."""
  from pallas_kernels.mosaic import dense_decode  # pylint: disable=g-import-not-at-top
  from pallas_kernels.sparse_decode import identity_lists  # pylint: disable=g-import-not-at-top
  b, hkv, g, d, bs, nb, dtype, splits, w = shape
  case = Case(b, hkv, g, d, bs, nb, 1, False, dtype, seed=seed, num_splits=splits)
  q, k, v, _, _, _, _ = case.arrays()
  rng = np.random.default_rng(seed)
  length = jnp.asarray(rng.choice([0, case.t, rng.integers(1, case.t)], b), jnp.int32)
  if with_pos:
    pos, k_bad, v_bad = poisoned(case, k, v, length, seed)
  else:
    bad = (jnp.arange(case.t)[None, None] >= length[:, None, None])[..., None]
    pos, k_bad, v_bad = None, jnp.where(bad, jnp.inf, k), jnp.where(bad, jnp.nan, v)
  gpu_callbacks.reset_gpu_interpret_mode_state()
  out, lse = jax.block_until_ready(dense_decode(
      q, k_bad, v_bad, length, block_size=bs, impl="mosaic", interpret=PARAMS, pos=pos,
      num_splits=splits, tokens_per_step=w))
  assert not gpu_callbacks.get_races().races_found
  idx, nv = identity_lists(b, hkv, nb, length, bs)
  ref = reference(q, k, v, idx, nv, length, block_size=bs, pos=pos)
  assert_attention_close(out, lse, *ref, dtype)


def test_dense_identity_mode_refusals():
  from pallas_kernels.mosaic.sparse_decode import decode_partials as dp  # pylint: disable=g-import-not-at-top
  case = Case(1, 1, 2, 64, 16, 8, 6, False, jnp.bfloat16, seed=0, num_splits=1)
  q, k, v, idx, n_valid, length, _ = case.arrays()
  with pytest.raises(ValueError, match="identity mode"):
    dp(q.reshape(1, 1, 2, 64), k, v, None, None, length, row_bits=idx, block_size=16,
       scale=0.125, num_splits=1, num_stages=3, softcap=None, interpret=PARAMS)
