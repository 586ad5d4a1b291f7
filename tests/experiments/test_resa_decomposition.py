"""experiments.analysis.resa_decomposition: RESA's error split into mass and value, on synthetic
cases where the true unselected mass and value are known."""

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.claims import table as claims_table
from experiments.analysis import attention_error, errors
from experiments.analysis import resa_decomposition as rd
from sparse_attn import methods

L, N, K, S, D = 2, 4, 2, 112, 8
PREFILL, STEPS = 96, 6


def _parts(rng, n=5, d=6, t=40, frac=0.3):
  """One query row per case: logits ``s [n, t]``, values ``v [t, d]``, a selected mask."""
  s = rng.normal(size=(n, t)) * 2.0
  v = rng.normal(size=(t, d))
  sel = rng.uniform(size=(n, t)) < frac
  sel[:, 0] = True
  sel[:, 1] = False  # something selected and something not, in every row

  def attend(mask):
    x = np.where(mask, s, -np.inf)
    m = x.max(-1, keepdims=True)
    w = np.exp(x - m)
    return (w @ v) / w.sum(-1, keepdims=True), np.log(w.sum(-1)) + m[:, 0]

  (o_sel, l_sel), (o_true, l_true) = attend(sel), attend(~sel)
  o_dense = attend(np.ones_like(sel))[0]
  return o_sel, l_sel, o_true, l_true, o_dense


def test_oracle_estimate_gives_dense():
  o_sel, l_sel, o_true, l_true, o_dense = _parts(np.random.default_rng(0))
  got = rd.decompose(o_sel, l_sel, o_true, l_true, o_true, l_true, o_dense)
  np.testing.assert_allclose(got["out_rel_l2_true_mass"], 0.0, atol=1e-5)
  np.testing.assert_allclose(got["out_rel_l2_true_value"], 0.0, atol=1e-5)
  np.testing.assert_allclose(got["mass_ratio"], 1.0, rtol=1e-5)
  np.testing.assert_allclose(got["mass_est"], got["mass_true"], rtol=1e-5)


def test_each_swap_leaves_exactly_the_other_estimates_error():
  rng = np.random.default_rng(1)
  o_sel, l_sel, o_true, l_true, o_dense = _parts(rng)
  o_est = o_true + rng.normal(size=o_true.shape)  # a wrong value ...
  l_est = l_true + np.log(2.5)  # ... and 2.5x the true mass
  got = rd.decompose(o_sel, l_sel, o_est, l_est, o_true, l_true, o_dense)
  share = lambda l: np.exp(l) / (np.exp(l_sel) + np.exp(l))
  norm = lambda x: np.linalg.norm(x, axis=-1)
  # True mass: the residual's share is right, its value off by o_est - o_true.
  want_value = share(l_true) * norm(o_est - o_true) / norm(o_dense)
  # True value: the residual's value is right, its share off by share(l_est) - share(l_true).
  want_mass = np.abs(share(l_est) - share(l_true)) * norm(o_true - o_sel) / norm(o_dense)
  np.testing.assert_allclose(got["out_rel_l2_true_mass"], want_value, rtol=1e-4)
  np.testing.assert_allclose(got["out_rel_l2_true_value"], want_mass, rtol=1e-4)
  np.testing.assert_allclose(got["mass_ratio"], 2.5, rtol=1e-5)
  np.testing.assert_allclose(got["mass_true"], share(l_true), rtol=1e-5)
  np.testing.assert_allclose(got["mass_est"], share(l_est), rtol=1e-5)


def test_empty_residuals():
  o = jnp.ones((3, 2))
  inf = jnp.inf
  got = rd.decompose(o, jnp.zeros(3), -o, jnp.array([-inf, 0.0, -inf]), -o,
                     jnp.array([-inf, -inf, 0.0]), o)
  np.testing.assert_array_equal(np.isnan(got["mass_ratio"]), [True, False, False])
  assert got["mass_ratio"][1] == np.inf and got["mass_ratio"][2] == 0.0
  np.testing.assert_allclose(got["mass_true"], [0.0, 0.0, 0.5])
  assert np.all(np.isfinite(got["out_rel_l2_true_mass"]))


def test_per_head_median_and_correlation():
  rng = np.random.default_rng(2)
  true = rng.uniform(0.1, 0.5, size=(2, 9, 3))
  est = true.copy()
  est[:, :, 1] = 0.3 * true[:, :, 1] + 0.05  # compressed but perfectly correlated
  est[:, :, 2] = 0.4  # constant: no correlation defined
  res = dict(mass_true=true, mass_est=est, mass_ratio=est / true,
             out_rel_l2_true_mass=np.ones_like(true), out_rel_l2_true_value=np.zeros_like(true))
  out = rd.per_head(res)
  np.testing.assert_allclose(out["mass_corr"][:, :2], 1.0)
  assert np.all(np.isnan(out["mass_corr"][:, 2]))
  np.testing.assert_allclose(out["mass_ratio"], np.median(est / true, axis=1))
  x, y = rng.normal(size=50), rng.normal(size=50)
  np.testing.assert_allclose(rd.pearson_over(x, y, 0), np.corrcoef(x, y)[0, 1])
  assert rd.per_head(dict(out_rel_l2=true)) == {}


def test_source_names_the_larger_single_estimate_error():
  assert rd.source(0.198, 0.135) == "value"  # the true mass helps less than the true value
  assert rd.source(0.031, 0.073) == "mass"
  assert rd.source(0.1, 0.105) == "both"


# ------------------------------------------------ through the simulation (errors.simulate)


@pytest.fixture(scope="module")
def exact_prior():
  """q and k whose deviations are orthogonal: RESA's logit ``P_j + b`` equals the true one.

  ``q_i = (x_i, c_q)``, ``k_j = (1, y_j)``: ``(q - mu_Q) . (k_j - mu_K) = 0``, so Eq. 2's
  error term vanishes and RESA's mass and value are the truth."""
  rng = np.random.default_rng(3)
  q = np.concatenate([rng.normal(size=(L, N, S, 1)) * 2.0,
                      np.broadcast_to(rng.normal(size=(L, N, 1, D - 1)), (L, N, S, D - 1))], -1)
  k = np.concatenate([np.ones((L, K, S, 1)), rng.normal(size=(L, K, S, D - 1))], -1)
  v = rng.normal(size=(L, K, S, D))
  return tuple(x.astype(np.float32) for x in (q, k, v))


@pytest.fixture(scope="module")
def generic():
  rng = np.random.default_rng(0)
  q = rng.normal(size=(L, N, S, D)).astype(np.float32) * 1.5
  k = rng.normal(size=(L, K, S, D)).astype(np.float32) + 0.5
  v = rng.normal(size=(L, K, S, D)).astype(np.float32)
  return q, k, v


_CACHE = {}


def _sim(qkv, spec, **kw):
  """Simulated once per case for the whole module (compiles dominate the cost)."""
  key = (id(qkv), spec, tuple(sorted(kw.items())))
  if key not in _CACHE:
    m = methods.make(spec, block_size=8, budget=0.2, local_window=8, **kw)
    _CACHE[key] = errors.simulate(m, *qkv, 0.35, PREFILL, STEPS, chunk=32)
  return _CACHE[key]


def test_exact_prior_decomposes_to_zero(exact_prior):
  r = _sim(exact_prior, "quest+resa")
  assert r["mass_true"].min() > 1e-3  # the residual matters ...
  for name in ("out_rel_l2", "out_rel_l2_true_mass", "out_rel_l2_true_value"):
    assert np.all(r[name] < 1e-4), name  # ... and RESA estimates it exactly
  np.testing.assert_allclose(r["mass_ratio"], 1.0, rtol=1e-4)
  head = rd.per_head(r)
  np.testing.assert_allclose(head["mass_corr"], 1.0, atol=1e-3)


def test_generic_decomposition_bounds_and_lam0(generic):
  base, zero, resa = (_sim(generic, s) for s in ("quest", "quest+resa:lam=0.0", "quest+resa"))
  assert "mass_ratio" not in base
  # lam = 0: RESA's mass is 0, so "RESA's mass + the true value" is the selector alone.
  np.testing.assert_allclose(zero["out_rel_l2_true_value"], base["out_rel_l2"], rtol=1e-4)
  assert np.all(zero["mass_est"] == 0) and np.all(zero["mass_ratio"] == 0)
  for r in (zero, resa):
    for name in ("mass_est", "mass_true"):
      assert np.all((r[name] >= 0) & (r[name] <= 1))
  # The mass-only error of lam = 1 is below the selector's: RESA's mass is on the right side.
  assert resa["out_rel_l2_true_value"].mean() < base["out_rel_l2"].mean()
  np.testing.assert_allclose(resa["mass_true"], zero["mass_true"], rtol=1e-5)
  literal = _sim(generic, "quest+resa", lam=0.5, lam_form="literal")
  assert "mass_ratio" not in literal  # not a merge: no decomposition


def test_summary_table_and_report_row(generic):
  recs = []
  for spec in ("quest", "quest+resa"):
    decomp, res = rd.split(_sim(generic, spec))
    rec = dict(experiment="attention_error", config=dict(model="m"), spec=spec, budget=0.05,
               prefill_len=PREFILL, **{k: np.nanmean(v, axis=1) for k, v in res.items()},
               **decomp)
    recs.append(rec)
  _, red = attention_error.summary(recs)
  row = red[0]
  assert row["source"] in ("mass", "value", "both")
  assert row["out_rel_l2_true_value"] == pytest.approx(
      float(np.mean(recs[1]["out_rel_l2_true_value"])))
  got = claims_table.score_error_reduction(recs)
  assert "the output error comes from" in got.why
  # Records written before the decomposition existed still render, without the clause.
  old = [{k: v for k, v in r.items() if k not in rd.HEAD_FIELDS} for r in recs]
  assert "comes from" not in claims_table.score_error_reduction(old).why
