"""chunk_attention: Pallas (interpret mode) == jnp reference (tiled, the XLA path) == masked dense
attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import chunk_attention, chunk_attention_reference
from pallas_kernels.chunk_attention import default_key_splits, visible_tiles
from sparse_attn import kernels, methods, reference as dense
from sparse_attn.cache import write
from pk_testutil import assert_attention_close

F32, BF16 = jnp.float32, jnp.bfloat16
# (batch, kv heads, G, queries, D, slots, key_tile, window, dtype): G in {1, 3, 4, 7}, D 64 /
# 80 (padded) / 96 / 128, windows, chunks longer and shorter than a query tile.
POOL = [
    (2, 2, 3, 20, 64, 96, 16, None, F32),
    (1, 1, 4, 33, 80, 64, 32, 7, F32),
    (2, 2, 7, 5, 96, 160, 16, None, BF16),
    (1, 2, 1, 70, 128, 128, 64, None, BF16),
    (1, 1, 2, 1, 64, 48, 16, 5, F32),
]


def random_problem(shape, seed, compacted):
  """q, k, v, query positions (some padding), slot positions, lengths."""
  b, kh, g, s, d, t, _, _, dtype = shape
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, kh * g, s, d)), dtype)
  k = jnp.asarray(rng.standard_normal((b, kh, t, d)), dtype)
  v = jnp.asarray(rng.standard_normal((b, kh, t, d)), dtype)
  length = rng.integers(0, t + 1, b)
  length[0] = rng.choice([0, t, length[0]])
  if compacted:  # any slot order, holes (-1) below length
    k_pos = np.where(rng.random((b, kh, t)) < 0.2, -1, rng.integers(0, t, (b, kh, t)))
  else:  # slot = position, as a prefill writes them
    k_pos = np.broadcast_to(np.arange(t), (b, kh, t))
  start = rng.integers(0, t)
  q_pos = np.where(rng.random((b, s)) < 0.1, -1, np.minimum(start + np.arange(s), t - 1))
  return (q, k, v, jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32),
          jnp.asarray(length, jnp.int32))


@settings(max_examples=12, deadline=None)
@given(shape=st.sampled_from(POOL), seed=st.integers(0, 2**31 - 1), compacted=st.booleans(),
       key_splits=st.sampled_from([None, 1, 3]))
def test_kernel_matches_reference(shape, seed, compacted, key_splits):
  # None: the default split of a small grid (every POOL grid is small: up to its key tiles)
  q, k, v, q_pos, k_pos, length = random_problem(shape, seed, compacted)
  key_tile, window, dtype = shape[6:]
  out, lse = chunk_attention(q, k, v, q_pos, k_pos, length, window=window, key_tile=key_tile,
                             key_splits=key_splits, impl="pallas", interpret=True)
  assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3]
  ref_out, ref_lse = chunk_attention_reference(q, k, v, q_pos, k_pos, length, window=window)
  assert_attention_close(out, lse, ref_out, ref_lse, dtype)


@settings(max_examples=8, deadline=None)
@given(shape=st.sampled_from(POOL), seed=st.integers(0, 2**31 - 1),
       tiles=st.sampled_from([(None, 128), (256, 128), (16, 8), (32, 3)]))
def test_reference_equals_dense_attention(shape, seed, tiles):
  """The reference, tiled or not, is sparse_attn's masked attention with the position rule
  spelled out."""
  q, k, v, q_pos, k_pos, length = random_problem(shape, seed, compacted=True)
  g, window, dtype = shape[2], shape[7], shape[8]
  out, lse = chunk_attention_reference(q, k, v, q_pos, k_pos, length, window=window,
                                       key_tile=tiles[0], query_tile=tiles[1])
  mask = None
  if window is not None:
    mask = jnp.repeat(k_pos[:, :, None, :] > q_pos[:, None, :, None] - window, g, axis=1)
  never = jnp.iinfo(jnp.int32).max
  d_out, d_lse = dense.attention(q, k, v, mask, kv_length=length, q_positions=q_pos,
                                 k_positions=jnp.where(k_pos >= 0, k_pos, never))
  assert_attention_close(out, lse, d_out, d_lse, dtype)


def test_visible_tiles_stops_after_the_last_tile_a_query_sees():
  # 4 tiles of 16 slots holding positions 0..63; queries at 20..35 see tiles 0-2.
  k_pos = jnp.arange(64, dtype=jnp.int32)[None, None]
  q_pos = jnp.arange(20, 36, dtype=jnp.int32)[None]
  tiles = visible_tiles(q_pos, k_pos, jnp.asarray([64]), query_tile=8, key_tile=16)
  np.testing.assert_array_equal(tiles, [[[2, 3]]])
  # a filled length of 40 ends the second query tile's visit in tile 2 as well; length 16: tile 0
  tiles = visible_tiles(q_pos, k_pos, jnp.asarray([16]), query_tile=8, key_tile=16)
  np.testing.assert_array_equal(tiles, [[[1, 1]]])
  # compacted: position 3 sits in the last slot, so a query at 5 must visit every tile
  k_pos = k_pos.at[0, 0, 63].set(3)
  tiles = visible_tiles(jnp.asarray([[5]]), k_pos, jnp.asarray([64]), query_tile=1, key_tile=16)
  np.testing.assert_array_equal(tiles, [[[4]]])


@pytest.mark.parametrize("window", [None, 24])
def test_equals_the_xla_path_on_a_prefilled_cache(window):
  """The kernel and the XLA path agree on a cache written chunk by chunk (a prefill)."""
  b, kh, g, d, t = 2, 2, 3, 64, 128
  rng = np.random.default_rng(3)
  cache = methods.make("dense").init_cache(b, kh, t, d, jnp.float32)
  kv = jnp.asarray(rng.standard_normal((b, kh, 100, d)), jnp.float32)
  cache = write(cache, kv, kv * 0.5, jnp.broadcast_to(jnp.arange(100, dtype=jnp.int32), (b, 100)))
  q = jnp.asarray(rng.standard_normal((b, kh * g, 36, d)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(64, 100, dtype=jnp.int32), (b, 36)).at[1, 30:].set(-1)
  ref = kernels.dense_attention(q, cache, pos, window=window, impl="xla")
  out = chunk_attention(q, cache.k, cache.v, pos, cache.pos, cache.length, window=window,
                        impl="pallas", interpret=True)
  assert_attention_close(*out, *ref, jnp.float32)


def test_bad_tiles_raise():
  q = jnp.zeros((1, 2, 4, 16))
  kv = jnp.zeros((1, 1, 32, 16))
  args = (q, kv, kv, jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 1, 32), jnp.int32),
          jnp.zeros((1,), jnp.int32))
  with pytest.raises(ValueError, match="key_tile"):
    chunk_attention(*args, key_tile=24, impl="pallas", interpret=True)
  with pytest.raises(ValueError, match="query_tile"):
    chunk_attention(*args, query_tile=3, impl="pallas", interpret=True)
  with pytest.raises(ValueError, match="multiple"):
    chunk_attention(q[:, :1].repeat(3, 1), jnp.zeros((1, 2, 32, 16)), jnp.zeros((1, 2, 32, 16)),
                    *args[3:4], jnp.zeros((1, 2, 32), jnp.int32), args[5])


def test_jit_and_vmap_over_batch():
  shape = POOL[0]
  q, k, v, q_pos, k_pos, length = random_problem(shape, 5, compacted=True)
  run = lambda *a: chunk_attention(*a, key_tile=16, impl="pallas", interpret=True)
  plain = run(q, k, v, q_pos, k_pos, length)
  one = lambda *a: jax.tree.map(lambda x: x[0], run(*(x[None] for x in a)))
  mapped = jax.vmap(one)(q, k, v, q_pos, k_pos, length)
  jitted = jax.jit(run)(q, k, v, q_pos, k_pos, length)
  for got in (mapped, jitted):
    assert_attention_close(*got, *plain, jnp.float32)


def test_default_key_splits_fill_a_small_grid_only():
  assert default_key_splits(8, 2048) == 32  # a Llama-8B decode step: 8 programs
  assert default_key_splits(8, 4) == 4  # never more splits than key tiles
  assert default_key_splits(64, 2048) == 4
  assert default_key_splits(512, 2048) == 1  # a prefill chunk's grid is already full


def in_order_problem(shape, seed, start_at_zero):
  """A chunk meeting an in-order cache: queries at start + i (some padding), slot j holds
  position j, lengths anywhere in [0, T] (below, inside or past the chunk)."""
  b, kh, g, s, d, t, _, _, dtype = shape
  rng = np.random.default_rng(seed)
  q, k, v, _, _, _ = random_problem(shape, seed, compacted=False)
  start = 0 if start_at_zero else int(rng.integers(0, t - s + 1))
  q_pos = np.where(rng.random((b, s)) < 0.15, -1, start + np.arange(s))
  length = rng.integers(0, t + 1, b)
  length[-1] = start + s  # a prefill: the chunk's own keys just written
  k_pos = np.broadcast_to(np.arange(t), (b, kh, t))
  return (q, k, v, jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32),
          jnp.asarray(length, jnp.int32))


@settings(max_examples=5, deadline=None)
@given(shape=st.sampled_from([POOL[0], POOL[2]]),
       seed=st.integers(0, 2**31 - 1), case=st.sampled_from(["zero", "offset", "compacted"]))
def test_in_order_path_matches_reference(shape, seed, case):
  """The Pallas path's in-order branch (two dot_product_attention calls merged, taken when the
  traced state is in order) and its kernel branch (anything else) both equal the reference."""
  from pallas_kernels import prompt_attention  # pylint: disable=g-import-not-at-top
  if case == "compacted":
    q, k, v, q_pos, k_pos, length = random_problem(shape, seed, compacted=True)
  else:
    q, k, v, q_pos, k_pos, length = in_order_problem(shape, seed, case == "zero")
    ok, start = prompt_attention.in_order_start(q_pos, k_pos, length, k.shape[2])
    assert bool(ok) == bool(jnp.any(q_pos >= 0))
    out, lse = prompt_attention.in_order_attention(q, k, v, q_pos, length, start,
                                                   implementation="xla")
    ref = chunk_attention_reference(q, k, v, q_pos, k_pos, length)
    if bool(ok):
      assert_attention_close(out, lse, *ref, shape[8])
  out, lse = chunk_attention(q, k, v, q_pos, k_pos, length, key_tile=shape[6], impl="pallas",
                             interpret=True, in_order="xla")
  assert out.dtype == q.dtype
  assert_attention_close(out, lse, *chunk_attention_reference(q, k, v, q_pos, k_pos, length),
                         shape[8])


def test_in_order_start_rejects_what_the_two_calls_cannot_state():
  from pallas_kernels import prompt_attention  # pylint: disable=g-import-not-at-top
  t = 16
  ordered = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, 1, t))
  pos = jnp.broadcast_to(jnp.arange(4, 8, dtype=jnp.int32), (2, 4))
  full = jnp.full((2,), 8, jnp.int32)
  check = lambda qp, kp, ln: tuple(map(int, prompt_attention.in_order_start(qp, kp, ln, t)))
  assert check(pos, ordered, full) == (1, 4)
  assert check(pos.at[1, 2:].set(-1), ordered, full) == (1, 4)  # padding anywhere
  assert check(pos.at[1].add(1), ordered, full)[0] == 0  # rows at different starts
  assert check(pos.at[0, 1].set(4), ordered, full)[0] == 0  # a repeated position
  assert check(jnp.full((2, 4), -1, jnp.int32), ordered, full)[0] == 0  # nothing to attend
  assert check(pos + 9, ordered, full)[0] == 0  # the chunk would run past the cache
  holes = ordered.at[1, 0, 3].set(-1)
  assert check(pos, holes, full)[0] == 0  # a hole below the length (compaction)
  assert check(pos, holes, jnp.array([8, 3], jnp.int32))[0] == 1  # ... past it: never read


def test_in_order_implementation_auto_is_cudnn_on_a_gpu_only():
  from pallas_kernels.chunk_attention import in_order_implementation  # pylint: disable=g-import-not-at-top
  on_gpu = jax.default_backend() == "gpu"
  assert in_order_implementation("auto", BF16, 4096, 128, None) == ("cudnn" if on_gpu else None)
  assert in_order_implementation("auto", F32, 4096, 128, None) is None  # cuDNN: 16-bit only
  assert in_order_implementation("auto", BF16, 32, 128, None) is None  # short: the kernel
  assert in_order_implementation("xla", F32, 1, 64, None) == "xla"
  assert in_order_implementation("cudnn", BF16, 4096, 128, 512) is None  # a window: the kernel
  assert in_order_implementation(None, BF16, 4096, 128, None) is None
  with pytest.raises(ValueError, match="in_order"):
    in_order_implementation("fast", BF16, 4096, 128, None)


@pytest.mark.parametrize("shape,compacted", [(POOL[1], True), (POOL[2], False)])
def test_softcap_kernel_reference_and_dense_agree(shape, compacted):
  """Gemma 2's soft-cap: the kernel (interpret mode) == the tiled reference == dense attention
  with the cap, and it changes the result (logits scaled up past the cap)."""
  q, k, v, q_pos, k_pos, length = random_problem(shape, 7, compacted)
  q, length = q * 4, length.at[0].set(k.shape[2])
  g, key_tile, window, dtype = shape[2], shape[6], shape[7], shape[8]
  cap = 4.0
  out, lse = chunk_attention(q, k, v, q_pos, k_pos, length, window=window, key_tile=key_tile,
                             impl="pallas", interpret=True, softcap=cap)
  ref_out, ref_lse = chunk_attention_reference(q, k, v, q_pos, k_pos, length, window=window,
                                               softcap=cap, key_tile=16, query_tile=8)
  assert_attention_close(out, lse, ref_out, ref_lse, dtype)
  mask = None
  if window is not None:
    mask = jnp.repeat(k_pos[:, :, None, :] > q_pos[:, None, :, None] - window, g, axis=1)
  never = jnp.iinfo(jnp.int32).max
  d_out, d_lse = dense.attention(q, k, v, mask, kv_length=length, q_positions=q_pos,
                                 k_positions=jnp.where(k_pos >= 0, k_pos, never), softcap=cap)
  assert_attention_close(ref_out, ref_lse, d_out, d_lse, dtype)
  plain = chunk_attention_reference(q, k, v, q_pos, k_pos, length, window=window)[1]
  finite = np.isfinite(np.asarray(ref_lse))
  assert np.abs(np.asarray(plain)[finite] - np.asarray(ref_lse)[finite]).max() > 0.1
