"""The decode step's cache write in one kernel (``pallas_kernels.cache_append``): interpret mode
equals its reference and ``sparse_attn.cache.write`` bit for bit (appends, overwrites below the
length, padding rows, empty slots in the touched block), it lowers for CUDA in place, and (with
the ``ptx`` extra) compiles for sm_90 without register spills."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import cache_append, cache_append_reference
from pallas_kernels.shapes import BF16, I32, S
from sparse_attn import cache as cache_lib


def _cache(rng, b, h, t, d, bs, dtype, filled, holes, stale=0):
  c = cache_lib.init_cache(b, h, t, d, bs, dtype, ("box",))
  if filled:
    k, v = (jnp.asarray(rng.standard_normal((b, h, filled, d)), dtype) for _ in range(2))
    slots = jnp.broadcast_to(jnp.arange(filled, dtype=jnp.int32), (b, filled))
    c = cache_lib.write(c, k, v, slots)
  if holes:  # compaction leaves empty slots below the length (its digests follow)
    c = cache_lib.replace_storage(c, c.k, c.v, c.pos.at[:, :, np.asarray(holes)].set(-1),
                                  c.length)
  if stale:  # rows past the length that still hold a position: not part of any digest
    c = cache_lib.replace_storage(c, c.k, c.v, c.pos, c.length - stale)
  return c


@settings(deadline=None, max_examples=6)  # each example compiles three programs (~2 s)
@given(b=st.integers(1, 3), h=st.integers(1, 3), nb=st.integers(1, 6),
       bs=st.sampled_from((16, 32)), d=st.sampled_from((16, 48, 64)),
       dtype=st.sampled_from((jnp.float32, jnp.bfloat16)), data=st.data(),
       seed=st.integers(0, 2**16))
def test_interpret_equals_the_reference_and_the_cache_write(b, h, nb, bs, d, dtype, data, seed):
  rng = np.random.default_rng(seed)
  t = nb * bs
  filled = data.draw(st.integers(0, t - 1))
  holes = data.draw(st.lists(st.integers(0, max(filled - 1, 0)), max_size=3)) if filled else []
  stale = data.draw(st.integers(0, min(filled, 3)))
  c = _cache(rng, b, h, t, d, bs, dtype, filled, holes, stale)
  # append at the length, overwrite below it, or a padding row (-1)
  slot = jnp.asarray(data.draw(st.lists(st.integers(-1, filled - stale), min_size=b,
                                        max_size=b)), jnp.int32)
  k_new, v_new = (jnp.asarray(rng.standard_normal((b, h, 1, d)), dtype) for _ in range(2))
  want = cache_lib.write(c, k_new, v_new, slot[:, None])
  got_write = cache_lib.write(c, k_new, v_new, slot[:, None], impl="pallas", interpret=True)
  token_pos = jnp.broadcast_to(slot[:, None], (b, h))
  args = (c.k, c.v, c.pos, c.kmin, c.kmax, k_new[:, :, 0], v_new[:, :, 0], slot, token_pos,
          want.length)
  ref = cache_append_reference(*args, block_size=bs)
  got = cache_append(*args, block_size=bs, impl="pallas", interpret=True)
  for name, w, r, g, gw in zip(("k", "v", "pos", "kmin", "kmax"),
                               (want.k, want.v, want.pos, want.kmin, want.kmax), ref, got,
                               (got_write.k, got_write.v, got_write.pos, got_write.kmin,
                                got_write.kmax)):
    for x in (r, g, gw):
      np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(w, np.float32), name)
  np.testing.assert_array_equal(got_write.length, want.length)


def test_other_writes_keep_the_xla_path():
  """Several tokens, or digests beyond the box, are written by ``cache.write``'s own path."""
  c = cache_lib.init_cache(1, 2, 64, 16, 16, jnp.float32)  # every digest kind
  k = jnp.ones((1, 2, 1, 16))
  want = cache_lib.write(c, k, k, jnp.zeros((1, 1), jnp.int32))
  got = cache_lib.write(c, k, k, jnp.zeros((1, 1), jnp.int32), impl="pallas", interpret=True)
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(w, g)
  text = jax.jit(functools.partial(cache_lib.write, impl="pallas")).lower(
      c, k, k, jnp.zeros((1, 1), jnp.int32)).as_text()
  assert "cache_append" not in text


def _avals(t=8256, d=128, nb=516):
  cache = S((1, 8, t, d), BF16)
  return (cache, cache, S((1, 8, t), I32), S((1, 8, nb, d), BF16), S((1, 8, nb, d), BF16),
          S((1, 8, d), BF16), S((1, 8, d), BF16), S((1,), I32), S((1, 8), I32), S((1,), I32))


def test_lowers_for_cuda_in_place():
  fn = jax.jit(functools.partial(cache_append, block_size=16, impl="pallas"),
               donate_argnums=(0, 1, 2, 3, 4))
  text = jax.export.export(
      fn, platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
          *_avals()).mlir_module()
  assert "__gpu$xla.gpu.triton" in text
  assert text.count("tf.aliasing_output") == 5  # k, v, pos, kmin, kmax written in place


def test_compiles_for_sm90_without_spills(tmp_path):
  pytest.importorskip("triton")
  from pallas_kernels import ptx  # pylint: disable=g-import-not-at-top
  [mod] = ptx.triton_modules(functools.partial(cache_append, block_size=16, impl="pallas"),
                             *_avals())
  kernel = ptx.compile_sm90(mod, str(tmp_path))
  usage = ptx.register_usage(kernel, str(tmp_path))
  assert usage["spill_bytes"] == 0 and usage["registers"] <= 255, usage
