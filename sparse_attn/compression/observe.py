"""What scoring methods remember of the queries, and the exact attention they need.

Letters: B batch, K kv heads, G query heads per kv head, N = K G query heads, W window of
buffered queries, S chunk length, T cache slots, D head dim.

Efficient attention never materialises the attention matrix, so methods that score keys by
attention keep what they need in their state and recompute only that part:
  * a ring buffer of the last ``W`` queries and their token positions (SnapKV's observation
    window, Expected Attention's query statistics, TOVA's current query);
  * ``window_probs``: the softmax of those few queries over the cache (``W x T``, never ``T x T``);
  * ``column_sums``: H2O's accumulated attention of a prefill chunk, computed over query blocks
    and the key tiles each block can see, against the chunk's ``lse``, so only
    ``block x key_tile`` scores exist at a time; ``column_counts``: how many of those queries
    see each key (kvpress's observed attention divides by it).

On a soft-capped model (Gemma 2, ``softcap``) both recompute the capped logits
(``pallas_kernels.soft_cap``), the ones the attention's softmax and ``lse`` saw, and on a
sliding-window layer (``window``) they mask keys outside each query's window as its attention
did, so the weights they read are the model's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.key_tiles import (clamped_tile, seeable_positions, tile_first_positions,
                                     tiles_to_visit)
from pallas_kernels.softmax import soft_cap


def init_ring(batch: int, num_heads: int, window: int, head_dim: int):
  """An empty ring of ``window`` queries: ``{"buf" [B, W, N, D] f32, "pos" [B, W], "n" [B]}``."""
  return {"buf": jnp.zeros((batch, window, num_heads, head_dim), jnp.float32),
          "pos": jnp.full((batch, window), -1, jnp.int32),
          "n": jnp.zeros((batch,), jnp.int32)}


def ring_push(ring, x, positions, valid):
  """Appends the valid queries of a chunk, keeping the last ``W`` (oldest overwritten).

  Args:
    ring: as from ``init_ring``.
    x: ``[B, N, S, D]`` queries.
    positions: ``[B, S]`` int32 token positions.
    valid: ``[B, S]`` bool, which queries to record.

  Returns:
    The updated ring. Only the last ``W`` valid queries of the chunk are written, so no slot is
    written twice by one scatter.
  """
  w = ring["buf"].shape[1]
  nvalid = jnp.sum(valid, axis=-1, dtype=jnp.int32)  # [B]
  rank = jnp.cumsum(valid, axis=-1, dtype=jnp.int32) - 1  # [B, S]
  write = valid & (rank >= nvalid[:, None] - w)
  slot = jnp.where(write, (ring["n"][:, None] + rank) % w, w)
  bi = jnp.arange(x.shape[0])[:, None]
  xt = jnp.swapaxes(x, 1, 2).astype(jnp.float32)  # [B, S, N, D]
  buf = ring["buf"].at[bi, slot].set(xt, mode="drop")
  pos = ring["pos"].at[bi, slot].set(positions.astype(jnp.int32), mode="drop")
  return {"buf": buf, "pos": pos, "n": ring["n"] + nvalid}


def ring_filled(ring):
  """``[B, W]`` bool: the ring slots that hold a query."""
  w = ring["buf"].shape[1]
  return jnp.arange(w)[None, :] < jnp.minimum(ring["n"], w)[:, None]


def window_probs(qw, qpos, qvalid, k, kpos, kvalid, scale, softcap=None, window=None):
  """Causal softmax of a few queries over the cache.

  Args:
    qw: ``[B, W, N, D]`` queries (post-RoPE, as the keys).
    qpos: ``[B, W]`` their token positions.
    qvalid: ``[B, W]`` bool.
    k: ``[B, K, T, D]`` keys.
    kpos: ``[B, K, T]`` key token positions.
    kvalid: ``[B, K, T]`` bool.
    scale: softmax scale.
    softcap: attention-logit soft-cap (None = none).
    window: sliding window (keys at positions ``> qpos - window`` only; None = unlimited).

  Returns:
    ``[B, K, G, W, T]`` float32 attention probabilities (0 for invalid queries or keys).
  """
  b, w, n, d = qw.shape
  hkv = k.shape[1]
  qg = qw.reshape(b, w, hkv, n // hkv, d)
  # [B, K, G, W, T]
  logits = soft_cap(jnp.einsum("bwkgd,bktd->bkgwt", qg, k.astype(jnp.float32)) * scale,
                    softcap)
  mask = (kvalid[:, :, None, None, :] & qvalid[:, None, None, :, None]
          & (kpos[:, :, None, None, :] <= qpos[:, None, None, :, None]))
  if window is not None:
    mask &= kpos[:, :, None, None, :] > qpos[:, None, None, :, None] - window
  logits = jnp.where(mask, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
  den = jnp.sum(p, axis=-1, keepdims=True)
  return jnp.where(den > 0, p / jnp.where(den > 0, den, 1.0), 0.0)


def column_sums(q, positions, lse, k, kpos, kvalid, scale, block: int = 256,
                key_tile: int = 512, softcap=None, window=None):
  """Per-key attention mass summed over the chunk's queries (H2O's accumulated attention).

  Queries are taken ``block`` at a time and each block visits only the key tiles that hold a
  key it can see (tiles ``0 .. n-1``, ``n`` one past the last tile whose oldest filled slot is
  at or before the block's newest position, as ``pallas_kernels.chunk_attention`` bounds its
  tiles): a prefill chunk early in the prompt then scores its prefix, not the whole capacity.

  Args:
    q: ``[B, N, S, D]`` queries of the chunk.
    positions: ``[B, S]`` their token positions (-1 = padding).
    lse: ``[B, N, S]`` their log-sum-exp over the cache (from the attention that produced
      the outputs), so ``p = exp(scale q.k - lse)`` is exact without a second softmax.
    k: ``[B, K, T, D]``, kpos ``[B, K, T]``, kvalid ``[B, K, T]``: the cache.
    scale: softmax scale.
    block: static number of queries scored at a time.
    key_tile: static number of cache slots scored at a time.
    softcap: attention-logit soft-cap (None = none; ``lse`` is then over capped logits).
    window: sliding window (None = unlimited; ``lse`` is then over the window).

  Returns:
    ``[B, K, T]`` float32: ``sum_s mean_g p[g, s, t]`` (the group's heads averaged).
  """
  b, n, s, d = q.shape
  hkv, t = k.shape[1], k.shape[2]
  g = n // hkv
  nb = -(-s // block)
  pad = nb * block - s
  qp = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
  pp = jnp.pad(positions, ((0, 0), (0, pad)), constant_values=-1)
  lp = jnp.pad(lse, ((0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf)
  # [nb, B, K, G, blk, D], [nb, B, blk], [nb, B, K, G, blk]
  qb = jnp.moveaxis(qp.reshape(b, hkv, g, nb, block, d), 3, 0)
  pb = jnp.moveaxis(pp.reshape(b, nb, block), 1, 0)
  lb = jnp.moveaxis(lp.reshape(b, hkv, g, nb, block), 3, 0)
  kt = min(key_tile, t)
  seeable = seeable_positions(kpos, kvalid)  # [B, K, T]
  first = jnp.min(tile_first_positions(seeable, kt), axis=(0, 1))  # [NT] oldest per tile

  def one_block(acc, xs):
    qi, pi, li = xs
    live = (pi >= 0)[:, None, None, :] & jnp.isfinite(li)  # [B, K, G, blk]
    li = jnp.where(live, li, 0.0)

    def one_tile(i, acc):
      start, kp = clamped_tile(seeable, i, kt)  # [B, K, kt]
      take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, kt, axis=2)
      logits = soft_cap(
          jnp.einsum("bkgsd,bktd->bkgst", qi, take(k).astype(jnp.float32)) * scale, softcap)
      ok = live[..., None] & (kp[:, :, None, None, :] <= pi[:, None, None, :, None])
      if window is not None:
        ok &= kp[:, :, None, None, :] > pi[:, None, None, :, None] - window
      p = jnp.where(ok, jnp.exp(logits - li[..., None]), 0.0)
      return jax.lax.dynamic_update_slice_in_dim(
          acc, take(acc) + jnp.sum(p, axis=(2, 3)) / g, start, axis=2)

    visits = tiles_to_visit(first, jnp.max(pi))
    return jax.lax.fori_loop(0, visits, one_tile, acc), None

  acc, _ = jax.lax.scan(one_block, jnp.zeros((b, hkv, t), jnp.float32), (qb, pb, lb))
  return acc


def column_counts(positions, kpos, kvalid, window=None):
  """How many of a chunk's queries see each cache slot (the causal mask's column sums).

  Args:
    positions: ``[B, S]`` the queries' token positions (-1 = padding).
    kpos: ``[B, K, T]`` key token positions; kvalid ``[B, K, T]`` bool.
    window: sliding window (None = unlimited): a query sees keys ``> position - window``.

  Returns:
    ``[B, K, T]`` float32: the number of valid queries at or after each key's position (and
    within their window); 0 for empty slots.
  """
  s = positions.shape[1]
  # padding as -1 sorts first and is below every key position, so it never counts
  srt = jnp.sort(jnp.where(positions >= 0, positions, -1).astype(jnp.int32), axis=-1)
  at_or_after = lambda p: s - jax.vmap(
      lambda r, x: jnp.searchsorted(r, x.ravel(), side="left").reshape(x.shape))(srt, p)
  seen = at_or_after(kpos.astype(jnp.int32))
  if window is not None:
    seen -= at_or_after(kpos.astype(jnp.int32) + window)
  return jnp.where(kvalid, seen, 0).astype(jnp.float32)


__all__ = ["init_ring", "ring_push", "ring_filled", "window_probs", "column_sums",
           "column_counts"]
