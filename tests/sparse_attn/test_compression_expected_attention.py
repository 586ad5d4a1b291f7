"""Expected Attention (Devoto et al. 2025) against an independent numpy implementation of Eq. 5-9.

The numpy side builds every RoPE matrix explicitly from 2x2 rotations of the channel pairs
``(i, i + D/2)`` and works from the pre-RoPE queries it generated, so it also checks that the
method recovers pre-RoPE statistics from the post-RoPE queries it is given.
"""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods
from sparse_attn.compression import expected_attention as ea

B, HQ, HKV, D = 2, 4, 2, 8
L, T = 48, 64
LENGTHS = (48, 37)
THETA = 50.0
N_QUERIES, N_FUTURE, N_SINK, EPS = 16, 32, 3, 0.01


def rope_matrix(p, inv):
  """``R_p [D, D]``: a 2x2 rotation by ``p * inv[i]`` on every channel pair (i, i + D/2)."""
  d = 2 * len(inv)
  r = np.zeros((d, d))
  for i, w in enumerate(inv):
    c, s = math.cos(p * w), math.sin(p * w)
    j = i + d // 2
    r[i, i], r[i, j], r[j, i], r[j, j] = c, -s, s, c
  return r


def make_problem(seed):
  rng = np.random.default_rng(seed)
  inv = 1.0 / THETA ** (np.arange(0, D, 2) / D)
  qpre = rng.normal(size=(B, HQ, L, D)) * 0.7 + rng.normal(size=(B, HQ, 1, D))
  kpre = rng.normal(size=(B, HKV, L, D)) + 0.5 * rng.normal(size=(B, HKV, 1, D))
  v = rng.normal(size=(B, HKV, L, D))
  rots = np.stack([rope_matrix(p, inv) for p in range(L)])  # [L, D, D]
  qpost = np.einsum("lde,bhle->bhld", rots, qpre)
  kpost = np.einsum("lde,bhle->bhld", rots, kpre)
  pos = np.tile(np.arange(L), (B, 1))
  for b, n in enumerate(LENGTHS):
    pos[b, n:] = -1
  return dict(inv=inv, qpre=qpre, qpost=qpost, kpost=kpost, v=v, pos=pos)


def numpy_scores(p, use_rope, use_cov, use_vnorm, stats="all"):
  """Eq. 5-9 for every (row, kv head, key); NaN for sinks / empty keys.

  The query statistics come from every prompt query after the sinks (``stats="all"``, the
  paper's prefill protocol) or from the last ``N_QUERIES`` of them (``"window"``).
  """
  scale = 1.0 / math.sqrt(D)
  out = np.full((B, HKV, L), np.nan)
  g = HQ // HKV
  for b, n in enumerate(LENGTHS):
    window = [i for i in range(n) if i >= N_SINK]
    if stats == "window":
      window = window[-N_QUERIES:]
    rbar = (np.mean([rope_matrix(n + j, p["inv"]) for j in range(N_FUTURE)], axis=0)
            if use_rope else np.eye(D))  # Eq. 5, t + 1 = n the next position
    keys = list(range(N_SINK, n))
    for h in range(HKV):
      a = np.zeros(len(keys))
      for qh in range(h * g, (h + 1) * g):
        x = (p["qpre"] if use_rope else p["qpost"])[b, qh, window]
        mu = x.mean(0)
        cov = (x - mu).T @ (x - mu) / len(window)
        mu_bar, cov_bar = rbar @ mu, rbar @ cov @ rbar.T  # Eq. 6
        k = p["kpost"][b, h, keys]
        z = scale * k @ mu_bar  # Eq. 7
        if use_cov:
          z = z + 0.5 * scale**2 * np.einsum("td,de,te->t", k, cov_bar, k)
        e = np.exp(z - z.max())
        a += e / e.sum() / g  # Eq. 8, averaged over the group
      if use_vnorm:
        a = (a + EPS) * np.linalg.norm(p["v"][b, h, keys], axis=-1)  # Eq. 9
      out[b, h, keys] = a
  return out


def prefilled(m, p, chunk=L):
  """Prefill of the problem in chunks of ``chunk`` tokens (the last one padded, position -1)."""
  n = -(-L // chunk) * chunk

  def pad(x, fill=0.0):  # along the token axis (last of pos [B, L], third of [B, H, L, D])
    widths = [(0, 0)] * x.ndim
    widths[1 if x.ndim == 2 else 2] = (0, n - L)
    return np.pad(x, widths, constant_values=fill)

  f32 = lambda x: jnp.asarray(x, jnp.float32)
  q, k, v, pos = pad(p["qpost"]), pad(p["kpost"]), pad(p["v"]), pad(p["pos"], -1)
  cache = m.init_cache(B, HKV, T, D)
  state = m.init_state(B, HQ, HKV, D, T)
  step = jax.jit(m.prefill)
  for start in range(0, n, chunk):
    sl = slice(start, start + chunk)
    _, cache, state = step(f32(q[:, :, sl]), f32(k[:, :, sl]), f32(v[:, :, sl]), cache, state,
                           jnp.asarray(pos[:, sl]))
  return cache, state


@pytest.mark.parametrize("use_rope,use_cov,use_vnorm,stats",
                         [(True, True, True, "all"), (True, False, False, "all"),
                          (False, True, True, "all"), (True, True, True, "window")])
def test_scores_match_numpy_eq5_to_9(use_rope, use_cov, use_vnorm, stats):
  rope = dict(rope_theta=THETA) if use_rope else {}
  m = methods.make("expected_attention", ratio=0.5, n_queries=N_QUERIES, n_future=N_FUTURE,
                   n_sink=N_SINK, eps=EPS, use_covariance=use_cov, use_vnorm=use_vnorm,
                   prefill_stats=stats, head_budget="uniform", **rope)
  p = make_problem(0)
  cache, state = prefilled(m, p)
  got = np.asarray(jax.jit(m.scores, static_argnums=2)(cache, state, 1 / math.sqrt(D), None))
  want = numpy_scores(p, use_rope, use_cov, use_vnorm, stats)
  ok = ~np.isnan(want)
  np.testing.assert_allclose(got[:, :, :L][ok], want[ok], rtol=2e-4, atol=1e-7)
  # The kept set (uniform budgets): sinks plus the top of Eq. 9 per head.
  cache2, _ = m.end_prefill(cache, state)
  pos, valid = np.asarray(cache2.pos), np.asarray(cache2.valid)
  for b, n in enumerate(LENGTHS):
    k = math.ceil(n / 2)
    for h in range(HKV):
      top = np.argsort(-want[b, h, N_SINK:n], kind="stable")[:k - N_SINK] + N_SINK
      assert set(pos[b, h][valid[b, h]].tolist()) == set(range(N_SINK)) | set(top.tolist())


def test_average_rotation_is_the_mean_of_2x2_rotations():
  inv = 1.0 / THETA ** (np.arange(0, D, 2) / D)
  got = np.asarray(ea.average_rotation(jnp.asarray([5, 100]), N_FUTURE, inv.astype(np.float32)))
  for b, start in enumerate((5, 100)):
    want = np.mean([rope_matrix(start + j, inv) for j in range(N_FUTURE)], axis=0)
    np.testing.assert_allclose(got[b], want, atol=2e-6)


def test_rotate_back_recovers_pre_rope_queries():
  p = make_problem(1)
  back = ea.rotate(jnp.asarray(p["qpost"], jnp.float32), -jnp.asarray(np.arange(L))[None],
                   p["inv"].astype(np.float32))
  np.testing.assert_allclose(back, p["qpre"], atol=2e-5)


@hypothesis.given(seed=st.integers(0, 2**31 - 1))
@hypothesis.settings(max_examples=5, deadline=None)
def test_closed_form_matches_monte_carlo(seed):
  """E[exp(s q.k)] = exp(s mu.k + s^2/2 k^T Sigma k) for q ~ N(mu, Sigma) (Eq. 7), and Eq. 8."""
  rng = np.random.default_rng(seed)
  d, nk, ns = 8, 6, 400_000
  s = 1.0 / math.sqrt(d)
  mu = rng.normal(size=d) * 0.5
  a = rng.normal(size=(d, d)) * 0.25
  cov = a @ a.T
  k = rng.normal(size=(nk, d))
  q = mu + rng.normal(size=(ns, d)) @ np.linalg.cholesky(cov).T
  mc = np.exp(s * q @ k.T).mean(0)  # [nk]
  closed = np.exp(s * k @ mu + 0.5 * s * s * np.einsum("td,de,te->t", k, cov, k))
  np.testing.assert_allclose(mc, closed, rtol=0.02)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  a_hat = ea.expected_attention(f32(mu)[None, None], f32(cov)[None, None], f32(k)[None, None],
                                jnp.ones((1, 1, nk), bool), s)[0, 0, 0]
  np.testing.assert_allclose(a_hat, mc / mc.sum(), rtol=0.02)


@pytest.mark.parametrize("chunk", [16, 7])  # 7: chunks straddle the sinks, the last is padded
def test_chunked_prefill_statistics_are_those_of_the_whole_prompt(chunk):
  """Running moments merged chunk by chunk = the numpy statistics of every prompt query."""
  # n_queries < L: the decoding buffer would hold only the last 16 queries
  m = methods.make("expected_attention", ratio=0.5, n_queries=N_QUERIES, n_future=N_FUTURE,
                   n_sink=N_SINK, eps=EPS, rope_theta=THETA)
  p = make_problem(2)
  cache, state = prefilled(m, p, chunk)
  got = np.asarray(jax.jit(m.scores, static_argnums=2)(cache, state, 1 / math.sqrt(D), None))
  want = numpy_scores(p, True, True, True, "all")
  ok = ~np.isnan(want)
  np.testing.assert_allclose(got[:, :, :L][ok], want[ok], rtol=2e-4, atol=1e-7)


def test_decoding_compression_uses_the_recent_query_buffer():
  """With a decode phase, rows past ``end_prefill`` (budget set) score from the last
  ``n_queries`` queries (the paper's 256-query decoding buffer), prefill from all of them."""
  m = methods.make("expected_attention", ratio=0.5, phase="both", n_queries=N_QUERIES,
                   n_future=N_FUTURE, n_sink=N_SINK, eps=EPS, rope_theta=THETA)
  p = make_problem(3)
  cache, state = prefilled(m, p)
  score = jax.jit(m.scores, static_argnums=2)
  ok = ~np.isnan(numpy_scores(p, True, True, True))
  for budget, stats in ((-1, "all"), (5, "window")):
    st_b = dict(state, budget=jnp.full((B,), budget, jnp.int32))
    got = np.asarray(score(cache, st_b, 1 / math.sqrt(D), None))
    want = numpy_scores(p, True, True, True, stats)
    np.testing.assert_allclose(got[:, :, :L][ok], want[ok], rtol=2e-4, atol=1e-7)


def test_paper_defaults():
  """Devoto et al. 2025, Sec. 2.2 and 3.1: Ada-KV, T = 512, eps = 0.01, covariance and ||v||,
  4 sinks, prefill statistics from all prompt queries, a 256-query decoding buffer, interval 512."""
  m = methods.make("expected_attention", ratio=0.5)
  assert (m.head_budget, m.n_future, m.eps, m.use_covariance, m.use_vnorm, m.n_sink,
          m.prefill_stats, m.n_queries, m.interval) == ("adakv", 512, 0.01, True, True, 4,
                                                        "all", 256, 512)


def test_bad_prefill_stats_raises():
  with pytest.raises(ValueError, match="prefill_stats"):
    methods.make("expected_attention", ratio=0.5, prefill_stats="last")
