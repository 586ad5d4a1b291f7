"""Padding rows inside the decode kernels (``query_pos``): a row whose query position is negative
attends nothing and comes out ``0`` / ``-inf``, RESA's epilogue result included, on the Triton
kernels (interpret mode), the Mosaic GPU kernels (GPU interpret mode, race detection on) and the
references; every live row is exactly what the same op returns without ``query_pos``. So the
decode step masks no row after its launches (``sparse.mask_rows`` stays for the XLA-merged
paths)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

from pallas_kernels import (dense_decode, empty_padding_rows, sparse_decode, sparse_decode_resa,
                            split_combine_pairs)
from pk_testutil import POOL, Case
from test_mosaic_sparse_decode import FIELDS, POOL as MOSAIC_POOL


def _aggregator():
  from sparse_attn.enhancers import resa  # pylint: disable=g-import-not-at-top
  return resa.Aggregator(0.5, "renormalised")


def _problem(case):
  """The case's arrays with row 0 a padding row that would attend (its whole list, the whole
  cache) and RESA epilogue inputs that give an empty row a nonzero estimate."""
  q, k, v, idx, n_valid, length, prior = case.arrays()
  n = idx.shape[-1]
  idx = idx.at[0].set(jnp.arange(case.num_blocks - n, case.num_blocks, dtype=jnp.int32))
  n_valid = n_valid.at[0].set(n)
  length = length.at[0].set(case.t)
  prior = jnp.where(jax.random.bernoulli(jax.random.key(case.seed), 0.7, prior.shape), prior,
                    -jnp.inf)
  rng = np.random.default_rng(case.seed)
  b, hq, d = q.shape
  extras = (jnp.asarray(rng.standard_normal((b, hq, d)), jnp.float32),  # O_est
            jnp.asarray(rng.standard_normal((b, hq)) + 3, jnp.float32),  # log Z
            jnp.asarray(rng.standard_normal((b, hq)), jnp.float32),  # bias
            jnp.asarray(rng.integers(0, 60, (b, hq)), jnp.int32))  # prior count
  query_pos = jnp.asarray([-1] + [case.t - 1] * (b - 1), jnp.int32)
  return (q, k, v, idx, n_valid, length, prior, extras), query_pos


def _ops(case, impl, interpret):
  """name -> ``f(arrays, query_pos) -> (out, lse)`` for the three decode ops."""
  kw = dict(block_size=case.block_size, num_splits=case.num_splits, impl=impl,
            interpret=interpret)
  return {
      "sparse": lambda a, qp: sparse_decode(*a[:6], query_pos=qp, **kw),
      "dense": lambda a, qp: dense_decode(*a[:3], a[5], query_pos=qp, **kw),
      "resa": lambda a, qp: sparse_decode_resa(*a[:3], a[6], *a[3:6], epilogue=_aggregator(),
                                               extras=a[7], query_pos=qp, **kw),
  }


def _check(op, arrays, query_pos):
  out, lse = op(arrays, query_pos)
  free_out, free_lse = op(arrays, None)
  live = np.asarray(query_pos) >= 0
  assert np.isfinite(np.asarray(free_lse)[~live]).any(), "the padding row must attend something"
  assert not np.asarray(out[~live], np.float32).any() and np.isneginf(np.asarray(lse)[~live]).all()
  want_out, want_lse = empty_padding_rows(free_out, free_lse, query_pos)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
  np.testing.assert_array_equal(lse, want_lse)


@pytest.mark.parametrize("name", ["sparse", "dense", "resa"])
@pytest.mark.parametrize("impl", ["pallas", "xla"])
@settings(max_examples=4, deadline=None)
@given(shape=st.sampled_from(POOL), seed=st.integers(0, 2**31 - 1))
def test_padding_rows_attend_nothing_triton_and_reference(name, impl, shape, seed):
  case = Case(**dict(zip(FIELDS, shape)), seed=seed)
  arrays, query_pos = _problem(case)
  _check(_ops(case, impl, True)[name], arrays, query_pos)


@pytest.mark.parametrize("name", ["sparse", "dense", "resa"])
def test_padding_rows_attend_nothing_mosaic(name):
  case = Case(**dict(zip(FIELDS, MOSAIC_POOL[1])), seed=7)  # two rows, bf16, per-head lists
  arrays, query_pos = _problem(case)
  op = _ops(case, "mosaic", True)[name]

  def raced(a, qp):
    gpu_callbacks.reset_gpu_interpret_mode_state()
    got = jax.block_until_ready(op(a, qp))
    assert not gpu_callbacks.get_races().races_found
    return got
  _check(raced, arrays, query_pos)


@pytest.mark.parametrize("splits", [1, 3])
def test_combine_empties_padding_rows_after_epilogue_and_carry(splits):
  """``split_combine_pairs(query_pos=...)``: the kernel (and the one-split path) == the
  reference, and a padding row is empty though its epilogue and carried partial are not."""
  rng = np.random.default_rng(splits)
  b, p, r, d = 2, 2, 3, 16
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  pairs = [(f(b, p, splits, r, d), f(b, p, splits, r)) for _ in range(2)]
  seen = jnp.asarray(rng.integers(0, 5, (b, p, splits, r)), jnp.int32)
  extras = (f(b, p, r, d), f(b, p, r) + 3, f(b, p, r),
            jnp.asarray(rng.integers(0, 9, (b, p, r)), jnp.int32))
  query_pos = jnp.asarray([5, -1], jnp.int32)
  run = functools.partial(split_combine_pairs, pairs, seen, epilogue=_aggregator(), extras=extras)
  got = run(query_pos=query_pos, impl="pallas", interpret=True)
  want = run(query_pos=query_pos, impl="xla")
  free = run(impl="xla")
  assert np.isfinite(np.asarray(free[1][1])).all()
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)
  assert not np.asarray(got[0][1]).any() and np.isneginf(np.asarray(got[1][1])).all()
  np.testing.assert_array_equal(got[1][0], free[1][0])
  (carried,), counts = split_combine_pairs(pairs[:1], seen, carry_in=[(f(b, p, r, d), f(b, p, r))],
                                           query_pos=query_pos, impl="pallas", interpret=True)
  assert not np.asarray(carried[0][1]).any() and np.isneginf(np.asarray(carried[1][1])).all()
  assert not np.asarray(counts[1]).any() and np.asarray(counts[0]).any()


@pytest.mark.parametrize("impl,call", [("pallas", "__gpu$xla.gpu.triton"),
                                       ("mosaic", "mosaic_gpu_v2")])
def test_lowers_for_cuda_with_query_pos(impl, call):
  """The dense and sparse ops with ``query_pos`` at Llama-3.1-8B's heads, 8k slots, lower for
  CUDA to their kernels with no more XLA ops than without it: the positions are an operand,
  not an op before the launch (the Triton path has no compare at all; Mosaic's split merge is
  XLA's)."""
  sds, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
  b, hq, hkv, d, t, bs, n = 1, 32, 8, 128, 8192, 16, 52
  cache, rows = sds((b, hkv, t, d), bf16), sds((b,), i32)
  checks = [jax.export.DisabledSafetyCheck.custom_call(call)]
  ops = lambda text: len(re.findall(r"= \"?stablehlo\.", text))
  for fn, lists in ((dense_decode, ()), (sparse_decode, (sds((b, hkv, n), i32),
                                                         sds((b, hkv), i32)))):
    def lower(**kw):
      return jax.export.export(
          jax.jit(functools.partial(fn, block_size=bs, impl=impl)), platforms=["cuda"],
          disabled_checks=checks)(sds((b, hq, d), bf16), cache, cache, *lists, rows,
                                  **kw).mlir_module()
    text, plain = lower(query_pos=rows), lower()
    assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {call}
    assert ops(text) == ops(plain)
    if impl == "pallas":
      assert "stablehlo.compare" not in text and "stablehlo.select" not in text
