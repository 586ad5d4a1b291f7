"""Which slots survive: a scorer wrapped in a uniform or an Ada-KV head-budget rule.

Letters: B batch, K kv heads, T slots.

A compression method is one scorer (``scorer.Scorer``: per-slot importance, higher = keep;
``+inf`` = forced, e.g. sinks or a recent window; ``-inf`` = empty slot). How a per-row budget
``n [B]`` (tokens per head) is spent over the heads is a separate rule that wraps the scorer,
as kvpress wraps any scoring press in its ``AdaKVPress``; here the two rules are:

* :class:`Uniform`: every kv head keeps its own top ``n`` slots (the budget split evenly across
  heads, the ablation of Ada-KV, Feng et al. 2024, Sec. 4); the cache stays per head.
* :class:`AdaKV`: Ada-KV (Feng et al. 2024, Alg. 1): one layer-wide top-``K n`` over all heads'
  scores, so heads whose attention is concentrated give budget to heads whose attention is
  spread. A per-head floor (the paper's safeguard, Sec. 4.3, ``alpha = 0.2``) guarantees every
  head its own top ``floor(alpha n)`` first; an optional per-head ceiling keeps the largest head
  within a static buffer. The heads then keep different counts, so the cache becomes the flat
  layout (``layout.FLAT``).

``HeadBudget`` names the rule in a spec (``head_budget=uniform|adakv``); ``rule`` builds it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from sparse_attn.compression import layout
from sparse_attn.compression.compact import rank_desc
from sparse_attn.compression.scorer import Scorer
from sparse_attn.protocol import Choice


class HeadBudget(Choice):
  """How a layer's budget is spread over its kv heads (option ``head_budget``)."""

  UNIFORM = "uniform"
  ADAKV = "adakv"


def uniform_keep(score, n):
  """Top ``n [B]`` slots of every head of ``score [B, K, T]`` -> ``keep [B, K, T]`` bool."""
  rank = rank_desc(score)
  return (rank < n[:, None, None]) & (score > -jnp.inf)


def adakv_keep(score, n, floor: float, ceiling: int | None = None, total=None):
  """Ada-KV head-adaptive selection (Feng et al. 2024, Alg. 1 with the Sec. 4.3 safeguard).

  Args:
    score: ``[B, K, T]`` float32 importance (``+inf`` forced, ``-inf`` empty).
    n: ``[B]`` int32 average budget per head; the layer keeps ``K * n`` slots in all.
    floor: static fraction ``alpha``: each head first gets its top ``floor(alpha * n)``.
    ceiling: static max slots per head (None = unbounded).
    total: ``[B]`` int32 slots the layer keeps in all, instead of ``K * n`` (a budget ranked
      over every layer: ``cross_layer``).

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
  total = hkv * n if total is None else total
  return allowed & (layer_rank < total[:, None, None])


@dataclasses.dataclass(frozen=True)
class Uniform:
  """Every kv head keeps the top ``n`` slots of ``scorer`` (its own scores).

  Attributes:
    scorer: the method's scoring contract (``scorer.Scorer``).
  """

  scorer: Scorer
  layout: ClassVar[layout.PerHead] = layout.PER_HEAD  # what end_prefill compacts into

  def keep(self, cache, state, scale, n, ceiling: int | None = None):
    """The slots kept when every kv head is cut to ``n [B]`` tokens (at most ``ceiling``).

    Args:
      cache: ``[B, K, T]`` rows (a ``KVCache`` or ``flat.HeadsView``).
      state: the method's state; scale: softmax scale or None.
      n: ``[B]`` tokens per head.
      ceiling: static most slots per head (None = unbounded).

    Returns:
      ``[B, K, T]`` bool, never an empty slot.
    """
    score = self.scorer.slot_scores(cache, state, scale, n)
    keep = uniform_keep(score, n.astype(jnp.int32))
    if ceiling is not None:
      keep = keep & (rank_desc(score) < ceiling)
    return keep & cache.valid


@dataclasses.dataclass(frozen=True)
class AdaKV:
  """Ada-KV around ``scorer``: one layer-wide top ``K n`` with a per-head floor (Alg. 1).

  Attributes:
    scorer: the method's scoring contract (``scorer.Scorer``).
    floor: the safeguard ``alpha``: each head keeps at least ``floor(alpha n)``.
  """

  scorer: Scorer
  floor: float = 0.2
  layout: ClassVar[layout.Flat] = layout.FLAT  # what end_prefill compacts into

  def keep(self, cache, state, scale, n, ceiling: int | None = None):
    """The slots kept when the layer keeps ``K n [B]`` tokens in all (see ``Uniform.keep``)."""
    score = self.scorer.slot_scores(cache, state, scale, n)
    return adakv_keep(score, n.astype(jnp.int32), self.floor, ceiling) & cache.valid


def rule(head_budget: HeadBudget, scorer: Scorer, floor: float) -> Uniform | AdaKV:
  """The head-budget rule ``head_budget`` wrapped around ``scorer``."""
  if HeadBudget(head_budget) is HeadBudget.ADAKV:
    return AdaKV(scorer, floor)
  return Uniform(scorer)
