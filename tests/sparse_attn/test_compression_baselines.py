"""Each baseline's kept set against a brute-force numpy version on random prompts.

The numpy side materialises the full causal attention matrix (the thing the methods avoid) and
scores every key from its paper's definition; a slot may differ only where its score ties the
cut-off within float32 rounding. Ada-KV's layer-wide allocation is checked the same way.
"""

import functools
import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods

B, HQ, HKV, D = 2, 4, 2, 8
L, T = 40, 48
LENGTHS = (40, 29)
N_SINK, WINDOW = 2, 6
G = HQ // HKV
SCALE = 1 / math.sqrt(D)


def make_problem(seed):
  rng = np.random.default_rng(seed)
  pos = np.tile(np.arange(L), (B, 1))
  for b, n in enumerate(LENGTHS):
    pos[b, n:] = -1
  return dict(q=rng.normal(size=(B, HQ, L, D)), k=rng.normal(size=(B, HKV, L, D)) * 1.5,
              v=rng.normal(size=(B, HKV, L, D)), pos=pos)


def causal_probs(p, b, n):
  """``[HQ, n, n]`` exact causal softmax of row ``b``'s first ``n`` tokens."""
  kk = np.repeat(p["k"][b, :, :n], G, axis=0)
  z = SCALE * np.einsum("hsd,htd->hst", p["q"][b, :, :n], kk)
  z = np.where(np.tril(np.ones((n, n), bool)), z, -np.inf)
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def group_mean(x):
  return x.reshape(HKV, G, *x.shape[1:]).mean(1)


def numpy_scores(name, p, b, n, budget):
  """``[HKV, n]`` scores (+inf = forced) of row ``b`` from each paper's definition."""
  k = p["k"][b, :, :n]
  posn = np.arange(n)
  if name == "knorm":  # Devoto et al. 2024: lowest L2 norm
    return -np.linalg.norm(k, axis=-1)
  if name == "keydiff":  # Park et al. 2025: -cos to the mean unit key
    unit = k / np.linalg.norm(k, axis=-1, keepdims=True)
    anchor = unit.mean(1, keepdims=True)
    return -np.sum(unit * anchor, -1) / np.linalg.norm(anchor, axis=-1)
  if name == "streaming_llm":  # Xiao et al. 2024: most recent
    return np.tile(posn.astype(float), (HKV, 1))
  if name == "random":  # the baseline: the seeded uniform draws themselves
    return np.asarray(jax.random.uniform(jax.random.key(0), (B, HKV, T)))[b, :, :n]
  if name.startswith("lagkv"):  # arXiv 2504.04704, as kvpress's LagKVPress
    return numpy_lagkv(k, p["v"][b, :, :n], LAG[name])
  if name.startswith("cur"):  # arXiv 2509.15038, as kvpress's CURPress: windowed k2 * v2
    rows = [k, p["v"][b, :, :n]]
    if name == "cur_random":  # use_random_leverage: both projected on one Gaussian [D, 20]
      g = np.asarray(jax.random.normal(jax.random.key(0), (D, 20))) / np.sqrt(20)
      rows = [x @ g for x in rows]
    lev = [numpy_windowed((x ** 2).sum(-1), 16) for x in rows]
    score = lev[0] * lev[1]
    return score / score.sum(-1, keepdims=True)
  probs = causal_probs(p, b, n)
  if name == "tova":  # Oren et al. 2024: the last query's attention, all heads averaged
    return np.tile(probs[:, -1].mean(0), (HKV, 1))
  if name == "tova_group":  # the per-KV-group variant: each group's heads averaged
    return group_mean(probs[:, -1])
  if name == "h2o":  # Zhang et al. 2023: accumulated attention + recent half
    acc = group_mean(probs.sum(1))
    return np.where(posn >= n - budget // 2, np.inf, acc)
  if name == "observed_attention":  # kvpress: the mean over the queries that see the key
    return group_mean(probs.sum(1) / (n - posn))
  if name == "snapkv":  # Li et al. 2024: pooled window votes + the window
    votes = group_mean(probs[:, n - WINDOW:].sum(1))
    votes[:, n - WINDOW:] = 0.0
    padded = np.pad(votes, ((0, 0), (2, 2 + T - n)))
    pooled = np.stack([np.convolve(r, np.ones(5) / 5, mode="valid") for r in padded])[:, :n]
    return np.where(posn >= n - WINDOW, np.inf, pooled)
  raise ValueError(name)


LAG = {"lagkv": 4, "lagkv_short": 16}  # lag 16: row 1 (29 tokens) is below n_sink + 2 lag


def numpy_windowed(x, w):
  """``x [H, n]`` over each run of ``w`` tokens' sum (the last run partial)."""
  h, n = x.shape
  runs = np.pad(x, ((0, 0), (0, -n % w))).reshape(h, -1, w)
  return (runs / runs.sum(-1, keepdims=True)).reshape(h, -1)[:, :n]


def numpy_lagkv(k, v, lag):
  """``[H, n]`` LagKV scores, literally as kvpress's ``LagKVPress.score``."""
  h, n, d = k.shape
  if n < N_SINK + 2 * lag:
    return np.concatenate([np.ones((h, N_SINK)),
                           np.tile(np.arange(n - N_SINK) / (n - N_SINK), (h, 1))], -1)
  end = N_SINK + (n - N_SINK) // lag * lag

  def states(x):
    t = x[:, N_SINK:end].reshape(h, -1, lag, d)
    ref, cur = t[:, 1:], t[:, :-1]
    lo, hi = ref.min(2, keepdims=True), ref.max(2, keepdims=True)
    s = ((cur - lo) / (hi - lo)).std(-1, ddof=1)
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

  score = (states(k) + states(v)) / 2
  rank = score.argsort(-1).argsort(-1) / lag
  return np.concatenate([np.ones((h, N_SINK)), rank.reshape(h, -1),
                         np.ones((h, lag + n - end))], -1)


def check_kept(keep, score, budget, total=None):
  """``keep [H, n]`` must be the top ``budget`` of ``score`` per head (or ``total`` overall)."""
  score = np.where(np.arange(score.shape[-1]) < N_SINK, np.inf, score)
  if total is None:
    for h in range(score.shape[0]):
      check_kept(keep[h:h + 1], score[h:h + 1], None, total=budget)
    return
  flat, kept = score.ravel(), keep.ravel()
  assert kept.sum() == min(total, flat.size)
  cut = np.sort(flat)[::-1][total - 1]
  wrong = kept != (flat >= cut)
  # only near-ties with the cut-off may differ (float32 vs float64)
  np.testing.assert_allclose(flat[wrong], cut, rtol=1e-4, atol=1e-7)


BASELINES = ["knorm", "keydiff", "streaming_llm", "tova", "tova_group", "h2o",
             "observed_attention", "snapkv", "cur", "cur_random", "lagkv", "lagkv_short",
             "random"]


@functools.lru_cache(maxsize=None)
def keep_fn(m):
  """Jitted ``(q, k, v, pos, n) -> (keep, cache.pos)`` after a dense prefill of method ``m``."""
  @jax.jit
  def keep_of(q, k, v, pos, n):
    cache = m.init_cache(B, HKV, T, D)
    state = m.init_state(B, HQ, HKV, D, T)
    _, cache, state = m.prefill(q, k, v, cache, state, pos)
    return m.keep_mask(cache, state, None, n), cache.pos
  return keep_of


def method(name, **kw):
  if name == "tova_group":
    name, kw = "tova", dict(kw, scope="group")
  if name in LAG:
    name, kw = "lagkv", dict(kw, lag_size=LAG[name])
  if name == "cur_random":
    name, kw = "cur", dict(kw, random_leverage=True)
  return methods.make(name, ratio=0.5, n_sink=N_SINK,
                      **(dict(window_size=WINDOW) if name == "snapkv" else {}), **kw)


@pytest.mark.parametrize("name", BASELINES)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), frac=st.floats(0.2, 0.9))
@hypothesis.settings(max_examples=10, deadline=None)
def test_kept_set_matches_brute_force(name, seed, frac):
  p = make_problem(seed)
  budgets = np.array([max(N_SINK + 1, int(frac * n)) for n in LENGTHS])
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  keep, pos = keep_fn(method(name))(f32(p["q"]), f32(p["k"]), f32(p["v"]), jnp.asarray(p["pos"]),
                           jnp.asarray(budgets, jnp.int32))
  keep, pos = np.asarray(keep), np.asarray(pos)
  for b, n in enumerate(LENGTHS):
    np.testing.assert_array_equal(pos[b, :, :n], np.tile(np.arange(n), (HKV, 1)))
    assert not keep[b, :, n:].any()
    check_kept(keep[b, :, :n], numpy_scores(name, p, b, n, budgets[b]), budgets[b])


@pytest.mark.parametrize("name", ["tova_group", "snapkv"])  # snapkv: the board's adakv_snapkv
@pytest.mark.parametrize("skew,floor", [(1.0, 0.25), (0.0, 0.75), (4.0, 0.75)])
@hypothesis.given(seed=st.integers(0, 2**31 - 1), frac=st.floats(0.2, 0.9))
@hypothesis.settings(max_examples=8, deadline=None)
def test_adakv_allocation_matches_brute_force(name, skew, floor, seed, frac):
  """Ada-KV (Feng et al. 2024, Alg. 1): per-head floor, then one top-k over all heads.
  ``skew`` scales kv head 0's keys (0: its attention uniform, 4: sharp), so that one top-k
  over the layer would starve a head; a floor of 0.75 lies above the sinks and SnapKV's
  window and decides what that head keeps (a floor of 0 fails this test)."""
  m = method(name, head_budget="adakv", floor=floor)
  p = make_problem(seed)
  p["k"][:, 0] *= skew
  budgets = np.array([max(N_SINK + 1, int(frac * n)) for n in LENGTHS])
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  keep = np.asarray(keep_fn(m)(f32(p["q"]), f32(p["k"]), f32(p["v"]), jnp.asarray(p["pos"]),
                               jnp.asarray(budgets, jnp.int32))[0])
  for b, n in enumerate(LENGTHS):
    score = numpy_scores(name, p, b, n, budgets[b])
    score = np.where(np.arange(n) < N_SINK, np.inf, score)
    guaranteed = int(math.floor(floor * budgets[b]))
    # Tier 1: each head's own top `guaranteed` (and the sinks); tier 0: the rest, layer-wide.
    floor_mask = np.zeros_like(keep[b, :, :n])
    for h in range(HKV):
      floor_mask[h, np.argsort(-score[h], kind="stable")[:guaranteed]] = True
    assert keep[b, :, :n][floor_mask].all()
    rest = np.where(floor_mask, np.inf, score)
    check_kept(keep[b, :, :n], rest, None, total=HKV * budgets[b])
    assert keep[b].sum() == HKV * budgets[b]


def test_tova_layer_scope_keeps_one_set_for_every_head():
  """The paper's TOVA: every kv head keeps the same tokens (the layer's head-averaged
  attention), through prefill compaction and one-token-per-step decode eviction."""
  rng = np.random.default_rng(5)
  f32 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  m = methods.make("tova", ratio=0.5, phase="both", n_sink=N_SINK)
  cache = m.init_cache(B, HKV, T, D)
  state = m.init_state(B, HQ, HKV, D, T)
  pos = jnp.asarray(make_problem(5)["pos"])
  _, cache, state = jax.jit(m.prefill)(f32(B, HQ, L, D), f32(B, HKV, L, D), f32(B, HKV, L, D),
                                       cache, state, pos)
  cache, state = m.end_prefill(cache, state)
  dec = jax.jit(m.decode)
  for i in range(4):
    _, cache, state = dec(f32(B, HQ, 1, D), f32(B, HKV, 1, D), f32(B, HKV, 1, D), cache, state,
                          jnp.asarray(LENGTHS)[:, None] + i)
    kept = np.where(np.asarray(cache.valid), np.asarray(cache.pos), -1)
    for h in range(1, HKV):
      np.testing.assert_array_equal(kept[:, h], kept[:, 0])
  with pytest.raises(ValueError, match="scope"):
    methods.make("tova", ratio=0.5, head_budget="adakv")
  with pytest.raises(ValueError, match="scope"):
    methods.make("tova", ratio=0.5, scope="head")


@hypothesis.given(seed=st.integers(0, 2**31 - 1), start=st.integers(0, 30),
                  block=st.sampled_from([3, 8, 64]), key_tile=st.sampled_from([5, 16, 48, 512]))
@hypothesis.settings(max_examples=12, deadline=None)
def test_column_sums_match_brute_force(seed, start, block, key_tile):
  """H2O's accumulated attention of one chunk (positions ``start ..``, some padded) over a
  cache in shuffled slot order with empty slots, for any query block and key tile (tiles a
  block cannot see are skipped; the clamped last tile counts no slot twice)."""
  from sparse_attn.compression import observe  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  s = 10
  q = rng.normal(size=(B, HQ, s, D))
  k = rng.normal(size=(B, HKV, T, D))
  pos = np.tile(np.arange(start, start + s), (B, 1))
  pos[1, 7:] = -1  # padding rows
  filled = start + s
  kpos = np.full((B, HKV, T), -1)
  for b in range(B):
    for h in range(HKV):
      kpos[b, h, rng.permutation(T)[:filled]] = np.arange(filled)
  kvalid = kpos >= 0
  z = SCALE * np.einsum("bkgsd,bktd->bkgst", q.reshape(B, HKV, G, s, D), k)
  see = kvalid[:, :, None, None, :] & (kpos[:, :, None, None, :] <= pos[:, None, None, :, None])
  z = np.where(see, z, -np.inf)
  lse = np.log(np.exp(z).sum(-1))  # [B, K, G, s]
  probs = np.where(see, np.exp(z - np.where(np.isfinite(lse), lse, 0)[..., None]), 0.0)
  want = probs.sum(3).mean(2)  # [B, K, T]
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  got = observe.column_sums(f32(q), jnp.asarray(pos, jnp.int32), f32(lse.reshape(B, HQ, s)),
                            f32(k), jnp.asarray(kpos, jnp.int32), jnp.asarray(kvalid), SCALE,
                            block, key_tile)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=1e-6)


@hypothesis.given(seed=st.integers(0, 2**31 - 1), start=st.integers(0, 30),
                  window=st.sampled_from([None, 1, 4, 9]))
@hypothesis.settings(max_examples=12, deadline=None)
def test_column_counts_match_brute_force(seed, start, window):
  """The queries of one chunk (some padded, out of order) that see each slot of a shuffled
  cache with empty slots: causal, and inside the query's sliding window when there is one."""
  from sparse_attn.compression import observe  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  s = 10
  pos = np.stack([rng.permutation(np.arange(start, start + s)) for _ in range(B)])
  pos[1, rng.permutation(s)[:3]] = -1
  kpos = np.full((B, HKV, T), -1)
  for b in range(B):
    for h in range(HKV):
      kpos[b, h, rng.permutation(T)[:start + s]] = np.arange(start + s)
  kvalid = kpos >= 0
  q, k = pos[:, None, :, None], kpos[:, :, None, :]
  see = (q >= 0) & (k <= q) & kvalid[:, :, None, :]
  if window is not None:
    see &= k > q - window
  got = observe.column_counts(jnp.asarray(pos, jnp.int32), jnp.asarray(kpos, jnp.int32),
                              jnp.asarray(kvalid), window)
  np.testing.assert_array_equal(np.asarray(got), see.sum(2))


def test_observed_attention_counts_across_chunks():
  """A prompt prefilled in chunks scores as in one: the sums and the counts both accumulate
  (the first chunk's keys are seen again by the later chunks' queries)."""
  m = method("observed_attention")
  p = make_problem(11)
  f32 = lambda x: jnp.asarray(x, jnp.float32)

  def scores(chunks):
    cache, state = m.init_cache(B, HKV, T, D), m.init_state(B, HQ, HKV, D, T)
    for a, b in chunks:
      _, cache, state = m.prefill(f32(p["q"][:, :, a:b]), f32(p["k"][:, :, a:b]),
                                  f32(p["v"][:, :, a:b]), cache, state,
                                  jnp.asarray(p["pos"][:, a:b]))
    return np.asarray(m.scores(cache, state, SCALE, jnp.asarray(LENGTHS))), state

  whole, _ = scores([(0, L)])
  split, state = scores([(0, 13), (13, 31), (31, L)])
  np.testing.assert_allclose(split, whole, rtol=2e-5, atol=1e-7)
  for b, n in enumerate(LENGTHS):  # a causal prompt: key j is seen by n - j queries
    np.testing.assert_array_equal(np.asarray(state["seen"])[b, :, :n],
                                  np.tile(n - np.arange(n), (HKV, 1)))
    np.testing.assert_allclose(whole[b, :, :n], numpy_scores("observed_attention", p, b, n, 0),
                               rtol=2e-4, atol=1e-7)


@pytest.mark.parametrize("name", ["cur", "lagkv"])
def test_sequence_scorers_follow_positions_not_slots(name):
  """CUR's windows and LagKV's partitions are runs of tokens: a cache holding the same tokens
  in shuffled slots (with empty slots between) scores each token the same."""
  import types  # pylint: disable=g-import-not-at-top
  m = methods.make(name, ratio=0.5, **(dict(lag_size=4) if name == "lagkv" else {}))
  p = make_problem(3)
  rng = np.random.default_rng(0)
  perm = rng.permutation(T)
  pos = np.full((B, HKV, T), -1)
  pos[:, :, :L] = p["pos"][:, None]
  kv = [np.pad(x, ((0, 0), (0, 0), (0, T - L), (0, 0))) for x in (p["k"], p["v"])]
  cache = lambda pos, k, v: types.SimpleNamespace(
      pos=jnp.asarray(pos), valid=jnp.asarray(pos >= 0), k=jnp.asarray(k, jnp.float32),
      v=jnp.asarray(v, jnp.float32), head_dim=D)
  ordered = np.asarray(m.scores(cache(pos, *kv), {}, SCALE, None))
  shuffled = np.asarray(m.scores(cache(pos[..., perm], *(x[:, :, perm] for x in kv)), {}, SCALE,
                                 None))
  valid = pos[..., perm] >= 0
  np.testing.assert_allclose(shuffled[valid], ordered[..., perm][valid], rtol=1e-6)
