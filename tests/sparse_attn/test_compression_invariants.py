"""For every compression method: ratio 0 is dense; ratio r really shrinks the cache.

Also: sinks are always kept, bad ratios / options raise, and the prompt tokens kept per head are
exactly ``ceil((1 - r) L)`` in a physically smaller buffer (``KVCache.nbytes``).
"""

import dataclasses
import fractions
import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import compression, methods
from sparse_attn.compression import flat

NAMES = sorted(compression.BUILDERS)
B, HQ, HKV, D = 2, 4, 2, 16
L, T = 40, 64  # prompt length, allocated capacity (prompt + decode room)
STEPS = 3
LENGTHS = (40, 33)  # the second row is padded (positions -1)
# Methods whose paper fixes each head's count otherwise than ceil((1 - r) L) (skipped by the
# two count tests below; each has its own count test): name -> why.
OWN_COUNTS = {"duo_attention_on_the_fly": "streaming heads keep sinks + recent tokens and "
              "retrieval heads every token, in its own flat buffer (test_compression_duo_attention)",
              "think": "prunes key channels, not tokens: every token stays, the prompt keys "
              "with ceil((1 - r) D) channels, per head only (test_compression_think)"}
# Methods whose one budget sets two stages (eviction, then a sparse decode): ratio 0 still
# decodes sparsely and ``budget`` is not ``1 - ratio``; name -> why (skipped by the ratio-0,
# budget and Ada-KV tests; its own tests cover budget 1 == dense and the split).
TWO_STAGE = {"rocketkv": "budget b keeps b^r of the prompt and decodes top-k b/2 (the authors' "
             "split), uniform heads only (test_rocketkv)"}


def problem(seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  pos = np.tile(np.arange(L), (B, 1))
  for i, n in enumerate(LENGTHS):
    pos[i, n:] = -1
  return dict(q=f(B, HQ, L, D), k=f(B, HKV, L, D), v=f(B, HKV, L, D), pos=jnp.asarray(pos),
              dq=f(STEPS, B, HQ, 1, D), dk=f(STEPS, B, HKV, 1, D), dv=f(STEPS, B, HKV, 1, D))


def run(m, p, steps=STEPS):
  """prefill -> end_prefill -> ``steps`` decode steps; returns outputs and caches."""
  cache = m.init_cache(B, HKV, T, D)
  state = m.init_state(B, HQ, HKV, D, T)
  out, cache, state = jax.jit(m.prefill)(p["q"], p["k"], p["v"], cache, state, p["pos"])
  full = cache
  cache, state = m.end_prefill(cache, state)
  outs = [out]
  dec = jax.jit(m.decode)
  lengths = jnp.asarray(LENGTHS)
  for i in range(steps):
    o, cache, state = dec(p["dq"][i], p["dk"][i], p["dv"][i], cache, state,
                          (lengths + i)[:, None])
    outs.append(o)
  return outs, full, cache


@pytest.fixture(scope="module")
def dense_run():
  m = methods.make("dense")
  p = problem()
  cache = m.init_cache(B, HKV, T, D)
  state = m.init_state(B, HQ, HKV, D, T)
  out, cache, state = jax.jit(m.prefill)(p["q"], p["k"], p["v"], cache, state, p["pos"])
  outs = [out]
  lengths = jnp.asarray(LENGTHS)
  dec = jax.jit(m.decode)
  for i in range(STEPS):
    # the dense method writes at slot = position; rows are contiguous so that is slot = length
    o, cache, state = dec(p["dq"][i], p["dk"][i], p["dv"][i], cache, state,
                               (lengths + i)[:, None])
    outs.append(o)
  return outs


@pytest.mark.parametrize("name", NAMES)
def test_ratio_zero_is_dense(name, dense_run):
  if name in TWO_STAGE:
    pytest.skip(TWO_STAGE[name])
  outs, _, cache = run(methods.make(name, ratio=0.0), problem())
  assert cache.capacity == T
  for got, want in zip(outs, dense_run):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def per_head(cache):
  """``pos, valid [B, K, S]`` of either layout (per-head ``KVCache`` or flat Ada-KV cache)."""
  if isinstance(cache, flat.FlatKVCache):
    cache = flat.heads_view(cache)
  return np.asarray(cache.pos), np.asarray(cache.valid)


def expected_kept(n, ratio):
  f = fractions.Fraction(ratio).limit_denominator(1000)
  return math.ceil((1 - f) * n)


@pytest.mark.parametrize("name", NAMES)
def test_ratio_keeps_ceil_in_smaller_buffer(name):
  if name in OWN_COUNTS:
    pytest.skip(OWN_COUNTS[name])
  ratio, n_sink = 0.5, 2
  opts = dict(snapkv=dict(window_size=8), kvzip=dict(layerwise=True)).get(name, {})
  m = methods.make(name, ratio=ratio, n_sink=n_sink, head_budget="uniform", **opts)
  outs, full, cache = run(m, problem(1), steps=0)
  kept = [expected_kept(n, ratio) for n in LENGTHS]
  valid = np.asarray(cache.valid)
  pos = np.asarray(cache.pos)
  for b in range(B):
    for h in range(HKV):
      prompt = pos[b, h][valid[b, h] & (pos[b, h] < LENGTHS[b])]
      assert len(prompt) == kept[b], (b, h)
      assert set(range(n_sink)) <= set(prompt.tolist())  # sinks always kept
      assert len(set(prompt.tolist())) == len(prompt)
  # each row keeps the decode room the caller gave it (T - L), beside its largest head
  assert cache.capacity == m.round_capacity(max(k + T - n for k, n in zip(kept, LENGTHS)))
  assert cache.capacity < T
  assert cache.nbytes() < full.nbytes()
  # every per-slot buffer shrinks with the capacity (only `length [B]` does not)
  assert cache.nbytes() == pytest.approx(full.nbytes() * cache.capacity / T, rel=1e-3)
  for o in outs:
    assert np.all(np.isfinite(np.asarray(o)))


def test_ratio_07_count_is_exact():
  assert expected_kept(10, 0.7) == 3
  m = methods.make("knorm", ratio=0.7, block_size=4)
  p = problem(2)
  _, _, cache = run(m, p, steps=0)
  np.testing.assert_array_equal(np.asarray(cache.valid).sum(-1)[:, 0],
                                [expected_kept(n, 0.7) for n in LENGTHS])


@pytest.mark.parametrize("name", ["knorm", "h2o"])
def test_decode_reads_only_the_kept_tokens(name):
  """After compaction, decoding equals exact attention over the kept prompt tokens + new ones."""
  m = methods.make(name, ratio=0.5, head_budget="adakv")
  p = problem(3)
  outs, full, cache = run(m, p)
  # Reference: the full prompt cache with the evicted tokens masked out, then the decoded ones.
  kept = np.zeros((B, HKV, T), bool)
  pos, valid = per_head(cache)
  for b in range(B):
    for h in range(HKV):
      kept[b, h, pos[b, h][valid[b, h]]] = True
  dense = methods.make("dense")
  ref_cache = dataclasses.replace(
      full, pos=jnp.where(jnp.asarray(kept[..., :T]), full.pos, -1))
  lengths = jnp.asarray(LENGTHS)
  state = dense.init_state(B, HQ, HKV, D, T)
  dec = jax.jit(dense.decode)
  for i in range(STEPS):
    o, ref_cache, state = dec(p["dq"][i], p["dk"][i], p["dv"][i], ref_cache, state,
                                       (lengths + i)[:, None])
    np.testing.assert_allclose(outs[i + 1], o, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, True, "half"])
def test_bad_ratio_raises(ratio):
  with pytest.raises(ValueError, match="ratio"):
    methods.make("expected_attention", ratio=ratio)


@pytest.mark.parametrize("bad,match", [
    (dict(foo=1), "valid options"), (dict(phase="later"), "phase"),
    (dict(head_budget="greedy"), "head_budget"), (dict(n_sink=-1), "n_sink"),
    (dict(interval=0), "interval")])
def test_bad_options_raise(bad, match):
  for name in NAMES:
    with pytest.raises(ValueError, match=match):
      methods.make(name, ratio=0.5, **bad)


def test_spec_inline_options_and_registry():
  m = methods.make("snapkv:ratio=0.25,window_size=16,head_budget=adakv")
  assert (m.ratio, m.window_size, m.head_budget) == (0.25, 16, "adakv")
  assert m.window == 1 and m.rect_interval == 0  # the decode-loop flags
  assert methods.make("streaming_llm").n_sink == 4
  with pytest.raises(ValueError, match="enhancer"):
    methods.make("snapkv+resa", ratio=0.5)
  hash(methods.make("expected_attention", ratio=0.5, rope_inv_freq=np.ones(8)))


def test_a_budget_is_the_fraction_kept():
  """``budget`` means what it means for a selector: ``ratio = 1 - budget``, the same method
  (its spec says ``ratio``); a keyword overrides an inline one; both at one level or a token
  count raise."""
  for name in set(NAMES) - set(TWO_STAGE):
    assert methods.make(name, budget=0.1) == methods.make(name, ratio=0.9)
  assert methods.make("snapkv:budget=0.25") == methods.make("snapkv:ratio=0.75")
  assert methods.make("snapkv:ratio=0.5", budget=0.1).ratio == 0.9
  assert methods.make("snapkv:budget=0.5", ratio=0.25).ratio == 0.25
  ea = methods.make("expected-attention", budget=0.1)  # the preset's inline ratio=0.5
  assert ea == methods.make("expected-attention", ratio=0.9) and ea.head_budget == "adakv"
  for spec, kw in (("snapkv", dict(budget=0.1, ratio=0.5)), ("snapkv:budget=0.1,ratio=0.5", {})):
    with pytest.raises(ValueError, match="budget .* or ratio .*, not both"):
      methods.make(spec, **kw)
  for b in (256, 256.0):
    with pytest.raises(ValueError, match="keeps a fraction of the context.*token count 256"):
      methods.make("snapkv", budget=b)
  with pytest.raises(ValueError, match=r"a fractional budget must be in \(0, 1\], got 1.5"):
    methods.make("tova", budget=1.5)


def test_end_prefill_under_jit_needs_decode_slots():
  m = methods.make("knorm", ratio=0.5)
  p = problem()
  cache = m.init_cache(B, HKV, T, D)
  state = m.init_state(B, HQ, HKV, D, T)
  _, cache, state = jax.jit(m.prefill)(p["q"], p["k"], p["v"], cache, state, p["pos"])
  with pytest.raises(ValueError, match="decode_slots"):
    jax.jit(m.end_prefill)(cache, state)


def adakv_opts(name):
  return {"snapkv": dict(window_size=8), "tova": dict(scope="group")}.get(name, {})


@pytest.mark.parametrize("name", NAMES)
def test_adakv_cache_bytes_equal_kept_tokens(name):
  """The same with Ada-KV budgets: the flat buffer holds the kept tokens and the decode room,
  padded to a multiple of ``block_size`` once per layer (less than one block)."""
  if name in OWN_COUNTS or name in TWO_STAGE:
    pytest.skip(OWN_COUNTS.get(name) or TWO_STAGE[name])
  ratio, n_sink, bs = 0.5, 2, 8
  m = methods.make(name, ratio=ratio, n_sink=n_sink, head_budget="adakv", block_size=bs,
                   **adakv_opts(name))
  outs, full, cache = run(m, problem(1))
  assert isinstance(cache, flat.FlatKVCache)
  kept = [expected_kept(n, ratio) for n in LENGTHS]
  pos, valid = per_head(cache)
  for b in range(B):
    prompt = [pos[b, h][valid[b, h] & (pos[b, h] < LENGTHS[b])] for h in range(HKV)]
    assert sum(len(x) for x in prompt) == HKV * kept[b]  # Ada-KV's layer-wide total
    for x in prompt:
      assert set(range(n_sink)) <= set(x.tolist()) and len(set(x.tolist())) == len(x)
      assert len(x) >= math.floor(m.floor * kept[b])
    new = [pos[b, h][valid[b, h] & (pos[b, h] >= LENGTHS[b])] for h in range(HKV)]
    for x in new:  # every decoded token in every head
      assert sorted(x.tolist()) == list(range(LENGTHS[b], LENGTHS[b] + STEPS))
  # each row: its kept tokens and the decode room the caller gave it (T - L), for every head
  need = max(HKV * (k + T - n) for k, n in zip(kept, LENGTHS))
  slot_bytes = 2 * D * 4 + 4 + 1  # f32 key and value, int32 position, int8 head id
  assert cache.capacity == -(-need // bs) * bs
  assert cache.nbytes() == B * cache.capacity * slot_bytes + B * 4  # + length [B] int32
  assert 0 <= cache.nbytes() - B * need * slot_bytes - B * 4 < B * bs * slot_bytes
  # keys and values: (1 - ratio) of the prompt's plus the room, not the largest head's padding
  kv = cache.k.nbytes + cache.v.nbytes
  dense_kv = full.k.nbytes + full.v.nbytes
  assert kv == pytest.approx(dense_kv * need / (HKV * T), abs=B * bs * 2 * D * 4)
  for o in outs:
    assert np.all(np.isfinite(np.asarray(o)))


@hypothesis.given(seed=st.integers(0, 2**31 - 1), skew=st.floats(0.05, 1.0))
@hypothesis.settings(max_examples=4, deadline=None)
def test_adakv_flat_cache_against_numpy(seed, skew):
  """KNorm + Ada-KV (Feng et al. 2024, Alg. 1) in numpy: each head's floor, then one layer-wide
  top ``K n``; the flat cache must hold exactly those keys and values, heads contiguous and in
  token order, and its shape must not depend on the allocation (one compiled compaction)."""
  ratio, n_sink, floor = 0.5, 2, 0.25
  m = methods.make("knorm", ratio=ratio, n_sink=n_sink, head_budget="adakv", floor=floor)
  p = problem(seed)
  p["k"] = p["k"].at[:, 0].multiply(skew)  # head 0's keys are short: it gets more of the budget
  _, _, cache = run(m, p, steps=0)
  k, v = np.asarray(p["k"]), np.asarray(p["v"])
  ck, cv, cpos, chead = (np.asarray(x) for x in (cache.k, cache.v, cache.pos, cache.head))
  for b, n in enumerate(LENGTHS):
    budget = expected_kept(n, ratio)
    score = -np.linalg.norm(k[b, :, :n], axis=-1)  # [HKV, n]
    score[:, :n_sink] = np.inf
    tier = np.zeros_like(score)
    for h in range(HKV):
      tier[h, np.argsort(-score[h], kind="stable")[:math.floor(floor * budget)]] = 1
    flat_order = np.lexsort((-score.ravel(), -tier.ravel()))[:HKV * budget]
    want_head, want_pos = np.divmod(np.sort(flat_order), n)  # head-major, token order
    got = int(cache.length[b])
    assert got == HKV * budget
    np.testing.assert_array_equal(chead[b, :got], want_head)
    np.testing.assert_array_equal(cpos[b, :got], want_pos)
    np.testing.assert_array_equal(ck[b, :got], k[b, want_head, want_pos])
    np.testing.assert_array_equal(cv[b, :got], v[b, want_head, want_pos])
    assert np.all(cpos[b, got:] == -1)
  # the capacity is fixed by the layer total, whatever the per-head split
  assert cache.capacity == m.round_capacity(max(HKV * (expected_kept(n, ratio) + T - n)
                                                for n in LENGTHS))


def test_adakv_flat_cache_masked_row_and_jit():
  """A padding row (position -1) writes nothing and returns 0 on the flat cache (the
  empty-row contract), and the jitted decode equals the plain call."""
  m = methods.make("knorm", ratio=0.5, head_budget="adakv")
  p = problem(4)
  _, _, cache = run(m, p, steps=0)
  state = m.init_state(B, HQ, HKV, D, T)  # knorm keeps no query state
  positions = jnp.asarray([[LENGTHS[0]], [-1]])
  args = (p["dq"][0], p["dk"][0], p["dv"][0], cache, state, positions)
  out, new, _ = m.decode(*args)
  out_j, new_j, _ = jax.jit(m.decode)(*args)
  np.testing.assert_allclose(out_j, out, atol=1e-6)
  jax.tree_util.tree_map(np.testing.assert_array_equal, new_j, new)
  assert np.all(np.asarray(out[1]) == 0) and np.all(np.isfinite(np.asarray(out)))
  for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(cache)):
    np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(b)[1])  # row 1 untouched
  assert int(new.length[0]) == int(cache.length[0]) + HKV  # one slot per kv head
