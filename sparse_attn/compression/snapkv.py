"""SnapKV: votes of an observation window of recent queries, pooled (Li et al., 2024).

"SnapKV: LLM Knows What You are Looking for Before Generation" (NeurIPS 2024), Sec. 4.2 and
Listing 1: the last ``window_size`` (64) prompt queries attend the whole prompt; the attention
each prefix key receives is summed over the window queries (the "votes"), smoothed by 1-D pooling
of kernel ``kernel`` (5) over the sequence, and the top keys of each head are kept together with
the window's own keys. The state keeps a ring of the last ``window_size`` queries and their
positions, so only a ``window x L`` block of attention is ever computed. GQA: votes are averaged
over the group's query heads. ``pooling`` is ``"avg"`` (the authors' code) or ``"max"``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparse_attn.compression import observe
from sparse_attn.compression.base import CompressionMethod

POOLINGS = ("avg", "max")


@dataclasses.dataclass(frozen=True)
class SnapKV(CompressionMethod):
  """SnapKV eviction (Li et al. 2024, Sec. 4.2, Listing 1).

  Attributes:
    window_size: observation window (last queries) that votes (named so as not to shadow
      the decode loop's ``window`` flag).
    kernel: pooling kernel size (odd), ``padding = kernel // 2``, stride 1.
    pooling: ``"avg"`` or ``"max"``.
  """

  window_size: int = 64
  kernel: int = 5
  pooling: str = "avg"

  name = "snapkv"
  SIGNAL = "attention"  # the observation window's attention
  PANELS = ("query_agnostic", "query_aware")  # kvpress's leaderboard panels

  def __post_init__(self):
    super().__post_init__()
    if self.window_size < 1:
      raise ValueError(f"window_size must be >= 1, got {self.window_size}")
    if self.kernel < 1 or self.kernel % 2 == 0:
      raise ValueError(f"kernel must be a positive odd int, got {self.kernel}")
    if self.pooling not in POOLINGS:
      raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")

  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity):
    return {"obs": observe.init_ring(batch, num_q_heads, self.window_size, head_dim)}

  def observe(self, q, cache, state, positions, lse, scale):
    return dict(state, obs=observe.ring_push(state["obs"], q, positions, positions >= 0))

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: pooled window votes; ``+inf`` for the window's own keys (Listing 1)."""
    del n
    ring = state["obs"]
    p = observe.window_probs(ring["buf"], ring["pos"], observe.ring_filled(ring), cache.k,
                             cache.pos, cache.valid, scale, self.softcap,
                             self.sliding_window)  # [B, K, G, W, T]
    votes = jnp.mean(jnp.sum(p, axis=3), axis=2)  # [B, K, T]
    in_window = cache.valid & (cache.pos >= state["next_pos"][:, None, None] - self.window_size)
    votes = jnp.where(in_window, 0.0, votes)
    pooled = _pool(votes, self.kernel, self.pooling)
    return jnp.where(in_window, jnp.inf, pooled)


def _pool(x, kernel: int, pooling: str):
  """1-D pooling over the last axis, stride 1, zero padding ``kernel // 2`` (same length)."""
  if pooling == "avg":
    window = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 1, kernel), (1, 1, 1),
                                   [(0, 0), (0, 0), (kernel // 2, kernel // 2)])
    return window / kernel
  padded = jnp.pad(x, ((0, 0), (0, 0), (kernel // 2, kernel // 2)))
  return jax.lax.reduce_window(padded, -jnp.inf, jax.lax.max, (1, 1, kernel), (1, 1, 1), "VALID")
