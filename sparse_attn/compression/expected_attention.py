"""Expected Attention: score keys by the attention future queries are expected to pay them.

Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from Future
Queries Distribution" (2025), Sec. 3. Letters: B batch, K kv heads, G group, N = K G query
heads, W buffered queries, F future positions, T cache slots, D head dim.

For every query head, future (pre-RoPE) queries are modelled as ``q ~ N(mu, Sigma)`` (Sec. 2.2,
Eq. 5). Where the statistics come from follows the paper's protocol (Sec. 3.1, "Implementation
details"): prefill compression uses every prompt query after the ``n_sink`` sinks
(``prefill_stats="all"``: running moments merged chunk by chunk, so a chunked prefill gives the
statistics of the whole prompt), decoding compression a buffer of the last ``n_queries`` (256)
queries. ``prefill_stats="window"`` estimates the prefill statistics from that buffer as well
(the last ``n_queries`` prompt queries; this library's former default). RoPE at the next
``n_future`` (512) positions is averaged, ``R_bar = 1/F sum_j R_{t+j}`` (Eq. 5), and applied to
both statistics, ``mu_bar = R_bar mu`` and ``Sigma_bar = R_bar Sigma R_bar^T`` (Eq. 6). For a
post-RoPE key ``k`` the expected unnormalised score is the Gaussian moment generating function
(Eq. 7)

    E[exp(s q.k)] = exp(s mu_bar.k + s^2/2 k^T Sigma_bar k)        (s = 1/sqrt(d): /(2d))

normalised over the keys into the expected attention ``a_hat`` (Eq. 8), and the importance is
``(a_hat + eps) ||v||`` (Eq. 9). GQA: ``a_hat`` is averaged over the group's query heads (Sec. 3).
The first ``n_sink`` (4) tokens are excluded from the statistics and the softmax, and always kept.
The budget is allocated across heads by Ada-KV by default (``head_budget="adakv"``, the paper's
setting, Sec. 2.2 "Head-Adaptive Compression"; ``"uniform"`` is the Sec. 5 / Table 4b ablation).
The paper's defaults: ``n_future=512``, ``eps=0.01`` (``eps=0`` for needle in a haystack),
covariance and value norm on, prefill statistics from all prompt queries, a 256-query buffer and
compression every 512 steps when decoding.

**RoPE.** The method is given post-RoPE queries, so it cannot see pre-RoPE ones directly. With
``rope_theta`` (or explicit ``rope_inv_freq`` for scaled RoPE) given, every recorded query is
rotated back by its own position (the Hugging Face half-split convention, channel ``i`` paired
with ``i + D/2``), which recovers the pre-RoPE query exactly, and Eq. 5-6 are applied as in the
paper, ``t`` the next token position. Without a RoPE config the statistics are those of the
post-RoPE queries and ``R_bar = I`` (a documented deviation: the rotations of the buffered
queries' own positions are then averaged into ``mu`` and ``Sigma`` instead of the future ones).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sparse_attn.compression import observe
from sparse_attn.compression.base import CompressionMethod
from sparse_attn.compression.head_budget import HeadBudget
from sparse_attn.compression.rope import RopeOptions, rotate


def average_rotation(start, n_future: int, inv_freq):
  """``R_bar [B, D, D] = 1/F sum_{j<F} R_{start+j}`` (Devoto et al., Eq. 5).

  ``R_p = diag(cos(p w)) + diag(sin(p w)) P`` with ``P x = rotate_half(x)``.
  """
  d = 2 * inv_freq.shape[0]
  pos = start[:, None].astype(jnp.float32) + jnp.arange(n_future, dtype=jnp.float32)  # [B, F]
  angles = pos[..., None] * jnp.asarray(inv_freq)  # [B, F, D/2]
  c = jnp.mean(jnp.cos(angles), axis=1)
  s = jnp.mean(jnp.sin(angles), axis=1)
  c = jnp.concatenate([c, c], axis=-1)  # [B, D]
  s = jnp.concatenate([s, s], axis=-1)
  eye = jnp.eye(d // 2, dtype=jnp.float32)
  zero = jnp.zeros_like(eye)
  p = jnp.block([[zero, -eye], [eye, zero]])  # rotate_half as a matrix
  return c[:, :, None] * jnp.eye(d, dtype=jnp.float32) + s[:, :, None] * p


PREFILL_STATS = ("all", "window")


def init_moments(batch: int, num_heads: int, head_dim: int):
  """Empty running moments: count ``[B]``, mean ``[B, N, D]``, centred scatter ``[B, N, D, D]``."""
  return {"count": jnp.zeros((batch,), jnp.float32),
          "mean": jnp.zeros((batch, num_heads, head_dim), jnp.float32),
          "m2": jnp.zeros((batch, num_heads, head_dim, head_dim), jnp.float32)}


def update_moments(moments, x, valid):
  """Adds the valid queries of a chunk to the running moments.

  Chan et al.'s pairwise merge of (count, mean, centred scatter): the chunk's own moments are
  centred on the chunk mean, so no ``E[x x^T] - mu mu^T`` cancellation in float32.

  Args:
    moments: as from ``init_moments``.
    x: ``[B, N, S, D]`` float32 queries.
    valid: ``[B, S]`` bool, which queries count.
  """
  w = valid[:, None, :, None]
  n_b = jnp.sum(valid, axis=-1).astype(jnp.float32)  # [B]
  mean_b = jnp.sum(jnp.where(w, x, 0.0), axis=2) / jnp.maximum(n_b, 1.0)[:, None, None]
  xc = jnp.where(w, x - mean_b[:, :, None], 0.0)
  m2_b = jnp.einsum("bnsd,bnse->bnde", xc, xc)
  n_a = moments["count"]
  n = n_a + n_b
  frac = jnp.where(n > 0, n_b / jnp.maximum(n, 1.0), 0.0)  # [B] n_b / n
  delta = mean_b - moments["mean"]  # [B, N, D]
  # M2 = M2_a + M2_b + delta delta^T n_a n_b / n
  m2 = (moments["m2"] + m2_b
        + jnp.einsum("bnd,bne->bnde", delta, delta) * (n_a * frac)[:, None, None, None])
  return {"count": n, "mean": moments["mean"] + delta * frac[:, None, None], "m2": m2}


def moment_statistics(moments):
  """Mean ``[B, N, D]`` and (biased) covariance ``[B, N, D, D]`` of the running moments."""
  cnt = jnp.maximum(moments["count"], 1.0)[:, None, None, None]
  return moments["mean"], moments["m2"] / cnt


def query_statistics(buf, filled):
  """Mean ``[B, N, D]`` and (biased) covariance ``[B, N, D, D]`` of the buffered queries."""
  w = filled[:, :, None, None]
  cnt = jnp.maximum(jnp.sum(filled, axis=1), 1).astype(jnp.float32)[:, None, None]
  mu = jnp.sum(jnp.where(w, buf, 0.0), axis=1) / cnt
  xc = jnp.where(w, buf - mu[:, None], 0.0)
  cov = jnp.einsum("bwnd,bwne->bnde", xc, xc) / cnt[..., None]
  return mu, cov


def expected_attention(mu_bar, cov_bar, k, kmask, scale):
  """Expected attention ``a_hat`` (Devoto et al., Eq. 7-8), per query head.

  Args:
    mu_bar: ``[B, N, D]`` rotated query mean.
    cov_bar: ``[B, N, D, D]`` rotated covariance, or None (mean only).
    k: ``[B, K, T, D]`` post-RoPE keys.
    kmask: ``[B, K, T]`` bool keys taking part in the softmax.
    scale: softmax scale ``s`` (``1/sqrt(d)``).

  Returns:
    ``[B, K, G, T]`` float32, each row a distribution over the masked keys (0 elsewhere).
  """
  b, n, d = mu_bar.shape
  hkv = k.shape[1]
  kf = k.astype(jnp.float32)
  mu_g = mu_bar.reshape(b, hkv, n // hkv, d)
  # [B, K, G, T]: log E[exp(s q.k)] = s mu.k + s^2/2 k^T Sigma k  (Eq. 7)
  z = scale * jnp.einsum("bkgd,bktd->bkgt", mu_g, kf)
  if cov_bar is not None:
    cov_g = cov_bar.reshape(b, hkv, n // hkv, d, d)
    z = z + 0.5 * scale * scale * jnp.einsum("bktd,bkgde,bkte->bkgt", kf, cov_g, kf)
  z = jnp.where(kmask[:, :, None], z, -jnp.inf)
  m = jnp.max(z, axis=-1, keepdims=True)
  e = jnp.exp(z - jnp.where(jnp.isfinite(m), m, 0.0))
  den = jnp.sum(e, axis=-1, keepdims=True)
  return jnp.where(den > 0, e / jnp.where(den > 0, den, 1.0), 0.0)  # Eq. 8


@dataclasses.dataclass(frozen=True)
class ExpectedAttention(RopeOptions, CompressionMethod):
  """Expected Attention eviction (Devoto et al. 2025, Eq. 5-9).

  Attributes:
    n_future: future positions RoPE is averaged over (``T`` of Eq. 5).
    n_queries: buffered recent queries the decoding statistics are estimated from (256, Sec. 3.1
      "Implementation details").
    prefill_stats: ``"all"`` (every prompt query after the sinks, the paper's prefill protocol)
      or ``"window"`` (the last ``n_queries`` prompt queries).
    use_covariance: include the ``k^T Sigma_bar k / (2d)`` term of Eq. 7.
    use_vnorm: rescale by ``||v||`` (Eq. 9).
    eps: the ``epsilon`` of Eq. 9.
    rope_theta: RoPE base of the model (enables exact pre-RoPE statistics).
    rope_inv_freq: ``D/2`` inverse frequencies (a tuple; for scaled RoPE), instead of theta.
  """

  n_future: int = 512
  n_queries: int = 256
  use_covariance: bool = True
  use_vnorm: bool = True
  eps: float = 0.01
  prefill_stats: str = "all"

  name = "expected_attention"
  SIGNAL = "queries"  # a Gaussian model of future queries
  # Its weights are Gaussian moments of uncapped, unwindowed logits: refused on a soft-capped
  # model and on a sliding-window layer.
  estimates_raw_attention = True
  # Ada-KV head-adaptive budgets (Sec. 2.2 "Head-Adaptive Compression", Table 4b ablation),
  # 4 sinks, compression every 512 decoding steps (Sec. 3.1 "Implementation details")
  DEFAULTS = {"n_sink": 4, "interval": 512, "head_budget": HeadBudget.ADAKV}

  def __post_init__(self):
    super().__post_init__()
    for field in ("n_future", "n_queries"):
      if getattr(self, field) < 1:
        raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
    if self.prefill_stats not in PREFILL_STATS:
      raise ValueError(f"prefill_stats must be one of {PREFILL_STATS}, got {self.prefill_stats!r}")
    if self.eps < 0:
      raise ValueError(f"eps must be >= 0, got {self.eps}")
    self._check_rope()

  @property
  def uses_window(self) -> bool:
    """Whether the state buffers the last ``n_queries`` queries (decoding or window stats)."""
    return self.prefill_stats == "window" or self.compresses_decode

  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity):
    extra = {}
    if self.prefill_stats == "all":
      extra["moments"] = init_moments(batch, num_q_heads, head_dim)
    if self.uses_window:
      extra["queries"] = observe.init_ring(batch, num_q_heads, self.n_queries, head_dim)
    return extra

  def observe(self, q, cache, state, positions, lse, scale):
    """Records the (pre-RoPE when a RoPE config is given) queries past the sinks."""
    inv = self.inv_freq(q.shape[-1])
    x = q.astype(jnp.float32)
    if inv is not None:
      x = rotate(x, -positions, inv)
    valid = positions >= self.n_sink
    state = dict(state)
    if "moments" in state:
      state["moments"] = update_moments(state["moments"], x, valid)
    if "queries" in state:
      state["queries"] = observe.ring_push(state["queries"], x, positions, valid)
    return state

  def statistics(self, state, head_dim: int):
    """``mu_bar [B, N, D]`` and ``Sigma_bar [B, N, D, D]`` or None (Eq. 5-6).

    Prefill compression (``end_prefill``) uses the ``prefill_stats`` source; decoding compression
    (rows whose decode budget is set, ``budget >= 0``, which only ``end_prefill`` does) the buffer
    of the last ``n_queries`` queries.
    """
    if self.prefill_stats == "all":
      mu, cov = moment_statistics(state["moments"])
    else:
      mu, cov = _ring_statistics(state["queries"])
    if self.compresses_decode and self.prefill_stats == "all":
      decoding = (state["budget"] >= 0)[:, None, None]  # [B, 1, 1]
      mu_w, cov_w = _ring_statistics(state["queries"])
      mu = jnp.where(decoding, mu_w, mu)
      cov = jnp.where(decoding[..., None], cov_w, cov)
    inv = self.inv_freq(head_dim)
    if inv is not None:
      r = average_rotation(state["next_pos"], self.n_future, inv)  # [B, D, D]
      mu = jnp.einsum("bde,bne->bnd", r, mu)
      cov = jnp.einsum("bde,bnef,bgf->bndg", r, cov, r)
    return mu, (cov if self.use_covariance else None)

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: ``(mean_g a_hat + eps) ||v||`` (Eq. 9); sinks are forced by the base."""
    del n
    mu, cov = self.statistics(state, cache.head_dim)
    kmask = cache.valid & (cache.pos >= self.n_sink)
    a = jnp.mean(expected_attention(mu, cov, cache.k, kmask, scale), axis=2)
    if self.use_vnorm:
      return (a + self.eps) * jnp.linalg.norm(cache.v.astype(jnp.float32), axis=-1)
    return a


def _ring_statistics(ring):
  return query_statistics(ring["buf"], observe.ring_filled(ring))
