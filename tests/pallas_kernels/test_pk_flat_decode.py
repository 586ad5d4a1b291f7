"""flat_decode: decoding over one buffer every kv head shares (Ada-KV's flat layout). The kernel
(interpret mode) equals the reference on random owners, holes, padding rows, soft-caps and split
counts, with up to 32 query heads in one bit word and more in two, and under jit and vmap; the
reference equals a per-head numpy softmax over each head's own slots and the compression
layout's jnp form; it lowers for CUDA without the ``[B, N, T]`` logits, and with the ``ptx``
extra compiles for sm_90 without spills."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import flat_decode, flat_decode_reference
from pallas_kernels.flat_decode import owner_bits_table
from pallas_kernels.shapes import BF16, I32, S
from sparse_attn.compression import flat as flat_lib
from pk_testutil import F32, assert_attention_close

# (batch, kv heads, group, head dim, slots, dtype, splits): N = 6, 40 (two bit words), 32 (bit 31
# in use), 9; split counts heuristic, given, one.
POOL = [
    (2, 2, 3, 64, 320, F32, None),
    (1, 2, 20, 32, 96, BF16, 2),
    (2, 8, 4, 128, 512, BF16, 3),
    (2, 3, 3, 64, 256, F32, 1),
]


def _problem(shape, seed, holes: bool):
  b, k, g, d, t, dtype, _ = shape
  rng = np.random.default_rng(seed)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  head = rng.integers(0, k, (b, t))
  pos = np.broadcast_to(np.arange(t), (b, t)).copy()
  if holes:  # a compacted buffer's empty slots, owner 0 (as flat.from_heads leaves them)
    empty = rng.random((b, t)) < 0.2
    pos[empty], head[empty] = -1, 0
  length = rng.integers(0, t + 1, (b,))
  length[0] = rng.choice([t, t - 3])
  query_pos = np.where(np.arange(b) == b - 1, -1, t) if b > 1 else np.full((1,), t)
  return (normal(b, k * g, d), normal(b, t, d), normal(b, t, d),
          jnp.asarray(head, flat_lib.head_dtype(k)), jnp.asarray(length, jnp.int32),
          jnp.asarray(pos, jnp.int32), jnp.asarray(query_pos, jnp.int32))


@settings(max_examples=10, deadline=None)
@given(shape=st.sampled_from(POOL), seed=st.integers(0, 2**31 - 1), holes=st.booleans(),
       softcap=st.sampled_from((None, 5.0)))
def test_kernel_equals_reference(shape, seed, holes, softcap):
  q, k, v, head, length, pos, query_pos = _problem(shape, seed, holes)
  kw = dict(num_kv_heads=shape[1], pos=pos, softcap=softcap, query_pos=query_pos)
  out, lse = flat_decode(q, k, v, head, length, num_splits=shape[-1], impl="pallas",
                         interpret=True, **kw)
  want_out, want_lse = flat_decode_reference(q, k, v, head, length, **kw)
  assert_attention_close(out, lse, want_out, want_lse, shape[5])
  if shape[0] > 1:  # the padding row
    assert np.all(np.isneginf(np.asarray(lse[-1]))) and not np.asarray(out[-1], F32).any()


def test_kernel_under_vmap_equals_the_reference():
  """A leading axis vmapped over the kernel (a batch of layers' buffers, say)."""
  shape = POOL[0]
  probs = [_problem(shape, s, holes=True) for s in range(3)]
  stacked = [jnp.stack(x) for x in zip(*probs)]
  kw = dict(num_kv_heads=shape[1])
  run = lambda q, k, v, h, n, p, qp: flat_decode(q, k, v, h, n, pos=p, query_pos=qp,
                                                  impl="pallas", interpret=True, **kw)
  out, lse = jax.jit(jax.vmap(run))(*stacked)
  for i, prob in enumerate(probs):
    q, k, v, head, length, pos, query_pos = prob
    want = flat_decode_reference(q, k, v, head, length, pos=pos, query_pos=query_pos, **kw)
    assert_attention_close(out[i], lse[i], *want, F32)


@pytest.mark.parametrize("holes", [False, True])
def test_reference_is_each_heads_softmax_over_its_own_slots(holes):
  shape = POOL[0]
  q, k, v, head, length, pos, query_pos = _problem(shape, 7, holes)
  out, lse = flat_decode_reference(q, k, v, head, length, num_kv_heads=2, pos=pos,
                                   query_pos=query_pos, scale=0.3)
  g = shape[2]
  for bi in range(shape[0]):
    for n in range(q.shape[1]):
      slots = [s for s in range(int(length[bi])) if head[bi, s] == n // g and pos[bi, s] >= 0]
      if query_pos[bi] < 0 or not slots:
        assert np.isneginf(lse[bi, n]) and not np.asarray(out[bi, n]).any()
        continue
      logits = 0.3 * np.asarray(k[bi, slots], np.float64) @ np.asarray(q[bi, n], np.float64)
      m = logits.max()
      w = np.exp(logits - m)
      np.testing.assert_allclose(lse[bi, n], m + np.log(w.sum()), atol=1e-5)
      np.testing.assert_allclose(out[bi, n], w @ np.asarray(v[bi, slots]) / w.sum(), atol=1e-5)
  # the compression layout's jnp form (every slot at or before the query)
  cache = flat_lib.FlatKVCache(k=k, v=v, pos=pos, head=head, length=length, num_kv_heads=2)
  at = jnp.where(query_pos >= 0, shape[4], -1)[:, None]
  f_out, f_lse = flat_lib.attend(q[:, :, None], cache, at, 0.3)
  assert_attention_close(out, lse, f_out[:, :, 0], f_lse[:, :, 0], F32)


@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (40, 2), (9, 3), (64, 8), (8, 8)])
def test_owner_bits_mark_each_query_head_once_in_its_owner_row(heads, kv_heads):
  table = owner_bits_table(heads, kv_heads).view(np.uint32)  # [K, A]
  assert table.shape == (kv_heads, -(-heads // 32))
  for n in range(heads):
    has = [(int(table[h, n // 32]) >> (n % 32)) & 1 for h in range(kv_heads)]
    assert has == [int(h == n // (heads // kv_heads)) for h in range(kv_heads)], n
  used = sum(bin(int(x)).count("1") for x in table.ravel())
  assert used == heads  # no bit past the last query head


def _avals(n, k, t):
  return (S((1, n, 128), BF16), S((1, t, 128), BF16), S((1, t, 128), BF16), S((1, t), jnp.int8),
          S((1,), I32), S((1, t), I32))


def _step(q, k, v, head, length, pos, *, num_kv_heads, **kw):
  return flat_decode(q, k, v, head, length, num_kv_heads=num_kv_heads, pos=pos,
                     query_pos=length, impl="pallas", **kw)


# Llama-3.1-8B's 32 query / 8 kv heads at 32k kept at 0.5 with decode room; 64 / 8 heads (8 warps).
SHAPES = [(32, 8, 131072 + 64), (64, 8, 65536)]


def test_lowers_for_cuda_without_the_logits():
  """The kernel and its split combine; no op the size of every head's logits ([1, 32, T])."""
  n, k, t = SHAPES[0]
  text = jax.export.export(
      jax.jit(functools.partial(_step, num_kv_heads=k)), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
          *_avals(n, k, t)).mlir_module()
  assert text.count("__gpu$xla.gpu.triton") == 2
  assert f"{n}x{t}" not in text


@pytest.mark.parametrize("n,k,t", SHAPES)
def test_compiles_for_sm90_without_spills(n, k, t, tmp_path):
  pytest.importorskip("triton")
  from pallas_kernels import ptx  # pylint: disable=g-import-not-at-top
  reps = ptx.report(functools.partial(_step, num_kv_heads=k), *_avals(n, k, t),
                    workdir=str(tmp_path))
  assert [r.name for r in reps] == ["sparse_decode", "split_combine"]
  for rep in reps:
    assert rep.spill_bytes == 0 and rep.shared_bytes <= ptx.H100_SMEM_PER_BLOCK, str(rep)
    if rep.name == "sparse_decode":
      assert rep.ring_depth >= 2 and rep.stages_in_flight >= 2, str(rep)
