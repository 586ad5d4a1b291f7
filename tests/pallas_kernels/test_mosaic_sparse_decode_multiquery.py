"""Mosaic GPU sparse_decode_multiquery == sparse_decode_multiquery_reference under Mosaic GPU's
interpret mode (CPU: simulated SMEM, TMA and mbarriers, race detection on), the dispatch of
``impl="mosaic"``, and its lowering for CUDA (jax.export)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

from pallas_kernels import backends, sparse_decode_multiquery_reference, shapes
from pallas_kernels import sparse_decode_multiquery as dispatched
from pallas_kernels.mosaic import sparse_decode_multiquery
from pk_testutil import Case, assert_attention_close
from test_mosaic_sparse_decode import FIELDS
from test_pk_sparse_decode_multiquery import carried, window_inputs

reference = jax.jit(sparse_decode_multiquery_reference,
                    static_argnames=("block_size", "softcap", "count_attended"))
# Fixed shapes (FIELDS + window W): G 1-3, W 2-32, bs 16/32/64, f32 and bf16, both list layouts,
# 1-3 splits. The last one has 3 x 32 rows: two launches (2 heads, 1 head; at most 64 rows) and
# per-head words with bit 31 set.
POOL = [
    (1, 1, 2, 64, 16, 8, 6, False, jnp.float32, 2, 3),
    (2, 1, 3, 64, 32, 4, 3, True, jnp.bfloat16, 1, 2),
    (1, 1, 3, 64, 64, 3, 3, True, jnp.float32, 3, 32),
]


def make(shape, seed, with_pos, with_prior):
  """``(case, args, pos, prior)`` of a random multi-query problem."""
  *fields, window = shape
  case = Case(**dict(zip(FIELDS, fields)), seed=seed, window=window, multi=True)
  q, k, v, idx, n_valid, length, prior = case.arrays()
  block_mask, q_limit = window_inputs(case, seed)
  rng = np.random.default_rng(seed)
  pos = None
  if with_pos:  # a compacted cache: holes (-1) below length
    pos = jnp.asarray(np.where(rng.random(k.shape[:3]) < 0.3, -1, np.arange(case.t)), jnp.int32)
  if with_prior:  # -inf outside RESA's prior set: the kernel counts the members it attends
    prior = jnp.where(jnp.asarray(rng.random(prior.shape) < 0.7), prior, -jnp.inf)
  return case, (q, k, v, idx, n_valid, block_mask, q_limit, length), pos, (
      prior if with_prior else None)


def run(fn, case, *args, **kw):
  gpu_callbacks.reset_gpu_interpret_mode_state()
  out = jax.block_until_ready(fn(*args, block_size=case.block_size, impl="mosaic",
                                 interpret=True, num_splits=case.num_splits, **kw))
  assert not gpu_callbacks.get_races().races_found
  return out


def check(got, want, dtype, count_attended=True, carried=False):
  assert len(got) == len(want)
  if count_attended:  # the keys each query attended, last
    assert got[-1].dtype == jnp.int32
    np.testing.assert_array_equal(got[-1], want[-1])
    got, want = got[:-1], want[:-1]
  assert all(x.dtype == jnp.float32 for x in got[:4])
  assert_attention_close(*got[:2], *want[:2], dtype)
  if len(got) > 2:
    np.testing.assert_array_equal(got[4], want[4])
    assert_attention_close(got[2], got[3], want[2], want[3], dtype)
    if not carried:  # (a carried partial may give a query that saw no member a prior part)
      np.testing.assert_array_equal(np.isneginf(got[3]), got[4] == 0)


@settings(max_examples=3, deadline=None)
@given(shape=st.sampled_from(POOL), seed=st.integers(0, 2**31 - 1), with_pos=st.booleans(),
       with_prior=st.booleans())
def test_matches_reference(shape, seed, with_pos, with_prior):
  case, args, pos, prior = make(shape, seed, with_pos, with_prior)
  carry = carried(case, args[0], 1 if prior is None else 2)  # cached partials merged in
  got = run(sparse_decode_multiquery, case, *args, pos=pos, prior=prior, count_attended=True,
            carry_in=carry)
  assert got[0].shape == args[0].shape and got[1].shape == args[0].shape[:3]
  check(got, reference(*args, block_size=case.block_size, pos=pos, prior=prior,
                       count_attended=True, carry_in=carry), case.dtype, carried=True)


def test_dispatch_two_launches_softcap():
  """impl="mosaic" of the Triton twin's op runs this kernel (``MOSAIC_OPS``); 3 heads x 32
  queries with holes, a prior, a soft-cap and carried partials (each launch merges its own
  heads' share), then empty lists."""
  assert backends.resolve_impl("mosaic", "sparse_decode_multiquery", capability=9.0) == "mosaic"
  case, args, pos, prior = make(POOL[2], 7, True, True)
  args = (30.0 * args[0],) + args[1:]
  carry = carried(case, args[0], 2)
  got = run(dispatched, case, *args, pos=pos, prior=prior, softcap=5.0, carry_in=carry)
  check(got, reference(*args, block_size=case.block_size, pos=pos, prior=prior, softcap=5.0,
                       carry_in=carry), case.dtype, count_attended=False, carried=True)
  empty = args[:3] + (args[3][..., :0], args[4], args[5][..., :0]) + args[6:]
  out, lse = dispatched(*empty, block_size=case.block_size, impl="mosaic", interpret=True)
  assert not np.any(out) and np.all(np.isneginf(lse))


S, I32 = jax.ShapeDtypeStruct, jnp.int32


@pytest.mark.parametrize("dtype,per_head", [(jnp.bfloat16, False), (jnp.float32, True)])
def test_lowers_for_cuda(dtype, per_head):
  """Llama-3.1-8B heads at 32k, W = 8 (32 rows per kv head): Pallas -> Mosaic GPU MLIR (the
  positions and prior rings, multi-word row bits, per-row limits, the keys-attended count)
  runs on the CPU; Mosaic's passes to PTX need the CUDA plugin."""
  b, hq, hkv, d, t, bs, n = shapes.MODELS["llama31_8b_32k"]
  w = shapes.WINDOW
  hs = hq if per_head else hkv
  cache = S((b, hkv, t, d), dtype)
  fn = functools.partial(sparse_decode_multiquery, block_size=bs, impl="mosaic",
                         softcap=50.0 if per_head else None, count_attended=True)
  extra = dict(pos=S((b, hkv, t), I32), prior=S((b, hq, t), jnp.float32)) if per_head else {}
  exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(
      S((b, hq, w, d), dtype), cache, cache, S((b, hs, n), I32), S((b, hs), I32),
      S((b, hs, w, n), jnp.bool_), S((b, w), I32), S((b,), I32), **extra)
  text = exported.mlir_module()
  assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {"mosaic_gpu_v2"}
