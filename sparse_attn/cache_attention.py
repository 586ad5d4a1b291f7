"""Exact causal attention of a query chunk over a ``KVCache`` on the jnp path.

``dense_over_cache`` is ``pallas_kernels.chunk_attention_reference`` (query tiles x the key
tiles each can see, flash attention's schedule as XLA loops) over the cache's arrays; use
``kernels.dense_attention`` to choose between it and the Pallas kernel by ``impl``.

Letters: B batch, Hq query heads, S queries, D head dim.
"""

from __future__ import annotations

from pallas_kernels.chunk_attention import (REF_KEY_TILE, REF_QUERY_TILE,
                                            chunk_attention_reference)
from sparse_attn.cache import KVCache


def dense_over_cache(q, cache: KVCache, positions, scale=None, *,
                     key_tile: int | None = REF_KEY_TILE, query_tile: int = REF_QUERY_TILE,
                     window: int | None = None, softcap: float | None = None):
  """Causal exact attention of ``q [B, Hq, S, D]`` at ``positions [B, S]`` over the cache.

  Keys are the valid slots (``slot < length``, ``pos >= 0``) whose position is at or before
  the query's (and, with Mistral's sliding ``window``, after ``position - window``); equals
  one masked softmax over the whole cache for any tile sizes.

  Args:
    q: ``[B, Hq, S, D]`` queries; positions: ``[B, S]`` their token positions (negative rows
      attend nothing).
    cache: the layer cache.
    scale: softmax scale (default ``1/sqrt(D)``).
    key_tile: slots per key tile (``None``: one call over all ``T`` slots).
    query_tile: queries per query tile.
    window: sliding-window length (``None``: full causal attention).
    softcap: attention-logit soft-cap (Gemma 2, ``pallas_kernels.soft_cap``), None = none.

  Returns:
    ``out [B, Hq, S, D]`` (``q.dtype``) and ``lse [B, Hq, S]`` (float32).
  """
  return chunk_attention_reference(q, cache.k, cache.v, positions, cache.pos, cache.length,
                                   scale=scale, window=window, key_tile=key_tile,
                                   query_tile=query_tile, softcap=softcap)
