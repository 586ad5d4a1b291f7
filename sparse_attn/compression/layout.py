"""The two cache layouts a compression method decodes from: per-head slots or one flat buffer.

Letters: B batch, K kv heads, N query heads, S new tokens, T slots per head, Tf flat slots,
C new capacity, D head dim.

* ``PER_HEAD``: a ``cache.KVCache`` ``[B, K, T, D]``; every head has its own ``T`` slots. A
  uniform budget keeps the same count per head, so this buffer holds the kept tokens exactly.
* ``FLAT``: a ``flat.FlatKVCache`` ``[B, Tf, D]`` with a kv-head id per slot, for Ada-KV's
  head-adaptive budgets (Feng et al. 2024): the heads keep different counts, and a per-head
  buffer would pad every head to the largest (see ``flat``'s docstring).

The prompt is always written per head (``prefill`` writes slot = position); ``end_prefill``
compacts it into the layout of its head-budget rule (``head_budget.Uniform.layout`` /
``AdaKV.layout``), and from then on the cache's type says which layout it is: ``of(cache)`` is
the one place that asks. Each layout answers the same questions (attend, append, compact,
how full, how it is sized), so the per-layer schedule (``base``), the prefill sizing
(``prefill``) and the decode phase (``decode_phase``) never branch on the cache type.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import Impl
from sparse_attn import kernels
from sparse_attn.cache import KVCache, write
from sparse_attn.compression import compact as compact_lib
from sparse_attn.compression import flat


@dataclasses.dataclass(frozen=True)
class PerHead:
  """``KVCache [B, K, T, D]``: each kv head's kept tokens in its own ``T`` slots."""

  def heads(self, num_kv_heads: int) -> int:
    """How many heads share one slot count when sizing: 1 (the capacity is per head)."""
    del num_kv_heads
    return 1

  def count(self, keep):
    """Slots the kept set ``keep [B, K, T]`` needs, ``[B, K]`` (per head)."""
    return jnp.sum(keep, axis=-1)

  def view(self, cache: KVCache) -> KVCache:
    """The cache as ``[B, K, T]`` rows for scoring: itself."""
    return cache

  def attend(self, q, cache: KVCache, positions, scale, softcap=None, window=None, *,
             impl: Impl = "xla", interpret: bool = False):
    """Exact causal attention of ``q [B, N, S, D]`` -> ``(out, lse [B, N, S], view)``
    (``softcap``: the attention-logit soft-cap; ``window``: a sliding window; ``impl``: the
    kernels', ``kernels.dense_attention``'s, or for one query without a window the split-K
    ``kernels.dense_decode``'s: every kept slot is at or before the newest token's position,
    and a negative position is an inactive row there too)."""
    if q.shape[2] == 1 and window is None:
      out, lse = kernels.dense_decode(q[:, :, 0], cache, positions[:, 0], scale, impl=impl,
                                      interpret=interpret, softcap=softcap)
      return out[:, :, None], lse[:, :, None], cache
    out, lse = kernels.dense_attention(q, cache, positions, scale, window=window,
                                       softcap=softcap, impl=impl, interpret=interpret)
    return out, lse, cache

  def append(self, cache: KVCache, k, v, positions, *, impl: Impl = "xla",
             interpret: bool = False) -> KVCache:
    """Writes ``k, v [B, K, S, D]`` after the row's slots (``positions [B, S]``, -1 skipped;
    ``impl``: ``cache.write``'s, whose ``cache_append`` kernel writes the tokens and their
    blocks' digests in one launch)."""
    ok = positions >= 0
    rank = jnp.cumsum(ok, axis=-1, dtype=jnp.int32) - 1
    slots = jnp.where(ok, cache.length[:, None] + rank, -1)
    return write(cache, k.astype(cache.k.dtype), v.astype(cache.v.dtype), slots,
                 token_positions=positions, impl=impl, interpret=interpret)

  def from_heads(self, cache: KVCache, keep, capacity: int, block_size: int):
    """Compacts the prompt's kept slots ``keep [B, K, T]`` into ``capacity`` slots per head.

    Returns ``(cache, idx [B, K, C], per_head [B])``: the old slot of each new slot and the
    most tokens any head of the row kept.
    """
    del block_size  # the cache's own
    new, idx = compact_lib.compact(cache, keep, capacity)
    return new, idx, new.length

  def full(self, cache: KVCache):
    """``[B]`` bool: the next token no longer fits."""
    return cache.length >= cache.capacity

  def ceiling(self, capacity: int, interval: int) -> int:
    """Most tokens one head may keep at a decode-phase compression: room for ``interval``
    more appends in the ``capacity`` slots it has alone."""
    return max(capacity - interval, 1)

  def compact(self, cache: KVCache, keep):
    """Moves the kept slots ``keep [B, K, T]`` to the front -> ``(cache, idx [B, K, T])``."""
    return compact_lib.compact(cache, keep, cache.capacity)


@dataclasses.dataclass(frozen=True)
class Flat:
  """``flat.FlatKVCache [B, Tf, D]``: every head's kept tokens in one buffer (Ada-KV)."""

  def heads(self, num_kv_heads: int) -> int:
    """How many heads share the buffer when sizing: all ``K``."""
    return num_kv_heads

  def count(self, keep):
    """Slots the kept set ``keep [B, K, T]`` needs, ``[B]`` (all heads' together)."""
    return jnp.sum(keep, axis=(-2, -1))

  def view(self, cache: flat.FlatKVCache) -> flat.HeadsView:
    """The buffer as ``[B, K, Tf]`` rows for scoring (``flat.heads_view``)."""
    return flat.heads_view(cache)

  def attend(self, q, cache: flat.FlatKVCache, positions, scale, softcap=None, window=None, *,
             impl: Impl = "xla", interpret: bool = False):
    """Exact causal attention of ``q [B, N, S, D]`` (own head's slots) -> ``(out, lse, view)``
    (``softcap``: the attention-logit soft-cap; ``window``: a sliding window; ``impl``: for one
    query without a window, ``kernels.flat_decode``'s, whose kernel reads the buffer once for
    every query head; ``flat.attend`` otherwise)."""
    if q.shape[2] == 1 and window is None:
      got = kernels.flat_decode(q[:, :, 0], cache, positions[:, 0], scale, impl=impl,
                                interpret=interpret, softcap=softcap)
      if got is not None:
        return got[0][:, :, None], got[1][:, :, None], flat.heads_view(cache)
    out, lse = flat.attend(q, cache, positions, scale, softcap, window)
    return out, lse, flat.heads_view(cache)

  def append(self, cache: flat.FlatKVCache, k, v, positions, *, impl: Impl = "xla",
             interpret: bool = False) -> flat.FlatKVCache:
    """Appends ``k, v [B, K, S, D]``: ``K`` slots per token (``flat.append``; ``impl``,
    ``interpret``: unused, a scatter of ``K`` rows and no digests)."""
    del impl, interpret
    return flat.append(cache, k, v, positions)

  def from_heads(self, cache: KVCache, keep, capacity: int, block_size: int):
    """Compacts the prompt's kept slots ``keep [B, K, T]`` into one ``capacity``-slot buffer.

    Returns ``(cache, idx [B, K, C], per_head [B])`` as ``PerHead.from_heads``.
    """
    new, idx = flat.from_heads(cache.k, cache.v, cache.pos, keep & cache.valid, capacity,
                               block_size)
    return new, idx, jnp.max(flat.per_head_counts(new), axis=-1)

  def full(self, cache: flat.FlatKVCache):
    """``[B]`` bool: the next token's ``K`` slots no longer fit."""
    return cache.length + cache.num_kv_heads > cache.capacity

  def ceiling(self, capacity: int, interval: int) -> None:
    """No per-head cap: the heads share the buffer, only the layer total is bounded."""
    del capacity, interval

  def compact(self, cache: flat.FlatKVCache, keep):
    """Moves the slots kept in their own head's row of ``keep [B, K, Tf]`` to the front."""
    return flat.compact(cache, jnp.any(keep, axis=1))


PER_HEAD = PerHead()
FLAT = Flat()


def of(cache) -> PerHead | Flat:
  """The layout of ``cache`` (the only type test on a compression cache)."""
  return FLAT if isinstance(cache, flat.FlatKVCache) else PER_HEAD
