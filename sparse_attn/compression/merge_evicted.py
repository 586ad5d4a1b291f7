"""Merge on evict: each evicted value folded into its nearest kept token's (kvpress's
``MergingPress``).

Letters: B batch, K kv heads, T slots, D head dim.

kvpress's ``MergingPress`` (its leaderboard's ``merging_knorm``, ``merging_snapkv``,
``merging_expected_attention``; after Token Merging, Bolya et al., ICLR 2023, and D2O, Wan et
al. 2024) replaces the prompt's hard cut by a blend. Per kv head, every evicted token ``i``
finds the kept token ``j(i)`` whose key is the most cosine-similar, ``s_i = max_j cos(k_i,
k_j)``; it merges when ``s_i >= threshold`` and ``s_i`` lies in the top ``fraction`` of the
head's evicted tokens by ``s`` (the ``1 - fraction`` quantile of ``s``, with the tokens under
the threshold at ``-inf``), with weight

  w_i = max(s_i, 0) ||v_i|| / (||v_i|| + ||v_j(i)|| + 1e-6),

and each kept value becomes

  v_j <- (v_j + sum_{i: j(i) = j} w_i v_i) / (1 + sum_{i: j(i) = j} w_i)

(unchanged where nothing merged). Keys are untouched, so their RoPE positions stay valid. The
merge applies at the prompt's cut only (kvpress's press is a prefill press); a decode phase's
later cuts evict plainly.

Cost: every slot's cosine with every slot of its head, masked to the kept ones (static shapes:
which slots are evicted is data), ``ROW_TILE`` rows at a time: ``B K T^2 D`` multiply-adds
once per layer, where kvpress forms the evicted x kept block (a quarter of it at ratio 0.5).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

EPS = 1e-6  # kvpress's: the norms' floor and the weight's denominator term
ROW_TILE = 128  # evicted slots whose similarities to every slot are formed at once


def nearest_kept(k, keep, tile: int = ROW_TILE):
  """``(sim [B, K, T], target [B, K, T])``: each slot's largest key cosine with a kept slot of
  its head and that slot (the lowest one at a tie); ``-inf`` / 0 for a head that keeps none.
  ``k [B, K, T, D]``, ``keep [B, K, T]`` bool; ``tile`` rows at a time, so the similarities
  live as ``[B, K, tile, T]``, not ``[B, K, T, T]``."""
  b, kh, t, d = k.shape
  unit = k.astype(jnp.float32)
  unit = unit / jnp.maximum(jnp.linalg.norm(unit, axis=-1, keepdims=True), EPS)
  nt = -(-t // tile)
  rows = jnp.pad(unit, ((0, 0), (0, 0), (0, nt * tile - t), (0, 0)))
  rows = jnp.moveaxis(rows.reshape(b, kh, nt, tile, d), 2, 0)  # [nt, B, K, tile, D]

  def one(r):
    sim = jnp.einsum("bkrd,bktd->bkrt", r, unit)
    sim = jnp.where(keep[:, :, None, :], sim, -jnp.inf)
    return jnp.max(sim, axis=-1), jnp.argmax(sim, axis=-1).astype(jnp.int32)

  sim, target = jax.lax.map(one, rows)
  back = lambda x: jnp.moveaxis(x, 0, 2).reshape(b, kh, nt * tile)[..., :t]
  return back(sim), back(target)


def lerp_quantile(x, q: float, count):
  """``[..., 1]``: the ``q`` quantile of the first ``count [..., 1]`` values of each row of ``x``
  in sorted order (the rest NaN, sorted last), interpolated as ``torch.quantile`` and
  ``numpy.quantile`` do: ``a + t (b - a)`` below ``t = 1/2``, ``b - (1 - t) (b - a)`` from it.
  Between ``-inf`` and a finite value that is NaN below ``1/2``, which no similarity passes
  (kvpress's gate then merges nothing); ``jnp.nanquantile`` gives ``-inf`` there."""
  s = jnp.sort(x, axis=-1)
  pos = q * (count - 1).astype(jnp.float32)
  lo = jnp.clip(jnp.floor(pos), 0, x.shape[-1] - 1).astype(jnp.int32)
  hi = jnp.clip(jnp.ceil(pos), 0, x.shape[-1] - 1).astype(jnp.int32)
  t = pos - jnp.floor(pos)
  a, b = jnp.take_along_axis(s, lo, axis=-1), jnp.take_along_axis(s, hi, axis=-1)
  return jnp.where(t < 0.5, a + t * (b - a), b - (1.0 - t) * (b - a))


def merge_evicted(cache, keep, threshold: float = 0.0, fraction: float = 1.0):
  """``cache`` with each evicted value of ``keep [B, K, T]`` merged into its nearest kept one
  (module docstring); keys, positions and the kept set unchanged. Evicted = a valid slot
  outside ``keep``."""
  keep = keep & cache.valid
  evicted = cache.valid & ~keep
  sim, target = nearest_kept(cache.k, keep)
  ok = evicted & (sim >= threshold)
  if fraction < 1.0:  # the evicted tokens' 1 - fraction quantile, those under the threshold
    # at -inf (as kvpress); the other slots sort last (NaN) and are not counted
    s = jnp.where(evicted, jnp.where(ok, sim, -jnp.inf), jnp.nan)
    cut = lerp_quantile(s, 1.0 - fraction, jnp.sum(evicted, axis=-1, keepdims=True))
    ok = ok & (sim >= cut)
  v = cache.v.astype(jnp.float32)
  norm = jnp.linalg.norm(v, axis=-1)  # [B, K, T]
  target_norm = jnp.take_along_axis(norm, target, axis=-1)
  w = jnp.where(ok, jnp.maximum(sim, 0.0) * norm / (norm + target_norm + EPS), 0.0)
  bi, ki = jnp.indices(target.shape[:2])
  bi, ki = bi[..., None], ki[..., None]
  added = jnp.zeros_like(v).at[bi, ki, target].add(w[..., None] * v)
  total = jnp.zeros_like(norm).at[bi, ki, target].add(w)
  merged = (v + added) / (1.0 + total[..., None])
  new_v = jnp.where((keep & (total > 0))[..., None], merged.astype(cache.v.dtype), cache.v)
  return dataclasses.replace(cache, v=new_v)


@dataclasses.dataclass(frozen=True)
class MergeOnEvict:
  """The merge options of every compression method (a base of ``base.CompressionMethod``).

  Attributes:
    merge: fold each evicted value into its nearest kept token's at the prompt's cut (kvpress's
      ``MergingPress`` around the method).
    merge_threshold: least key cosine for a merge (kvpress's ``similarity_threshold``, 0).
    merge_fraction: the share of the evicted tokens, most similar first, that merge (1).
  """

  merge: bool = False
  merge_threshold: float = 0.0
  merge_fraction: float = 1.0

  def check_merge(self):
    """Raises ValueError for a bad merge option."""
    if not isinstance(self.merge, bool):
      raise ValueError(f"merge must be a bool, got {self.merge!r}")
    if not 0.0 <= self.merge_threshold <= 1.0:
      raise ValueError(f"merge_threshold must be in [0, 1], got {self.merge_threshold!r}")
    if not 0.0 < self.merge_fraction <= 1.0:
      raise ValueError(f"merge_fraction must be in (0, 1], got {self.merge_fraction!r}")

  def merged(self, cache, keep):
    """The prompt's cache as ``end_prefill`` compacts it: values merged when ``merge``."""
    if not self.merge:
      return cache
    return merge_evicted(cache, keep, self.merge_threshold, self.merge_fraction)
