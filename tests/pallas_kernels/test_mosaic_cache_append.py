"""Mosaic GPU cache_append == cache_append_reference (and ``sparse_attn.cache.write``) bit for bit
under Mosaic GPU's interpret mode (CPU: simulated SMEM, TMA and mbarriers, race detection on),
under vmap, and its lowering for CUDA: one ``mosaic_gpu_v2`` custom call writing the donated
cache and its length in place (jax.export)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

from pallas_kernels import cache_append, cache_append_reference
from pallas_kernels.shapes import BF16, I32, S
from sparse_attn import cache as cache_lib
from test_pk_cache_append import _cache

F32 = jnp.float32
# Fixed shapes (interpret-mode programs compile once each): batch, kv heads, blocks, block size,
# head dim, dtype. Block 16 (one partly filled 64-row tile), 64 (one tile), 128 (two tiles).
POOL = [
    (2, 2, 3, 16, 64, BF16),
    (1, 2, 2, 64, 32, F32),
    (1, 1, 2, 128, 64, BF16),
]
NAMES = ("k", "v", "pos", "kmin", "kmax", "length")


def run(*args, block_size):
  gpu_callbacks.reset_gpu_interpret_mode_state()
  got = jax.block_until_ready(
      cache_append(*args, block_size=block_size, impl="mosaic", interpret=True))
  assert not gpu_callbacks.get_races().races_found
  return got


def assert_equal(got, want):
  assert len(got) == len(want) == len(NAMES)
  for name, g, w in zip(NAMES, got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32), name)


@settings(deadline=None, max_examples=6)
@given(shape=st.sampled_from(POOL), data=st.data(), seed=st.integers(0, 2**16))
def test_matches_reference_and_cache_write(shape, data, seed):
  b, h, nb, bs, d, dtype = shape
  rng = np.random.default_rng(seed)
  t = nb * bs
  filled = data.draw(st.integers(0, t - 1))
  holes = data.draw(st.lists(st.integers(0, max(filled - 1, 0)), max_size=3)) if filled else []
  stale = data.draw(st.integers(0, min(filled, 3)))  # rows past the length with a position
  c = _cache(rng, b, h, t, d, bs, dtype, filled, holes, stale)
  n = filled - stale
  # append at the length, overwrite below it, or a padding row (-1, or past the capacity)
  slot = jnp.asarray(data.draw(st.lists(st.sampled_from((-1, t, n, n // 2)),
                                        min_size=b, max_size=b)), jnp.int32)
  k_new, v_new = (jnp.asarray(rng.standard_normal((b, h, 1, d)), dtype) for _ in range(2))
  # cache.write takes -1 for "no write" and stores the slot as the token position
  want = cache_lib.write(c, k_new, v_new, jnp.where(slot < t, slot, -1)[:, None])
  # positions shared by the kv heads ([B]) or per head ([B, K]); the length before the write
  token_pos = slot if data.draw(st.booleans()) else jnp.broadcast_to(slot[:, None], (b, h))
  args = (c.k, c.v, c.pos, c.kmin, c.kmax, k_new[:, :, 0], v_new[:, :, 0], slot, token_pos,
          c.length)
  got = run(*args, block_size=bs)
  assert_equal(got, cache_append_reference(*args, block_size=bs))
  assert_equal(got, tuple(getattr(want, name) for name in NAMES))
  # cache.write hands the kernel a token axis ([B, K, 1, D])
  gpu_callbacks.reset_gpu_interpret_mode_state()
  through = cache_lib.write(c, k_new, v_new, jnp.where(slot < t, slot, -1)[:, None],
                            impl="mosaic", interpret=True)
  assert_equal(tuple(getattr(through, name) for name in NAMES), got)


def test_the_length_advances_from_the_one_before_the_write():
  """Rows that append past the length or overwrite below it: ``max(length, s + 1)``."""
  b, h, nb, bs, d, dtype = POOL[0]
  rng = np.random.default_rng(2)
  c = _cache(rng, b, h, nb * bs, d, bs, dtype, 20, [], 0)
  slot = jnp.asarray([20, 7], jnp.int32)
  k_new = jnp.asarray(rng.standard_normal((b, h, d)), dtype)
  got = run(c.k, c.v, c.pos, c.kmin, c.kmax, k_new, k_new, slot, slot, c.length, block_size=bs)
  np.testing.assert_array_equal(got[5], [21, 20])


def test_after_operands_stay_in_the_call_and_change_nothing():
  """An ``after`` array is an operand of the one custom call (a Ref no program touched would be
  pruned) and leaves every output as it was (interpret mode, race detection on)."""
  b, h, nb, bs, d, dtype = POOL[0]
  rng = np.random.default_rng(4)
  c = _cache(rng, b, h, nb * bs, d, bs, dtype, 20, [], 0)
  slot = jnp.asarray([20, 7], jnp.int32)
  k_new = jnp.asarray(rng.standard_normal((b, h, d)), dtype)
  args = (c.k, c.v, c.pos, c.kmin, c.kmax, k_new, k_new, slot, slot, c.length)
  later = jnp.full((b, h), jnp.nan, jnp.float32)
  gpu_callbacks.reset_gpu_interpret_mode_state()
  got = jax.block_until_ready(cache_append(*args, block_size=bs, impl="mosaic", interpret=True,
                                           after=(later,)))
  assert not gpu_callbacks.get_races().races_found
  assert_equal(got, run(*args, block_size=bs))
  fn = jax.jit(lambda *a, after: cache_append(*a, block_size=bs, impl="mosaic", after=after))
  text = jax.export.export(fn, platforms=["cuda"])(
      *(S(x.shape, x.dtype) for x in args), after=(S((b, h), jnp.float32),)).mlir_module()
  operands = re.search(r"custom_call @mosaic_gpu_v2\(([^)]*)\)", text).group(1).split(", ")
  assert len(operands) == 11 and "%arg10" in operands


def test_a_window_takes_the_reference():
  """The Mosaic twin writes one token a row; a window of several (RetroAttention) through
  ``impl="mosaic"`` is ``cache.write``'s XLA result."""
  b, h, nb, bs, d, dtype = POOL[0]
  rng = np.random.default_rng(1)
  c = _cache(rng, b, h, nb * bs, d, bs, dtype, 20, [3])
  slots = jnp.asarray([[18, 19, 20], [19, 20, -1]], jnp.int32)
  k_new, v_new = (jnp.asarray(rng.standard_normal((b, h, 3, d)), dtype) for _ in range(2))
  want = cache_lib.write(c, k_new, v_new, slots)
  got = cache_lib.write(c, k_new, v_new, slots, impl="mosaic", interpret=True)
  assert_equal(tuple(getattr(got, name) for name in NAMES),
               tuple(getattr(want, name) for name in NAMES))


def test_vmap_folds_into_the_batch():
  """A vmapped axis (the cache and the rows batched, one input not) runs as a larger batch."""
  b, h, nb, bs, d, dtype = POOL[0]
  rng = np.random.default_rng(0)
  t, n = nb * bs, 2
  caches = [_cache(rng, b, h, t, d, bs, dtype, f, [1]) for f in (20, 40)]
  stack = lambda name: jnp.stack([getattr(c, name) for c in caches])
  k_new = jnp.asarray(rng.standard_normal((n, b, h, d)), dtype)
  v_new = jnp.asarray(rng.standard_normal((b, h, d)), dtype)  # shared: not batched
  slot = jnp.asarray([[20, 3], [47, -1]], jnp.int32)
  tok = jnp.asarray(rng.integers(0, 100, (n, b, h)), jnp.int32)
  args = (*map(stack, NAMES[:5]), k_new, v_new, slot, tok, stack("length"))
  axes = (0,) * 6 + (None, 0, 0, 0)
  gpu_callbacks.reset_gpu_interpret_mode_state()
  got = jax.vmap(functools.partial(cache_append, block_size=bs, impl="mosaic", interpret=True),
                 in_axes=axes)(*args)
  assert not gpu_callbacks.get_races().races_found
  assert_equal(got, jax.vmap(functools.partial(cache_append_reference, block_size=bs),
                             in_axes=axes)(*args))


@pytest.mark.parametrize("dtype,bs", [(BF16, 16), (F32, 128)])
def test_lowers_for_cuda_in_place(dtype, bs):
  """Llama-3.1-8B kv heads at 32k: the whole program is one ``mosaic_gpu_v2`` custom call whose
  six written outputs alias the donated cache and length (no copy of it, no other op)."""
  b, h, t, d = 1, 8, 32768, 128
  cache, dig, row = S((b, h, t, d), dtype), S((b, h, t // bs, d), dtype), S((b, h, d), dtype)
  fn = jax.jit(functools.partial(cache_append, block_size=bs, impl="mosaic"),
               donate_argnums=(0, 1, 2, 3, 4, 9))
  text = jax.export.export(fn, platforms=["cuda"])(
      cache, cache, S((b, h, t), I32), dig, dig, row, row, S((b,), I32), S((b, h), I32),
      S((b,), I32)).mlir_module()
  assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {"mosaic_gpu_v2"}
  assert set(re.findall(r"stablehlo\.(\w+)\b(?!<)", text)) == {"custom_call"}
  assert text.count("tf.aliasing_output") == 6
  # The six written outputs alias the five cache operands and the length (the interpret-mode
  # tests, which run the same discharge, check which output is which).
  operands = re.search(r"custom_call @mosaic_gpu_v2\(([^)]*)\)", text).group(1).split(", ")
  aliased = re.findall(r"output_tuple_indices = \[\d+\], operand_index = (\d+)", text)
  assert sorted(operands[int(i)] for i in aliased) == [f"%arg{i}" for i in (0, 1, 2, 3, 4, 9)]
