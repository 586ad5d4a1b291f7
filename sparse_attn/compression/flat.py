"""A flat per-layer cache for head-adaptive budgets: every kv head's kept tokens in one buffer.

Letters: B batch, K kv heads, G query heads per kv head, N = K G query heads, T slots of the
per-head layout, Tf slots of the flat buffer, S queries per head, C new slots, D head dim.

Ada-KV (Feng et al. 2024) gives each kv head its own number of kept tokens; only the layer
total ``K n`` is fixed. In the per-head layout ``[B, K, T, D]`` every head would be padded to
the largest head (at ratio 0.5 on SmolLM2 that buffer is ~70% of dense, not 50%). The flat layout
stores the kept tokens of all heads of a layer in one buffer ``k, v [B, Tf, D]`` with a kv-head id
per slot, so the buffer holds exactly the kept tokens plus the decode room, rounded up once per
layer to a multiple of ``block_size`` (less than one block of padding). After
compaction the heads' tokens are contiguous (head 0's first, each in token order: per-head
offsets into the buffer); each decode step appends ``K`` slots, one per head. Because the layer
total is the same for every layer, every layer compacts to the same shape (compiled once).

Query head ``h`` attends the slots of kv head ``h // G`` (a head mask over the flat buffer):
the memory is exact, the logits cost ``K`` times those of one head's slots (every query head
scores the whole layer buffer, masked), a dense matmul with no gather. ``attend`` is that jnp
form; a decode step on a GPU runs ``pallas_kernels.flat_decode`` instead (``layout.Flat``),
which reads the buffer once for every query head without the ``[B, N, Tf]`` logits in memory.
Scoring and slot-aligned method state use ``heads_view``: the buffer seen as ``[B, K, Tf]`` with
each slot valid only in its own head's row, so every method's per-head ``scores`` works unchanged.
The flat cache has no block digests: compression methods attend densely and never read them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparse_attn import reference
from sparse_attn.cache import SlotBuffer, scatter_set
from sparse_attn.compression import compact as compact_lib


def head_dtype(num_kv_heads: int):
  """The smallest integer dtype holding every kv-head id."""
  return jnp.int8 if num_kv_heads <= 127 else jnp.int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FlatKVCache(SlotBuffer):
  """One layer's cache with all kv heads' tokens in one buffer.

  Attributes:
    k, v: ``[B, Tf, D]`` keys (post-RoPE) and values.
    pos: ``[B, Tf]`` int32 token position of each slot, -1 if empty.
    head: ``[B, Tf]`` kv head owning each slot (int8 for up to 127 heads).
    length: ``[B]`` int32 slots in use (one past the highest written slot).
    num_kv_heads: static ``K``.
    block_size: static; the capacity ``Tf`` is a multiple of it.
  """

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  head: jax.Array
  length: jax.Array
  num_kv_heads: int = dataclasses.field(metadata=dict(static=True), default=1)
  block_size: int = dataclasses.field(metadata=dict(static=True), default=16)

  def slot_bytes(self) -> int:
    """Bytes per slot (key, value, position and head id)."""
    return sum(x.dtype.itemsize * (x.shape[2] if x.ndim == 3 else 1)
               for x in (self.k, self.v, self.pos, self.head))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadsView(SlotBuffer):
  """The flat buffer seen per kv head (``[B, K, Tf]``), for scoring; read-only, never stored.

  Has the fields every method's ``scores``/``observe`` reads of a ``KVCache``: ``k, v
  [B, K, Tf, D]`` (the buffer broadcast over heads), ``pos [B, K, Tf]`` (-1 outside the row's own
  head), ``length``, ``valid``, ``head_dim``, ``capacity``.
  """

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  length: jax.Array


def heads_view(cache: FlatKVCache) -> HeadsView:
  """``cache`` as ``[B, K, Tf]`` rows, each slot valid only in its own head's row."""
  kk = cache.num_kv_heads
  shape = (cache.batch, kk) + cache.k.shape[1:]
  own = cache.head[:, None, :] == jnp.arange(kk, dtype=cache.head.dtype)[None, :, None]
  return HeadsView(k=jnp.broadcast_to(cache.k[:, None], shape),
                   v=jnp.broadcast_to(cache.v[:, None], shape),
                   pos=jnp.where(own, cache.pos[:, None, :], -1), length=cache.length)


def view_index(src, head, num_kv_heads: int):
  """``[B, K, C]`` per-head view of a flat compaction index ``src [B, C]`` (-1 off-head).

  Moves slot-aligned method state (``[B, K, T]``) along with the compaction.
  """
  own = head[:, None, :] == jnp.arange(num_kv_heads, dtype=head.dtype)[None, :, None]
  return jnp.where(own & (src[:, None, :] >= 0), src[:, None, :], -1)


def from_heads(k, v, pos, keep, capacity: int, block_size: int):
  """Compacts the kept slots of a per-head layout into a flat cache.

  Args:
    k, v: ``[B, K, T, D]``; pos: ``[B, K, T]`` token positions.
    keep: ``[B, K, T]`` bool kept slots (valid ones only).
    capacity: static flat capacity ``C`` (a multiple of ``block_size``).
    block_size: static.

  Returns:
    ``(cache, idx)``: the flat cache (head 0's kept tokens first, each head in slot order) and
    ``idx [B, K, C]`` the per-head old slot of each new slot (-1 elsewhere), for
    ``compact_state``.
  """
  b, kk, t, d = k.shape
  src = compact_lib.compaction_index(keep.reshape(b, kk * t), capacity)  # [B, C]
  head = jnp.where(src >= 0, src // t, 0).astype(head_dtype(kk))
  cache = FlatKVCache(
      k=compact_lib.gather_slots(k.reshape(b, 1, kk * t, d), src[:, None])[:, 0],
      v=compact_lib.gather_slots(v.reshape(b, 1, kk * t, d), src[:, None])[:, 0],
      pos=compact_lib.gather_slots(pos.reshape(b, 1, kk * t), src[:, None], -1)[:, 0],
      head=head, length=jnp.sum(src >= 0, axis=-1).astype(jnp.int32),
      num_kv_heads=kk, block_size=block_size)
  slot = jnp.where(src >= 0, src % t, -1)
  return cache, view_index(slot, head, kk)


def compact(cache: FlatKVCache, keep, capacity: int | None = None):
  """Moves the kept slots ``keep [B, Tf]`` of a flat cache to its front (in slot order).

  Returns ``(cache, idx)`` with ``idx [B, K, C]`` as in ``from_heads``.
  """
  capacity = cache.capacity if capacity is None else capacity
  src = compact_lib.compaction_index(keep & cache.valid, capacity)  # [B, C]
  gather = lambda x, fill=0: compact_lib.gather_slots(x[:, None], src[:, None], fill)[:, 0]
  head = gather(cache.head)
  new = dataclasses.replace(cache, k=gather(cache.k), v=gather(cache.v),
                            pos=gather(cache.pos, -1), head=head,
                            length=jnp.sum(src >= 0, axis=-1).astype(jnp.int32))
  return new, view_index(src, head, cache.num_kv_heads)


def append(cache: FlatKVCache, k, v, positions) -> FlatKVCache:
  """Appends ``S`` tokens, one slot per kv head each, after the cache's slots.

  Token ``s`` (the ``s``-th non-padding one of its row) of kv head ``h`` lands at slot
  ``length + s K + h``: the layout ``S`` one-token appends leave.

  Args:
    k, v: ``[B, K, S, D]`` the new keys (post-RoPE) and values of every kv head.
    positions: ``[B, S]`` token positions; -1 = padding (nothing written).
  """
  b, kk, s = k.shape[:3]
  ok = positions >= 0  # [B, S]
  rank = jnp.cumsum(ok, axis=-1, dtype=jnp.int32) - 1
  slot = (cache.length[:, None, None] + rank[:, :, None] * kk
          + jnp.arange(kk, dtype=jnp.int32)[None, None])  # [B, S, K]
  slot = jnp.where(ok[:, :, None] & (slot < cache.capacity), slot, cache.capacity)  # dropped
  slot = slot.reshape(b, s * kk)
  bi = jnp.arange(b)[:, None]
  put = lambda arr, val: scatter_set(arr, (bi, slot), val)
  # [B, K, S, D] -> [B, S * K, D] in slot order
  rows = lambda x: jnp.swapaxes(x, 1, 2).reshape(b, s * kk, x.shape[-1])
  heads = jnp.broadcast_to(jnp.arange(kk), (b, s, kk)).reshape(b, s * kk)
  tok = jnp.broadcast_to(positions[:, :, None], (b, s, kk)).reshape(b, s * kk)
  added = kk * jnp.sum(ok, axis=-1, dtype=jnp.int32)
  return dataclasses.replace(
      cache, k=put(cache.k, rows(k)), v=put(cache.v, rows(v)), pos=put(cache.pos, tok),
      head=put(cache.head, heads), length=jnp.minimum(cache.length + added, cache.capacity))


def attend(q, cache: FlatKVCache, positions, scale=None, softcap=None, window=None):
  """Exact causal attention of ``q [B, N, S, D]`` over a flat cache (own head's slots only;
  ``softcap``, ``window``: the attention-logit soft-cap and the sliding window,
  ``reference.attention``'s).

  Returns ``out [B, N, S, D]`` (``q.dtype``) and ``lse [B, N, S]`` float32 (0 / -inf for a row
  that attends nothing).
  """
  n = q.shape[1]
  group = n // cache.num_kv_heads
  qhead = (jnp.arange(n) // group).astype(cache.head.dtype)
  mask = (cache.head[:, None, None, :] == qhead[None, :, None, None])  # [B, N, 1, Tf]
  return reference.attention(q, cache.k[:, None], cache.v[:, None], mask, scale,
                             kv_length=cache.length, q_positions=positions,
                             k_positions=cache.pos, softcap=softcap, window=window)


def per_head_counts(cache: FlatKVCache):
  """``[B, K]`` int32 valid slots owned by each kv head."""
  own = cache.head[:, None, :] == jnp.arange(cache.num_kv_heads,
                                             dtype=cache.head.dtype)[None, :, None]
  return jnp.sum(own & cache.valid[:, None, :], axis=-1, dtype=jnp.int32)
