"""The decode step's cache write in one kernel (``pallas_kernels.cache_append``): interpret mode
equals its reference and ``sparse_attn.cache.write`` bit for bit (appends, overwrites below the
length, padding rows, empty slots in the touched block; one token or a window of several a
row; positions shared by the kv heads or per head; the length advanced from the one before
the write), it lowers for CUDA in place with no XLA op around it, and (with the ``ptx`` extra)
compiles for sm_90 without register spills."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import cache_append, cache_append_reference
from pallas_kernels.cache_append import MAX_TOKENS
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


NAMES = ("k", "v", "pos", "kmin", "kmax", "length")


def _kernel_path(data, c, k_new, v_new, slots, block_size):
  """One of the kernel's entry points, drawn per example (each costs a compilation):
  ``cache.write(impl="pallas")`` (positions shared by the kv heads, as a decode step passes
  them), or ``cache_append`` itself with shared or per-head positions (one token a row:
  ``k_new [B, K, D]`` and ``slots [B]``, the decode step's form). Returns the reference's and
  the kernel's ``(k, v, pos, kmin, kmax, length)``; ``k_new [B, K, n, D]``, ``slots [B, n]``."""
  entry = data.draw(st.sampled_from(("cache.write", "shared", "per_head")), label="entry")
  if entry == "cache.write":
    ref = cache_append_reference(c.k, c.v, c.pos, c.kmin, c.kmax, k_new, v_new, slots, slots,
                                 c.length, block_size=block_size)
    wrote = cache_lib.write(c, k_new, v_new, slots, impl="pallas", interpret=True)
    return ref, tuple(getattr(wrote, name) for name in NAMES)
  if slots.shape[1] == 1:
    k_new, v_new, slots = k_new[:, :, 0], v_new[:, :, 0], slots[:, 0]
  per_head = jnp.broadcast_to(slots[:, None], (slots.shape[0], c.num_kv_heads) + slots.shape[1:])
  token_pos = per_head if entry == "per_head" else slots
  args = (c.k, c.v, c.pos, c.kmin, c.kmax, k_new, v_new, slots, token_pos, c.length)
  ref = cache_append_reference(*args, block_size=block_size)
  return ref, cache_append(*args, block_size=block_size, impl="pallas", interpret=True)


def _assert_same(want, ref, got):
  """The reference's and the kernel's ``(k, v, pos, kmin, kmax, length)`` equal
  ``cache.write``'s XLA result ``want`` bit for bit."""
  assert len(ref) == len(got) == len(NAMES)
  for name, r, g in zip(NAMES, ref, got):
    w = getattr(want, name)
    for x in (r, g):
      np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(w, np.float32), name)


@settings(deadline=None, max_examples=6)  # each example compiles two programs
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
  _assert_same(want, *_kernel_path(data, c, k_new, v_new, slot[:, None], bs))


@settings(deadline=None, max_examples=6)
@given(b=st.integers(1, 2), h=st.integers(1, 2), nb=st.integers(2, 5),
       bs=st.sampled_from((16, 32)), n=st.integers(2, 9),
       dtype=st.sampled_from((jnp.float32, jnp.bfloat16)), data=st.data(),
       seed=st.integers(0, 2**16))
def test_a_window_of_tokens_equals_the_cache_write(b, h, nb, bs, n, dtype, data, seed):
  """RetroAttention's step: ``n`` consecutive slots a row (rewritten below the length, the last
  appended; some rows padded with -1 entries), blocks shared by several of them, holes and
  stale rows in them: kernel == reference == ``cache.write``'s XLA path."""
  rng = np.random.default_rng(seed)
  t, d = nb * bs, 32
  filled = data.draw(st.integers(n, t - 1))
  holes = data.draw(st.lists(st.integers(0, filled - n), max_size=2))
  c = _cache(rng, b, h, t, d, bs, dtype, filled, holes, data.draw(st.integers(0, 2)))
  start = rng.integers(c.length.min() - n + 1, c.length.min() + 1, b)
  slots = np.stack([np.arange(x, x + n) for x in start]).astype(np.int32)
  slots[rng.random((b, n)) < 0.2] = -1
  slots = jnp.asarray(slots)
  k_new, v_new = (jnp.asarray(rng.standard_normal((b, h, n, d)), dtype) for _ in range(2))
  want = cache_lib.write(c, k_new, v_new, slots)
  _assert_same(want, *_kernel_path(data, c, k_new, v_new, slots, bs))


@pytest.mark.parametrize("window", (1, 3))
def test_the_length_advances_from_the_one_before_the_write(window):
  """Rows that append past the length, overwrite below it, or only pad: the new length is
  ``max(length, s + 1)`` over the written slots (the kernel's own, from the old length)."""
  rng = np.random.default_rng(window)
  c = _cache(rng, 3, 2, 64, 16, 16, jnp.float32, 40, [], 0)
  first = np.asarray([[40], [10], [-1]])  # append, overwrite, padding
  slots = jnp.asarray(first + np.arange(window), jnp.int32).at[2].set(-1)
  k_new = jnp.asarray(rng.standard_normal((3, 2, window, 16)), jnp.float32)
  got = cache_append(c.k, c.v, c.pos, c.kmin, c.kmax, k_new, k_new, slots, slots, c.length,
                     block_size=16, impl="pallas", interpret=True)
  np.testing.assert_array_equal(got[5], [40 + window, 40, 40])
  np.testing.assert_array_equal(got[5], cache_lib.write(c, k_new, k_new, slots).length)


def test_other_writes_keep_the_xla_path():
  """Digests beyond the box, or more than ``MAX_TOKENS`` tokens a row, are written by
  ``cache.write``'s own path."""
  c = cache_lib.init_cache(1, 2, 64, 16, 16, jnp.float32)  # every digest kind
  k = jnp.ones((1, 2, 1, 16))
  want = cache_lib.write(c, k, k, jnp.zeros((1, 1), jnp.int32))
  got = cache_lib.write(c, k, k, jnp.zeros((1, 1), jnp.int32), impl="pallas", interpret=True)
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(w, g)
  text = jax.jit(functools.partial(cache_lib.write, impl="pallas")).lower(
      c, k, k, jnp.zeros((1, 1), jnp.int32)).as_text()
  assert "cache_append" not in text
  box = cache_lib.init_cache(1, 2, 64, 16, 16, jnp.float32, ("box",))
  lower = lambda n: jax.export.export(
      jax.jit(functools.partial(cache_lib.write, impl="pallas")), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
          box, jnp.ones((1, 2, n, 16)), jnp.ones((1, 2, n, 16)),
          jnp.arange(n, dtype=jnp.int32)[None]).mlir_module()
  call = 'name = "cache_append"'
  assert call in lower(MAX_TOKENS) and call not in lower(MAX_TOKENS + 1)


def _avals(t=8256, d=128, nb=516, window=0):
  """The 8B shape's append arguments: one token, or a ``window`` of tokens a row."""
  cache = S((1, 8, t, d), BF16)
  w = (window,) if window else ()
  return (cache, cache, S((1, 8, t), I32), S((1, 8, nb, d), BF16), S((1, 8, nb, d), BF16),
          S((1, 8, *w, d), BF16), S((1, 8, *w, d), BF16), S((1, *w), I32), S((1, 8, *w), I32),
          S((1,), I32))


@pytest.mark.parametrize("window", (0, 8))
def test_lowers_for_cuda_in_place(window):
  fn = jax.jit(functools.partial(cache_append, block_size=16, impl="pallas"),
               donate_argnums=(0, 1, 2, 3, 4, 9))
  text = jax.export.export(
      fn, platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
          *_avals(window=window)).mlir_module()
  assert "__gpu$xla.gpu.triton" in text
  assert text.count("tf.aliasing_output") == 6  # k, v, pos, kmin, kmax, length in place


def test_after_operands_order_the_launch_without_ops():
  """``after`` arrays become operands of the launch (so their producers run first) and change
  nothing: the same result in interpret mode, no XLA op for them in the CUDA export."""
  rng = np.random.default_rng(3)
  c = _cache(rng, 2, 2, 64, 16, 16, jnp.float32, 30, [], 0)
  k_new = jnp.asarray(rng.standard_normal((2, 2, 16)), jnp.float32)
  slot = jnp.asarray([30, 4], jnp.int32)
  args = (c.k, c.v, c.pos, c.kmin, c.kmax, k_new, k_new, slot, slot, c.length)
  later = jnp.full((2, 2), jnp.nan)  # never read: even NaN changes nothing
  for impl in ("pallas", "xla"):
    got = cache_append(*args, block_size=16, impl=impl, interpret=True, after=(later,))
    for g, w in zip(got, cache_append(*args, block_size=16, impl=impl, interpret=True)):
      np.testing.assert_array_equal(g, w)
  fn = jax.jit(lambda *a, after: cache_append(*a, block_size=16, impl="pallas", after=after))
  text = jax.export.export(
      fn, platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
          *_avals(), after=(S((1, 8), jnp.float32),)).mlir_module()
  operands = re.search(r"custom_call @[\w$.]+\(([^)]*)\)", text).group(1).split(", ")
  assert operands[-1] == "%arg10" and len(operands) == 11
  assert not set(re.findall(r"stablehlo\.(\w+)\b(?!<)", text)) - {"custom_call",
                                                                   "broadcast_in_dim"}


def test_a_decode_write_is_the_launch_alone():
  """``cache.write`` of one token a row at the 8B shape, 128k, exported for CUDA: the launch
  and no XLA compute op beside it (the slot check, the length and the positions' broadcast
  are in the kernel), the length among the outputs written in place."""
  t, d = 131072, 128
  c = cache_lib.init_cache(1, 8, t, d, 16, jnp.bfloat16, ("box",))
  avals = jax.tree.map(lambda x: S(x.shape, x.dtype), c)
  row = S((1, 8, 1, d), BF16)
  fn = jax.jit(functools.partial(cache_lib.write, impl="pallas"), donate_argnums=0)
  text = jax.export.export(
      fn, platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
          avals, row, row, S((1, 1), I32)).mlir_module()
  ops = set(re.findall(r"stablehlo\.(\w+)\b(?!<)", text))
  assert ops <= {"custom_call", "constant", "broadcast_in_dim"}, ops  # the empty digest kinds
  assert re.search(r"tensor<1xi32> \{tf\.aliasing_output", text)  # the length, in place


@pytest.mark.parametrize("window", (0, 8))
def test_compiles_for_sm90_without_spills(window, tmp_path):
  pytest.importorskip("triton")
  from pallas_kernels import ptx  # pylint: disable=g-import-not-at-top
  [mod] = ptx.triton_modules(functools.partial(cache_append, block_size=16, impl="pallas"),
                             *_avals(window=window))
  kernel = ptx.compile_sm90(mod, str(tmp_path))
  usage = ptx.register_usage(kernel, str(tmp_path))
  assert usage["spill_bytes"] == 0 and usage["registers"] <= 255, usage
