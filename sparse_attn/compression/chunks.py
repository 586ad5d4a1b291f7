"""Runs of consecutive tokens ("chunks") for the scorers that select by chunk.

Letters: B batch, K kv heads, T cache slots, C chunks.

ChunkKV keeps whole chunks ranked by their mean score; FINCH (chunked) keeps a share of every
chunk. Both are expressed as per-slot scores so the shared head-budget rules (a top ``n`` per
head) apply unchanged: a *tiered* score orders slots by a primary key (the chunk's score, or
"inside its chunk's quota") and breaks ties by a secondary key (the token's own score).
Chunks are counted from the first token (kvpress's ``ChunkKVPress`` / ``FinchPress``), over the
slots sorted by token position (``order``), the last chunk partial.
"""

from __future__ import annotations

import jax.numpy as jnp

from sparse_attn.compression import compact as compact_lib


def chunk_of(t: int, length: int):
  """``[T]`` int32: the chunk of each position in token order (``i // length``)."""
  return jnp.arange(t, dtype=jnp.int32) // length


def chunk_means(x, valid, length: int):
  """Mean of ``x [B, K, T]`` (token order) over the valid slots of each chunk, broadcast back
  to ``[B, K, T]`` (0 for a chunk with no valid slot)."""
  b, k, t = x.shape
  c = -(-t // length)
  pad = ((0, 0), (0, 0), (0, c * length - t))
  xs = jnp.pad(jnp.where(valid, x, 0.0), pad).reshape(b, k, c, length)
  n = jnp.pad(valid, pad).reshape(b, k, c, length).sum(-1, keepdims=True)
  mean = jnp.sum(xs, axis=-1, keepdims=True) / jnp.maximum(n, 1)
  return jnp.broadcast_to(mean, xs.shape).reshape(b, k, c * length)[:, :, :t]


def within_chunk_quota(score, valid, length: int, ratio: float):
  """``[B, K, T]`` bool: the slots (token order) among the top ``ceil((1 - ratio) s)`` of their
  chunk of ``s`` valid tokens by ``score`` (FINCH's per-chunk share)."""
  b, k, t = score.shape
  c = -(-t // length)
  pad = ((0, 0), (0, 0), (0, c * length - t))
  s = jnp.pad(jnp.where(valid, score, -jnp.inf), pad, constant_values=-jnp.inf)
  s = s.reshape(b, k, c, length)
  n = jnp.pad(valid, pad).reshape(b, k, c, length).sum(-1, keepdims=True)
  rank = compact_lib.rank_desc(s)
  return (rank < compact_lib.keep_count(n, ratio)).reshape(b, k, c * length)[:, :, :t]


def tiered(primary, secondary):
  """``[B, K, T]`` float32 scores ordering slots by ``primary``, ties by ``secondary`` (both
  higher first; remaining ties by lower slot): ``T - rank``, so a top ``n`` of the result is
  the lexicographic top ``n``."""
  t = primary.shape[-1]
  slot = jnp.broadcast_to(jnp.arange(t), primary.shape)
  order = jnp.lexsort((slot, -secondary, -primary), axis=-1)
  rank = jnp.argsort(order, axis=-1)
  return (t - rank).astype(jnp.float32)
