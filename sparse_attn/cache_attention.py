"""Exact causal attention of a query chunk over a KV cache, reading only the filled slots.

Prefill and rectification attend a chunk of queries over the whole cache. The cache has a
static capacity ``T`` but holds only ``length`` tokens, so attending all ``T`` slots (and
materialising ``[S, T]`` logits) wastes work early in a long prefill: an 8k prefill in 512-token
chunks would read 16 tiles per chunk where on average 8.5 are filled. ``dense_over_cache``
loops over key tiles of ``key_tile`` slots up to the filled length (a ``while_loop``, so the
trip count is a traced value) and merges the tiles' partial results exactly (``merge``).
A cache of at most ``key_tile`` slots takes one plain call of ``reference.attention``.

Letters: B batch, K kv heads, Hq query heads, S queries, T slots, D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_attn import reference
from sparse_attn.cache import KVCache
from sparse_attn.merge import merge

DEFAULT_KEY_TILE = 512


def dense_over_cache(q, cache: KVCache, positions, scale=None, *,
                     key_tile: int | None = DEFAULT_KEY_TILE, window: int | None = None):
  """Causal exact attention of ``q [B, Hq, S, D]`` at ``positions [B, S]`` over the cache.

  Keys are the valid slots (``slot < length``, ``pos >= 0``) whose position is at or before
  the query's. Equals ``reference.attention`` over the whole cache for any ``key_tile``.
  ``key_tile=None``, and any single-query call (``S == 1``: decode, where the loop's per-tile
  overhead outweighs the skipped empty slots), attends all ``T`` slots in one call.
  ``window`` (Mistral's sliding window) further restricts a query at position ``p`` to keys at
  positions ``> p - window``.

  Returns:
    ``out [B, Hq, S, D]`` (``q.dtype``) and ``lse [B, Hq, S]`` (float32).
  """
  t = cache.capacity
  if key_tile is not None and key_tile <= 0:
    raise ValueError(f"key_tile must be positive or None, got {key_tile}")
  if key_tile is None or t <= key_tile or q.shape[2] == 1:
    return reference.attention(q, cache.k, cache.v, scale=scale, kv_length=cache.length,
                               q_positions=positions, k_positions=cache.pos, window=window)
  b, hq, s, d = q.shape
  num_tiles = (jnp.max(cache.length) + key_tile - 1) // key_tile
  offsets = jnp.arange(key_tile, dtype=jnp.int32)

  def tile(i, acc):
    # The last tile is clamped to end at T; slots an earlier tile covered are masked out by
    # marking them empty (pos = -1), so no key is counted twice.
    start = jnp.minimum(i * key_tile, t - key_tile)
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, key_tile, axis=2)
    slots = start + offsets
    pos = jnp.where(slots >= i * key_tile, take(cache.pos), -1)
    part = reference.attention(q, take(cache.k), take(cache.v), scale=scale,
                               kv_length=cache.length - start, q_positions=positions,
                               k_positions=pos, window=window)
    return merge(acc, (part[0].astype(jnp.float32), part[1]))

  init = (jnp.zeros((b, hq, s, d), jnp.float32), jnp.full((b, hq, s), -jnp.inf, jnp.float32))
  out, lse = jax.lax.fori_loop(0, num_tiles, tile, init)
  return out.astype(q.dtype), lse
