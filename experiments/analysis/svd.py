"""Spectra and rank-1 structure of attention logits (RESA, Yang et al. ICLR 2026, Sec. 3.2).

Letters: H heads (query heads; keys repeated over their kv group), S queries = keys (a prefill
of S tokens), D head dim, n decode steps.

The logit matrix of a head over a prefill is ``M = scale * Q K^T`` (``[S, S]``, unmasked, the
matrix RESA decomposes). It has rank at most ``D``, so its singular values are exactly those of
a ``D x D`` matrix: with thin QR factorisations ``Q = Q_q R_q`` and ``K = Q_k R_k`` (computed as
Cholesky QR, in float64), ``M = Q_q (scale R_q R_k^T) Q_k^T`` and ``svd(M)`` follows from
``svd(scale R_q R_k^T)`` in ``O(S D^2)`` instead of ``O(S^3)`` (``factored_svd``).
``dense_singular_values`` is the direct ``jnp.linalg.svd`` of the ``S x S`` matrix, kept to
check the factored path on a subset.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _chol_factor(x):
  """Cholesky QR: ``x [H, S, D] = Q R`` with ``R = chol(x^T x)^T`` (tiny jitter for rank
  deficiency); returns ``(R [H, D, D], R^{-1})``. LAPACK's Householder QR of a tall-skinny
  ``[8192, 64]`` matrix is ~100x slower on these machines than the Gram + Cholesky route."""
  gram = np.swapaxes(x, -1, -2) @ x  # [H, D, D]
  d = gram.shape[-1]
  jitter = 1e-12 * np.trace(gram, axis1=-2, axis2=-1)[:, None, None] * np.eye(d)
  r = np.swapaxes(np.linalg.cholesky(gram + jitter + 1e-300 * np.eye(d)), -1, -2)
  return r, np.linalg.inv(r)


def factored_svd(q, k, scale: float):
  """Singular values and the principal singular pair of ``M = scale Q K^T``, exactly.

  With ``Q = Q_q R_q`` and ``K = Q_k R_k`` (orthonormal ``Q_q, Q_k``), ``M = Q_q (scale R_q
  R_k^T) Q_k^T``, so ``svd(M)`` is ``svd`` of the ``D x D`` core rotated back.

  Args:
    q: ``[H, S, D]`` queries; k: ``[H, S, D]`` keys (same head order).
    scale: softmax scale.

  Returns:
    ``s [H, min(S, D)]`` descending (float64), ``u1 [H, S]``, ``v1 [H, S]`` (unit vectors with
    ``M v1 = s_1 u1``).
  """
  q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
  rq, rq_inv = _chol_factor(q64)
  rk, rk_inv = _chol_factor(k64)
  u, s, vt = np.linalg.svd(scale * rq @ np.swapaxes(rk, -1, -2))
  r = min(q64.shape[1], q64.shape[2])
  # Q_q u = Q R^{-1} u
  u1 = np.einsum("hsd,hd->hs", q64, np.einsum("hde,he->hd", rq_inv, u[:, :, 0]))
  v1 = np.einsum("hsd,hd->hs", k64, np.einsum("hde,he->hd", rk_inv, vt[:, 0, :]))
  norm = lambda a: a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-300)
  return s[:, :r], norm(u1), norm(v1)


def dense_singular_values(q, k, scale: float, heads_per_call: int = 1) -> np.ndarray:
  """``svdvals(scale Q K^T)`` of the explicit ``[S, S]`` matrices in float32 (``[H, S]``)."""
  fn = jax.jit(lambda a, b: jnp.linalg.svd(
      scale * jnp.einsum("hsd,htd->hst", a, b, precision=jax.lax.Precision.HIGHEST),
      compute_uv=False))
  out = []
  for i in range(0, q.shape[0], heads_per_call):
    out.append(np.asarray(fn(jnp.asarray(q[i:i + heads_per_call], jnp.float32),
                             jnp.asarray(k[i:i + heads_per_call], jnp.float32))))
  return np.concatenate(out, axis=0)


def cumulative_ratio(s) -> np.ndarray:
  """``sum_{i<=r} s_i / sum_i s_i`` along the last axis (Fig. 2a): monotone, ends at 1."""
  s = np.asarray(s, np.float64)
  return np.cumsum(s, axis=-1) / np.maximum(np.sum(s, axis=-1, keepdims=True), 1e-300)


def principal_share(s) -> np.ndarray:
  """``s_1 / sum_i s_i`` (Fig. 2b): the principal singular value's share of the spectrum."""
  s = np.asarray(s, np.float64)
  return s[..., 0] / np.maximum(np.sum(s, axis=-1), 1e-300)


def energy_share(s) -> np.ndarray:
  """``s_1^2 / sum_i s_i^2``: the share of ``||M||_F^2`` the best rank-1 approximation keeps."""
  s2 = np.square(np.asarray(s, np.float64))
  return s2[..., 0] / np.maximum(np.sum(s2, axis=-1), 1e-300)


def linear_fit(x, y):
  """Least-squares ``y ~ a x + b`` per row of ``y [..., P]`` over ``x [P]``.

  Returns:
    ``(slope, intercept, r2)``, each ``[...]``; ``r2 = 1 - SS_res / SS_tot`` (1 for a
    constant ``y`` fitted exactly).
  """
  x = np.asarray(x, np.float64)
  y = np.asarray(y, np.float64)
  xm = x - x.mean()
  slope = np.sum(xm * (y - y.mean(-1, keepdims=True)), -1) / np.sum(xm * xm)
  intercept = y.mean(-1) - slope * x.mean()
  res = y - (slope[..., None] * x + intercept[..., None])
  ss_res = np.sum(res * res, -1)
  ss_tot = np.sum(np.square(y - y.mean(-1, keepdims=True)), -1)
  r2 = np.where(ss_tot > 0, 1.0 - ss_res / np.where(ss_tot > 0, ss_tot, 1.0), 1.0)
  return slope, intercept, r2


def mean_query_alignment(q, k, scale: float, s, u1, v1) -> dict:
  """How well the mean query's logits ``mu_Q K^T`` stand for the rank-1 part (Fig. 4b).

  RESA's prior replaces every query by ``mu_Q``: the matrix ``1 w^T`` with ``w = scale K mu_Q``
  (every row the same). Both it and ``s_1 u_1 v_1^T`` are rank 1, so their Frobenius cosine is
  ``(u_1 . 1)(v_1 . w) / (sqrt(S) ||w||)``. Since ``<M, 1 w^T>_F = S ||w||^2``, the mean-query
  matrix keeps the share ``S ||w||^2 / ||M||_F^2`` of the energy (at most ``energy_share``).

  Args:
    q, k: ``[H, S, D]``; s, u1, v1: from ``factored_svd``.

  Returns:
    dict of ``[H]`` arrays: ``row_cosine`` (the paper's statistic: the mean over rows ``i`` of
    ``cos(s_1 u_1i v_1^T, w^T)``, each row's rank-1 part against the prior row) and its minimum
    ``row_cosine_min``; ``cosine`` (the Frobenius cosine, signed), ``key_cosine``
    (``|cos(v_1, w)|``), ``mean_query_energy`` (``S ||w||^2 / ||M||^2``).
  """
  q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
  n = q64.shape[1]
  w = scale * np.einsum("hsd,hd->hs", k64, q64.mean(1))  # [H, S]
  wn = np.maximum(np.linalg.norm(w, axis=-1), 1e-300)
  cos = np.sum(u1, -1) * np.sum(v1 * w, -1) / (np.sqrt(n) * wn)
  key_cos = np.abs(np.sum(v1 * w, -1)) / wn
  energy = n * np.square(wn) / np.maximum(np.sum(np.square(s), -1), 1e-300)
  # The paper's Fig. 4b is row-wise: cos(s_1 u_1i v_1, w) = sign(u_1i) (v_1 . w) / ||w||.
  row = np.sign(u1) * (np.sum(v1 * w, -1) / wn)[:, None]  # [H, S]
  return dict(cosine=cos, key_cosine=key_cos, mean_query_energy=energy,
              row_cosine=row.mean(-1), row_cosine_min=row.min(-1))


def key_concentration(q, k, scale: float, bins=None) -> dict:
  """How tightly each key's historical logits sit around their mean (Fig. 4a).

  Key ``j``'s history is ``M_ij`` for the queries ``i >= j`` that attended it (causal). The
  pooled within-key variance is compared with the variance of all causal logits.

  Args:
    q, k: ``[H, S, D]``.
    bins: optional histogram bin edges for the deviations (``[E]``).

  Returns:
    dict of ``[H]`` arrays ``explained`` (``1 - within / total`` variance: the share of the
    logit variance that the per-key means explain), ``within_std``, ``total_std``; with
    ``bins``, ``hist_key [H, E-1]`` (``M_ij - mean_j``) and ``hist_all`` (``M_ij - mean``).
  """
  qj, kj = jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32)
  out = _concentration(qj, kj, scale, None if bins is None else jnp.asarray(bins, jnp.float32))
  return {name: np.asarray(val, np.float64) for name, val in out.items()}


@jax.jit
def _concentration_core(q, k, scale, bins):
  n = q.shape[1]
  m = scale * jnp.einsum("hsd,htd->hst", q, k, precision=jax.lax.Precision.HIGHEST)
  causal = (jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]).astype(jnp.float32)  # [i, j]
  cnt = jnp.sum(causal, 0)  # [S] queries per key
  col_mean = jnp.sum(m * causal, 1) / cnt  # [H, S]
  dev_key = m - col_mean[:, None, :]
  tot = jnp.sum(causal)
  mean = jnp.sum(m * causal, (1, 2)) / tot
  dev_all = m - mean[:, None, None]
  within = jnp.sum(dev_key ** 2 * causal, (1, 2)) / tot
  total = jnp.sum(dev_all ** 2 * causal, (1, 2)) / tot
  return within, total, _hist(dev_key, causal, bins), _hist(dev_all, causal, bins)


def _hist(x, weights, edges):
  """Weighted counts ``[H, E-1]`` of ``x [H, ...]`` in uniform bins ``edges [E]`` (values
  outside the range are dropped)."""
  nb = edges.shape[0] - 1
  pos = (x - edges[0]) / (edges[-1] - edges[0]) * nb
  idx = jnp.where((pos >= 0) & (pos <= nb), jnp.minimum(pos.astype(jnp.int32), nb - 1), nb)
  w = jnp.broadcast_to(weights, x.shape).reshape(x.shape[0], -1)
  out = jnp.zeros((x.shape[0], nb + 1), jnp.float32)
  out = out.at[jnp.arange(x.shape[0])[:, None], idx.reshape(x.shape[0], -1)].add(w)
  return out[:, :nb]


def _concentration(q, k, scale, bins):
  no_bins = bins is None
  bins = jnp.linspace(-1.0, 1.0, 3) if no_bins else bins
  within, total, hist_key, hist_all = _concentration_core(q, k, scale, bins)
  out = dict(explained=1.0 - within / jnp.maximum(total, 1e-30), within_std=jnp.sqrt(within),
             total_std=jnp.sqrt(total))
  if not no_bins:
    out.update(hist_key=hist_key, hist_all=hist_all)
  return out


def channel_profile(x) -> np.ndarray:
  """``|mean_s x[:, s, d]| / rms_s x[:, s, d]`` per head and channel (Fig. 5b), in [0, 1].

  Args:
    x: ``[H, S, D]`` post-RoPE queries or keys.

  Returns:
    ``[H, D]``: 1 for a channel that is constant over positions, ~0 for one whose values
    cancel (a fast-rotating RoPE pair).
  """
  x = np.asarray(x, np.float64)
  rms = np.sqrt(np.mean(x * x, axis=1))
  return np.abs(x.mean(1)) / np.maximum(rms, 1e-30)


def frequency_rank(head_dim: int) -> np.ndarray:
  """RoPE frequency index of each channel (half-split: ``d`` pairs with ``d + D/2``).

  Index 0 rotates fastest (``inv_freq = 1``); ``D/2 - 1`` slowest.
  """
  return np.arange(head_dim) % (head_dim // 2)


def delta_autocorrelation(q, k, scale: float, prefix: int, steps: int, max_lag: int) -> dict:
  """RESA's estimation error ``delta_i = scale (q_i - mu_Q)(K - mu_K)^T`` over decode steps.

  ``mu_Q, mu_K`` are the prompt's mean query and key (the first ``prefix`` tokens); the
  ``steps`` queries after the prompt play the decode steps and ``K`` is the prompt's keys
  (Fig. 6b). ``delta_i`` has zero mean over keys, so the cosine of two steps' deltas is their
  Pearson correlation; with ``G = (K - mu_K)^T (K - mu_K)`` it is
  ``dq_i G dq_j / sqrt(dq_i G dq_i dq_j G dq_j)`` (no ``[S]`` vectors needed).

  Args:
    q, k: ``[H, S_total, D]`` with ``S_total >= prefix + steps``.

  Returns:
    dict: ``autocorr [H, max_lag]`` (mean correlation of steps ``l`` apart, ``l = 1..max_lag``),
    ``baseline [H]`` (mean correlation over all pairs of distinct steps), ``relative [H]``
    (mean ``||delta_i|| / ||scale q_i (K - mu_K)^T||``: the query-specific share of the logit
    variation that ``mu_Q`` misses).
  """
  q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
  if q64.shape[1] < prefix + steps:
    raise ValueError(f"need {prefix + steps} tokens, got {q64.shape[1]}")
  mu_q = q64[:, :prefix].mean(1)  # [H, D]
  kc = k64[:, :prefix] - k64[:, :prefix].mean(1, keepdims=True)
  g = np.einsum("hsd,hse->hde", kc, kc)  # [H, D, D]
  qi = q64[:, prefix:prefix + steps]  # [H, n, D]
  dq = qi - mu_q[:, None]
  dg = dq @ g  # [H, n, D]
  inner = dg @ np.swapaxes(dq, -1, -2)  # [H, n, n]
  norm = np.sqrt(np.maximum(np.einsum("hii->hi", inner), 1e-300))
  corr = inner / (norm[:, :, None] * norm[:, None, :])
  lags = np.arange(1, max_lag + 1)
  auto = np.stack([np.mean(np.diagonal(corr, offset=int(l), axis1=1, axis2=2), -1)
                   for l in lags], -1)
  off = ~np.eye(steps, dtype=bool)
  baseline = np.sum(np.where(off, corr, 0.0), (1, 2)) / off.sum()
  full = np.sqrt(np.maximum(np.sum((qi @ g) * qi, -1), 1e-300))
  relative = np.mean(norm / full, -1)
  return dict(autocorr=auto, baseline=baseline, relative=relative)


def delta_token_acf(q, k, scale: float, prefix: int, steps: int, max_lag: int) -> dict:
  """The paper's Fig. 6b: per key, the ACF of its error ``delta_i[j]`` over decode steps ``i``.

  ``delta_i[j] = scale (q_i - mu_Q) . (k_j - mu_K)`` (RESA Appendix, Eq. of the remaining error)
  is a time series over the ``steps`` queries after the prompt for every prompt key ``j``. Its
  sample ACF at lag ``l`` is ``sum_t x~_t x~_{t+l} / sum_t x~_t^2`` (``x~`` the series minus its
  mean); the paper's shaded band is the 95% interval of white noise, ``+-1.96 / sqrt(steps)``.

  Args:
    q, k: ``[H, S_total, D]`` with ``S_total >= prefix + steps``.

  Returns:
    dict: ``acf [H, max_lag]`` (mean over keys), ``acf_q25, acf_q75 [H, max_lag]`` (quartiles
    over keys), ``acf_significant [H, max_lag]`` (fraction of keys outside the band) and
    ``acf_ci95`` (the band's half width).
  """
  q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
  if q64.shape[1] < prefix + steps:
    raise ValueError(f"need {prefix + steps} tokens, got {q64.shape[1]}")
  if not 1 <= max_lag < steps:
    raise ValueError(f"max_lag must be in [1, steps={steps}), got {max_lag}")
  mu_q = q64[:, :prefix].mean(1)  # [H, D]
  kc = k64[:, :prefix] - k64[:, :prefix].mean(1, keepdims=True)
  # [H, n, S]: the error series of every key
  x = scale * np.einsum("hnd,hsd->hns", q64[:, prefix:prefix + steps] - mu_q[:, None], kc)
  x = x - x.mean(1, keepdims=True)
  var = np.maximum(np.sum(x * x, 1), 1e-300)  # [H, S]
  acf = np.stack([np.sum(x[:, :-l] * x[:, l:], 1) / var for l in range(1, max_lag + 1)], -1)
  ci = 1.96 / np.sqrt(steps)
  return dict(acf=acf.mean(1), acf_q25=np.quantile(acf, 0.25, axis=1),
              acf_q75=np.quantile(acf, 0.75, axis=1),
              acf_significant=np.mean(np.abs(acf) > ci, axis=1), acf_ci95=float(ci))
