"""Kernel dispatch: the one place where an op chooses its Pallas kernel or its jnp path.

One function per op that has a kernel (dense causal attention over the cache, block scores, the
sort-free top-k select, sparse decode, RESA's partials, retro's window partials). Each runs the
Pallas (Triton) kernel when ``impl`` resolves to ``"pallas"`` (``"auto"``: on a GPU backend) and
the selection is block-level, and its jnp path otherwise; the jnp paths
(``cache_attention.dense_over_cache``, ``sparse.attend_selection``, ``scoring.quest_scores``,
``prior_partials.masked_partials``) are the references the kernels are tested against.

Letters: B batch, K kv heads, N query heads, H selection heads, S queries per head, D head dim.
"""

from __future__ import annotations

import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import resolve_impl
from sparse_attn import scoring, selection, sparse
from sparse_attn.cache import KVCache
from sparse_attn.cache_attention import dense_over_cache
from sparse_attn import prior_partials
from sparse_attn.selection import Selection


def use_pallas(impl: str, sel: Selection | None, cache: KVCache) -> bool:
  """True when ``impl`` resolves to Pallas and ``sel`` lists whole cache blocks."""
  if resolve_impl(impl) != "pallas":
    return False
  return sel is None or sel.granularity == cache.block_size


def dense_attention(q, cache: KVCache, positions, scale=None, *, window: int | None = None,
                    impl: str = "xla", interpret: bool = False):
  """Exact causal attention of ``q [B, N, S, D]`` at ``positions [B, S]`` over the cache ->
  ``(out [B, N, S, D], lse [B, N, S])``: prefill chunks, rectification, dense decode.

  ``"pallas"``: ``pallas_kernels.chunk_attention`` (flash attention by token position, key
  tiles bounded by what the chunk can see); otherwise ``cache_attention.dense_over_cache``.
  """
  if resolve_impl(impl) != "pallas":
    return dense_over_cache(q, cache, positions, scale, window=window)
  return pallas_kernels.chunk_attention(q, cache.k, cache.v, positions, cache.pos, cache.length,
                                        scale=scale, window=window, impl="pallas",
                                        interpret=interpret)


def quest_scores(qs, cache: KVCache, *, impl: str = "xla", interpret: bool = False):
  """Quest's digest upper bounds of ``qs [B, H, D]`` for every block -> ``[B, H, N]``."""
  if not use_pallas(impl, None, cache):
    return scoring.quest_scores(qs, cache.kmin, cache.kmax)
  b, h, d = qs.shape
  qg = qs.reshape(b, cache.num_kv_heads, h // cache.num_kv_heads, d)
  s = pallas_kernels.block_score(qg, cache.kmin, cache.kmax, cache.length,
                                 block_size=cache.block_size, impl="pallas", interpret=interpret)
  return s.reshape(b, h, -1)


def top_ids(ranked, count, n_max: int, *, impl: str = "xla", interpret: bool = False):
  """Ids ``[B, H, n_max]`` whose first ``count [B]`` are the best of ``ranked [B, H, NB]``
  (``selection.rank_scores``): ``lax.top_k`` (a sort on GPUs) or the Pallas radix select."""
  if resolve_impl(impl) != "pallas":
    return selection.top_k_ids(ranked, count, n_max)
  b, h, nb = ranked.shape
  rows = jnp.broadcast_to(count[:, None], (b, h)).reshape(b * h)
  ids = pallas_kernels.block_select(ranked.reshape(b * h, nb), rows, n=n_max, impl="pallas",
                                    interpret=interpret)
  return ids.reshape(b, h, n_max)


def sparse_decode(q, cache: KVCache, sel: Selection, scale=None, *, impl: str = "xla",
                  interpret: bool = False):
  """Exact attention of ``q [B, N, D]`` over the selected entries -> ``(out [B, N, D], lse)``.

  ``impl``: ``"xla"`` (``sparse.attend_selection``), ``"pallas"`` (the Triton kernel; block
  selections only, token selections take the jnp path) or ``"auto"``; ``interpret`` runs the
  kernel in Pallas interpret mode.
  """
  if not use_pallas(impl, sel, cache):
    return sparse.attend_selection(q, cache, sel, scale)
  return pallas_kernels.sparse_decode(q, cache.k, cache.v, sel.idx, sel.n_valid, cache.length,
                                      block_size=cache.block_size, scale=scale, impl="pallas",
                                      interpret=interpret, pos=cache.pos)


def resa_partials(q, cache: KVCache, sel: Selection, prior, scale, *, impl: str = "xla",
                  interpret: bool = False):
  """RESA's true and prior partials of one query per head over the selection (RESA Eq. 3-5).

  Args:
    q: ``[B, N, D]``; prior: ``[B, N, T]`` prior logits (``-inf`` = not in the prior set).

  Returns:
    ``(out [B,N,D] f32, lse [B,N]), (prior_out, prior_lse), seen [B,N] int32`` (prior members
    attended).
  """
  kg, vg, ok, _ = sparse.gather_selection(cache, sel)
  pg = prior_partials.gather_prior(prior, sel)  # [B, H, R, L]
  if not use_pallas(impl, sel, cache):
    true, prior_part, seen, _ = prior_partials.masked_partials(q[:, :, None], kg, vg,
                                                              ok[:, :, None], pg, scale)
    squeeze = lambda pair: (pair[0][:, :, 0], pair[1][:, :, 0])
    return squeeze(true), squeeze(prior_part), seen[:, :, 0]
  out, lse, pout, plse = pallas_kernels.sparse_decode_resa(
      q, cache.k, cache.v, prior, sel.idx, sel.n_valid, cache.length,
      block_size=cache.block_size, scale=scale, impl="pallas", interpret=interpret,
      pos=cache.pos)
  seen = jnp.sum(ok[:, :, None] & jnp.isfinite(pg), -1).reshape(q.shape[:2])
  return (out.astype(jnp.float32), lse), (pout, plse), seen.astype(jnp.int32)


def window_partials(q, cache: KVCache, sel: Selection, use, positions, prior, scale, *,
                    impl: str = "xla", interpret: bool = False):
  """RetroAttention's partials of a window of queries over the newest query's selection.

  Args:
    q: ``[B, N, w, D]``; use: ``[B, H, w, n]`` which listed entries each query still lacks;
      positions: ``[B, w]`` (a key is attended only at or before its query); prior: RESA's
      ``[B, N, T]`` prior logits, or None.

  Returns:
    ``(out [B,N,w,D] f32, lse [B,N,w])``, the prior pair (None without a prior), ``seen`` and
    ``exposed`` ``[B,N,w]`` int32 (prior members / keys attended).
  """
  kg, vg, ok, pos_g = sparse.gather_selection(cache, sel)  # [B, H, L, ...]
  g = sel.granularity
  # [B, H, w, L]: listed, unseen by the query, and at or before it (the causal limit)
  ok_all = (ok[:, :, None] & jnp.repeat(use, g, axis=-1)
            & (pos_g[:, :, None, :] <= positions[:, None, :, None]))
  pg = None if prior is None else prior_partials.gather_prior(prior, sel)  # [B, H, R, L]
  if not use_pallas(impl, sel, cache):
    return prior_partials.masked_partials(q, kg, vg, ok_all, pg, scale)
  outs = pallas_kernels.sparse_decode_multiquery(
      q, cache.k, cache.v, sel.idx, sel.n_valid, use, positions, cache.length,
      block_size=g, scale=scale, impl="pallas", interpret=interpret, pos=cache.pos, prior=prior)
  b, n, w, _ = q.shape
  h = sel.idx.shape[1]
  exposed = jnp.repeat(jnp.sum(ok_all, -1), n // h, axis=1).astype(jnp.int32)
  true = (outs[0].astype(jnp.float32), outs[1])
  if prior is None:
    return true, None, jnp.zeros((b, n, w), jnp.int32), exposed
  # [B, H, R, w]: prior members each query attended
  seen = jnp.sum(ok_all[:, :, None] & jnp.isfinite(pg)[:, :, :, None, :], -1)
  return true, outs[2:], seen.reshape(b, n, w).astype(jnp.int32), exposed
