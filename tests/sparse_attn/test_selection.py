"""Block scores, budget rules and selectors vs brute force."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from sparse_attn import budget as budget_lib
from sparse_attn import kernels, scoring, selection
from tests.sparse_attn import helpers


def _np_quest(q, kmin, kmax, g, lengths, bs):
  """Quest Eq. 1 literally; blocks starting at or past the length score ``-inf``."""
  q, kmin, kmax = (np.asarray(x, np.float64) for x in (q, kmin, kmax))
  b, h, d = q.shape
  out = np.zeros((b, h, kmin.shape[2]))
  for i in range(b):
    for j in range(h):
      for n in range(kmin.shape[2]):
        kv = j // g
        out[i, j, n] = sum(max(q[i, j, c] * kmax[i, kv, n, c], q[i, j, c] * kmin[i, kv, n, c])
                           for c in range(d)) if n * bs < lengths[i] else -np.inf
  return out


@given(seed=st.integers(0, 2**31 - 1), g=st.sampled_from([1, 3]),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_quest_scores_match_bruteforce_eq1(seed, g, dtype):
  rng = np.random.default_rng(seed)
  c = helpers.filled_cache(rng, 2, 2, 48, 6, [48, 21], block_size=8, dtype=dtype)
  q = helpers.normal(rng, (2, 2 * g, 6), dtype)
  got = kernels.quest_scores(q, c, impl="xla")
  np.testing.assert_allclose(got, _np_quest(q, c.kmin, c.kmax, g, [48, 21], 8), rtol=1e-4,
                             atol=1e-4)
  # group mode scores once per kv head with the mean query
  pooled = scoring.scoring_queries(q, 2, "group")
  np.testing.assert_allclose(pooled, np.asarray(q, np.float32).reshape(2, 2, g, 6).mean(2),
                             **helpers.tol(dtype))
  # ... formed inside the scoring op (pool=True): the same scores as pooling first
  got = kernels.quest_scores(q, c, impl="xla", pool=True)
  np.testing.assert_array_equal(got, kernels.quest_scores(pooled, c, impl="xla"))
  np.testing.assert_allclose(got, _np_quest(pooled, c.kmin, c.kmax, 1, [48, 21], 8), rtol=1e-4,
                             atol=1e-4)


@given(seed=st.integers(0, 2**31 - 1))
def test_quest_and_arkvale_scores_bound_every_key(seed):
  """Quest's box and ArkVale's sphere and cuboid give an upper bound on q.k of every valid key
  in the block (cuboid-mean, a shrunken box, need not)."""
  rng = np.random.default_rng(seed)
  c = helpers.filled_cache(rng, 1, 1, 64, 8, [50], block_size=16)
  q = helpers.normal(rng, (1, 1, 8))
  lg = np.asarray(c.k[0, 0] @ q[0, 0])
  for s in (kernels.quest_scores(q, c, impl="xla"),
            scoring.arkvale_scores(q, c, "sphere"), scoring.arkvale_scores(q, c, "cuboid")):
    for n in range(4):
      keys = lg[n * 16:min(50, (n + 1) * 16)]
      if len(keys):
        assert float(s[0, 0, n]) >= keys.max() - 1e-4


def test_arkvale_sphere_matches_formula():
  rng = np.random.default_rng(0)
  c = helpers.filled_cache(rng, 1, 1, 32, 4, [30], block_size=16)
  q = helpers.normal(rng, (1, 2, 4))
  got = scoring.arkvale_scores(q, c, "sphere")
  k = np.asarray(c.k[0, 0])
  for n, (lo, hi) in enumerate(((0, 16), (16, 30))):
    cen = k[lo:hi].mean(0)
    rad = np.linalg.norm(k[lo:hi] - cen, axis=-1).max()
    for h in range(2):
      qh = np.asarray(q[0, h])
      np.testing.assert_allclose(got[0, h, n], qh @ cen + np.linalg.norm(qh) * rad, rtol=1e-5)
  with pytest.raises(ValueError, match="sphere"):
    scoring.arkvale_scores(q, c, "cone")


@given(seed=st.integers(0, 2**31 - 1), length=st.integers(1, 48), g=st.sampled_from([1, 3]))
def test_arkvale_cuboid_mean_matches_eq3_on_the_mean_box(seed, length, g):
  """ArkVale's default digest (Chen et al. 2024, Eq. 3-4): the box ``c +- r`` with ``c`` the
  bounding box's centre and ``r`` the mean ``|c - k|`` per channel, brute force per block."""
  rng = np.random.default_rng(seed)
  c = helpers.filled_cache(rng, 1, 2, 48, 5, [length], block_size=16)
  q = helpers.normal(rng, (1, 2 * g, 5))
  got = np.asarray(scoring.arkvale_scores(q, c, "cuboid-mean"))
  for h in range(2 * g):
    k = np.asarray(c.k[0, h // g], np.float64)
    qh = np.asarray(q[0, h], np.float64)
    for n in range(-(-length // 16)):
      keys = k[n * 16:min(length, (n + 1) * 16)]
      centre = 0.5 * (keys.min(0) + keys.max(0))
      r = np.abs(keys - centre).mean(0)
      want = np.maximum(qh * (centre + r), qh * (centre - r)).sum()
      np.testing.assert_allclose(got[0, h, n], want, rtol=1e-4, atol=1e-4)
  # the default of the selector
  bud = budget_lib.Budget(budget=0.5)
  np.testing.assert_array_equal(helpers.select("arkvale", q, c, bud).idx,
                                helpers.select("arkvale", q, c, bud, variant="cuboid-mean").idx)


def _np_count(bud, length, bs, n_forced):
  """Brute-force entries attended in all: each paper's rule (``sparse_attn.budget``)."""
  nb_ctx = -(-length // bs)
  if bud.budget is None:
    count = max(bud.n_min, math.ceil(nb_ctx * bud.p))
  elif isinstance(bud.budget, float):
    count = math.ceil(bud.budget * length / bs)
  else:
    count = -(-bud.budget // bs)
  count = max(count, -(-bud.min_tokens // bs))
  return count + n_forced if bud.forced_count == "extra" else max(count, n_forced)


def _np_expected_set(scores, length, bs, bud):
  """Brute-force block set of one (row, head): forced blocks then best scores."""
  nb_ctx = -(-length // bs)
  blocks = list(range(nb_ctx))
  forced = {n for n in blocks if n * bs < bud.n_sink}
  if bud.n_local is not None:
    forced |= {n for n in blocks if n >= nb_ctx - bud.n_local}
  else:
    forced |= {n for n in blocks if bud.local_window and (n + 1) * bs > length - bud.local_window}
  n = min(max(_np_count(bud, length, bs, len(forced)), len(forced)), nb_ctx)
  rest = sorted((n_ for n_ in blocks if n_ not in forced), key=lambda n_: -scores[n_])
  return forced | set(rest[:n - len(forced)]) if n >= len(forced) else forced


accountings = st.sampled_from(budget_lib.FORCED_ACCOUNTING)
budgets = st.one_of(
    st.builds(budget_lib.Budget, budget=st.sampled_from([0.05, 0.25, 0.5, 1.0]),
              n_sink=st.sampled_from([0, 4]), local_window=st.sampled_from([0, 16, 64]),
              forced_count=accountings, min_tokens=st.sampled_from([0, 0, 40])),
    st.builds(budget_lib.Budget, budget=st.sampled_from([1, 40, 100, 10_000]),
              n_sink=st.just(4), local_window=st.just(8), forced_count=accountings),
    st.builds(budget_lib.Budget, budget=st.none(), p=st.sampled_from([0.1, 0.5]),
              n_min=st.sampled_from([1, 3]), n_local=st.sampled_from([0, 1, 2]),
              forced_count=accountings))


@given(seed=st.integers(0, 2**31 - 1), bud=budgets, bs=st.sampled_from([4, 16]))
def test_block_selection_matches_bruteforce_budget_rules(seed, bud, bs):
  rng = np.random.default_rng(seed)
  t = bs * 12
  lengths = [int(rng.integers(0, t + 1)), int(rng.integers(1, t + 1))]
  c = helpers.filled_cache(rng, 2, 1, t, 4, lengths, block_size=bs)
  q = helpers.normal(rng, (2, 2, 4))
  scores = kernels.quest_scores(q, c, impl="xla")
  sel = selection.select_blocks(scores, c, bud)
  assert sel.idx.shape[-1] == bud.max_count(t, bs) or sel.idx.shape[-1] == t // bs
  for i, ln in enumerate(lengths):
    for h in range(2):
      got = [int(x) for x in sel.idx[i, h, :int(sel.n_valid[i, h])]]
      assert len(got) == len(set(got)), "duplicate block ids"
      assert all(x * bs < ln for x in got), "block past length selected"
      want = _np_expected_set(np.asarray(scores[i, h]), ln, bs, bud)
      assert set(got) == want


def test_budget_larger_than_context_selects_everything_once():
  rng = np.random.default_rng(0)
  c = helpers.filled_cache(rng, 1, 1, 64, 4, [37], block_size=8)
  for bud in (budget_lib.Budget(budget=1.0), budget_lib.Budget(budget=10_000),
              budget_lib.Budget(budget=None, p=1.0, n_min=100)):
    sel = helpers.select("quest", helpers.normal(rng, (1, 1, 4)), c, bud)
    got = sorted(int(x) for x in sel.idx[0, 0, :int(sel.n_valid[0, 0])])
    assert got == [0, 1, 2, 3, 4]


def test_topk_oracle_picks_highest_true_logits():
  rng = np.random.default_rng(1)
  c = helpers.filled_cache(rng, 1, 1, 64, 8, [60], block_size=16)
  q = helpers.normal(rng, (1, 2, 8))
  bud = budget_lib.Budget(budget=10, n_sink=0, local_window=0)
  sel = selection.topk(q, c, bud)
  for h in range(2):
    lg = np.asarray(c.k[0, 0, :60] @ q[0, h])
    got = set(int(x) for x in sel.idx[0, h, :int(sel.n_valid[0, h])])
    assert got == set(np.argsort(-lg)[:10].tolist())


@given(seed=st.integers(0, 2**31 - 1), n_sink=st.sampled_from([0, 4]),
       local=st.sampled_from([0, 8]), gqa=st.sampled_from(["head", "group"]),
       count=st.integers(1, 24))
def test_topk_matches_brute_force_with_forced_tokens_and_group_pooling(seed, n_sink, local, gqa,
                                                                       count):
  """The oracle's kept tokens: the sinks and the local window, then the top ``count`` of the
  rest by the true logit (``gqa="group"``: the mean over the group's query heads), per row."""
  rng = np.random.default_rng(seed)
  lengths = [int(rng.integers(1, 96)), 96]
  c = helpers.filled_cache(rng, 2, 2, 96, 8, lengths, block_size=16)
  q = helpers.normal(rng, (2, 6, 8))  # 3 query heads per kv head
  bud = budget_lib.Budget(budget=count, n_sink=n_sink, local_window=local)
  sel = selection.topk(q, c, bud, gqa)
  k, qn = np.asarray(c.k, np.float64), np.asarray(q, np.float64)
  lists = 2 if gqa == "group" else 6  # one per kv head, or one per query head
  for b, n in enumerate(lengths):
    forced = {t for t in range(n) if t < n_sink or t >= n - local}
    for h in range(lists):
      heads = range(3 * h, 3 * h + 3) if gqa == "group" else [h]
      lg = k[b, heads[0] // 3, :n] @ qn[b, list(heads)].T / math.sqrt(8)  # [n, heads]
      score = lg.mean(-1)
      got = set(int(x) for x in sel.idx[b, h, :int(sel.n_valid[b, h])])
      assert forced <= got
      chosen = got - forced
      assert len(chosen) == min(count, n - len(forced))
      rest = sorted((t for t in range(n) if t not in forced), key=lambda t: -score[t])
      assert chosen == set(rest[:len(chosen)])


def test_streaming_keeps_sinks_and_recent_window():
  rng = np.random.default_rng(2)
  c = helpers.filled_cache(rng, 2, 1, 128, 4, [100, 10], block_size=16)
  bud = budget_lib.Budget(budget=20, n_sink=4, local_window=8, forced_count="inside")
  sel = selection.streaming(helpers.normal(rng, (2, 1, 4)), c, bud)
  got0 = set(int(x) for x in sel.idx[0, 0, :int(sel.n_valid[0, 0])])
  assert got0 == set(range(4)) | set(range(84, 100))
  got1 = set(int(x) for x in sel.idx[1, 0, :int(sel.n_valid[1, 0])])
  assert got1 == set(range(10))
  # Forced on top: the 4 sinks and the 8 + 4 local tokens (whole entries) come besides the 20,
  # so StreamingLLM attends as many tokens as a score-based selector at the same budget.
  extra = budget_lib.Budget(budget=20, n_sink=4, local_window=8)
  sel = selection.streaming(helpers.normal(rng, (2, 1, 4)), c, extra)
  got0 = set(int(x) for x in sel.idx[0, 0, :int(sel.n_valid[0, 0])])
  assert got0 == set(range(4)) | set(range(100 - (20 + 4 + 8) + 4, 100))
  assert len(got0) == extra.accounting(100, 1)["total"]


def test_gqa_is_a_closed_set_checked_with_the_valid_values():
  assert scoring.GQA_MODES == ("head", "group")
  rng = np.random.default_rng(3)
  c = helpers.filled_cache(rng, 1, 1, 32, 4, [20], block_size=16)
  q = helpers.normal(rng, (1, 2, 4))
  bud = budget_lib.Budget(budget=8)
  for check in (lambda: scoring.check_gqa("pooled"), lambda: selection.topk(q, c, bud, "pooled"),
                lambda: scoring.scoring_queries(q, 1, "pooled"),
                lambda: helpers.select("quest", q, c, bud, gqa="pooled")):
    with pytest.raises(ValueError, match=r"gqa must be one of \('head', 'group'\)"):
      check()


def test_token_mask_covers_selected_blocks():
  sel = selection.Selection(idx=jnp.array([[[2, 0, 1]]]), n_valid=jnp.array([[2]]),
                            granularity=4)
  np.testing.assert_array_equal(sel.token_mask(16)[0, 0],
                                [1] * 4 + [0] * 4 + [1] * 4 + [0] * 4)


def test_budget_validation():
  for bad in (dict(budget=0.0), dict(budget=1.5), dict(budget=0), dict(budget=None),
              dict(budget=None, p=2.0), dict(n_sink=-1), dict(budget=True)):
    with pytest.raises(ValueError):
      budget_lib.Budget(**bad)
