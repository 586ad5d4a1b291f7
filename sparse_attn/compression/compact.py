"""Compaction: kept slots of each kv head moved into a physically smaller buffer.

Letters: B batch, K kv heads, T old capacity, C new capacity, D head dim.

After eviction every head keeps its own set of slots. ``compact`` gathers each head's kept slots
to the front of a buffer of ``C`` slots (kept in their old slot order, so in token order), pads
the rest with zeros and ``pos = -1``, and sets ``length`` to the largest kept count of the row
(heads that kept fewer have holes, masked by ``pos < 0``). The original token positions of the
kept keys stay in ``pos``: RoPE is already applied and the model keeps counting positions from
the original length. Decoding then reads only the ``C``-slot buffer.

These helpers live here rather than in ``cache.py`` (owned elsewhere); they only use the public
``cache.replace_storage`` and ``cache.block_digests``.
"""

from __future__ import annotations

import fractions

import jax
import jax.numpy as jnp

from sparse_attn.cache import KVCache, replace_storage


def ratio_fraction(ratio: float) -> tuple[int, int]:
  """``ratio`` as an exact small fraction ``(num, den)`` so counts are integer arithmetic."""
  f = fractions.Fraction(ratio).limit_denominator(1000)
  return f.numerator, f.denominator


def keep_count(n, ratio: float):
  """``ceil((1 - ratio) * n)`` in integer arithmetic (exact for ratios like 0.3 or 0.57).

  Args:
    n: int or int array of token counts.
    ratio: static fraction evicted, in [0, 1).
  """
  num, den = ratio_fraction(ratio)
  return ((den - num) * n + den - 1) // den


def round_up(n: int, block_size: int) -> int:
  """The smallest positive multiple of ``block_size`` holding ``n`` slots."""
  return max(1, -(-int(n) // block_size)) * block_size


def bucket(n: int, bits: int, block_size: int) -> int:
  """``n`` slots rounded up to a size with ``bits`` significant binary digits after the
  leading one (``2 ** bits`` sizes per doubling, at most ``2 ** -bits`` more slots than
  ``round_up``'s), a multiple of ``block_size``: caches of nearby sizes share one shape.

  E.g. ``bits=2``: 600 -> 640, 700 -> 768, 4100 -> 5120 (block 16)."""
  n = round_up(n, block_size)
  step = 1 << max(n.bit_length() - 1 - bits, 0)
  return round_up(round_up(n, step), block_size)


def rank_desc(score, axis=-1):
  """Rank of each entry in descending order (0 = largest); ties broken by lower index."""
  order = jnp.argsort(-score, axis=axis, stable=True)
  return jnp.argsort(order, axis=axis)


def compaction_index(keep, capacity: int):
  """Source slot of every new slot.

  Args:
    keep: ``[..., T]`` bool, the slots to keep.
    capacity: static new capacity ``C`` (kept counts above it are truncated).

  Returns:
    ``idx [..., C]`` int32 old slot per new slot, -1 for padding.
  """
  t = keep.shape[-1]
  order = jnp.argsort(~keep, axis=-1, stable=True).astype(jnp.int32)  # kept first, in order
  if capacity <= t:
    order = order[..., :capacity]
  else:
    pad = jnp.zeros(order.shape[:-1] + (capacity - t,), jnp.int32)
    order = jnp.concatenate([order, pad], axis=-1)
  count = jnp.sum(keep, axis=-1, dtype=jnp.int32)
  return jnp.where(jnp.arange(capacity) < count[..., None], order, -1)


def gather_slots(x, idx, fill=0):
  """``x [B, K, T, ...]`` gathered at ``idx [B, K, C]`` (``fill`` where idx < 0)."""
  safe = jnp.maximum(idx, 0)
  extra = x.ndim - idx.ndim
  ix = safe.reshape(safe.shape + (1,) * extra)
  out = jnp.take_along_axis(x, ix, axis=2)
  mask = (idx >= 0).reshape(idx.shape + (1,) * extra)
  return jnp.where(mask, out, jnp.asarray(fill, x.dtype))


def compact(cache: KVCache, keep, capacity: int):
  """Compacts the kept slots of every head into a ``capacity``-slot cache.

  Args:
    cache: ``[B, K, T, D]`` cache.
    keep: ``[B, K, T]`` bool kept slots (should be a subset of ``cache.valid``).
    capacity: static new capacity (a multiple of the block size).

  Returns:
    ``(new_cache, idx)``: the compacted cache (digests recomputed) and ``idx [B, K, C]`` the
    old slot of each new slot (-1 = padding), for compacting slot-aligned method state.
  """
  if capacity % cache.block_size:
    raise ValueError(f"capacity {capacity} is not a multiple of block_size {cache.block_size}")
  keep = keep & cache.valid
  idx = compaction_index(keep, capacity)
  k = gather_slots(cache.k, idx)
  v = gather_slots(cache.v, idx)
  pos = gather_slots(cache.pos, idx, -1)
  length = jnp.max(jnp.sum(idx >= 0, axis=-1), axis=-1).astype(jnp.int32)
  return replace_storage(cache, k, v, pos, length), idx


def select_rows(pred, new, old):
  """Per batch row ``pred [B]``: leaves of ``new`` where True, of ``old`` elsewhere.

  Works on any pytree whose leaves lead with the batch axis (a ``KVCache`` included: its
  digests come along with its keys, so they stay in sync).
  """
  def pick(a, b):
    p = pred.reshape(pred.shape + (1,) * (a.ndim - 1))
    return jnp.where(p, a, b)
  return jax.tree_util.tree_map(pick, new, old)

