"""RocketKV (sparse_attn/compression/rocketkv.py) and its hybrid sparse attention
(sparse_attn/selectors/hybrid.py): a brute-force numpy reference of the stage-2 estimate and
top-k on random caches, the budget split, a full budget decoding as dense, the stage-1 cache
really smaller, jit / vmap, padding rows and bf16 logits ~1e4 without NaN."""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods
from sparse_attn.compression.rocketkv import RocketKV, stages
from sparse_attn.selectors.hybrid import HybridSparse, reduction
from tests.sparse_attn import helpers

CAP, D = 48, 8


def _np_scores(q, k, n, c):
  """float64 estimate of one kv head: ``q [G, D]``, ``k [n, D]`` -> ``[n]``."""
  cs, r = reduction(c, D)
  s = np.where(q.sum(0) > 0, 1.0, -1.0)
  chunks = [np.max(s * k[i:i + cs], axis=0) for i in range(0, n, cs)]
  dims = np.argsort(-np.abs(q).mean(0), kind="stable")[:r]
  w = np.zeros((q.shape[0], n))
  for g in range(q.shape[0]):
    qk = np.array([(s * q[g])[dims] @ chunks[i // cs][dims] for i in range(n)])
    temp = math.sqrt(D * np.abs(q[g][dims]).sum() / np.abs(q[g]).sum())
    e = np.exp(qk / temp - (qk / temp).max())
    w[g] = e / e.sum()
  return w.mean(0)


@hypothesis.settings(deadline=None, max_examples=10, derandomize=True)
@hypothesis.given(seed=st.integers(0, 2 ** 16), c=st.sampled_from([1.0, 2.0, 4.0, 9.0]),
                  count=st.integers(1, 12), group=st.sampled_from([1, 3]))
def test_the_selection_matches_a_brute_force_reference(seed, c, count, group):
  rng = np.random.default_rng(seed)
  lengths = [int(rng.integers(1, CAP)), int(rng.integers(1, CAP))]
  cache = helpers.filled_cache(rng, 2, 2, CAP, D, lengths, 4)
  q = helpers.normal(rng, (2, 2 * group, D))
  got = HybridSparse(budget=count, c=c, block_size=4).select(q, cache)
  idx, n_valid = np.asarray(got.idx), np.asarray(got.n_valid)
  k, qn = np.asarray(cache.k, np.float64), np.asarray(q, np.float64)
  for b in range(2):
    for h in range(2):
      n = lengths[b]
      est = _np_scores(qn[b, h * group:(h + 1) * group], k[b, h, :n], n, c)
      kk = min(count, n)
      assert n_valid[b, h] == kk
      srt = np.sort(est)[::-1]
      if kk < n and srt[kk - 1] - srt[kk] < 1e-6:
        continue  # a tie (a shared chunk score) at the boundary: either is right
      assert set(idx[b, h, :kk]) == set(np.argsort(-est)[:kk])


def test_the_budget_split_follows_the_authors_compress():
  b = 0.05
  r = min(0.2 + 0.06 * math.log2(20), 0.8)
  want = dict(ratio=1 - b ** r, topk=b / 2 / b ** r, c=b ** r / b)
  assert stages(b) == pytest.approx(want)
  m = methods.make("rocketkv", budget=b)
  assert isinstance(m, RocketKV) and (m.window_size, m.kernel, m.pooling) == (32, 63, "max")
  assert (m.ratio, m.topk, m.c) == pytest.approx((want["ratio"], want["topk"], want["c"]))
  assert methods.make("rocketkv", budget=0.1, kernel=7).kernel == 7
  assert reduction(1.0, 64) == (1, 64) and reduction(16.0, 64) == (4, 16)
  with pytest.raises(ValueError, match="uniform"):
    methods.make("rocketkv", budget=0.1, head_budget="adakv")
  with pytest.raises(ValueError, match="unknown option"):
    methods.make("rocketkv", budget=0.1, nope=1)


def _run(m, rng, lengths, steps=3, **kw):
  """Prefill random prompts of ``lengths``, end_prefill, ``steps`` decode steps ->
  ``(outputs, cache after the steps)``."""
  outs, _, cache = helpers.prefill_then_decode(m, rng, lengths, capacity=CAP, head_dim=D,
                                               steps=steps, **kw)
  return outs, cache


def test_a_full_budget_is_dense_and_a_small_one_keeps_a_smaller_cache():
  dense = methods.make("dense", block_size=4)
  full = methods.make("rocketkv", budget=1.0, block_size=4)
  want, _ = _run(dense, np.random.default_rng(0), [40, 13])
  got, _ = _run(full, np.random.default_rng(0), [40, 13])
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **helpers.tol(jnp.float32))
  small = methods.make("rocketkv", budget=0.1, block_size=4, window_size=4, kernel=3)
  outs, cache = _run(small, np.random.default_rng(0), [40, 13])
  assert cache.capacity < CAP and int(cache.length[0]) == math.ceil(40 * (1 - small.ratio)) + 3
  assert all(np.all(np.isfinite(np.asarray(o))) for o in outs)


def test_jit_vmap_padding_and_large_bf16_logits():
  rng = np.random.default_rng(1)
  cache = helpers.filled_cache(rng, 3, 2, CAP, D, [0, 30, 47], 4, jnp.bfloat16, scale=35.0)
  q = helpers.normal(rng, (3, 4, D), jnp.bfloat16, 35.0)
  sel = HybridSparse(budget=6, c=4.0, block_size=4)
  plain = sel.select(q, cache)
  jitted = jax.jit(sel.select)(q, cache)
  mapped = jax.vmap(lambda qq, cc: sel.select(qq[None], jax.tree.map(lambda x: x[None], cc)))(
      q, cache)
  for a, b in ((plain.idx, jitted.idx), (plain.idx, mapped.idx[:, 0])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.asarray(plain.n_valid).tolist() == [[0, 0], [6, 6], [6, 6]]
  m = methods.make("rocketkv", budget=0.2, block_size=4, window_size=4, kernel=3)
  outs, _ = _run(m, rng, [0, 29], dtype=jnp.bfloat16, scale=35.0)
  for o in outs:
    assert np.all(np.isfinite(np.asarray(o, np.float32))) and not np.any(np.asarray(o[0]))


def test_attended_tokens_are_stage_twos_reads_of_the_kept_prompt():
  """The harness's share of the context read is the top-k over the evicted prompt: equal to
  the n_valid stage 2 selects on the cache stage 1 leaves (brute force), not the cache size."""
  m = methods.make("rocketkv", budget=0.2, block_size=4, window_size=4, kernel=3)
  n = 40
  _, cache = _run(m, np.random.default_rng(2), [n, n], steps=0)
  acc = m.attended_tokens(n)
  kept = math.ceil(n * (1 - m.ratio))
  assert acc["kept"] == kept == int(cache.length[0]) and acc["context"] == n
  q = helpers.normal(np.random.default_rng(3), (2, 4, D))
  sel = m.stage2.select(q, cache)
  assert acc["total"] == acc["chosen"] == int(np.asarray(sel.n_valid).max()) < kept
  assert methods.make("rocketkv", budget=1.0).attended_tokens(n)["total"] == n
