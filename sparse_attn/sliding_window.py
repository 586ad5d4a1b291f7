"""Mistral's sliding-window attention for decoding over a cache (Jiang et al. 2023, Sec. 2).

A query at position ``p`` attends only keys at positions ``p - window < pos <= p``. Prefill and
rectification chunks pass ``window`` to ``dense_over_cache`` (a per-query mask). A decode step
has one query position per row, so the window is applied once to the cache: ``visible`` marks
the slots before the window empty (``pos = -1``), and every path that respects empty slots
(dense attention, token selectors, the gathered sparse attention) then stays inside it; block
selectors also rank blocks without a visible slot last (``mask_block_scores``), so the budget
goes to blocks inside the window.

Letters: B batch, K kv heads, H selection heads (K or a multiple), NB blocks, T slots.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sparse_attn.cache import KVCache


def check_window(window) -> int:
  """``window`` as a positive int, or a ValueError."""
  if isinstance(window, bool) or not isinstance(window, int) or window < 1:
    raise ValueError(f"sliding_window must be a positive int, got {window!r}")
  return window


def visible(cache: KVCache, q_positions, window: int) -> KVCache:
  """The cache as seen by queries at ``q_positions [B]``: slots before the window emptied.

  Only ``pos`` changes (a view for attending; never write it back: the digests still cover the
  hidden keys, which is harmless for the upper-bound scores of Quest and ArkVale).
  """
  keep = cache.pos > (q_positions[:, None, None] - window)  # [B, K, T]
  return dataclasses.replace(cache, pos=jnp.where(keep, cache.pos, -1))


def mask_block_scores(scores, cache: KVCache):
  """``scores [B, H, NB]`` with blocks that hold no visible key of ``cache`` set to ``-inf``."""
  b, k, t = cache.pos.shape
  n = cache.num_blocks
  seen = jnp.any(cache.valid.reshape(b, k, n, t // n), axis=-1)  # [B, K, NB]
  seen = jnp.repeat(seen, scores.shape[1] // k, axis=1)  # head h reads kv head h // G
  return jnp.where(seen, scores, -jnp.inf)
