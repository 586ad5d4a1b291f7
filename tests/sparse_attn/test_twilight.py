"""Twilight (sparse_attn/selectors/twilight.py): a brute-force numpy reference of its top-p set
on random caches, its invariants (topp=1 is the base Quest selection, a full budget decodes as
dense, jit and vmap agree, empty rows and padding never NaN) and its spec options."""

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods, selectors
from sparse_attn.budget import Budget
from sparse_attn.selectors import Quest, Twilight
from tests.sparse_attn import helpers

BS, CAP, D = 4, 64, 8


def _np_quantise(k, bits):
  """Asymmetric min-max per-token quantisation and back, in float64."""
  k = np.asarray(k, np.float64)
  lo, hi = k.min(-1, keepdims=True), k.max(-1, keepdims=True)
  levels = 2 ** bits - 1
  step = np.maximum(hi - lo, 1e-9) / levels
  return np.clip(np.round((k - lo) / step), 0, levels) * step + lo


def _reference(q, cache, sel: Twilight):
  """Per (row, head): the kept slot set, or None where the top-p boundary is too close to call
  in float32. Candidates are the Quest selection's slots inside the context."""
  base = Quest(budget=sel.budget, block_size=sel.block_size, gqa=sel.gqa).select(
      q, cache, impl="xla")
  pages, n_pages = np.asarray(base.idx), np.asarray(base.n_valid)
  k, length = np.asarray(cache.k, np.float64), np.asarray(cache.length)
  qn = np.asarray(q, np.float64)
  b, hq = qn.shape[:2]
  hkv = k.shape[1]
  h = pages.shape[1]
  bud = sel.budget
  out = {}
  for i in range(b):
    for j in range(h):
      kv = j // (h // hkv)
      qj = qn[i, j] if h == hq else qn[i, j * (hq // hkv):(j + 1) * (hq // hkv)].mean(0)
      slots = sorted(s for p in pages[i, j, :n_pages[i, j]] for s in range(p * BS, p * BS + BS)
                     if s < length[i])
      if not slots:
        out[i, j] = set()
        continue
      est = (_np_quantise(k[i, kv, slots], sel.bits) @ qj) / np.sqrt(D)
      w = np.exp(est - est.max())
      w /= w.sum()
      forced = [s < bud.n_sink or (bud.local_window > 0 and s >= length[i] - bud.local_window)
                for s in slots]
      order = sorted(range(len(slots)), key=lambda a: (not forced[a], -w[a]))
      csum = np.cumsum(w[order])
      n_forced = sum(forced)
      if sel.topp >= 1.0:
        keep = len(slots)
      else:
        keep = max(n_forced, int(np.searchsorted(csum, sel.topp)) + 1)
        near = np.abs(csum[max(n_forced - 1, 0):] - sel.topp) < 1e-4
        if near.any():
          out[i, j] = None
          continue
      out[i, j] = {slots[a] for a in order[:keep]}
  return out


def _kept(selection):
  idx, n = np.asarray(selection.idx), np.asarray(selection.n_valid)
  return {(i, j): set(idx[i, j, :n[i, j]].tolist()) for i in range(idx.shape[0])
          for j in range(idx.shape[1])}


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(
    lengths=st.lists(st.integers(0, CAP), min_size=2, max_size=2),
    hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 2]),
    gqa=st.sampled_from(["head", "group"]),
    budget=st.sampled_from([0.1, 0.3, 0.6, 12, 40]),
    forced=st.sampled_from([(0, 0), (4, 0), (4, 8), (0, 5)]),
    topp=st.sampled_from([0.3, 0.6, 0.85, 0.95, 1.0]), bits=st.sampled_from([2, 4]),
    seed=st.integers(0, 2 ** 16))
def test_equals_a_brute_force_reference(lengths, hkv, group, gqa, budget, forced, topp, bits,
                                        seed):
  rng = np.random.default_rng(seed)
  cache = helpers.filled_cache(rng, 2, hkv, CAP, D, lengths, block_size=BS, scale=1.5)
  q = helpers.normal(rng, (2, hkv * group, D), scale=1.5)
  bud = Budget(budget=budget, n_sink=forced[0], local_window=forced[1])
  sel = Twilight(budget=bud, block_size=BS, gqa=gqa, topp=topp, bits=bits)
  got = sel.select(q, cache, impl="xla")
  assert got.granularity == 1 and got.idx.shape[-1] == sel.max_tokens(CAP)
  heads = hkv if gqa == "group" else hkv * group
  assert got.idx.shape[:2] == (2, heads)
  kept = _kept(got)
  for key, want in _reference(q, cache, sel).items():
    if want is not None:
      assert kept[key] == want, key
    assert all(s < lengths[key[0]] for s in kept[key])
    assert len(kept[key]) == int(got.n_valid[key])  # distinct ids


def test_topp_one_is_the_quest_selection_as_tokens_and_less_prunes():
  rng = np.random.default_rng(0)
  lengths = [61, 30]
  cache = helpers.filled_cache(rng, 2, 2, CAP, D, lengths, block_size=BS)
  q = helpers.normal(rng, (2, 4, D), scale=3.0)
  bud = Budget(budget=0.25, n_sink=2, local_window=4)
  for gqa in ("head", "group"):
    quest = Quest(budget=bud, block_size=BS, gqa=gqa).select(q, cache, impl="xla")
    pages = _kept(quest)
    full = _kept(Twilight(budget=bud, block_size=BS, gqa=gqa, topp=1.0).select(q, cache))
    for (i, j), ids in pages.items():
      assert full[i, j] == {s for p in ids for s in range(p * BS, p * BS + BS) if s < lengths[i]}
    pruned = _kept(Twilight(budget=bud, block_size=BS, gqa=gqa, topp=0.5).select(q, cache))
    for (i, j), ids in pruned.items():
      forced = {s for s in range(lengths[i]) if s < 2 or s >= lengths[i] - 4}
      assert forced <= ids <= full[i, j]
    assert sum(map(len, pruned.values())) < sum(map(len, full.values()))


def test_a_dominant_key_leaves_only_it_and_the_forced_tokens():
  rng = np.random.default_rng(1)
  cache = helpers.filled_cache(rng, 1, 1, CAP, D, [50], block_size=BS, scale=0.1)
  q = jnp.ones((1, 1, D)) * 4.0
  # q . k = 128 / sqrt(8) for slot 21: all the mass (the digests go stale; budget 1.0 lists
  # every page whatever they say)
  cache = dataclasses.replace(cache, k=cache.k.at[0, 0, 21].set(4.0))
  bud = Budget(budget=1.0, n_sink=1, local_window=2)
  got = _kept(Twilight(budget=bud, block_size=BS, topp=0.9).select(q, cache))
  assert got[0, 0] == {0, 21, 48, 49}


def _decode(m, rng, prompt=(37, 20), steps=3, hq=4, hkv=2, d=D, dtype=jnp.float32, scale=1.0):
  """Prefill right-padded rows, then a few jitted decode steps; every output."""
  b = len(prompt)
  cap = m.round_capacity(max(max(prompt), 1) + steps)
  cache, state = m.init_cache(b, hkv, cap, d, dtype), m.init_state(b, hq, hkv, d, cap, dtype)
  s = max(max(prompt), 1)
  pos = np.full((b, s), -1, np.int32)
  for i, n in enumerate(prompt):
    pos[i, :n] = np.arange(n)
  mk = lambda *shape: helpers.normal(rng, shape, dtype, scale)
  out, cache, state = m.prefill(mk(b, hq, s, d), mk(b, hkv, s, d), mk(b, hkv, s, d), cache,
                                state, jnp.asarray(pos))
  cache, state = m.end_prefill(cache, state)
  outs, step = [], jax.jit(m.decode)
  for t in range(steps):
    p = jnp.asarray(np.array(prompt)[:, None] + t, jnp.int32)
    o, cache, state = step(mk(b, hq, 1, d), mk(b, hkv, 1, d), mk(b, hkv, 1, d), cache, state, p)
    outs.append(o)
  return outs


@pytest.mark.parametrize("gqa", ["head", "group"])
def test_a_full_budget_with_topp_one_decodes_as_dense(gqa):
  twi = _decode(methods.make("twilight", budget=1.0, topp=1.0, gqa=gqa, block_size=BS),
                np.random.default_rng(2))
  dense = _decode(methods.make("dense", block_size=BS), np.random.default_rng(2))
  for a, b in zip(twi, dense):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


def test_jit_and_vmap_give_the_same_selection():
  sel = Twilight(budget=Budget(budget=0.3, n_sink=1, local_window=4), block_size=BS,
                 gqa="group", topp=0.8)
  rng = np.random.default_rng(3)
  caches = [helpers.filled_cache(rng, 2, 2, CAP, D, [45, 17], block_size=BS) for _ in range(3)]
  q = helpers.normal(rng, (3, 2, 4, D))
  plain = [sel.select(q[i], caches[i], impl="xla") for i in range(3)]
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *caches)
  run = lambda qq, cc: sel.select(qq, cc, impl="xla")
  vm = jax.jit(jax.vmap(run))(q, stacked)
  jt = jax.jit(run)(q[0], caches[0])
  for got, i in [(jt, 0)] + [(jax.tree.map(lambda x, i=i: x[i], vm), i) for i in range(3)]:
    np.testing.assert_array_equal(got.n_valid, plain[i].n_valid)
    assert _kept(got) == _kept(plain[i])


def test_no_nan_for_empty_rows_padding_and_large_logits():
  m = methods.make("twilight", budget=0.5, topp=0.9, block_size=BS)
  outs = _decode(m, np.random.default_rng(4), prompt=(0, 33), dtype=jnp.bfloat16, scale=30.0)
  assert all(np.isfinite(np.asarray(o, np.float32)).all() for o in outs)
  rng = np.random.default_rng(5)
  cache = helpers.filled_cache(rng, 2, 1, CAP, D, [0, 9], block_size=BS)
  got = m.selector.select(helpers.normal(rng, (2, 2, D)), cache)
  assert np.asarray(got.n_valid)[0].tolist() == [0, 0] and np.all(np.asarray(got.n_valid)[1] > 0)
  c = m.init_cache(1, 1, 16, D)  # an empty cache decoded by a padding row (position -1)
  x = jnp.ones((1, 2, 1, D))
  o, c, _ = m.decode(x, x[:, :1], x[:, :1], c, {}, jnp.array([[-1]]))
  assert np.all(np.asarray(o) == 0) and int(c.length[0]) == 0


def test_spec_builds_it_and_refuses_typos_and_bad_values():
  m = methods.make("twilight", budget=0.1, topp=0.9)
  assert m.selector == Twilight(budget=Budget(budget=0.1), topp=0.9)
  assert (m.name, m.granularity, m.cache_digests) == ("twilight", 1, ("box",))
  assert selectors.SELECTORS["twilight"] is Twilight
  assert methods.make("twilight:bits=8,gqa=group").selector.bits == 8
  default = methods.make("twilight").selector
  assert (default.topp, default.bits, default.gqa) == (0.85, 4, "head")
  enhanced = methods.make("twilight+resa", budget=0.5, block_size=BS)
  assert enhanced.resa is not None
  outs = _decode(enhanced, np.random.default_rng(6), steps=2)
  assert all(np.isfinite(np.asarray(o)).all() for o in outs)
  with pytest.raises(ValueError, match="topq"):
    methods.make("twilight", budget=0.1, topq=0.9)
  for bad in (dict(topp=0.0), dict(topp=1.5), dict(topp=True), dict(bits=0), dict(bits=2.5)):
    with pytest.raises(ValueError):
      methods.make("twilight", budget=0.1, **bad)
  with pytest.raises(ValueError, match="chooses 0 blocks"):
    methods.make("twilight", budget=1, n_sink=16, local_window=64,
                 forced_count="inside").check_context(500)
