"""Slots in token order: for the scorers that read the sequence, not the cache slots.

A cache row ``[B, K, T]`` holds its tokens in slots that need not follow the token order
(a compacted cache, a ring). LagKV's partitions and CUR's local windows are runs of consecutive
tokens, so they are computed on the slots sorted by position (empty slots last) and the scores
put back in slot order.
"""

from __future__ import annotations

import jax.numpy as jnp


def position_order(pos, valid):
  """``(idx, inv)`` ``[B, K, T]``: the slots sorted by token position (empty slots last, ties
  by slot) and the inverse permutation (``take(take(x, idx), inv) == x``)."""
  key = jnp.where(valid, pos, jnp.iinfo(jnp.int32).max)
  idx = jnp.argsort(key, axis=-1, stable=True)
  return idx, jnp.argsort(idx, axis=-1)


def take(x, idx):
  """``x [B, K, T, ...]`` gathered along ``T`` by ``idx [B, K, T]``."""
  idx = idx.reshape(idx.shape + (1,) * (x.ndim - idx.ndim))
  return jnp.take_along_axis(x, idx, axis=2)


def window_normalised(x, valid, width: int):
  """``x [B, K, T]`` (in token order, ``valid`` its filled slots) divided by its sum over each
  run of ``width`` consecutive slots (the last run partial); 0 where a run sums to 0."""
  b, k, t = x.shape
  runs = -(-t // width)
  x = jnp.where(valid, x, 0.0)
  padded = jnp.pad(x, ((0, 0), (0, 0), (0, runs * width - t))).reshape(b, k, runs, width)
  total = jnp.sum(padded, axis=-1, keepdims=True)
  out = jnp.where(total > 0, padded / jnp.where(total > 0, total, 1.0), 0.0)
  return out.reshape(b, k, runs * width)[:, :, :t]
