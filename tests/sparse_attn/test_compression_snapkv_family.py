"""PyramidKV, ChunkKV, FINCH, CriticalKV and CriticalAdaKV against brute-force numpy.

The numpy side materialises the full causal attention (``test_compression_baselines``'s
problem and SnapKV votes) and applies each paper's rule as kvpress 0.5.5 writes it; a slot may
differ only where its key ties the cut-off within float32 rounding. Also: PyramidKV's layer
budgets (kvpress's ``get_layer_budget`` transcribed) and the per-layer buffers they size.
jit / vmap: ``test_compression_snapkv_family_jit``.
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
from sparse_attn.compression import criticalkv, finch, prefill, pyramidkv
from tests.sparse_attn.test_compression_baselines import (B, D, G, HKV, HQ, LENGTHS, N_SINK,
                                                          SCALE, T, WINDOW, causal_probs,
                                                          check_kept, group_mean, keep_fn,
                                                          make_problem, numpy_scores)

f32 = lambda x: jnp.asarray(x, jnp.float32)


def budgets_of(frac):
  return np.array([max(N_SINK + 1, int(frac * n)) for n in LENGTHS])


@functools.lru_cache(maxsize=None)
def prepared_keep_fn(m, prep):
  """``keep_fn`` with ``prep(state, arg)`` applied before scoring (``arg`` traced)."""
  @jax.jit
  def keep_of(q, k, v, pos, n, arg):
    cache = m.init_cache(B, HKV, T, D)
    state = m.init_state(B, HQ, HKV, D, T)
    _, cache, state = m.prefill(q, k, v, cache, state, pos)
    return m.keep_mask(cache, prep(state, arg), None, n)
  return keep_of


def run_keep(m, p, budgets, prep=None, arg=None):
  """``keep [B, K, T]`` of ``m`` on problem ``p`` (``prep(state, arg)`` before scoring)."""
  args = (f32(p["q"]), f32(p["k"]), f32(p["v"]), jnp.asarray(p["pos"]),
          jnp.asarray(budgets, jnp.int32))
  if prep is None:
    return np.asarray(keep_fn(m)(*args)[0])
  return np.asarray(prepared_keep_fn(m, prep)(*args, arg))


def check_lex(keep, primary, secondary, n):
  """``keep [n_tok]`` must be the lexicographic top ``n`` of (primary, secondary), up to keys
  that tie the cut within float32 rounding."""
  order = np.lexsort((np.arange(len(primary)), -secondary, -primary))
  want = np.zeros_like(keep)
  want[order[:n]] = True
  assert keep.sum() == n
  wrong = keep != want
  cut = primary[order[n - 1]]
  np.testing.assert_allclose(primary[wrong], cut, rtol=1e-4, atol=1e-7)


# ---- PyramidKV ----
def kvpress_layer_budget(q_len, ratio, window, beta, layer, num_layers):
  """kvpress 0.5.5 ``PyramidKVPress.get_layer_budget``, literally (Python floats)."""
  cap = window + q_len * (1 - ratio)
  min_num = (cap - window) / beta
  max_num = (cap - window) * 2 - min_num
  if max_num >= q_len - window:
    max_num = q_len - window
    min_num = (cap - window) * 2 - max_num
  if not (q_len >= max_num >= min_num >= window):
    return max(1, round(q_len * (1 - ratio)))
  steps = (max_num - min_num) / (num_layers - 1) if num_layers > 1 else 0.0
  return round(max_num - layer * steps)


@hypothesis.given(q=st.integers(1, 20000), ratio=st.sampled_from([0.1, 0.25, 0.5, 0.75, 0.875]),
                  window=st.sampled_from([4, 64]), beta=st.sampled_from([1, 5, 20]),
                  layers=st.integers(1, 40), data=st.data())
@hypothesis.settings(max_examples=200, deadline=None)
def test_pyramid_layer_budget_is_kvpress(q, ratio, window, beta, layers, data):
  layer = data.draw(st.integers(0, layers - 1))
  want = kvpress_layer_budget(q, ratio, window, beta, layer, layers)
  assert pyramidkv.layer_budget(q, ratio, window, beta, layer, layers) == want
  got = pyramidkv.layer_budget(jnp.asarray([q], jnp.int32), ratio, window, beta, layer, layers)
  assert abs(int(got[0]) - want) <= (1 if q > 4096 else 0)  # float32 rounding at .5 only


def test_pyramid_keeps_its_layer_budget_in_a_buffer_of_that_size():
  """Each layer keeps SnapKV's top ``budget(l)`` in its own smaller buffer; the layers' mean
  is the uniform budget."""
  p = make_problem(7)
  layers, ratio = 4, 0.5
  base = methods.make("pyramidkv", ratio=ratio, n_sink=N_SINK, window_size=WINDOW, beta=2)
  kept, caps = [], []
  compiled = prefill._keep._cache_size()  # pylint: disable=protected-access
  for layer in range(layers):
    m = base.for_layer(layer, layers)
    cache = m.init_cache(B, HKV, T, D)
    state = m.init_state(B, HQ, HKV, D, T)
    _, cache, state = jax.jit(m.prefill)(f32(p["q"]), f32(p["k"]), f32(p["v"]), cache, state,
                                         jnp.asarray(p["pos"]))
    keep, _ = m.prefill_keep(cache, state)
    keep = np.asarray(keep)
    want = [pyramidkv.layer_budget(n, ratio, WINDOW, 2, layer, layers) for n in LENGTHS]
    for b, n in enumerate(LENGTHS):
      np.testing.assert_array_equal(keep[b].sum(-1), want[b])
      check_kept(keep[b, :, :n], numpy_scores("snapkv", p, b, n, want[b]), want[b])
    small, _ = m.end_prefill(cache, state)
    assert small.capacity == m.round_capacity(max(w + T - n for w, n in zip(want, LENGTHS)))
    np.testing.assert_array_equal(np.asarray(small.valid).sum(-1),
                                  np.broadcast_to(np.asarray(want)[:, None], (B, HKV)))
    kept.append(want)
    caps.append(small.capacity)
  # the layers share one keep program (the layer is its traced operand, not a static option)
  assert prefill._keep._cache_size() - compiled <= 1  # pylint: disable=protected-access
  assert kept[0][0] > kept[-1][0] and caps[0] > caps[-1]
  assert abs(np.mean(kept, axis=0)[0] - (1 - ratio) * LENGTHS[0]) <= 1
  assert base.prompt_keep(LENGTHS[0]) == math.ceil((1 - ratio) * LENGTHS[0])  # no layer: mean


# ---- ChunkKV ----
def numpy_chunkkv(p, b, n, chunk):
  """kvpress's ChunkKV(SnapKV) keys per token: (chunk mean of the layer's votes, own votes)."""
  votes = numpy_scores("snapkv", p, b, n, 0) / WINDOW  # kvpress's mean over the window
  finite = np.isfinite(votes)
  votes = np.where(finite, votes, votes[finite].max() + 1).sum(0)  # [n], summed over heads
  means = np.concatenate([np.full(len(c), c.mean()) for c in np.split(
      votes, range(chunk, n, chunk))])
  return means, votes


@hypothesis.given(seed=st.integers(0, 2**31 - 1), frac=st.floats(0.2, 0.9),
                  chunk=st.sampled_from([3, 5, 8]))
@hypothesis.settings(max_examples=8, deadline=None)
def test_chunkkv_matches_brute_force(seed, frac, chunk):
  p, budgets = make_problem(seed), budgets_of(frac)
  m = methods.make("chunkkv", ratio=0.5, window_size=WINDOW, chunk_length=chunk)
  keep = run_keep(m, p, budgets)
  for b, n in enumerate(LENGTHS):
    primary, secondary = numpy_chunkkv(p, b, n, chunk)
    for h in range(HKV):
      np.testing.assert_array_equal(keep[b, h], keep[b, 0])
      check_lex(keep[b, h, :n], primary, secondary, budgets[b])


# ---- FINCH ----
def numpy_finch(p, b, n, question, chunk, ratio):
  """kvpress's FinchPress scores of row ``b`` (the question: the last ``question`` tokens)."""
  probs = causal_probs(p, b, n)[:, n - question:]  # [HQ, question, n]
  weight = np.arange(n - question, n)[None, :, None]  # kvpress's non_zero_counts
  votes = group_mean((probs * weight).mean(1))
  votes[:, n - question:] = -np.inf
  votes[:, n - question:] = votes.max() + 1
  if chunk is None:
    return votes, None
  share = np.zeros(votes.shape, bool)
  for start in range(0, n, chunk):
    part = votes[:, start:start + chunk]
    quota = math.ceil((1 - ratio) * part.shape[1] - 1e-9)
    for h in range(HKV):
      share[h, start + np.argsort(-part[h], kind="stable")[:quota]] = True
  return votes, share


@hypothesis.given(seed=st.integers(0, 2**31 - 1), frac=st.floats(0.2, 0.9),
                  question=st.integers(1, WINDOW), chunk=st.sampled_from([None, 7, 16]))
@hypothesis.settings(max_examples=10, deadline=None)
def test_finch_matches_brute_force(seed, frac, question, chunk):
  p, budgets = make_problem(seed), budgets_of(frac)
  m = methods.make("finch", ratio=0.5, n_sink=N_SINK, window_size=WINDOW, chunk_length=chunk)
  keep = run_keep(m, p, budgets, finch.set_question_length, jnp.int32(question))
  for b, n in enumerate(LENGTHS):
    votes, share = numpy_finch(p, b, n, question, chunk, 0.5)
    if share is None:
      check_kept(keep[b, :, :n], votes, budgets[b])
      continue
    for h in range(HKV):
      sink = np.arange(n) < N_SINK
      check_lex(keep[b, h, :n], np.where(sink, 2.0, share[h]), np.where(sink, np.inf, votes[h]),
                budgets[b])


@hypothesis.given(seed=st.integers(0, 2**31 - 1), question=st.integers(1, WINDOW))
@hypothesis.settings(max_examples=8, deadline=None)
def test_finch_votes_weight_each_question_query_by_its_position(seed, question):
  """FINCH's votes themselves, not only the kept set: each question query's attention times
  its position (kvpress's ``non_zero_counts``), to float32 rounding (a weight off by one
  position moves them by a few percent, which a kept set forgives at near-ties)."""
  p = make_problem(seed)
  m = methods.make("finch", ratio=0.5, n_sink=N_SINK, window_size=WINDOW)

  @jax.jit
  def votes(q, k, v, pos, length):
    cache = m.init_cache(B, HKV, T, D)
    state = m.init_state(B, HQ, HKV, D, T)
    _, cache, state = m.prefill(q, k, v, cache, state, pos)
    return m.scores(cache, finch.set_question_length(state, length), SCALE, None)

  got = np.asarray(votes(f32(p["q"]), f32(p["k"]), f32(p["v"]), jnp.asarray(p["pos"]),
                         jnp.int32(question)))
  for b, n in enumerate(LENGTHS):
    want, _ = numpy_finch(p, b, n, question, None, 0.5)
    np.testing.assert_allclose(got[b, :, :n], want, rtol=2e-5, atol=1e-9)


# ---- CriticalKV / CriticalAdaKV ----
def numpy_norm(p, b, n, wo):
  """``[HKV, n]``: ``||v W^O_h||_1`` averaged over each group (identity ``wo``: ``||v||_1``)."""
  v = np.repeat(p["v"][b, :, :n], G, axis=0)  # [HQ, n, D]
  return group_mean(np.abs(np.einsum("htd,hde->hte", v, wo)).sum(-1))


def numpy_two_stage(raw, norm, first, epsilon=1e-4):
  score = (raw + epsilon) * norm
  for h in range(raw.shape[0]):
    score[h, np.argsort(-raw[h], kind="stable")[:first[h]]] = np.inf
  return np.where(np.isinf(raw), np.inf, score)


@functools.lru_cache(maxsize=None)
def out_proj(seed):
  e = 12
  return np.random.default_rng(seed).normal(size=(HQ, D, e)) / math.sqrt(D)


@pytest.mark.parametrize("projection", ["identity", "model"])
@pytest.mark.parametrize("epsilon", [1e-4, 0.05])  # 0.05: of the votes' own scale
@hypothesis.given(seed=st.integers(0, 2**31 - 1), frac=st.floats(0.2, 0.9),
                  first=st.sampled_from([0.0, 0.5, 1.0]))
@hypothesis.settings(max_examples=8, deadline=None)
def test_criticalkv_matches_brute_force(projection, epsilon, seed, frac, first):
  """Two stages over SnapKV's votes as a mean over the window (kvpress's scale, which
  ``epsilon`` is added to: at 0.05 the scale decides the order)."""
  p, budgets = make_problem(seed), budgets_of(frac)
  wo = np.tile(np.eye(D), (HQ, 1, 1)) if projection == "identity" else out_proj(seed % 7)
  m = methods.make("criticalkv", ratio=0.5, n_sink=N_SINK, window_size=WINDOW,
                   first_stage_ratio=first, epsilon=epsilon)
  keep = (run_keep(m, p, budgets) if projection == "identity" else
          run_keep(m, p, budgets, criticalkv.set_out_proj, f32(wo)))
  for b, n in enumerate(LENGTHS):
    raw = np.where(np.arange(n) < N_SINK, np.inf, numpy_scores("snapkv", p, b, n, 0) / WINDOW)
    first_n = np.full(HKV, int(budgets[b] * first))
    check_kept(keep[b, :, :n], numpy_two_stage(raw, numpy_norm(p, b, n, wo), first_n, epsilon),
               budgets[b])


@hypothesis.given(seed=st.integers(0, 2**31 - 1), frac=st.floats(0.2, 0.9))
@hypothesis.settings(max_examples=8, deadline=None)
def test_criticaladakv_matches_brute_force(seed, frac):
  """Ada-KV's counts from SnapKV's scores (floor, then layer-wide), two stages per head."""
  p, budgets, wo = make_problem(seed), budgets_of(frac), out_proj(seed % 7)
  m = methods.make("criticaladakv", ratio=0.5, n_sink=N_SINK, window_size=WINDOW)
  keep = run_keep(m, p, budgets, criticalkv.set_out_proj, f32(wo))
  for b, n in enumerate(LENGTHS):
    raw = np.where(np.arange(n) < N_SINK, np.inf, numpy_scores("snapkv", p, b, n, 0) / WINDOW)
    floor = int(math.floor(0.2 * budgets[b]))
    tier = np.zeros(raw.shape, bool)
    for h in range(HKV):
      tier[h, np.argsort(-raw[h], kind="stable")[:floor]] = True
    flat = np.where(tier, np.inf, raw).ravel()
    top = np.argsort(-flat, kind="stable")[:HKV * budgets[b]]
    share = np.bincount(top // n, minlength=HKV)
    cut = np.sort(flat)[::-1][HKV * budgets[b] - 1]
    if np.isfinite(cut) and np.sum(np.isclose(flat, cut, rtol=1e-4)) > 1:
      continue  # the allocation itself sits on a float near-tie
    np.testing.assert_array_equal(keep[b, :, :n].sum(-1), share)
    score = numpy_two_stage(raw, numpy_norm(p, b, n, wo), (share * 0.5).astype(int))
    for h in range(HKV):
      check_kept(keep[b, h:h + 1, :n], score[h:h + 1], share[h])


def test_options_are_checked():
  with pytest.raises(ValueError, match="beta"):
    methods.make("pyramidkv", ratio=0.5, beta=0.5)
  with pytest.raises(ValueError, match="phase"):
    methods.make("chunkkv", ratio=0.5, phase="both")
  with pytest.raises(ValueError, match="chunk_length"):
    methods.make("finch", ratio=0.5, chunk_length=0)
  with pytest.raises(ValueError, match="first_stage_ratio"):
    methods.make("criticalkv", ratio=0.5, first_stage_ratio=1.5)
  assert methods.make("criticaladakv", ratio=0.5).head_budget == "adakv"
  assert methods.make("pyramidkv", budget=0.25) == methods.make("pyramidkv", ratio=0.75)


def test_defaults_are_kvpress_leaderboard_presses():
  """The defaults kvpress 0.5.5's leaderboard runs (each module docstring): the reference
  tests above pass their options explicitly, so a changed default would go unseen there."""
  snap = dict(window_size=64, kernel=5, n_sink=0)
  want = {"snapkv": snap, "chunkkv": dict(snap, chunk_length=20),
          "pyramidkv": dict(snap, beta=20),
          "criticalkv": dict(snap, epsilon=1e-4, first_stage_ratio=0.5),
          "finch": dict(window_size=64, chunk_length=None, normalize_scores=True, n_sink=0,
                        rerotate_keys=True)}
  for name, opts in want.items():
    m = methods.make(name, ratio=0.5)
    assert {k: getattr(m, k) for k in opts} == opts, name
