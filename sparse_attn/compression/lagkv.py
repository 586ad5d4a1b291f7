"""LagKV: score a token against the tokens that follow it (arXiv 2504.04704).

Liang, Zhang, Li and Li, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are
Important" (2025), its lag-relative score (below) in kvpress's form; no equation numbers are
cited, as none could be read from the paper's text available to us.

After the ``n_sink`` sinks, the sequence is cut into partitions of ``lag_size`` tokens; each
partition is scored against the next one (its "lag" reference): every key channel is min-max
normalised by the reference partition's range, and a token's score is the standard deviation of
its normalised channels, softmaxed over the partition (the paper's lag-relative score, as
kvpress's ``LagKVPress`` computes it); keys and values are scored alike and averaged. Without
``cross_scoring`` (the default) a token's score is its rank within its partition over
``lag_size``, so every partition keeps the same share. The last full partition and the remainder
have no reference and are always kept, and a sequence shorter than ``n_sink + 2 lag_size``
ranks its tokens by recency. Defaults as kvpress's: ``lag_size = 128``, ``n_sink = 4``.

A partition whose reference has a constant channel (max = min) gives that channel 0 instead of
kvpress's division by zero.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparse_attn.compression import order
from sparse_attn.compression.base import CompressionMethod


def lag_scores(x):
  """``x [B, K, P, L, D]`` partitions -> ``[B, K, P, L]``: each token of partition ``j < P - 1``
  rated against partition ``j + 1`` (softmax over the partition of the std of the min-max
  normalised channels, ddof 1); partition ``P - 1`` gets 0."""
  ref, cur = x[:, :, 1:], x[:, :, :-1]
  lo = jnp.min(ref, axis=3, keepdims=True)
  span = jnp.max(ref, axis=3, keepdims=True) - lo
  z = jnp.where(span > 0, (cur - lo) / jnp.where(span > 0, span, 1.0), 0.0)
  score = jax.nn.softmax(jnp.std(z, axis=-1, ddof=1), axis=-1)
  return jnp.pad(score, ((0, 0), (0, 0), (0, 1), (0, 0)))


@dataclasses.dataclass(frozen=True)
class LagKV(CompressionMethod):
  """LagKV eviction (arXiv 2504.04704): lag-relative key/value statistics.

  Attributes:
    lag_size: tokens per partition.
    cross_scoring: keep the softmaxed scores (comparable across partitions) instead of the
      per-partition ranks.
  """

  lag_size: int = 128
  cross_scoring: bool = False

  name = "lagkv"
  SIGNAL = "keys"  # key and value statistics against the next partition
  DEFAULTS = {"n_sink": 4}

  def __post_init__(self):
    super().__post_init__()
    if isinstance(self.lag_size, bool) or not isinstance(self.lag_size, int) or self.lag_size < 1:
      raise ValueError(f"lag_size must be an int >= 1, got {self.lag_size!r}")
    if not isinstance(self.cross_scoring, bool):
      raise ValueError(f"cross_scoring must be a bool, got {self.cross_scoring!r}")

  def scores(self, cache, state, scale, n):
    """``[B, K, T]`` in [0, 1]: partition scores; sinks, the reference-less tail and short
    sequences as the module docstring says."""
    del state, scale, n
    lag, sink = self.lag_size, self.n_sink
    idx, inv = order.position_order(cache.pos, cache.valid)
    b, k, t = cache.pos.shape
    parts = max(1, -(-(t - sink) // lag))
    pad = ((0, 0), (0, 0), (0, sink + parts * lag - t), (0, 0))
    split = lambda x: jnp.pad(order.take(x, idx).astype(jnp.float32)[:, :, sink:],
                              pad).reshape(b, k, parts, lag, -1)
    score = (lag_scores(split(cache.k)) + lag_scores(split(cache.v))) / 2  # [B, K, P, L]
    if not self.cross_scoring:
      score = jnp.argsort(jnp.argsort(score, axis=-1), axis=-1) / lag
    length = jnp.sum(cache.valid, axis=-1)  # [B, K]
    full = (length - sink) // lag  # complete partitions
    scored = jnp.arange(parts) <= full[..., None] - 2  # partitions with a complete reference
    score = jnp.where(scored[..., None], score, 1.0).reshape(b, k, parts * lag)[:, :, :t - sink]
    score = jnp.concatenate([jnp.ones((b, k, min(sink, t))), score], axis=-1)
    i = jnp.arange(t)
    recency = jnp.where(i < sink, 1.0, (i - sink) / jnp.maximum(length - sink, 1)[..., None])
    short = (length < sink + 2 * lag)[..., None]
    return order.take(jnp.where(short, recency, score), inv)
