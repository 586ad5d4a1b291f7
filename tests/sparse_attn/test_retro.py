"""RetroAttention (Choi et al. 2025): merged outputs vs attention over each query's exposure."""

import dataclasses
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import cache as cache_lib
from sparse_attn import methods
from sparse_attn.cache_attention import dense_over_cache
from sparse_attn.enhancers import resa, retro

B, HQ, HKV, D, T, BS = 2, 4, 2, 16, 64, 8
SCALE = 1 / np.sqrt(D)
COMMON = dict(block_size=BS, n_sink=2, local_window=8)
SELECTORS = {"quest": dict(budget=0.2), "quest_group": dict(budget=0.2, gqa="group"),
             "topk": dict(budget=10), "streaming": dict(budget=10)}


def _make(sel, extra="", **kw):
  base = "quest" if sel == "quest_group" else sel
  return methods.make(base + extra, **{**COMMON, **SELECTORS[sel], **kw})


_JIT = {}


def _jit(m, name):
  """One compiled function per (method, name) across tests."""
  if (m, name) not in _JIT:
    _JIT[m, name] = jax.jit(getattr(m, name))
  return _JIT[m, name]


class Run:
  """Fixed per-position q/k/v (re-embedding leaves them unchanged): prefill, then decode."""

  def __init__(self, m, seed, prompt_len, steps):
    rng = np.random.default_rng(seed)
    n = prompt_len + steps
    self.q = rng.normal(size=(B, HQ, n, D)).astype(np.float32)
    self.k = rng.normal(size=(B, HKV, n, D)).astype(np.float32)
    self.v = rng.normal(size=(B, HKV, n, D)).astype(np.float32)
    self.m, self.prompt_len = m, prompt_len
    chunk = 40  # one prefill shape for every prompt length (padding has position -1)
    p = np.arange(chunk)
    pos = jnp.asarray(np.broadcast_to(np.where(p < prompt_len, p, -1), (B, chunk)), jnp.int32)
    self.cache = m.init_cache(B, HKV, T, D)
    self.state = m.init_state(B, HQ, HKV, D, T)
    sl = np.minimum(p, n - 1)
    _, self.cache, self.state = _jit(m, "prefill")(
        self.q[:, :, sl], self.k[:, :, sl], self.v[:, :, sl], self.cache, self.state, pos)
    self.cache, self.state = _jit(m, "end_prefill")(self.cache, self.state)
    self.decode = _jit(m, "decode")

  def step(self, t):
    w = self.m.window
    p = np.arange(t - w + 1, t + 1)
    pos = jnp.asarray(np.broadcast_to(np.where(p >= 0, p, -1), (B, w)).astype(np.int32))
    pc = np.maximum(p, 0)
    out, self.cache, self.state = self.decode(self.q[:, :, pc], self.k[:, :, pc],
                                              self.v[:, :, pc], self.cache, self.state, pos)
    sel = self.m.select(jnp.asarray(self.q[:, :, t]), self.cache)
    return np.asarray(out), sel


def _attend(q, k, v, mask):
  lg = np.where(mask, SCALE * k @ q, -np.inf)
  w = np.exp(lg - lg.max())
  return w @ v / w.sum()


def _simulate(m, seed, prompt_len, steps):
  """Runs the method and an independent set-based model of the exposures; yields both."""
  run = Run(m, seed, prompt_len, steps)
  g = m.granularity
  expo = {}  # (b, sel head, query pos) -> set of entries
  for t in range(prompt_len, prompt_len + steps):
    out, sel = run.step(t)
    idx, nv = np.asarray(sel.idx), np.asarray(sel.n_valid)
    h_sel = idx.shape[1]
    for b in range(B):
      for hs in range(h_sel):
        chosen = set(idx[b, hs, :nv[b, hs]].tolist())
        expo[b, hs, t] = set(chosen)
        for tp in range(max(t - m.window + 1, prompt_len), t):
          marked = {s // g for s in range(tp + 1, t + 1)}  # Algorithm 2's current-block stamp
          expo[b, hs, tp] |= chosen - marked
    yield run, t, out, expo, h_sel


def _expected(run, t, expo, h_sel):
  """Attention of every window query over its exposed entries with the causal limit."""
  m, w, g = run.m, run.m.window, run.m.granularity
  want = np.zeros((B, HQ, w, D))
  counts = np.zeros((B, HQ, w), int)
  for b in range(B):
    for h in range(HQ):
      kh, hs = h // (HQ // HKV), h // (HQ // h_sel)
      for i, tp in enumerate(range(t - w + 1, t + 1)):
        if tp < 0:
          continue
        slots = np.arange(t + 1)
        if tp < run.prompt_len:  # dense prefill output
          mask = slots <= tp
        else:
          mask = np.isin(slots // g, sorted(expo[b, hs, tp])) & (slots <= tp)
        want[b, h, i] = _attend(run.q[b, h, tp], run.k[b, kh, :t + 1], run.v[b, kh, :t + 1],
                                mask)
        counts[b, h, i] = mask.sum()
  return want, counts


@hypothesis.settings(max_examples=5, deadline=None,
                     phases=(hypothesis.Phase.explicit, hypothesis.Phase.generate))
@hypothesis.given(sel=st.sampled_from(sorted(SELECTORS)), w=st.integers(2, 4),
                  prompt_len=st.integers(20, 40), seed=st.integers(0, 2**16))
def test_outputs_equal_attention_over_union_of_exposed_entries(sel, w, prompt_len, seed):
  m = _make(sel, f"+retro:w={w}")
  for run, t, out, expo, h_sel in _simulate(m, seed, prompt_len, 5):
    want, counts = _expected(run, t, expo, h_sel)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    (rpos, rexp), _ = retro.effective_budget(run.state)
    np.testing.assert_array_equal(rpos, t - w + 1)
    np.testing.assert_array_equal(rexp, counts[:, :, 0])  # Fig. 2c: union of exposures


def test_w1_is_selector_and_full_selection_is_dense():
  for extra, kw, ref in [("+retro:w=1", {}, _make("quest")),
                         ("+retro:w=3", dict(budget=1.0), methods.make("dense", block_size=BS)),
                         ("+resa+retro:w=3", dict(budget=1.0),
                          methods.make("dense", block_size=BS))]:
    m = _make("quest", extra, **kw)
    run = Run(m, 0, 30, 5)
    for t in range(30, 35):
      out, _ = run.step(t)
      for i, tp in enumerate(range(t - m.window + 1, t + 1)):
        q = jnp.asarray(run.q[:, :, tp:tp + 1])
        want, _ = ref.attend(q[:, :, 0], run.cache, jnp.full((B,), tp, jnp.int32)) if (
            not ref.is_dense) else dense_over_cache(
                q, run.cache, jnp.full((B, 1), tp, jnp.int32))
        want = np.asarray(want).reshape(B, HQ, D)
        np.testing.assert_allclose(out[:, :, i], want, atol=2e-5, rtol=2e-5)


def test_resa_retro_matches_bruteforce():
  """RESA over each past query's exposure, prior restricted to keys at or before it."""
  m = _make("quest", "+resa:lam=0.5,prior_update=incremental+retro:w=3")
  for run, t, out, expo, h_sel in _simulate(m, 4, 25, 4):
    pass
  pl = run.prompt_len
  mu_q = run.q[:, :, :pl].mean(2)
  for b in range(B):
    for h in range(HQ):
      kh = h // (HQ // HKV)
      k, v = run.k[b, kh, :t + 1], run.v[b, kh, :t + 1]
      mu_k = k.mean(0)  # incremental: every key written so far
      for i, tp in enumerate(range(t - 2, t + 1)):
        slots = np.arange(t + 1)
        chosen = np.isin(slots // BS, sorted(expo[b, h, tp])) & (slots <= tp)
        bias = SCALE * (run.q[b, h, tp] - mu_q[b, h]) @ mu_k
        lg = np.where(chosen, SCALE * k @ run.q[b, h, tp],
                      np.where(slots <= tp, SCALE * k @ mu_q[b, h] + bias + np.log(0.5), -np.inf))
        wgt = np.exp(lg - lg.max())
        np.testing.assert_allclose(out[b, h, i], wgt @ v / wgt.sum(), atol=3e-5, rtol=3e-5)


def test_per_head_lambda_is_each_heads_scalar_lambda_in_the_window():
  """``resa.with_head_params`` on the retro window path: head h as the scalar ``lam_h``."""
  lams = np.array([0.25, 1.0, 1.0, 0.25], np.float32)  # [HQ]: heads of one kv group differ

  def outputs(m, head_log_lam=None):
    run = Run(m, 6, 25, 3)
    if head_log_lam is not None:
      run.state = dataclasses.replace(run.state, resa=resa.with_head_params(run.state.resa, head_log_lam))
    return np.stack([run.step(t)[0] for t in range(25, 28)])

  got = outputs(_make("quest", "+resa+retro:w=2"), np.log(lams))
  for lam in sorted(set(lams.tolist())):
    want, heads = outputs(_make("quest", f"+resa:lam={lam}+retro:w=2")), lams == lam
    np.testing.assert_allclose(got[:, :, heads], want[:, :, heads], atol=2e-5, rtol=2e-5)


def test_reembedding_overwrites_past_kv_and_digests():
  m = _make("quest", "+retro:w=3")
  run = Run(m, 1, 30, 1)
  rng = np.random.default_rng(2)
  k, v = (jnp.asarray(rng.normal(size=(B, HKV, 3, D)), jnp.float32) for _ in range(2))
  pos = jnp.asarray(np.broadcast_to(np.arange(28, 31), (B, 3)).astype(np.int32))
  _, cache, _ = run.decode(jnp.asarray(run.q[:, :, 28:31]), k, v, run.cache, run.state, pos)
  np.testing.assert_array_equal(cache.k[:, :, 28:31], k)
  np.testing.assert_array_equal(cache.v[:, :, 28:31], v)
  fresh = cache_lib.block_digests(cache.k, cache.valid, BS)
  assert cache.has_digests("box")  # Quest's; the sphere digests are not kept for Quest
  for a, b in zip((cache.kmin, cache.kmax, cache.kcen, cache.krad), fresh):
    if a.shape[2]:
      np.testing.assert_allclose(a, b, atol=1e-6)


def _stack(*trees):
  return jax.tree.map(lambda *x: jnp.stack(x), *trees)


def test_jit_vmap_and_no_nan():
  m = _make("quest", "+resa+retro:w=3")
  probs = []
  for seed in (0, 1):
    run = Run(m, seed, 30, 1)
    pos = jnp.asarray([[28, 29, 30], [-1, -1, -1]], jnp.int32)  # row 1 decodes nothing
    probs.append((jnp.asarray(run.q[:, :, 28:31]), jnp.asarray(run.k[:, :, 28:31]),
                  jnp.asarray(run.v[:, :, 28:31]), run.cache, run.state, pos))
  jitted = [_jit(m, "decode")(*p) for p in probs]  # jit == eager: test_resa, test_w1_...
  vm = jax.jit(jax.vmap(m.decode))(*_stack(*probs))
  for i, p in enumerate(jitted):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5),
                 (p[0], p[2]), jax.tree.map(lambda z, i=i: z[i], (vm[0], vm[2])))
    assert np.all(np.isfinite(p[0])) and np.all(np.asarray(p[0])[1] == 0)
  # bf16 with |q.k| ~ 1e4 and an empty prompt row.
  m = _make("quest", "+resa+retro:w=2")
  rng = np.random.default_rng(3)
  big = lambda *s: jnp.asarray(rng.normal(size=s) * 50, jnp.bfloat16)
  cache = m.init_cache(B, HKV, T, D, jnp.bfloat16)
  state = m.init_state(B, HQ, HKV, D, T)
  pos = jnp.asarray(np.stack([np.arange(20), np.full(20, -1)]).astype(np.int32))
  _, cache, state = _jit(m, "prefill")(big(B, HQ, 20, D), big(B, HKV, 20, D), big(B, HKV, 20, D),
                                       cache, state, pos)
  cache, state = _jit(m, "end_prefill")(cache, state)
  pos = jnp.asarray([[19, 20], [-1, 0]], jnp.int32)
  out, _, state = _jit(m, "decode")(big(B, HQ, 2, D), big(B, HKV, 2, D), big(B, HKV, 2, D),
                                    cache, state, pos)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  assert all(not np.any(np.isnan(np.asarray(x, np.float32))) for x in jax.tree.leaves(state))


@pytest.mark.parametrize("spec", ["quest+retro:w=3", "quest+resa+retro:w=3",
                                  "quest:gqa=head+resa+retro:w=2"])
def test_pallas_multiquery_path_matches_jnp(spec):
  """The Pallas multi-query kernel (RESA's prior fused in the same pass) equals the jnp path,
  and so do the keys each window query attended, counted in the kernel's pass or in XLA ops
  (``exposed=xla``)."""
  pytest.importorskip("pallas_kernels")
  kw = dict(budget=0.25, block_size=16, n_sink=2, local_window=16)
  outs, budgets = [], []
  for impl, extra in (("xla", ""), ("pallas", ""), ("pallas", ",exposed=xla")):
    m = methods.make(spec + extra, impl=impl, interpret=True, **kw)
    run = Run(m, 5, 40, 2)
    run.decode = m.decode
    outs.append([run.step(t)[0] for t in (40, 41)])
    budgets.append(jax.tree.map(np.asarray, retro.effective_budget(run.state)))
  for got, counts in zip(outs[1:], budgets[1:]):
    np.testing.assert_allclose(outs[0], got, atol=1e-5, rtol=1e-5)
    jax.tree.map(np.testing.assert_array_equal, counts, budgets[0])
  assert budgets[0][1][1].sum() > 0


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), w=st.integers(2, 4))
def test_one_stamp_equals_algorithm_2s_two_updates(seed, w):
  """``entry_mask`` with the current entry read as stamped, then one ``stamp``, equals Algorithm
  2 step by step: stamp the current entry ``t - 1``, build the mask, stamp the selection ``t``."""
  from sparse_attn.selection import Selection  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  b, h, ne, n, g = 2, 3, 12, 5, 4
  last_seen = rng.integers(-1, ne * g, (b, h, ne)).astype(np.int32)
  t = rng.integers(-1, ne * g, b).astype(np.int32)
  positions = (t[:, None] + np.arange(1 - w, 1)[None]).astype(np.int32)
  sel = Selection(jnp.asarray(rng.integers(0, ne, (b, h, n)), jnp.int32),
                  jnp.asarray(rng.integers(0, n + 1, (b, h)), jnp.int32), g)
  full = jnp.asarray(rng.random((b, w)) < 0.2)
  want = last_seen.copy()
  for bi in range(b):
    if t[bi] >= 0:
      e = t[bi] // g
      want[bi, :, e] = np.maximum(want[bi, :, e], t[bi] - 1)
  ls = np.take_along_axis(want, np.asarray(sel.idx), -1)
  unseen = ls[:, :, None, :] < positions[:, None, :, None]
  want_use = ((unseen | (np.arange(w) == w - 1)[None, None, :, None]) & ~np.asarray(full)[
      :, None, :, None] & (positions >= 0)[:, None, :, None])
  for bi in range(b):
    for hi in range(h):
      for j in range(int(sel.n_valid[bi, hi])):
        if t[bi] >= 0:
          e = int(sel.idx[bi, hi, j])
          want[bi, hi, e] = max(want[bi, hi, e], t[bi])
  current = retro.current_entry(jnp.asarray(t), g, ne)
  use = retro.entry_mask(jnp.asarray(last_seen), sel, jnp.asarray(positions), full, current)
  np.testing.assert_array_equal(use, want_use)
  np.testing.assert_array_equal(
      retro.stamp(jnp.asarray(last_seen), sel, jnp.asarray(t), current), want)
