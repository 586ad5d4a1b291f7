"""Compactor: approximate key leverage blended with non-causal chunked attention.

Chari & Van Durme, "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate
Leverage Scores" (arXiv 2507.08143), as kvpress's ``CompactorPress`` computes it (the defaults
here are its; its leaderboard entry ``adakv_compactor`` wraps it in Ada-KV, our default).
Letters: B batch, K kv heads, G group, N = K G query heads, T slots, C chunks, W chunk length,
D head dim, R sketch dimension.

The first ``sink_start`` (8) and last ``sink_end`` (4) prompt tokens are always kept; the
``M`` tokens between them (the "middle") are scored by two z-scored parts:

* **leverage** (geometry: outlier keys). With ``X`` the middle's pre-RoPE keys centred over
  the sequence and sketched on the right, ``X <- (X - mean X) Phi``, ``Phi ~ N(0, 1/R)^{D x R}``
  (``R = sketch_dimension = 48``), the leverage of token ``i`` is
  ``l_i = x_i^T (X^T X + 1e-2 I)^{-1} x_i`` (clamped at 0; kvpress's Cholesky solve with its
  first jitter ``1e-2``), z-scored over every head and middle token of the row (``std`` with
  ``ddof = 1``).
* **non-causal chunked attention** (what the prompt itself attends): the middle is cut into
  chunks of ``chunk_size`` (256) tokens from its first token; every query attends every key of
  its own chunk, before and after it, with the unscaled logit ``q.k`` (post-RoPE; kvpress's
  ``NonCausalAttnPress`` applies no ``1/sqrt(d)``), and a key's score is the attention it
  receives summed over its chunk's queries, averaged over the group's query heads, times
  ``||v||``, average-pooled over 3 neighbours (zero padding, divided by 3), z-scored like the
  leverage.

The score is ``blending * leverage + attention`` with ``blending = ratio`` unless given
(kvpress's heuristic). Prefill only, as kvpress's press.

Differences from kvpress, by design: the sketch is a JAX draw of ``jax.random.key(seed)``, not
torch's global generator, so the two sides' sketches differ (with ``sketch_dimension = D`` the
sketch is invertible and both compute the exact leverage); kvpress pads the last chunk with
zero queries and keys that take part in its softmax and sums (logit ``-1e-9`` keys, uniform
padded query rows), ours leaves padding out; the z-scores are per row (kvpress's pool the
batch). Without a RoPE config (``rope_theta`` / ``rope_inv_freq``, set by the model's
``with_rope``) the leverage reads the post-RoPE keys.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparse_attn.compression import order
from sparse_attn.compression.base import CompressionMethod
from sparse_attn.compression.head_budget import HeadBudget
from sparse_attn.compression.rope import RopeOptions, rotate_by


def zscore(x, mask):
  """``x [B, K, M]`` minus its mean over ``mask`` (every head), over its ``ddof=1`` std."""
  cnt = jnp.sum(mask, axis=(1, 2), keepdims=True).astype(jnp.float32)
  mean = jnp.sum(jnp.where(mask, x, 0.0), axis=(1, 2), keepdims=True) / jnp.maximum(cnt, 1.0)
  var = jnp.sum(jnp.where(mask, (x - mean) ** 2, 0.0), axis=(1, 2), keepdims=True)
  std = jnp.sqrt(var / jnp.maximum(cnt - 1.0, 1.0))
  return jnp.where(mask, (x - mean) / jnp.maximum(std, 1e-6), 0.0)


def leverage(keys, mask, phi, jitter: float = 1e-2):
  """``[B, K, M]`` sketched leverage ``x_i^T (X^T X + jitter I)^{-1} x_i`` of centred keys.

  Args:
    keys: ``[B, K, M, D]`` (pre-RoPE) keys; mask: ``[B, K, M]`` the tokens taking part.
    phi: ``[B, K, D, R]`` the right sketch.
  """
  w = mask[..., None]
  cnt = jnp.maximum(jnp.sum(w, axis=2, keepdims=True), 1).astype(jnp.float32)
  mean = jnp.sum(jnp.where(w, keys, 0.0), axis=2, keepdims=True) / cnt
  # [B, K, M, R]
  x = jnp.einsum("bkmd,bkdr->bkmr", jnp.where(w, keys - mean, 0.0), phi)
  gram = jnp.einsum("bkmr,bkms->bkrs", x, x) + jitter * jnp.eye(x.shape[-1])
  sol = jnp.linalg.solve(gram, jnp.swapaxes(x, -1, -2))  # [B, K, R, M]
  return jnp.maximum(jnp.einsum("bkmr,bkrm->bkm", x, sol), 0.0)


def chunk_attention_received(q, k, mask, chunk: int):
  """``[B, K, M]``: attention each key receives from its chunk's queries (non-causal, unscaled
  ``q.k``), summed over the queries and averaged over the group.

  Args:
    q: ``[B, N, M, D]``; k: ``[B, K, M, D]`` (post-RoPE, in token order).
    mask: ``[B, M]`` the tokens taking part (queries and keys alike).
  """
  b, n, m, d = q.shape
  hkv = k.shape[1]
  c = -(-m // chunk)
  pad = c * chunk - m
  qc = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(b, hkv, n // hkv, c, chunk, d)
  kc = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(b, hkv, c, chunk, d)
  mc = jnp.pad(mask, ((0, 0), (0, pad))).reshape(b, c, chunk)
  # [B, K, G, C, W(query), W(key)]
  logits = jnp.einsum("bkgcid,bkcjd->bkgcij", qc, kc)
  logits = jnp.where(mc[:, None, None, :, None, :], logits, -jnp.inf)
  mx = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - jnp.where(jnp.isfinite(mx), mx, 0.0))
  den = jnp.sum(p, axis=-1, keepdims=True)
  p = jnp.where(den > 0, p / jnp.where(den > 0, den, 1.0), 0.0)
  p = jnp.where(mc[:, None, None, :, :, None], p, 0.0)
  return jnp.mean(jnp.sum(p, axis=-2), axis=2).reshape(b, hkv, c * chunk)[:, :, :m]


@dataclasses.dataclass(frozen=True)
class Compactor(RopeOptions, CompressionMethod):
  """Compactor eviction (arXiv 2507.08143, as kvpress's ``CompactorPress``).

  Attributes:
    sink_start: leading prompt tokens always kept (8).
    sink_end: trailing prompt tokens always kept (4).
    chunk_size: tokens per non-causal attention chunk (256).
    sketch_dimension: columns ``R`` of the Gaussian sketch of the keys (48).
    blending: weight of the leverage part (None: ``ratio``, kvpress's default).
    seed: PRNG seed of the sketch.
    rope_theta, rope_inv_freq: the model's RoPE (pre-RoPE keys for the leverage).
  """

  sink_start: int = 8
  sink_end: int = 4
  chunk_size: int = 256
  sketch_dimension: int = 48
  blending: float | None = None
  seed: int = 0

  name = "compactor"
  SIGNAL = "attention"  # key leverage blended with chunked attention
  DEFAULTS = {"head_budget": HeadBudget.ADAKV}  # kvpress's leaderboard: adakv_compactor

  def __post_init__(self):
    super().__post_init__()
    for field, lo in (("sink_start", 0), ("sink_end", 0), ("chunk_size", 1),
                      ("sketch_dimension", 1)):
      val = getattr(self, field)
      if isinstance(val, bool) or not isinstance(val, int) or val < lo:
        raise ValueError(f"{field} must be an int >= {lo}, got {val!r}")
    if self.compresses_decode:
      raise ValueError("compactor scores the prompt only (phase='prefill'), as kvpress's press")
    self._check_rope()

  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity):
    """Every prompt query at slot = position (the non-causal attention needs them all)."""
    return {"queries": jnp.zeros((batch, num_q_heads, capacity, head_dim), jnp.float32)}

  def observe(self, q, cache, state, positions, lse, scale):
    buf = state["queries"]
    if buf.shape[2] == 0:  # after end_prefill: nothing more is scored
      return state
    bi = jnp.arange(q.shape[0])[:, None]
    slot = jnp.where(positions >= 0, positions, buf.shape[2])  # [B, S]
    xt = jnp.swapaxes(q, 1, 2).astype(jnp.float32)  # [B, S, N, D]
    buf = jnp.swapaxes(jnp.swapaxes(buf, 1, 2).at[bi, slot].set(xt, mode="drop"), 1, 2)
    return dict(state, queries=buf)

  def compact_state(self, state, idx):
    del idx
    return dict(state, queries=state["queries"][:, :, :0])

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: ``blending * z(leverage) + z(attention)``; ``+inf`` for the sinks at both
    ends (the module docstring)."""
    del scale, n
    b, hkv, t = cache.pos.shape
    idx, inv = order.position_order(cache.pos, cache.valid)
    pos = order.take(cache.pos, idx)
    length = jnp.sum(cache.valid, axis=-1)[..., None]  # [B, K, 1]
    head = jnp.minimum(self.sink_start, length)
    tail = jnp.minimum(self.sink_end, jnp.maximum(length - head, 0))
    ordered_valid = order.take(cache.valid, idx)
    middle = ordered_valid & (pos >= head) & (pos < length - tail)  # [B, K, T]
    # Token order from the first middle token on (sink_start is static, every row alike).
    s0 = min(self.sink_start, t)
    k = order.take(cache.k, idx).astype(jnp.float32)[:, :, s0:]
    v = order.take(cache.v, idx).astype(jnp.float32)[:, :, s0:]
    mid = middle[:, :, s0:]
    inv_freq = self.inv_freq(cache.head_dim)
    pre = k if inv_freq is None else rotate_by(k, -pos[:, :, s0:], inv_freq)
    d, r = cache.head_dim, self.sketch_dimension
    phi = jax.random.normal(jax.random.key(self.seed), (b, hkv, d, r)) / jnp.sqrt(r)
    lev = zscore(leverage(pre, mid, phi), mid)
    # queries are stored at slot = position, the token order of a prefilled cache
    q = state["queries"][:, :, s0:t]
    att = chunk_attention_received(q, k, mid[:, 0], self.chunk_size)
    att = att * jnp.linalg.norm(v, axis=-1)
    att = jnp.where(mid, att, 0.0)
    att = jax.lax.reduce_window(att, 0.0, jax.lax.add, (1, 1, 3), (1, 1, 1),
                                [(0, 0), (0, 0), (1, 1)]) / 3.0
    blend = self.ratio if self.blending is None else self.blending
    score = jnp.where(mid, blend * lev + zscore(att, mid), -jnp.inf)
    score = jnp.concatenate([jnp.zeros((b, hkv, s0)), score], axis=-1)
    score = jnp.where(ordered_valid & ~middle, jnp.inf, score)
    return order.take(score, inv)
