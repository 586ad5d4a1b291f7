"""Which slots survive: uniform per-head budgets or Ada-KV's head-adaptive allocation.

Letters: B batch, K kv heads, T slots.

Both rules take per-slot importance scores (higher = keep; ``+inf`` = forced, e.g. sinks or a
recent window; ``-inf`` = empty slot) and a per-row budget ``n [B]`` in tokens per head.

* ``uniform``: every kv head keeps its own top ``n`` slots (the budget split evenly across heads,
  the ablation of Ada-KV, Feng et al. 2024, Sec. 4).
* ``adakv``: Ada-KV (Feng et al. 2024, Alg. 1): one layer-wide top-``K n`` over all heads' scores,
  so heads whose attention is concentrated give budget to heads whose attention is spread. A
  per-head floor (the paper's safeguard, Sec. 4.3, ``alpha = 0.2``) guarantees every head its own
  top ``floor(alpha n)`` first; an optional per-head ceiling keeps the largest head within a
  static buffer.
"""

from __future__ import annotations

import jax.numpy as jnp

from sparse_attn.compression.compact import rank_desc

HEAD_BUDGETS = ("uniform", "adakv")


def uniform_keep(score, n):
  """Top ``n [B]`` slots of every head of ``score [B, K, T]`` -> ``keep [B, K, T]`` bool."""
  rank = rank_desc(score)
  return (rank < n[:, None, None]) & (score > -jnp.inf)


def adakv_keep(score, n, floor: float, ceiling: int | None = None):
  """Ada-KV head-adaptive selection (Feng et al. 2024, Alg. 1 with the Sec. 4.3 safeguard).

  Args:
    score: ``[B, K, T]`` float32 importance (``+inf`` forced, ``-inf`` empty).
    n: ``[B]`` int32 average budget per head; the layer keeps ``K * n`` slots in all.
    floor: static fraction ``alpha``: each head first gets its top ``floor(alpha * n)``.
    ceiling: static max slots per head (None = unbounded).

  Returns:
    ``keep [B, K, T]`` bool.
  """
  b, hkv, t = score.shape
  rank = rank_desc(score)  # within each head
  guaranteed = jnp.floor(floor * n.astype(jnp.float32)).astype(jnp.int32)[:, None, None]
  valid = score > -jnp.inf
  # Tiers: forced / floor entries first, then the layer-wide competition by raw score.
  tier = jnp.where(rank < guaranteed, 1.0, 0.0) + jnp.where(score == jnp.inf, 2.0, 0.0)
  adj = jnp.where(tier > 0, jnp.inf, score)
  allowed = valid if ceiling is None else valid & (rank < ceiling)
  adj = jnp.where(allowed, adj, -jnp.inf)
  # Sort by (tier, score): tiers as a primary key through a lexicographic argsort.
  flat_adj = adj.reshape(b, hkv * t)
  flat_tier = jnp.where(allowed, tier, -1.0).reshape(b, hkv * t)
  order = jnp.lexsort((-flat_adj, -flat_tier), axis=-1)
  layer_rank = jnp.argsort(order, axis=-1).reshape(b, hkv, t)
  return allowed & (layer_rank < (hkv * n)[:, None, None])


def select(score, n, head_budget: str, floor: float = 0.2, ceiling: int | None = None):
  """Dispatches on ``head_budget`` (``"uniform"`` | ``"adakv"``)."""
  if head_budget == "uniform":
    keep = uniform_keep(score, n)
    return keep if ceiling is None else keep & (rank_desc(score) < ceiling)
  if head_budget == "adakv":
    return adakv_keep(score, n, floor, ceiling)
  raise ValueError(f"head_budget must be one of {HEAD_BUDGETS}, got {head_budget!r}")
