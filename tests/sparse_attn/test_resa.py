"""RESA (Yang et al., ICLR 2026): the aggregator against a brute-force numpy Eq. 3, invariants."""

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import kernels, methods
from sparse_attn.enhancers import resa

B, HQ, HKV, D, T, BS = 2, 4, 2, 16, 64, 8
SELECTORS = {
    "quest": dict(budget=0.25),
    "quest_group": dict(budget=0.25, gqa="group"),
    "topk": dict(budget=12),
    "streaming": dict(budget=12),
}
COMMON = dict(block_size=BS, n_sink=2, local_window=8)


def _make(sel, extra="", **kw):
  base = "quest" if sel == "quest_group" else sel
  return methods.make(base + extra, **{**COMMON, **SELECTORS[sel], **kw})


def _rand(rng, shape, scale=1.0, dtype=jnp.float32):
  return jnp.asarray(rng.normal(size=shape) * scale, dtype)


def _prefill(m, rng, lengths, scale=1.0, dtype=jnp.float32):
  """Prefills row i with ``lengths[i]`` random tokens; returns (cache, state, q_prompt, pos)."""
  n = T - 8
  pos = np.full((B, n), -1, np.int32)
  for i, ln in enumerate(lengths):
    pos[i, :ln] = np.arange(ln)
  q = _rand(rng, (B, HQ, n, D), scale, dtype)
  k = _rand(rng, (B, HKV, n, D), scale, dtype)
  v = _rand(rng, (B, HKV, n, D), 1.0, dtype)
  cache = m.init_cache(B, HKV, T, D, dtype)
  state = m.init_state(B, HQ, HKV, D, T)
  _, cache, state = m.prefill(q, k, v, cache, state, jnp.asarray(pos))
  cache, state = m.end_prefill(cache, state)
  return cache, state, np.asarray(q, np.float64), pos


def _step(m, rng, cache, state, newest, scale=1.0, dtype=jnp.float32):
  """One decode step of fresh random q/k/v at positions ``newest [B]`` (-1 = padding row)."""
  q = _rand(rng, (B, HQ, 1, D), scale, dtype)
  k = _rand(rng, (B, HKV, 1, D), scale, dtype)
  v = _rand(rng, (B, HKV, 1, D), 1.0, dtype)
  pos = jnp.asarray(np.asarray(newest, np.int32)[:, None])
  out, cache, state = m.decode(q, k, v, cache, state, pos)
  return out[:, :, 0], q[:, :, 0], cache, state


def _oracle(m, q, cache, qp, ppos, prompt_len, lam, form="renormalised"):
  """Brute-force RESA Eq. 3-5: true logits on I, ``P_j + b`` elsewhere, the unselected weighted
  by lam in numerator and normaliser (renormalised) or, as alpha' = lam * alpha with beta
  unchanged, in the numerator only (literal)."""
  scale = 1 / np.sqrt(D)
  kc = np.asarray(cache.k, np.float64)
  vc = np.asarray(cache.v, np.float64)
  valid = np.asarray(cache.valid)
  sel = m.select(q, cache)
  tm = np.asarray(sel.token_mask(T))
  tm = np.repeat(tm, HQ // tm.shape[1], axis=1)
  q = np.asarray(q, np.float64)
  out = np.zeros((B, HQ, D))
  g = HQ // HKV
  for b in range(B):
    ok = ppos[b] >= 0
    if m.resa.typical_query == "mean":
      mu_q = qp[b][:, ok].mean(axis=1) if ok.any() else np.zeros((HQ, D))
    else:
      mu_q = qp[b][:, np.argmax(np.where(ok, ppos[b], -1))]
    for h in range(HQ):
      kh = h // g
      member = valid[b, kh].copy()
      if m.resa.prior_update == "prefill_only":
        member &= np.arange(T) < prompt_len[b]
      mu_k = kc[b, kh][member].mean(0) if member.any() else np.zeros(D)
      bias = scale * (q[b, h] - mu_q[h]) @ mu_k
      s = scale * kc[b, kh] @ q[b, h]
      p = scale * kc[b, kh] @ mu_q[h] + bias
      chosen = tm[b, h] & valid[b, kh]
      logit = np.where(chosen, s, np.where(member, p, -np.inf))
      if np.all(np.isinf(logit)):
        continue
      w = np.exp(logit - logit.max())
      lam_w = np.where(chosen, 1.0, lam)
      den = (w * lam_w).sum() if form == "renormalised" else w.sum()
      if den > 0:
        out[b, h] = (w * lam_w) @ vc[b, kh] / den
  return out


@hypothesis.settings(max_examples=8, deadline=None,
                     phases=(hypothesis.Phase.explicit, hypothesis.Phase.generate))
@hypothesis.given(sel=st.sampled_from(sorted(SELECTORS)), lam=st.sampled_from([0.0, 0.5, 1.0]),
                  form=st.sampled_from(resa.LAM_FORMS),
                  update=st.sampled_from(resa.PRIOR_UPDATES),
                  typical=st.sampled_from(resa.TYPICAL_QUERIES),
                  lengths=st.tuples(st.integers(20, T - 8), st.integers(1, T - 8)),
                  steps=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_matches_bruteforce_eq3(sel, lam, form, update, typical, lengths, steps, seed):
  m = _make(sel, "+resa", lam=lam, lam_form=form, prior_update=update, typical_query=typical)
  rng = np.random.default_rng(seed)
  cache, state, qp, ppos = _prefill(m, rng, lengths)
  for i in range(steps):  # decoded keys join the prior (incremental) or not (prefill_only)
    out, q, cache, state = _step(m, rng, cache, state, np.asarray(lengths) + i)
  want = _oracle(m, q, cache, qp, ppos, np.asarray(lengths), lam, form)
  np.testing.assert_allclose(np.asarray(out), want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("sel", sorted(SELECTORS))
def test_lam0_is_selector_and_full_selection_is_dense(sel):
  rng = np.random.default_rng(1)
  lengths = (40, 23)
  for extra, kw, ref in [("+resa:lam=0", {}, _make(sel)),
                         ("+resa", dict(budget=1.0), methods.make("dense", block_size=BS))]:
    m = _make(sel, extra, **kw)
    cache, state, _, _ = _prefill(m, np.random.default_rng(1), lengths)
    rcache, rstate, _, _ = _prefill(ref, np.random.default_rng(1), lengths)
    for i in range(3):
      r1, r2 = np.random.default_rng(10 + i), np.random.default_rng(10 + i)
      out, _, cache, state = _step(m, r1, cache, state, np.asarray(lengths) + i)
      want, _, rcache, rstate = _step(ref, r2, rcache, rstate, np.asarray(lengths) + i)
      np.testing.assert_allclose(out, want, atol=1e-6, rtol=1e-6)
  del rng


def test_prior_stays_exact_under_overwrites():
  """Incremental prior == one formed from scratch over the current keys, after rewrites."""
  m = _make("quest", "+resa:prior_update=incremental+rect:f=4")
  rng = np.random.default_rng(3)
  lengths = (30, 44)
  cache, state, _, _ = _prefill(m, rng, lengths)
  for i in range(5):
    _, _, cache, state = _step(m, rng, cache, state, np.asarray(lengths) + i)
  # Rectify the last 4 tokens (new K/V) and also rewrite two prompt slots.
  pos = np.stack([np.r_[3, 4, np.arange(4) + n + 1] for n in lengths]).astype(np.int32)
  s = pos.shape[1]
  _, cache, state = m.rectify(_rand(rng, (B, HQ, s, D)), _rand(rng, (B, HKV, s, D)),
                              _rand(rng, (B, HKV, s, D)), cache, state, jnp.asarray(pos))
  rs = state.resa
  fresh = resa.form_prior(rs, cache, 1 / np.sqrt(D))
  np.testing.assert_array_equal(np.isfinite(rs.prior), np.isfinite(fresh.prior))
  fin = np.isfinite(fresh.prior)
  np.testing.assert_allclose(np.asarray(rs.prior)[fin], np.asarray(fresh.prior)[fin],
                             rtol=1e-6, atol=1e-6)
  for a, b in zip(resa.total(rs), resa.total(fresh)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(resa.mu_k(rs), resa.mu_k(fresh), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(rs.kcount, fresh.kcount)


def _stack(*trees):
  return jax.tree.map(lambda *x: jnp.stack(x), *trees)


def test_jit_and_vmap_equal_plain_calls():
  m = _make("quest", "+resa:lam=0.5")
  probs = []
  for seed in (5, 6):
    rng = np.random.default_rng(seed)
    cache, state, _, _ = _prefill(m, rng, (37, 20))
    q, k, v = _rand(rng, (B, HQ, 1, D)), _rand(rng, (B, HKV, 1, D)), _rand(rng, (B, HKV, 1, D))
    probs.append((q, k, v, cache, state, jnp.asarray([[37], [20]], jnp.int32)))
  plain = [m.decode(*p) for p in probs]
  jitted = [jax.jit(m.decode)(*p) for p in probs]
  vmapped = jax.jit(jax.vmap(m.decode))(*_stack(*probs))
  for i, (a, b) in enumerate(zip(plain, jitted)):
    np.testing.assert_allclose(a[0], b[0], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(a[0], vmapped[0][i], atol=1e-6, rtol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5),
                 a[2], jax.tree.map(lambda z, i=i: z[i], vmapped[2]))


def test_no_nan_empty_rows_and_bf16_large_logits():
  m = _make("quest", "+resa+retro:w=2")
  # Row 1 has an empty prompt and decodes nothing (position -1): out = 0, never NaN.
  cache, state, _, _ = _prefill(m, np.random.default_rng(7), (9, 0))
  q = _rand(np.random.default_rng(8), (B, HQ, 2, D))
  kv = _rand(np.random.default_rng(9), (B, HKV, 2, D))
  out, _, state = m.decode(q, kv, kv, cache, state, jnp.asarray([[8, 9], [-1, -1]], jnp.int32))
  assert np.all(np.isfinite(out)) and np.all(np.asarray(out)[1] == 0)
  assert all(np.all(~np.isnan(np.asarray(x))) for x in jax.tree.leaves(state))
  # bf16 with |q.k| ~ 1e4.
  m = _make("quest", "+resa:lam=0.5")
  jm = dataclasses.replace(m)  # jit-compiled layer functions (a new dtype: compile once)
  for name in ("prefill", "end_prefill", "decode"):
    object.__setattr__(jm, name, jax.jit(getattr(m, name)))
  rng = np.random.default_rng(11)
  cache, state, _, _ = _prefill(jm, rng, (50, 33), scale=50.0, dtype=jnp.bfloat16)
  for i in range(2):
    out, q, cache, state = _step(jm, rng, cache, state, np.asarray([50, 33]) + i, scale=50.0,
                                 dtype=jnp.bfloat16)
  lg = np.abs(np.asarray(jnp.einsum("bhd,bhtd->bht", q.astype(jnp.float32),
                                    jnp.repeat(cache.k, 2, 1).astype(jnp.float32))))
  assert lg.max() > 5e3
  assert out.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(out, np.float32)))
  assert np.abs(np.asarray(out, np.float32)).max() <= np.abs(np.asarray(cache.v, np.float32)).max()


def test_pallas_path_matches_jnp():
  """The fused kernel (interpret mode) gives the jnp path's partials and coverage counts."""
  pytest.importorskip("pallas_kernels")
  m = methods.make("quest+resa", budget=0.25, block_size=16, n_sink=2, local_window=16)
  rng = np.random.default_rng(12)
  cache = m.init_cache(1, HKV, T, D)
  state = m.init_state(1, HQ, HKV, D, T)
  pos = jnp.arange(50, dtype=jnp.int32)[None]
  _, cache, state = m.prefill(_rand(rng, (1, HQ, 50, D)), _rand(rng, (1, HKV, 50, D)),
                              _rand(rng, (1, HKV, 50, D)), cache, state, pos)
  cache, state = m.end_prefill(cache, state)
  q = _rand(rng, (1, HQ, D))
  sel = m.select(q, cache)
  args = (q, cache, sel, state.resa.prior, 0.25)
  want = kernels.resa_partials(*args, impl="xla")
  got = kernels.resa_partials(*args, impl="pallas", interpret=True)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), got, want)
  # The aggregator inside the kernel's split combine == the partials aggregated afterwards.
  st = state.resa
  for lam, form in ((1.0, "renormalised"), (0.25, "renormalised"), (0.5, "literal")):
    extras = (*resa.total(st), resa.bias(st, q, 0.25), resa.prior_count(st, HQ))
    agg = resa.Aggregator(lam, form)
    after = resa.aggregate(want[0], want[1], resa.total(st), extras[2], lam,
                           want[2] >= extras[3], form)
    for impl in ("xla", "pallas"):
      fused = kernels.resa_attend(*args, agg, extras, impl=impl, interpret=True)
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), fused,
                   after)


def test_per_head_lambda_is_each_heads_scalar_lambda():
  """``with_head_params``: head h decodes as the method with the scalar ``lam = lam_h``
  (the retro window path: tests/sparse_attn/test_retro.py)."""
  extra = "+resa"
  lams = np.array([0.25, 1.0, 1.0, 0.25], np.float32)  # [HQ]: heads of one kv group differ
  lengths = (40, 23)

  def run(m, head_log_lam=None):
    cache, state, _, _ = _prefill(m, np.random.default_rng(3), lengths)
    if head_log_lam is not None:
      state = dataclasses.replace(state, resa=resa.with_head_params(state.resa, head_log_lam))
    outs = []
    for i in range(3):
      out, _, cache, state = _step(m, np.random.default_rng(20 + i), cache, state,
                                   np.asarray(lengths) + i)
      outs.append(np.asarray(out))
    assert head_log_lam is None or state.resa.head_log_lam is not None  # kept through decode
    return np.stack(outs)

  got = run(_make("quest", extra), np.log(lams))
  for lam in sorted(set(lams.tolist())):
    want, heads = run(_make("quest", extra, lam=lam)), lams == lam
    np.testing.assert_allclose(got[:, :, heads], want[:, :, heads], atol=2e-5, rtol=2e-5)
  with pytest.raises(ValueError, match="renormalised"):
    run(_make("quest", extra, lam_form="literal"), np.log(lams))


def test_head_params_fold_into_the_bias_and_set_every_layer():
  m = _make("quest", "+resa")
  _, state, _, _ = _prefill(m, np.random.default_rng(4), (40, 23))
  st = state.resa
  ll, bt = np.log([0.5, 1.0, 2.0, 4.0]), np.array([0.0, 1.0, 2.0, 0.5])
  for shape in ((B, HQ, D), (B, HQ, 3, D)):
    q = _rand(np.random.default_rng(5), shape)
    exp = (lambda x: x) if len(shape) == 3 else (lambda x: x[..., None])
    want = exp(jnp.asarray(bt, jnp.float32)) * resa.bias(st, q, 0.3) + exp(
        jnp.asarray(ll, jnp.float32))
    got = resa.online_bias(resa.with_head_params(st, ll, bt), q, 0.3)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  layers = [state, state, state]
  lam3, beta3 = np.stack([ll, ll + 1, ll - 1]), np.stack([bt, bt, bt])
  per_layer = resa.set_head_params(layers, lam3, beta3)
  stacked = resa.set_head_params(_stack(*layers), lam3, beta3)
  for i in range(3):
    jax.tree.map(lambda a, b, i=i: np.testing.assert_array_equal(a, b[i]), per_layer[i], stacked)
    np.testing.assert_allclose(per_layer[i].resa.head_log_lam[1], lam3[i], rtol=1e-6)
  with pytest.raises(ValueError, match=r"\[L=3, N\]"):
    resa.set_head_params(layers, lam3[:2])
  with pytest.raises(ValueError, match="resa part"):
    resa.set_head_params([{}], lam3[:1])
