"""Selectors: which blocks (or tokens) a decode step attends.

Letters: B batch, K kv heads, Hq query heads, H selection heads (K or Hq), NB entries (blocks of
``block_size`` tokens, or single tokens), n the static list length, D head dim.

A selection is a fixed-size list of entry ids per (batch, head) plus a valid count, so shapes are
static under jit: ``idx [B, H, n]`` and ``n_valid [B, H]``; ids past ``n_valid`` are padding.
Forced entries (sinks, local window) come first, then the highest scores (``lax.top_k``; the
Pallas radix select, ``pallas_kernels.block_select``, lists the same set in id order: every
consumer treats the first ``n_valid`` ids as a set); ids are distinct and never point past the
context. The block selectors (Quest, ArkVale) are ``selector.Selector``s: block scores
(``kernels.quest_scores``, ``scoring.arkvale_scores``) then ``select_blocks``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import block_select_reference
from pallas_kernels.block_select import rank_scores as _rank
from sparse_attn import reference, scoring
from sparse_attn.budget import Budget
from sparse_attn.cache import KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Selection:
  """Selected entries per (batch, head).

  Attributes:
    idx: ``[B, H, n]`` int32 entry ids (block ids, or token slots when ``granularity == 1``).
    n_valid: ``[B, H]`` int32 number of leading valid ids.
    granularity: static tokens per entry (the cache block size, or 1).
  """

  idx: jax.Array
  n_valid: jax.Array
  granularity: int = dataclasses.field(metadata=dict(static=True), default=1)

  def token_mask(self, capacity: int):
    """``[B, H, capacity]`` bool: the slots covered by the valid entries."""
    b, h, n = self.idx.shape
    ok = jnp.arange(n)[None, None, :] < self.n_valid[..., None]
    nb = capacity // self.granularity
    hit = jnp.zeros((b, h, nb + 1), bool)
    hit = hit.at[jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None],
                 jnp.where(ok, self.idx, nb)].set(True)[..., :nb]
    return jnp.repeat(hit, self.granularity, axis=-1)


def top_k_ids(ranked, count, n_max: int):
  """``[B, H, n_max]`` ids of the best of ``ranked [B, H, NB]``: the jnp path of the top-k
  select (``pallas_kernels.block_select_reference``, ``lax.top_k``; ``count [B]``, the number
  that will be valid, is not needed by a full top-k)."""
  return block_select_reference(ranked, count, n=n_max)


def top_entries(scores, valid, forced, count, n_max: int, granularity: int,
                pick=top_k_ids) -> Selection:
  """Top-``count`` entries by score with forced entries first.

  Args:
    scores: ``[B, H, NB]`` float32.
    valid: ``[B, NB]`` bool, entries inside the context (others are never selected).
    forced: ``[B, NB]`` bool, entries always selected (subset of valid).
    count: ``[B]`` int32 entries in all, forced included (``Budget.total``; raised to the forced
      count).
    n_max: static list length (``>= count``).
    granularity: tokens per entry.
    pick: ``pick(ranked [B, H, NB], n [B], n_max) -> ids [B, H, n_max]`` whose first ``n`` are
      the ``n`` best (``top_k_ids``, or ``kernels.top_ids``'s sort-free Pallas select).
  """
  n_max = min(n_max, scores.shape[-1])
  n = selected_count(valid, forced, count, n_max)
  idx = pick(rank_scores(scores, valid, forced), n, n_max)
  n_valid = jnp.broadcast_to(n[:, None], idx.shape[:2]).astype(jnp.int32)
  return Selection(idx=idx.astype(jnp.int32), n_valid=n_valid, granularity=granularity)


def rank_scores(scores, valid, forced):
  """The ranking ``top_entries`` sorts by: forced entries first, invalid ones last.

  ``scores [B, H, NB]``, ``valid, forced [B, NB]`` -> ``[B, H, NB]`` float32. Shared with the
  context-parallel decode, whose per-shard and global top-k must rank exactly alike.
  """
  return _rank(scores, valid[:, None, :], forced[:, None, :])  # the select kernels' rule


def selected_count(valid, forced, count, n_max: int):
  """``[B]`` entries a selection keeps: the budget ``count``, raised to the forced entries,
  capped by the context (``valid [B, NB]``) and the static list length ``n_max``."""
  n_ctx = jnp.sum(valid, axis=-1)
  n = jnp.minimum(jnp.maximum(count, jnp.sum(forced, axis=-1)), n_ctx)
  return jnp.minimum(n, n_max)


def block_count(length, budget: Budget, num_blocks: int, block_size: int, n_max: int):
  """``[B]`` int32: the blocks ``select_blocks`` keeps (``selected_count`` of its masks), in
  closed form from ``length [B]`` (``Budget.n_forced``; no ``[B, NB]`` mask or reduction)."""
  m = jnp.minimum(-(-length // block_size), num_blocks)  # blocks inside the context
  forced = budget.n_forced(length, num_blocks, block_size)
  n = jnp.minimum(jnp.maximum(budget.total(length, forced, block_size), forced), m)
  return jnp.minimum(n, n_max).astype(jnp.int32)


def _block_masks(cache: KVCache, budget: Budget):
  nb, bs = cache.num_blocks, cache.block_size
  valid = jnp.arange(nb)[None, :] * bs < cache.length[:, None]
  return valid, budget.forced(cache.length, nb, bs)


def select_blocks(scores, cache: KVCache, budget: Budget, pick=top_k_ids) -> Selection:
  """Block selection from ``scores [B, H, NB]`` under ``budget`` (``pick``: as ``top_entries``)."""
  valid, forced = _block_masks(cache, budget)
  bs = cache.block_size
  return top_entries(scores, valid, forced, _total(budget, cache.length, forced, bs),
                     budget.max_count(cache.capacity, bs), bs, pick)


def _total(budget: Budget, length, forced, unit: int):
  """``[B]`` entries attended in all under the budget's accounting of the ``forced [B, NB]``."""
  return budget.total(length, jnp.sum(forced, axis=-1).astype(jnp.int32), unit)


def _token_masks(cache: KVCache, budget: Budget):
  t = cache.capacity
  valid = cache.valid[:, 0, :] & (jnp.arange(t)[None, :] < cache.length[:, None])
  return valid, budget.forced(cache.length, t, 1) & valid


def topk(q, cache: KVCache, budget: Budget, gqa: scoring.GQA = "head",
         scale=None) -> Selection:
  """Ideal token-level top-k on the true logits (the oracle of Quest/RESA comparisons).

  ``gqa="group"`` ranks tokens by the group's mean logit, one list per kv head
  (``scoring.pool_group``).
  """
  lg = reference.logits(q[:, :, None, :], cache.k, scale)[:, :, 0, :]  # [B, Hq, T]
  lg = scoring.pool_group(lg, cache.num_kv_heads, gqa)  # [B, H, T]
  valid, forced = _token_masks(cache, budget)
  return top_entries(lg, valid, forced, _total(budget, cache.length, forced, 1),
                     budget.max_count(cache.capacity, 1), 1)


def streaming(q, cache: KVCache, budget: Budget) -> Selection:
  """StreamingLLM attention (Xiao et al. 2024, Sec. 3.3): sink tokens + a recent window.

  The window is the budget's total (``Budget.total``: with ``forced_count="extra"`` the sinks
  and local window on top of ``budget``, as for the score-based selectors at the same budget)
  minus the sinks, at least ``local_window``; one list per kv head.
  """
  valid, forced = _token_masks(cache, budget)
  count = _total(budget, cache.length, forced, 1)
  window = jnp.maximum(count - budget.n_sink, budget.local_window)
  t = cache.capacity
  idx = jnp.arange(t)[None, :]
  keep = valid & ((idx < budget.n_sink) | (idx >= cache.length[:, None] - window[:, None]))
  b, hkv = cache.batch, cache.num_kv_heads
  scores = jnp.broadcast_to(idx.astype(jnp.float32), (b, hkv, t))  # recency order
  del q  # position-only rule
  return top_entries(scores, valid, keep, jnp.zeros_like(count), budget.max_count(t, 1), 1)

