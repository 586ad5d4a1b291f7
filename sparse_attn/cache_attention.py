"""Exact causal attention of a query chunk over a KV cache, reading only the keys it can see.

Prefill and rectification attend a chunk of queries over the whole cache. The cache has a
static capacity ``T`` but holds only ``length`` tokens, and a causal query sees only keys at
or before its position, so attending all ``T`` slots with one ``[S, T]`` logits matrix wastes
work and, on CPU, memory bandwidth: the logits of a 512-query chunk over 2k keys are ~10 MB per
kv head group, and each of the softmax's passes streams them from DRAM. ``dense_over_cache``
works tile by tile instead (flash attention's schedule, Dao et al. 2022, Alg. 1, as XLA loops):

* a ``scan`` over **query tiles** of ``query_tile`` rows, so one tile's logits
  (``G * query_tile x key_tile`` floats, ~0.6 MB at the defaults) stay in cache through the
  matmul, the softmax and the second matmul (2x faster than one big call on a 2-core CPU);
* per query tile, a ``while_loop`` over **key tiles** of ``key_tile`` slots that stops after the
  last tile holding a key the tile can see: tile ``j`` is visited only if some valid slot in it
  holds a position ``<=`` the tile's newest query position (causal tile skipping bounded by the
  filled length; exact for any slot order, e.g. a compacted cache). The tiles' partial results
  combine exactly (an online softmax).

A single-query call (``S == 1``: decode, where the loops' overhead outweighs the skipped work)
or ``key_tile=None`` attends all ``T`` slots in one call of ``reference.attention``.

Letters: B batch, K kv heads, Hq query heads, S queries, T slots, D head dim, Q query tiles,
N key tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_attn import reference
from sparse_attn.cache import KVCache

DEFAULT_KEY_TILE = 256
DEFAULT_QUERY_TILE = 128
_NEVER = jnp.iinfo(jnp.int32).max


def dense_over_cache(q, cache: KVCache, positions, scale=None, *,
                     key_tile: int | None = DEFAULT_KEY_TILE,
                     query_tile: int = DEFAULT_QUERY_TILE, window: int | None = None):
  """Causal exact attention of ``q [B, Hq, S, D]`` at ``positions [B, S]`` over the cache.

  Keys are the valid slots (``slot < length``, ``pos >= 0``) whose position is at or before
  the query's. Equals ``reference.attention`` over the whole cache for any tile sizes.
  ``window`` (Mistral's sliding window) further restricts a query at position ``p`` to keys at
  positions ``> p - window``.

  Args:
    q: ``[B, Hq, S, D]`` queries; ``positions [B, S]`` their token positions (negative rows
      attend nothing).
    cache: the layer cache.
    scale: softmax scale (default ``1/sqrt(D)``).
    key_tile: slots per key tile (``None``: one call over all ``T`` slots).
    query_tile: queries per query tile.
    window: sliding-window length (``None``: full causal attention).

  Returns:
    ``out [B, Hq, S, D]`` (``q.dtype``) and ``lse [B, Hq, S]`` (float32).
  """
  if key_tile is not None and key_tile <= 0:
    raise ValueError(f"key_tile must be positive or None, got {key_tile}")
  if query_tile <= 0:
    raise ValueError(f"query_tile must be positive, got {query_tile}")
  b, hq, s, d = q.shape
  if key_tile is None or s == 1:
    return reference.attention(q, cache.k, cache.v, scale=scale, kv_length=cache.length,
                               q_positions=positions, k_positions=cache.pos, window=window)
  key_tile = min(key_tile, cache.capacity)
  first_pos = _first_position_per_tile(cache, key_tile)  # [N]
  qt = min(query_tile, s)
  num_q = -(-s // qt)
  pad = num_q * qt - s
  if pad:  # padded rows have position -1: they attend nothing and are cut off below
    q = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0)))
    positions = jnp.pad(positions, ((0, 0), (0, pad)), constant_values=-1)
  # [Q, B, Hq, qt, D], [Q, B, qt]
  q_tiles = q.reshape(b, hq, num_q, qt, d).transpose(2, 0, 1, 3, 4)
  pos_tiles = positions.reshape(b, num_q, qt).transpose(1, 0, 2)

  def one_query_tile(_, xs):
    qi, pi = xs
    return None, _attend_key_tiles(qi, pi, cache, first_pos, key_tile, scale, window)

  _, (out, lse) = jax.lax.scan(one_query_tile, None, (q_tiles, pos_tiles))
  out = out.transpose(1, 2, 0, 3, 4).reshape(b, hq, num_q * qt, d)[:, :, :s]
  lse = lse.transpose(1, 2, 0, 3).reshape(b, hq, num_q * qt)[:, :, :s]
  return out, lse


def _first_position_per_tile(cache: KVCache, key_tile: int):
  """``[N]`` int32: the smallest position held by a valid slot of key tile ``j`` (over batch
  and heads), ``int32 max`` for a tile with none. Tile ``j`` covers slots
  ``[j * key_tile, (j + 1) * key_tile)``, the last one cut at ``T``."""
  t = cache.capacity
  n = -(-t // key_tile)
  pos = jnp.where(cache.valid, cache.pos, _NEVER)
  pos = jnp.pad(pos, ((0, 0), (0, 0), (0, n * key_tile - t)), constant_values=_NEVER)
  return jnp.min(pos.reshape(-1, n, key_tile), axis=(0, 2))


def _attend_key_tiles(q, positions, cache: KVCache, first_pos, key_tile: int, scale, window):
  """One query tile ``q [B, Hq, qt, D]`` over the key tiles it can see -> ``(out, lse)``.

  Flash attention's online softmax (Dao et al. 2022, Alg. 1): a running row max ``m``, sum
  ``l`` and unnormalised output, rescaled by ``exp(m_old - m_new)`` per key tile.
  """
  b, hq, qt, d = q.shape
  t, hkv = cache.capacity, cache.num_kv_heads
  g = hq // hkv
  scale = reference.default_scale(d, scale)
  newest = jnp.max(positions)
  # Tiles past the last one holding a visible key contribute nothing: stop before them.
  tile_ids = jnp.arange(first_pos.shape[0], dtype=jnp.int32)
  num_tiles = jnp.max(jnp.where(first_pos <= newest, tile_ids + 1, 0))
  # Invalid slots get an unreachable position, so one comparison makes the mask; query rows
  # with a negative position see nothing.
  key_pos = jnp.where(cache.valid, cache.pos, _NEVER)  # [B, K, T]
  q_pos = jnp.where(positions >= 0, positions, -1)[:, None, None, :, None]  # [B, 1, 1, qt, 1]
  qg = (q.astype(jnp.float32) * scale).reshape(b, hkv, g * qt, d)  # [B, K, G*qt, D]
  offsets = jnp.arange(key_tile, dtype=jnp.int32)

  def tile(i, carry):
    acc, m, l = carry
    # The last tile is clamped to end at T; slots an earlier tile covered are masked out.
    start = jnp.minimum(i * key_tile, t - key_tile)
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, key_tile, axis=2)
    kpos = jnp.where(start + offsets >= i * key_tile, take(key_pos), _NEVER)
    see = kpos[:, :, None, None, :] <= q_pos  # [B, K, 1, qt, kt]
    if window is not None:
      see &= kpos[:, :, None, None, :] > q_pos - window
    # [B, K, G, qt, kt]
    logits = jnp.einsum("bkmd,bktd->bkmt", qg, take(cache.k),
                        preferred_element_type=jnp.float32).reshape(b, hkv, g, qt, key_tile)
    logits = jnp.where(see, logits, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(logits - m_safe[..., None])
    rescale = jnp.exp(m - m_safe)  # 0 while m = -inf
    l = l * rescale + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkmt,bktd->bkmd", p.reshape(b, hkv, g * qt, key_tile),
                    take(cache.v).astype(jnp.float32)).reshape(b, hkv, g, qt, d)
    return acc * rescale[..., None] + pv, m_new, l

  init = (jnp.zeros((b, hkv, g, qt, d), jnp.float32),
          jnp.full((b, hkv, g, qt), -jnp.inf, jnp.float32), jnp.zeros((b, hkv, g, qt), jnp.float32))
  acc, m, l = jax.lax.fori_loop(0, num_tiles, tile, init)
  seen = l > 0
  safe_l = jnp.where(seen, l, 1.0)
  out = jnp.where(seen[..., None], acc / safe_l[..., None], 0.0)
  lse = jnp.where(seen, m + jnp.log(safe_l), -jnp.inf)
  return out.reshape(b, hq, qt, d).astype(q.dtype), lse.reshape(b, hq, qt)
