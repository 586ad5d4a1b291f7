"""RESA's output error split into its two estimates: the unselected mass and the residual value.

RESA (Eq. 3-5) completes a sparse step with one exact ``(out, lse)`` merge
(``sparse_attn.merge``) of the selected part ``(o_sel, lse_sel)``, exact attention over the
selected set ``I``, with an estimate of the unselected keys: the residual value ``o_est`` (the
prior-weighted values of the unselected prior keys) at the mass
``lse_est = logsumexp_{j not in I} P_j + b + log lam``. The truth is dense attention restricted
to the unselected keys, ``(o_true, lse_true)``; merged with the selected part it is dense
attention exactly. Swapping one estimate for the truth leaves the error of the other:

  * ``out_rel_l2_true_mass``: ``merge(sel, (o_est, lse_true))``: error from the value estimate
    alone (it equals ``share_true * ||o_est - o_true|| / ||o*||``);
  * ``out_rel_l2_true_value``: ``merge(sel, (o_true, lse_est))``: error from the mass estimate
    alone (``|mass_est - mass_true| * ||o_true - o_sel|| / ||o*||``);
  * ``mass_ratio = e^{lse_est - lse_true}``: estimated / true unselected mass (both against the
    same exact selected part, so > 1 means RESA gives the unselected keys too much weight);
  * ``mass_est``, ``mass_true``: the unselected keys' share of the attention, RESA's and dense.

Per record, ``per_head`` reduces the decode steps per layer x head: error and share means, the
median mass ratio and the Pearson correlation over steps of ``mass_est`` with ``mass_true``.
``summarise`` reduces those over heads for the table and the report's Fig. 6a row.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from sparse_attn.merge import merge

# Per-step fields [L, n, N] that ``errors.simulate`` returns for a RESA method.
STEP_FIELDS = ("out_rel_l2_true_mass", "out_rel_l2_true_value", "mass_ratio", "mass_est",
               "mass_true")
# Per-head fields [L, N] that a record stores.
HEAD_FIELDS = ("out_rel_l2_true_mass", "out_rel_l2_true_value", "mass_ratio", "mass_corr",
               "mass_est", "mass_true")
TIE = 1.1  # one estimate "dominates" when its error alone is > TIE x the other's


def _rel_l2(o, o_dense):
  return jnp.linalg.norm(o - o_dense, axis=-1) / jnp.maximum(jnp.linalg.norm(o_dense, axis=-1),
                                                             1e-30)


def _share(lse_part, lse_sel):
  """``e^{lse_part} / (e^{lse_sel} + e^{lse_part})``; 0 for an empty part, NaN if both are."""
  tot = jnp.logaddexp(lse_sel, lse_part)
  ok = jnp.isfinite(tot)
  return jnp.where(ok, jnp.exp(lse_part - jnp.where(ok, tot, 0.0)), jnp.nan)


def decompose(o_sel, lse_sel, o_est, lse_est, o_true, lse_true, o_dense) -> dict:
  """The decomposition of one step (any leading shape ``[...]``).

  Args:
    o_sel, lse_sel: ``[..., D]``, ``[...]`` exact attention over the selected keys.
    o_est, lse_est: RESA's residual value and its (lam-weighted, biased) log-mass.
    o_true, lse_true: dense attention over the unselected keys (``-inf``: none unselected).
    o_dense: ``[..., D]`` dense attention over every visible key.

  Returns:
    dict of ``[...]`` f32 arrays named ``STEP_FIELDS``; ``mass_ratio`` is NaN where nothing is
    unselected (0 / 0), ``inf`` where RESA gives mass to an empty residual.
  """
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  sel = (f32(o_sel), f32(lse_sel))
  with_true_mass = merge(sel, (f32(o_est), f32(lse_true)))[0]
  with_true_value = merge(sel, (f32(o_true), f32(lse_est)))[0]
  lse_est, lse_true = f32(lse_est), f32(lse_true)
  both_empty = ~jnp.isfinite(lse_est) & ~jnp.isfinite(lse_true)
  diff = jnp.where(both_empty, jnp.nan, lse_est - lse_true)  # +-inf when one side is empty
  return dict(out_rel_l2_true_mass=_rel_l2(with_true_mass, o_dense),
              out_rel_l2_true_value=_rel_l2(with_true_value, o_dense),
              mass_ratio=jnp.exp(diff), mass_est=_share(lse_est, sel[1]),
              mass_true=_share(lse_true, sel[1]))


def pearson_over(x, y, axis: int):
  """Pearson correlation of ``x`` and ``y`` along ``axis`` over the entries where both are
  finite; NaN with fewer than 3 such entries or a constant series."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  ok = np.isfinite(x) & np.isfinite(y)
  cnt = ok.sum(axis)
  mean = lambda a: np.where(ok, a, 0.0).sum(axis) / np.maximum(cnt, 1)
  dx = np.where(ok, x - np.expand_dims(mean(x), axis), 0.0)
  dy = np.where(ok, y - np.expand_dims(mean(y), axis), 0.0)
  sxy, sxx, syy = (dx * dy).sum(axis), (dx * dx).sum(axis), (dy * dy).sum(axis)
  # "Constant" up to rounding: a spread below 1e-12 of the series' own size.
  flat = lambda d2, a: d2 <= 1e-12 * np.where(ok, a * a, 0.0).sum(axis)
  good = (cnt >= 3) & ~flat(sxx, x) & ~flat(syy, y) & (sxx > 0) & (syy > 0)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(good, sxy / np.sqrt(np.where(good, sxx * syy, 1.0)), np.nan)


def _nanreduce(fn, x, axis):
  x = np.asarray(x, np.float64)
  ok = np.isfinite(x).any(axis)
  with np.errstate(invalid="ignore"):
    return np.where(ok, fn(np.where(np.isfinite(x), x, np.nan), axis=axis), np.nan)


def per_head(res: dict) -> dict:
  """``[L, n, N]`` per-step fields of ``errors.simulate`` -> ``[L, N]`` per-head ``HEAD_FIELDS``
  ({} when the method has no decomposition). ``mass_ratio`` is the median over steps."""
  if "mass_ratio" not in res:
    return {}
  import warnings  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices are NaN, on purpose
    out = {k: _nanreduce(np.nanmean, res[k], 1)
           for k in ("out_rel_l2_true_mass", "out_rel_l2_true_value", "mass_est", "mass_true")}
    out["mass_ratio"] = _nanreduce(np.nanmedian, res["mass_ratio"], 1)
  out["mass_corr"] = pearson_over(res["mass_est"], res["mass_true"], axis=1)
  return out


def split(res: dict) -> tuple[dict, dict]:
  """``(per-head decomposition, the other per-step fields)`` of an ``errors.simulate`` result."""
  return per_head(res), {k: v for k, v in res.items() if k not in STEP_FIELDS}


def _over_heads(fn, rec, name):
  x = np.asarray(rec.get(name, np.nan), np.float64)
  return float(fn(x[np.isfinite(x)])) if np.isfinite(x).any() else float("nan")


def source(err_value_only: float, err_mass_only: float) -> str:
  """Which estimate the error comes from: ``"mass"``, ``"value"`` or ``"both"`` (within TIE)."""
  if not (np.isfinite(err_value_only) and np.isfinite(err_mass_only)):
    return "n/a"
  if err_mass_only > TIE * err_value_only:
    return "mass"
  if err_value_only > TIE * err_mass_only:
    return "value"
  return "both"


def summarise(rec: dict) -> dict:
  """Over layers x heads for one ``+resa`` record: mean errors, the median over heads of the
  per-head median mass ratio and of the per-head correlation, and ``source`` ({} without the
  decomposition, e.g. records written before it existed)."""
  if "mass_ratio" not in rec:
    return {}
  out = dict(out_rel_l2_true_mass=_over_heads(np.mean, rec, "out_rel_l2_true_mass"),
             out_rel_l2_true_value=_over_heads(np.mean, rec, "out_rel_l2_true_value"),
             mass_ratio_median=_over_heads(np.median, rec, "mass_ratio"),
             mass_corr_median=_over_heads(np.median, rec, "mass_corr"),
             mass_est=_over_heads(np.mean, rec, "mass_est"),
             mass_true=_over_heads(np.mean, rec, "mass_true"))
  out["source"] = source(out["out_rel_l2_true_mass"], out["out_rel_l2_true_value"])
  return out


TABLE_COLUMNS = ("selector", "resa", "budget", "out_rel_l2_base", "out_rel_l2_resa",
                 "out_rel_l2_true_mass", "out_rel_l2_true_value", "mass_true", "mass_est",
                 "mass_ratio_median", "mass_corr_median", "source")

TABLE_NOTE = (
    "RESA's output error split into its two estimates (oracle inputs, exact merge of the "
    "selected part with a residual part): `out_rel_l2_true_mass` = the true unselected mass with "
    "RESA's residual value (error of the value estimate alone), `out_rel_l2_true_value` = RESA's "
    "mass with the true residual value (dense attention over the unselected keys; error of the "
    "mass estimate alone); `mass_true` / `mass_est` = the unselected keys' mean share of the "
    "attention, dense and RESA's; `mass_ratio_median` = median over heads of each head's median "
    "(over steps) estimated / true unselected mass; `mass_corr_median` = median over heads of "
    "each head's Pearson correlation over steps of RESA's share with the true one; `source` = "
    f"the estimate whose error alone is larger (`both` within {TIE:g}x).")


def why(row: dict) -> str:
  """One clause for the report's Fig. 6a row: which estimate the output error comes from."""
  if "source" not in row or row["source"] == "n/a":
    return ""
  what = {"mass": "the unselected-mass estimate", "value": "the residual-value estimate",
          "both": "both estimates alike"}[row["source"]]
  return (f"; the output error comes from {what} (true mass + RESA value "
          f"{row['out_rel_l2_true_mass']:.3f}, RESA mass + true value "
          f"{row['out_rel_l2_true_value']:.3f}, RESA {row['out_rel_l2_resa']:.3f}; "
          f"est/true mass median {row['mass_ratio_median']:.2f}, "
          f"corr {row['mass_corr_median']:.2f})")
