"""experiments.analysis.errors / calibrate on synthetic q/k/v: the invariants of the protocol."""

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.analysis import calibrate, errors
from experiments.common import checkpoint
from sparse_attn import methods

L, N, K, S, D = 2, 4, 2, 112, 8
PREFILL, STEPS = 96, 6


@pytest.fixture(scope="module")
def qkv():
  rng = np.random.default_rng(0)
  q = rng.normal(size=(L, N, S, D)).astype(np.float32) * 1.5
  k = rng.normal(size=(L, K, S, D)).astype(np.float32) + 0.5  # a shared key direction
  v = rng.normal(size=(L, K, S, D)).astype(np.float32)
  return q, k, v


_CACHE = {}


def _sim(qkv, spec, budget=None):
  """Simulated once per (spec, budget) for the whole module (compiles dominate the cost)."""
  if (spec, budget) not in _CACHE:
    q, k, v = qkv
    kw = {} if budget is None else dict(budget=budget, local_window=8)
    m = methods.make(spec, block_size=8, **kw)
    _CACHE[spec, budget] = errors.simulate(m, q, k, v, 0.35, PREFILL, STEPS, chunk=32,
                                           residual=True)
  return _CACHE[spec, budget]


def test_dense_is_exact(qkv):
  r = _sim(qkv, "dense")
  assert r["out_rel_l2"].shape == (L, STEPS, N)
  assert np.all(r["out_rel_l2"] < 1e-5)
  assert np.all(np.isnan(r["score_l1"]))


def test_lam0_equals_selector_and_scores_describe_outputs(qkv):
  base = _sim(qkv, "quest", budget=0.2)
  zero = _sim(qkv, "quest+resa:lam=0.0", budget=0.2)
  resa = _sim(qkv, "quest+resa", budget=0.2)
  for name in ("out_rel_l2", "score_l1", "score_rel_l2", "attended"):
    np.testing.assert_allclose(zero[name], base[name], rtol=1e-5, atol=1e-6)
  for r in (base, zero, resa):
    assert np.all(r["score_out_gap"] < 1e-4)  # a @ V == the method's own output
    assert np.all((r["score_l1"] >= 0) & (r["score_l1"] <= 2 + 1e-5))
    assert np.all((r["attended"] > 0) & (r["attended"] <= 1))
  assert resa["score_l1"].mean() < base["score_l1"].mean()


def test_full_budget_is_exact(qkv):
  r = _sim(qkv, "quest+resa", budget=1.0)  # RESA with everything selected equals dense
  assert np.all(r["out_rel_l2"] < 1e-4)
  assert np.all(r["score_l1"] < 1e-4)


def test_retro_and_rect_run(qkv):
  retro = _sim(qkv, "quest+retro:w=2", budget=0.2)
  assert np.all(np.isfinite(retro["out_rel_l2_retired"]))
  rect = _sim(qkv, "quest+rect:f=3", budget=0.2)
  base = _sim(qkv, "quest", budget=0.2)
  # Oracle inputs: rectification rewrites identical K/V, so it changes nothing.
  np.testing.assert_allclose(rect["out_rel_l2"], base["out_rel_l2"], rtol=1e-5, atol=1e-6)


def test_residual_outputs_reproduce_lambda(qkv):
  parts = {k: v for k, v in _sim(qkv, "quest+resa", budget=0.2).items() if k in errors.RESIDUAL}
  half = _sim(qkv, "quest+resa:lam=0.5", budget=0.2)
  ones = np.ones((L, N), np.float32)
  err = calibrate.per_layer_error(parts, np.log(0.5) * ones, ones)
  np.testing.assert_allclose(err, half["out_rel_l2"].mean((1, 2)), rtol=1e-4)
  lam, best = calibrate.best_global_lambda(parts, [0.0, 0.5, 1.0])
  assert lam in (0.0, 0.5, 1.0) and np.isfinite(best)


def test_fit_lowers_error_and_roundtrips(qkv, tmp_path):
  parts = {k: v for k, v in _sim(qkv, "quest+resa", budget=0.2).items() if k in errors.RESIDUAL}
  params, curve = calibrate.fit(parts, fit_beta=True, steps=60)
  assert curve[-1] < curve[0]
  assert params["log_lam"].shape == (L, N) and np.all(np.isfinite(params["beta"]))
  checkpoint.save_arrays(str(tmp_path / "ckpt"), params)
  back = checkpoint.restore_arrays(str(tmp_path / "ckpt"))
  for name in params:
    np.testing.assert_array_equal(back[name], params[name])


def test_merge_residual_limits():
  o_sel, o_res = jnp.ones((3, 2)), -jnp.ones((3, 2))
  lse_sel = jnp.zeros(3)
  out = errors.merge_residual(o_sel, lse_sel, o_res, jnp.array([-jnp.inf, 0.0, 50.0]))
  np.testing.assert_allclose(out, [[1, 1], [0, 0], [-1, -1]], atol=1e-6)


def test_fig6a_per_head_reduction_quantiles():
  """The paper's Fig. 6a: layers' average error per head, RESA's reduction per head."""
  from experiments.analysis import attention_error  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  base = rng.uniform(1.0, 2.0, size=(3, 8))
  frac = np.linspace(0.2, 0.9, 8)  # head h keeps frac[h] of its error
  resa = base * frac[None]
  out = attention_error.head_reduction_quantiles(base, resa)
  want = 1.0 - frac
  np.testing.assert_allclose(out["head_reduction_median"], np.median(want))
  np.testing.assert_allclose(out["head_reduction_q25"], np.quantile(want, 0.25))
  assert out["heads_reduced"] == 1.0
  # A ratio of means weights heads by their error; the per-head median does not.
  base[:, 0] = 100.0
  resa[:, 0] = 100.0  # one large head RESA does not help
  out = attention_error.head_reduction_quantiles(base, resa)
  assert out["heads_reduced"] == 7 / 8
  assert out["head_reduction_median"] > 1.0 - resa.mean() / base.mean()
  rec = lambda spec, grid: dict(spec=spec, budget=0.1, score_l1=grid.tolist(),
                                **{m: grid.tolist() for m in attention_error.METRICS
                                   if m != "score_l1"}, attended=[1.0],
                                out_rel_l2_retired=[0.0])
  _, red = attention_error.summary([rec("quest", base), rec("quest+resa", resa)])
  assert red[0]["head_reduction_median"] == out["head_reduction_median"]
