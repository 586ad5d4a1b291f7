"""Adaptive budgets for block selectors: top-p (PSA / Twilight) and Ada-KV head allocation.

Both rules turn block scores into an estimated attention mass per block,
``mass_n = softmax_n(scale * score_n + log |block n|)`` over the blocks in the context (a block
of ``c`` tokens whose keys all reach the bound ``score_n`` would hold ``c e^{scale score_n}``),
and then vary the number of blocks per head.

* top-p (Twilight, Lin et al. 2025, Sec. 4; PSA): per head, the smallest set of blocks whose
  estimated mass reaches ``tau`` (forced blocks first, their mass counted).
* Ada-KV (Feng et al. 2024, Alg. 1): the layer's total block budget ``H * n`` goes to the
  globally largest masses across heads, with a per-head floor ``floor * n`` (Ada-KV's safeguard).

The static list length is the budget's bound times ``cap`` (top-p uses the budget's bound), so
shapes stay static under jit; the selected count per head is dynamic (``n_valid [B, H]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_attn import reference
from sparse_attn.budget import Budget
from sparse_attn.cache import KVCache
from sparse_attn.selection import Selection


def block_mass(scores, cache: KVCache, scale=None):
  """Estimated attention mass ``[B, H, NB]`` (sums to 1 over the context's blocks)."""
  bs = cache.block_size
  scale = reference.default_scale(cache.head_dim, scale)
  start = jnp.arange(cache.num_blocks) * bs
  size = jnp.clip(cache.length[:, None] - start[None, :], 0, bs)  # [B, NB] tokens per block
  lg = scale * scores + jnp.log(jnp.maximum(size, 1)).astype(jnp.float32)[:, None, :]
  lg = jnp.where((size > 0)[:, None, :], lg, -jnp.inf)
  m = jnp.max(lg, axis=-1, keepdims=True)
  p = jnp.exp(lg - jnp.where(jnp.isfinite(m), m, 0.0))
  return p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)


def _ranked(mass, cache: KVCache, budget: Budget, n_max: int):
  """Per-head blocks in order (forced first, then by mass): ``idx, sorted mass, valid``."""
  nb, bs = cache.num_blocks, cache.block_size
  valid = jnp.arange(nb)[None, :] * bs < cache.length[:, None]
  forced = budget.forced(cache.length, nb, bs)
  key = jnp.where(forced[:, None, :], 2.0 + mass, jnp.where(valid[:, None, :], mass, -1.0))
  top, idx = jax.lax.top_k(key, min(n_max, nb))
  ok = top >= 0.0
  m_sorted = jnp.where(ok, jnp.take_along_axis(mass, idx, axis=-1), 0.0)
  n_forced = jnp.sum(top >= 2.0, axis=-1)
  return idx.astype(jnp.int32), m_sorted, ok, n_forced


def topp(scores, cache: KVCache, budget: Budget, tau: float, scale=None) -> Selection:
  """Smallest per-head block set with estimated mass >= ``tau``, capped by ``budget``.

  Args:
    scores: ``[B, H, NB]`` block scores (e.g. Quest bounds).
    cache: the layer cache.
    budget: its forced blocks are always kept; its bound caps the list.
    tau: target mass in (0, 1].
  """
  if not 0.0 < tau <= 1.0:
    raise ValueError(f"topp threshold must be in (0, 1], got {tau}")
  mass = block_mass(scores, cache, scale)
  n_max = budget.max_count(cache.capacity, cache.block_size)
  idx, m_sorted, ok, n_forced = _ranked(mass, cache, budget, n_max)
  before = jnp.cumsum(m_sorted, axis=-1) - m_sorted  # mass of the entries ranked above
  n = jnp.sum(ok & (before < tau * (1.0 - 1e-6)), axis=-1)
  n = jnp.maximum(n, n_forced)
  return Selection(idx=idx, n_valid=n.astype(jnp.int32), granularity=cache.block_size)


def adakv(scores, cache: KVCache, budget: Budget, scale=None, floor: float = 0.2,
          cap: int = 4) -> Selection:
  """Ada-KV allocation of the layer's block budget across heads (Feng et al. 2024, Alg. 1).

  Args:
    scores: ``[B, H, NB]``.
    cache: the layer cache.
    budget: the uniform per-head count ``n`` (``Budget.total``, forced blocks counted as the
      budget's accounting says); the layer total is ``H * n``.
    floor: each head keeps at least ``ceil(floor * n)`` blocks.
    cap: static list length is ``cap`` times the uniform bound.
  """
  if not 0.0 <= floor <= 1.0:
    raise ValueError(f"adakv floor must be in [0, 1], got {floor}")
  b, h, nb = scores.shape
  bs = cache.block_size
  mass = block_mass(scores, cache, scale)
  n_max = min(nb, cap * budget.max_count(cache.capacity, bs))
  idx, m_sorted, ok, n_forced = _ranked(mass, cache, budget, n_max)
  n_u = budget.total(cache.length, n_forced[:, 0], bs)  # [B] uniform per-head count
  guaranteed = jnp.maximum(jnp.ceil(floor * n_u).astype(jnp.int32)[:, None], n_forced)
  rank = jnp.arange(idx.shape[-1])[None, None, :]
  # Entries every head keeps rank above all others; the rest compete on mass.
  key = jnp.where(rank < guaranteed[..., None], 2.0 + m_sorted, m_sorted)
  key = jnp.where(ok, key, -1.0).reshape(b, -1)
  total = jnp.minimum(h * n_u, jnp.sum(ok, axis=(1, 2)))  # [B]
  srt = -jnp.sort(-key, axis=-1)
  thresh = jnp.take_along_axis(srt, jnp.maximum(total - 1, 0)[:, None], axis=-1)  # [B, 1]
  # exactly ``total`` entries: all above the threshold, then the tied ones in entry order
  above = key > thresh
  tied = key == thresh
  room = total[:, None] - jnp.sum(above, axis=-1, keepdims=True)
  take = (above | (tied & (jnp.cumsum(tied, axis=-1) <= room))) & (key >= 0.0)
  take &= total[:, None] > 0
  n = jnp.sum(take.reshape(b, h, -1), axis=-1)
  n = jnp.minimum(jnp.maximum(n, jnp.minimum(guaranteed, jnp.sum(ok, -1))), jnp.sum(ok, -1))
  return Selection(idx=idx, n_valid=n.astype(jnp.int32), granularity=bs)
