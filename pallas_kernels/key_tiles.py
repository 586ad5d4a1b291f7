"""Which key tiles a query can see, for loops that skip the tiles it cannot.

A cache slot holds a key at a token position (``k_pos``; -1 = empty) and only slots below the
cache ``length`` are filled; a query at position ``p`` sees a filled slot whose position is at
or before ``p``. Slots nothing attends read ``NEVER`` (``seeable_positions``), so a tile's
smallest entry (``tile_first_positions``) says whether any query up to a position needs it, for
any slot order (a compacted cache is not position-sorted). Used by ``chunk_attention`` (its
kernel's tile counts and its reference's loop) and by H2O's column sums
(``sparse_attn.compression.observe``).

Letters: B batch, K kv heads, T slots, NT key tiles.
"""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp

NEVER = jnp.iinfo(jnp.int32).max  # a slot position no query reaches (an empty or invalid slot)


def seeable_positions(k_pos, filled):
  """``[B, K, T]`` int32: ``k_pos`` where the slot is ``filled`` (bool, broadcastable) and
  holds a token, else ``NEVER``."""
  return jnp.where(filled & (k_pos >= 0), k_pos, NEVER)


def below_length(length, t: int):
  """``[B, 1, T]`` bool: the slots below each row's cache ``length [B]``."""
  return jnp.arange(t)[None, None, :] < length[:, None, None]


def tile_first_positions(key_pos, key_tile: int):
  """``[B, K, NT]`` int32: the smallest position in each ``key_tile``-slot tile of
  ``key_pos [B, K, T]`` (``seeable_positions``); the last tile padded with ``NEVER``."""
  b, k, t = key_pos.shape
  nt = -(-t // key_tile)
  padded = jnp.pad(key_pos, ((0, 0), (0, 0), (0, nt * key_tile - t)), constant_values=NEVER)
  return jnp.min(padded.reshape(b, k, nt, key_tile), axis=-1)


def tiles_to_visit(first_pos, newest):
  """Tiles ``0 .. n-1`` a query at position ``newest`` must visit, for ``first_pos [..., NT]``
  (``tile_first_positions``, or its minimum over batch and heads for one bound) and ``newest``
  broadcastable to ``[...]``: ``n [...]`` int32 is one past the last tile whose smallest
  position it can see (tiles past it hold nothing it sees)."""
  ids = jnp.arange(1, first_pos.shape[-1] + 1, dtype=jnp.int32)
  return jnp.max(jnp.where(first_pos <= jnp.expand_dims(newest, -1), ids, 0), axis=-1)


def clamped_tile(key_pos, i, key_tile: int):
  """``(start, key_pos tile)`` of tile ``i``: the last tile is clamped to end at ``T`` and its
  slots an earlier tile covered read ``NEVER``, so no slot counts twice."""
  t = key_pos.shape[-1]
  start = jnp.minimum(i * key_tile, t - key_tile)
  offsets = jnp.arange(key_tile, dtype=jnp.int32)
  tile = lax.dynamic_slice_in_dim(key_pos, start, key_tile, axis=2)
  return start, jnp.where(start + offsets >= i * key_tile, tile, NEVER)
