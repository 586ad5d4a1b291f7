"""Quest's one-kernel group-shared selection (``pallas_kernels.score_select``): interpret mode
lists exactly what ``block_score_pooled`` + ``rank_scores`` + ``block_select`` list (the Pallas
path it replaces) and chooses its composed reference's set; the closed-form budget counts equal the
masks'; the Quest ``gqa=group`` decode step is unchanged; it lowers for CUDA at Llama-3.1-8B's
128k shape with fewer ops around it, and (``ptx`` extra) compiles for sm_90 without spills."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import (block_score_pooled, block_select, ptx, score_select,
                            score_select_reference)
from pallas_kernels.block_select import rank_scores
from pallas_kernels.shapes import BF16, I32, S
from sparse_attn import cache as cache_lib, methods, selection
from sparse_attn.budget import Budget

# (batch, kv heads, blocks, head dim, block size): fixed shapes keep compiled programs warm.
POOL = [(1, 1, 37, 64, 16), (2, 2, 64, 128, 32), (1, 2, 130, 64, 16)]


def _problem(rng, shape, dtype, integer, group=1):
  """Queries (``[B, K, D]``, or ``[B, K, G, D]`` pooled by the kernel) and digests;
  ``integer``: small integers (a mean of 4 of them is exact too), so every score is exact in
  any summation order and many tie."""
  b, k, nb, d, bs = shape
  draw = ((lambda s: rng.integers(-2, 3, s).astype(np.float32)) if integer
          else rng.standard_normal)
  lo, hi = draw((b, k, nb, d)), draw((b, k, nb, d))
  q = jnp.asarray(draw((b, k, d) if group == 1 else (b, k, group, d)), dtype)
  length = rng.integers(0, nb * bs + 1, b)
  length[0] = rng.choice([nb * bs, nb * bs - bs // 2, length[0]])  # full / partial last block
  return (q, jnp.asarray(np.minimum(lo, hi), dtype), jnp.asarray(np.maximum(lo, hi), dtype),
          jnp.asarray(length, jnp.int32))


def _budget_args(budget, length, nb, bs, n):
  sink, start = budget.forced_span(length, bs)
  return start, selection.block_count(length, budget, nb, bs, n), sink


def _two_kernels(q, kmin, kmax, length, start, count, *, block_size, n, n_sink_blocks):
  """Today's Pallas path: block_score_pooled (one row per kv head), the ranking, block_select."""
  b, k, nb, _ = kmin.shape
  s = block_score_pooled(q[:, :, None] if q.ndim == 3 else q, kmin, kmax, length,
                         block_size=block_size, impl="pallas", interpret=True)
  blocks = jnp.arange(nb)[None]
  valid = blocks * block_size < length[:, None]
  forced = ((blocks < n_sink_blocks) | (blocks >= start[:, None])) & valid
  ranked = rank_scores(s, valid[:, None], forced[:, None]).reshape(b * k, nb)
  ids = block_select(ranked, jnp.repeat(count, k), n=n, impl="pallas", interpret=True)
  return ids.reshape(b, k, n)


@settings(deadline=None, max_examples=5)
@given(shape=st.sampled_from(POOL), dtype=st.sampled_from((jnp.float32, jnp.bfloat16)),
       integer=st.booleans(), n_sink=st.sampled_from((0, 4, 40)),
       local=st.sampled_from((0, 64, 100)), frac=st.sampled_from((0.05, 0.3, 1.0)),
       group=st.sampled_from((1, 4)), seed=st.integers(0, 2**16))
def test_interpret_lists_what_the_two_kernels_list(shape, dtype, integer, n_sink, local, frac,
                                                   group, seed):
  rng = np.random.default_rng(seed)
  b, k, nb, _, bs = shape
  q, kmin, kmax, length = _problem(rng, shape, dtype, integer, group)
  budget = Budget(budget=frac, n_sink=n_sink, local_window=local)
  n = min(budget.max_count(nb * bs, bs), nb)
  start, count, sink = _budget_args(budget, length, nb, bs, n)
  kw = dict(block_size=bs, n=n, n_sink_blocks=sink)
  idx, n_valid = score_select(q, kmin, kmax, length, start, count, impl="pallas",
                              interpret=True, **kw)
  idx, n_valid = np.asarray(idx), np.asarray(n_valid)
  np.testing.assert_array_equal(idx, _two_kernels(q, kmin, kmax, length, start, count, **kw))
  np.testing.assert_array_equal(n_valid, np.repeat(np.asarray(count)[:, None], k, 1))
  ref, ref_valid = map(np.asarray, score_select_reference(q, kmin, kmax, length, start, count,
                                                          **kw))
  np.testing.assert_array_equal(n_valid, ref_valid)
  for bi in range(b):
    c = int(count[bi])
    for h in range(k):
      assert sorted(idx[bi, h, :c]) == list(idx[bi, h, :c])  # chosen: ascending ids
      assert len(set(idx[bi, h])) == n and 0 <= idx[bi, h].min() and idx[bi, h].max() < nb
      if integer:  # exact scores: the same set as lax.top_k (ties: lower id first)
        assert set(idx[bi, h, :c]) == set(ref[bi, h, :c])


@settings(deadline=None, max_examples=15)
@given(n_sink=st.integers(0, 70), local=st.integers(0, 130), n_local=st.none() | st.integers(0, 4),
       inside=st.booleans(), unit=st.sampled_from((1, 16, 32)), nb=st.integers(1, 40),
       seed=st.integers(0, 2**16))
def test_closed_form_counts_equal_the_masks(n_sink, local, n_local, inside, unit, nb, seed):
  budget = Budget(budget=0.2, n_sink=n_sink, local_window=local, n_local=n_local,
                  forced_count="inside" if inside else "extra")
  length = jnp.asarray(np.random.default_rng(seed).integers(0, nb * unit + 1, 4), jnp.int32)
  idx = np.arange(nb)[None]
  sink, start = budget.forced_span(length, unit)
  forced = np.asarray(budget.forced(length, nb, unit))
  np.testing.assert_array_equal(forced, ((idx < sink) | (idx >= np.asarray(start)[:, None]))
                                & (idx * unit < np.asarray(length)[:, None]))
  np.testing.assert_array_equal(budget.n_forced(length, nb, unit), forced.sum(-1))
  valid = jnp.asarray(idx * unit < np.asarray(length)[:, None])
  n_max = min(budget.max_count(nb * unit, unit), nb)
  total = budget.total(length, jnp.asarray(forced.sum(-1), jnp.int32), unit)
  np.testing.assert_array_equal(selection.block_count(length, budget, nb, unit, n_max),
                                selection.selected_count(valid, jnp.asarray(forced), total, n_max))


def test_quest_group_decode_step_is_unchanged():
  """Selections equal the two-kernel path's; the step's output equals the jnp path's."""
  rng = np.random.default_rng(0)
  b, hq, hkv, d, t, bs = 2, 4, 2, 64, 512, 16
  cache = cache_lib.init_cache(b, hkv, t, d, bs, jnp.bfloat16, ("box",))
  kv = [jnp.asarray(rng.standard_normal((b, hkv, 400, d)), jnp.bfloat16) for _ in range(2)]
  cache = cache_lib.write(cache, *kv, jnp.broadcast_to(jnp.arange(400), (b, 400)))
  cache = dataclasses.replace(cache, length=jnp.asarray([400, 123], jnp.int32))
  q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.bfloat16)
  pos = jnp.asarray([399, 122], jnp.int32)
  make = functools.partial(methods.make, budget=0.1, block_size=bs)
  fused, split = make("quest:gqa=group,fused=true", impl="pallas", interpret=True), make(
      "quest:gqa=group,fused=false", impl="pallas", interpret=True)
  got, want = fused.select(q, cache), split.select(q, cache)
  np.testing.assert_array_equal(got.idx, want.idx)
  np.testing.assert_array_equal(got.n_valid, want.n_valid)
  out = fused.attend(q, cache, pos)[0]
  ref = make("quest:gqa=group", impl="xla").attend(q, cache, pos)[0]
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             atol=2e-2, rtol=2e-2)


def _export_select(spec):
  """The 8B shape at 128k (Hq 32, Hkv 8, D 128, block 16, bf16): the selection for CUDA."""
  m = methods.make(spec, impl="pallas")
  cache = jax.eval_shape(lambda: cache_lib.init_cache(1, 8, 131072, 128, 16, BF16, ("box",)))
  return jax.export.export(
      jax.jit(lambda q, c: m.select(q, c)), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(ptx.TRITON_CALL)])(
          S((1, 32, 128), BF16), cache).mlir_module()


def test_lowers_for_cuda_at_128k_with_fewer_ops():
  """One Triton call (was two) and no XLA op over the 8192 blocks (was 27); StableHLO ops of
  the selection 118 -> 77 when written (``tests`` count only the direction)."""
  fused, split = _export_select("quest:gqa=group,fused=true"), _export_select("quest:gqa=group")
  calls = lambda text: text.count(f"stablehlo.custom_call @{ptx.TRITON_CALL}")
  assert (calls(fused), calls(split)) == (1, 2)
  ops = lambda text: [l for l in text.splitlines() if re.search(r"=\s+\"?stablehlo\.", l)]
  nb_sized = lambda text: [l for l in ops(text) if re.search(r"->\s*tensor<[^>]*8192", l)
                           and "custom_call" not in l]
  assert not nb_sized(fused) and nb_sized(split)
  assert len(ops(fused)) < len(ops(split))
  assert "sort" not in fused


def test_compiles_for_sm90_pipelined_without_spills(tmp_path):
  pytest.importorskip("triton", reason="the ptx extra (triton==3.9.0) compiles the PTX")
  fn = functools.partial(score_select, block_size=16, n=826, n_sink_blocks=1, impl="pallas")
  avals = (S((1, 8, 4, 128), BF16), S((1, 8, 8192, 128), BF16), S((1, 8, 8192, 128), BF16),
           S((1,), I32), S((1,), I32), S((1,), I32))
  [mod] = ptx.triton_modules(fn, *avals)
  kernel = ptx.compile_sm90(mod, str(tmp_path))
  assert 0 < kernel.metadata.shared <= ptx.H100_SMEM_PER_BLOCK
  usage = ptx.register_usage(kernel, str(tmp_path))
  assert usage["spill_bytes"] == 0 and usage["registers"] <= 255, usage
  [rep] = ptx.report(fn, *avals, workdir=str(tmp_path))
  assert rep.ring_depth >= 2 and rep.stages_in_flight >= 2, str(rep)
