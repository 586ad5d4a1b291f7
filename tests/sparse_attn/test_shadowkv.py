"""ShadowKV's selection (sparse_attn/selectors/shadowkv.py) and its low-rank keys
(sparse_attn/shadowkv.py): a brute-force numpy reference of the landmarks, outliers and top-k,
the rank-r keys against numpy's SVD, a full budget (and full rank) decoding as dense, jit /
vmap, padding rows and bf16 logits ~1e4 without NaN, the spec and its refusals."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import cache as cache_lib
from sparse_attn import methods
from sparse_attn.budget import Budget
from sparse_attn.compression.rope import inverse_frequencies
from sparse_attn.selectors import ShadowKV
from sparse_attn.shadowkv import ShadowKVMethod
from tests.sparse_attn import helpers

CAP, D, BS = 48, 8, 4


def _np_blocks(q, k, n, count, n_out, local):
  """float64 reference of one kv head: ``q [G, D]``, ``k [n, D]`` -> (forced and outlier
  blocks, {block: score} of the candidates, blocks chosen by score)."""
  nb = -(-n // BS)
  forced = {i for i in range(nb) if (i + 1) * BS > n - local} if local else set()
  means = [k[i * BS:(i + 1) * BS].mean(0) for i in range(nb)]
  cos = [min(kj @ means[i] / max(np.linalg.norm(kj) * np.linalg.norm(means[i]), 1e-8)
             for kj in k[i * BS:(i + 1) * BS]) for i in range(nb)]
  free = [i for i in range(nb) if i not in forced]
  outliers = set(sorted(free, key=lambda i: cos[i])[:n_out])
  cand = [i for i in free if i not in outliers]
  score = {}
  if cand:
    logits = np.array([[qg @ means[i] / np.sqrt(D) for i in cand] for qg in q])
    p = np.exp(logits - logits.max(1, keepdims=True))
    score = dict(zip(cand, (p / p.sum(1, keepdims=True)).max(0)))
  return forced | outliers, score, sorted(cand, key=lambda i: -score[i])[:count]


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("local", [32, BS])  # 32 (the default): 8 of 12 blocks forced
@hypothesis.settings(deadline=None, max_examples=5, derandomize=True)
@hypothesis.given(seed=st.integers(0, 2 ** 16), count=st.integers(1, 4),
                  n_out=st.sampled_from([0, 2, 0.15, 0.3]))
def test_the_selection_matches_a_brute_force_reference(group, local, seed, count, n_out):
  """``n_out``: outlier blocks (an int), or their share of the row's blocks (a float). With a
  one-block window most blocks are free, so which of them are outliers (the lowest cosine)
  and the landmark scores' max over a group of 3 heads decide the selection."""
  rng = np.random.default_rng(seed)
  lengths = [int(rng.integers(1, CAP)), int(rng.integers(1, CAP))]
  cache = helpers.filled_cache(rng, 2, 2, CAP, D, lengths, BS)
  q = helpers.normal(rng, (2, 2 * group, D))
  by = dict(outliers=n_out) if isinstance(n_out, int) else dict(outlier_share=n_out)
  sel = ShadowKV(budget=Budget(budget=count * BS, n_sink=0, local_window=local),
                 block_size=BS, **by)
  got = sel.select(q, cache)
  idx, n_valid = np.asarray(got.idx), np.asarray(got.n_valid)
  k, qn = np.asarray(cache.k, np.float64), np.asarray(q, np.float64)
  for b in range(2):
    for h in range(2):
      row_out = n_out if isinstance(n_out, int) else int(np.ceil(n_out * -(-lengths[b] // BS)))
      always, score, chosen = _np_blocks(qn[b, h * group:(h + 1) * group], k[b, h, :lengths[b]],
                                         lengths[b], count, row_out, local)
      assert n_valid[b, h] == len(always) + len(chosen)
      mine = set(idx[b, h, :n_valid[b, h]].tolist())
      assert always <= mine
      srt = sorted(score.values(), reverse=True)
      if len(srt) > count and srt[count - 1] - srt[count] < 1e-6:
        continue  # a tie at the boundary: either is right
      assert mine - always == set(chosen)


def _run(m, rng, lengths, steps=2, **kw):
  """Prefill random prompts of ``lengths``, end_prefill, ``steps`` decode steps (one jit
  compile per method) -> (outputs, cache after the prompt)."""
  outs, prompt_cache, _ = helpers.prefill_then_decode(m, rng, lengths, capacity=CAP,
                                                      head_dim=D, steps=steps, jit=True, **kw)
  return outs, prompt_cache


INV_FREQ = inverse_frequencies(D, 10000.0)


def test_a_full_budget_and_full_rank_decode_as_dense():
  want, _ = _run(methods.make("dense", block_size=BS), np.random.default_rng(0), [40, 13])
  for opts in (dict(), dict(rank=2 * D)):  # K * D = 16: rank 16 rebuilds the keys exactly
    m = methods.make("shadowkv", budget=1.0, block_size=BS, **opts).with_rope(INV_FREQ)
    got, _ = _run(m, np.random.default_rng(0), [40, 13])
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


def test_the_rank_r_keys_are_the_truncated_svd_of_the_pre_rope_keys():
  rank = 5
  m = methods.make("shadowkv", budget=0.25, block_size=BS, rank=rank, outliers=1,
                   local_window=8).with_rope(INV_FREQ)
  assert isinstance(m, ShadowKVMethod) and m.prefill_group is None
  rng = np.random.default_rng(3)
  exact = helpers.filled_cache(rng, 2, 2, CAP, D, [40, 21], BS)
  got = np.asarray(m.selector.low_rank_keys(exact, jnp.asarray(INV_FREQ)).k, np.float64)
  k = np.asarray(exact.k, np.float64)
  ang = np.arange(CAP)[:, None] * INV_FREQ.astype(np.float64)  # [T, D/2]

  def rot(x, sign):  # half-split RoPE by +-pos
    c, s = np.cos(ang), sign * np.sin(ang)
    return np.concatenate([x[..., :4] * c - x[..., 4:] * s, x[..., 4:] * c + x[..., :4] * s], -1)

  _, forced, outlier, _ = (np.asarray(a) for a in m.selector.masks(exact))
  for b, n in enumerate([40, 21]):
    x = rot(k[b], -1.0)[:, :n].transpose(1, 0, 2).reshape(n, 2 * D)  # [n, K * D]
    u, s, vt = np.linalg.svd(x, full_matrices=False)
    low = ((u[:, :rank] * s[:rank]) @ vt[:rank]).reshape(n, 2, D).transpose(1, 0, 2)
    want = rot(np.pad(low, ((0, 0), (0, CAP - n), (0, 0))), 1.0)
    for h in range(2):
      keep = np.repeat(forced[b] | outlier[b, h], BS)[:n]
      np.testing.assert_allclose(got[b, h, :n][~keep], want[h, :n][~keep], atol=1e-4)
      np.testing.assert_array_equal(got[b, h, :n][keep], k[b, h, :n][keep])
    assert keep.any() and (~keep).any()


def test_jit_vmap_padding_and_large_bf16_logits():
  rng = np.random.default_rng(1)
  cache = helpers.filled_cache(rng, 3, 2, CAP, D, [0, 30, 47], BS, jnp.bfloat16, scale=35.0)
  q = helpers.normal(rng, (3, 4, D), jnp.bfloat16, 35.0)
  sel = ShadowKV(budget=Budget(8, n_sink=0, local_window=4), block_size=BS, outliers=1)
  plain = sel.select(q, cache)
  jitted = jax.jit(sel.select)(q, cache)
  mapped = jax.vmap(lambda qq, cc: sel.select(qq[None], jax.tree.map(lambda x: x[None], cc)))(
      q, cache)
  for a, b in ((plain.idx, jitted.idx), (plain.idx, mapped.idx[:, 0])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.asarray(plain.n_valid).tolist() == [[0, 0], [5, 5], [5, 5]]  # 2 local + 1 outlier + 2
  m = methods.make("shadowkv", budget=0.2, block_size=BS, rank=3).with_rope(INV_FREQ)
  outs, _ = _run(m, rng, [0, 29], dtype=jnp.bfloat16, scale=35.0)
  for o in outs:
    assert np.all(np.isfinite(np.asarray(o, np.float32))) and not np.any(np.asarray(o[0]))


def test_the_spec_digests_and_refusals():
  m = methods.make("shadowkv", budget=0.05)
  sel = m.selector
  assert type(m) is methods.Method and (sel.outliers, sel.rank, sel.block_size) == (48, None, 16)
  assert (sel.budget.n_sink, sel.budget.local_window, sel.budget.forced_count) == (0, 32, "extra")
  assert set(m.cache_digests) >= {"sphere", "cosine"} and m.selection_heads(9, 3) == 3
  assert not sel.context_parallel
  cache = m.init_cache(1, 1, 32, 4)
  assert cache.kcos.shape == (1, 1, 2) and cache.has_digests("cosine")
  assert not methods.make("quest", budget=0.1).init_cache(1, 1, 32, 4).has_digests("cosine")
  with pytest.raises(ValueError, match="cosine"):
    sel.select(jnp.ones((1, 1, 4)), cache_lib.init_cache(1, 1, 32, 4, digests=("sphere",)))
  with pytest.raises(ValueError, match="with_rope"):
    mr = methods.make("shadowkv", budget=0.05, rank=8)
    mr.end_prefill(mr.init_cache(1, 1, 32, 4), mr.init_state(1, 1, 1, 4, 32))
  for bad in (dict(topp=0.9), dict(outliers=-1), dict(rank=0), dict(outlier_share=0.0),
              dict(outlier_share=1.5), dict(outlier_share=True)):
    with pytest.raises(ValueError):
      methods.make("shadowkv", budget=0.05, **bad)
