"""Unit tests of experiments.analysis.svd against numpy on random matrices."""

import numpy as np
import pytest

from experiments.analysis import svd


def _qk(rng, h=2, s=48, d=8):
  return rng.normal(size=(h, s, d)), rng.normal(size=(h, s, d))


def test_factored_svd_matches_numpy():
  rng = np.random.default_rng(0)
  q, k = _qk(rng)
  s, u1, v1 = svd.factored_svd(q, k, 0.5)
  m = 0.5 * q @ np.swapaxes(k, -1, -2)
  u, ref, vt = np.linalg.svd(m)
  np.testing.assert_allclose(s, ref[:, :8], rtol=1e-8)
  assert np.all(ref[:, 8:] < 1e-10 * ref[:, :1])  # rank <= D
  np.testing.assert_allclose(np.abs(np.sum(u[:, :, 0] * u1, -1)), 1.0, atol=1e-8)
  np.testing.assert_allclose(np.abs(np.sum(vt[:, 0] * v1, -1)), 1.0, atol=1e-8)
  np.testing.assert_allclose(np.einsum("hst,ht->hs", m, v1), s[:, :1] * u1, atol=1e-8)


def test_dense_singular_values_match_factored():
  rng = np.random.default_rng(1)
  q, k = _qk(rng, s=40)
  dense = svd.dense_singular_values(q.astype(np.float32), k.astype(np.float32), 0.3)
  fact, _, _ = svd.factored_svd(q, k, 0.3)
  np.testing.assert_allclose(dense[:, :8], fact, rtol=1e-4, atol=1e-4 * fact[:, :1].max())


def test_rank1_plus_noise_has_dominant_sigma1():
  rng = np.random.default_rng(2)
  s_len, d = 64, 16
  q = np.ones((1, s_len, 1)) * rng.normal(size=(1, 1, d)) + 1e-3 * rng.normal(size=(1, s_len, d))
  k = rng.normal(size=(1, s_len, d))
  s, _, _ = svd.factored_svd(q, k, 1.0)
  assert svd.principal_share(s)[0] > 0.95
  assert svd.energy_share(s)[0] > 0.999
  # Random (full-rank) logits spread their spectrum.
  qr, kr = _qk(rng, h=1, s=64, d=16)
  assert svd.principal_share(svd.factored_svd(qr, kr, 1.0)[0])[0] < 0.3


def test_cumulative_ratio_and_shares_in_range():
  rng = np.random.default_rng(3)
  s = np.sort(rng.random((5, 10)), -1)[:, ::-1]
  c = svd.cumulative_ratio(s)
  assert np.all(np.diff(c, axis=-1) >= 0) and np.allclose(c[:, -1], 1.0)
  for share in (svd.principal_share(s), svd.energy_share(s)):
    assert np.all((share >= 0) & (share <= 1))
  np.testing.assert_allclose(svd.principal_share(s), s[:, 0] / s.sum(-1))


def test_linear_fit():
  x = np.array([512.0, 1024, 2048, 4096])
  y = np.stack([3 * x + 1, x ** 2])
  slope, icpt, r2 = svd.linear_fit(x, y)
  np.testing.assert_allclose([slope[0], icpt[0], r2[0]], [3, 1, 1], rtol=1e-10)
  assert 0 < r2[1] < 1
  np.testing.assert_allclose(slope[1], np.polyfit(x, y[1], 1)[0])


def test_mean_query_alignment_identical_queries():
  rng = np.random.default_rng(4)
  mu = rng.normal(size=(1, 1, 8))
  q = np.repeat(mu, 32, axis=1)  # every query the mean query: M = 1 w^T exactly
  k = rng.normal(size=(1, 32, 8))
  s, u1, v1 = svd.factored_svd(q, k, 0.7)
  al = svd.mean_query_alignment(q, k, 0.7, s, u1, v1)
  np.testing.assert_allclose(al["cosine"], 1.0, atol=1e-6)
  np.testing.assert_allclose(al["mean_query_energy"], 1.0, atol=1e-6)
  q2, k2 = _qk(rng, h=3)
  s2, a2, b2 = svd.factored_svd(q2, k2, 1.0)
  al2 = svd.mean_query_alignment(q2, k2, 1.0, s2, a2, b2)
  assert np.all(np.abs(al2["cosine"]) <= 1 + 1e-9)
  assert np.all(al2["mean_query_energy"] <= svd.energy_share(s2) + 1e-9)


def test_key_concentration_matches_loops():
  rng = np.random.default_rng(5)
  q, k = _qk(rng, h=2, s=12, d=4)
  bins = np.linspace(-6, 6, 13)
  out = svd.key_concentration(q, k, 0.5, bins)
  for h in range(2):
    m = 0.5 * q[h] @ k[h].T
    cols = [m[j:, j] for j in range(12)]  # key j's history: queries i >= j
    vals = np.concatenate(cols)
    within = sum(np.sum((c - c.mean()) ** 2) for c in cols) / len(vals)
    total = np.var(vals)
    np.testing.assert_allclose(out["explained"][h], 1 - within / total, rtol=1e-4)
    dev = np.concatenate([c - c.mean() for c in cols])
    np.testing.assert_allclose(out["hist_key"][h], np.histogram(dev, bins)[0], atol=1e-3)
  assert np.all((out["explained"] >= 0) & (out["explained"] <= 1))


def test_delta_autocorrelation_matches_explicit_deltas():
  rng = np.random.default_rng(6)
  q, k = _qk(rng, h=1, s=40, d=6)
  q[:, 30:] = q[:, 29:30] + 0.1 * rng.normal(size=(1, 10, 6))  # slowly varying decode queries
  out = svd.delta_autocorrelation(q, k, 0.5, prefix=30, steps=10, max_lag=3)
  mu_q, kc = q[0, :30].mean(0), k[0, :30] - k[0, :30].mean(0)
  delta = 0.5 * (q[0, 30:] - mu_q) @ kc.T  # [n, S]
  corr = np.corrcoef(delta)
  for lag in (1, 2, 3):
    np.testing.assert_allclose(out["autocorr"][0, lag - 1], np.mean(np.diagonal(corr, lag)),
                               atol=1e-8)
  full = 0.5 * q[0, 30:] @ kc.T
  np.testing.assert_allclose(out["relative"][0], np.mean(np.linalg.norm(delta, axis=1)
                                                         / np.linalg.norm(full, axis=1)))


def test_channel_profile():
  x = np.zeros((1, 8, 2))
  x[0, :, 0] = 3.0
  x[0, :, 1] = np.where(np.arange(8) % 2, 1.0, -1.0)
  np.testing.assert_allclose(svd.channel_profile(x)[0], [1.0, 0.0])
  assert list(svd.frequency_rank(8)) == [0, 1, 2, 3, 0, 1, 2, 3]


def test_too_short_for_delta():
  with pytest.raises(ValueError):
    svd.delta_autocorrelation(np.zeros((1, 5, 2)), np.zeros((1, 5, 2)), 1.0, 4, 4, 1)


def test_delta_token_acf_matches_per_key_series():
  """The paper's Fig. 6b statistic: each key's error series over steps, its sample ACF."""
  rng = np.random.default_rng(8)
  q, k = _qk(rng, h=2, s=70, d=6)
  q[:, 30:] = np.cumsum(0.3 * rng.normal(size=(2, 40, 6)), 1)  # a random walk: strong ACF
  out = svd.delta_token_acf(q, k, 0.5, prefix=30, steps=40, max_lag=4)
  for h in range(2):
    mu_q, kc = q[h, :30].mean(0), k[h, :30] - k[h, :30].mean(0)
    x = 0.5 * (q[h, 30:] - mu_q) @ kc.T  # [n, S]: one series per key
    x = x - x.mean(0)
    for lag in range(1, 5):
      r = np.sum(x[:-lag] * x[lag:], 0) / np.sum(x * x, 0)
      np.testing.assert_allclose(out["acf"][h, lag - 1], r.mean(), atol=1e-10)
      np.testing.assert_allclose(out["acf_significant"][h, lag - 1],
                                 np.mean(np.abs(r) > 1.96 / np.sqrt(40)))
  assert out["acf"][:, 0].min() > 0.5  # a random walk is strongly autocorrelated
  noise = svd.delta_token_acf(rng.normal(size=(1, 400, 6)), k[:1, :60].repeat(1, 0), 1.0,
                              prefix=30, steps=300, max_lag=3)
  assert np.abs(noise["acf"]).max() < noise["acf_ci95"]  # white-noise queries: inside the band
  with pytest.raises(ValueError):
    svd.delta_token_acf(q, k, 1.0, 30, 40, 40)


def test_row_cosine_is_each_rows_rank1_part_against_the_prior_row():
  rng = np.random.default_rng(9)
  q, k = _qk(rng, h=1, s=25, d=5)
  s, u1, v1 = svd.factored_svd(q, k, 0.4)
  al = svd.mean_query_alignment(q, k, 0.4, s, u1, v1)
  m1 = s[0, 0] * np.outer(u1[0], v1[0])  # [S, S] the rank-1 part
  w = 0.4 * k[0] @ q[0].mean(0)
  rows = m1 @ w / (np.linalg.norm(m1, axis=1) * np.linalg.norm(w))
  np.testing.assert_allclose(al["row_cosine"][0], rows.mean(), atol=1e-8)
  np.testing.assert_allclose(al["row_cosine_min"][0], rows.min(), atol=1e-8)
