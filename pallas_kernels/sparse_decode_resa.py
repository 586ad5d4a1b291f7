"""Sparse decode fused with RESA's prior accumulation: ``sparse_decode_resa`` and its reference.

RESA (residual estimation) completes a sparse attention with a rank-1 estimate of the unselected
keys: a prior logit ``P_j`` per slot, its total mass ``Z`` and prior-weighted value ``O_est``. To
remove the selected positions from the estimate (RESA Eq. 4-5) the aggregator needs, over the
same selected set ``I``, the prior's own softmax statistics

  ``prior_lse = log sum_{j in I} e^{P_j}``,  ``prior_out = sum_{j in I} e^{P_j} v_j / e^{prior_lse}``.

The kernel accumulates them in the same pass as the attention itself (same blocks, same V loads),
online and max-shifted, split-K combined like the main path. Its outputs are partials that RESA
merges, all float32.

Letters: B batch, N query heads, K kv heads, H selection heads, n list length, T slots, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels._decode_kernel import decode_partials
from pallas_kernels.softmax import check_softcap, default_scale
from pallas_kernels.sparse_decode import (gather_listed, gather_prior, gathered_partials,
                                          checked_lists, selection_rows)


def sparse_decode_resa_reference(q, k, v, prior, block_idx, n_valid, length, *, block_size: int,
                                 scale: float | None = None, pos=None, epilogue=None,
                                 extras=(), softcap: float | None = None, query_pos=None):
  """Plain-jnp RESA-fused sparse decode (the ``impl="xla"`` path): gather the listed blocks and
  priors, one float32 softmax over the true and prior logits (``gathered_partials``). Any
  ``block_size`` dividing ``T`` (1: token lists).

  Args: as ``sparse_decode_resa``.

  Returns:
    ``(out [B, N, D], lse [B, N], prior_out [B, N, D], prior_lse [B, N])`` float32, ``seen
    [B, N]`` int32.
  """
  _, hq, d = q.shape
  selection_rows(hq, k.shape[1], block_idx.shape[1])
  length = _common.attended_length(length, query_pos)
  kg, vg, ok, _ = gather_listed(k, v, block_idx, n_valid, length, block_size, pos)
  (out, lse), (p_out, p_lse, seen) = gathered_partials(
      q[:, :, None], kg, vg, ok[:, :, None], gather_prior(prior, block_idx, block_size),
      scale=default_scale(d, scale), softcap=check_softcap(softcap))
  return _finish((out[:, :, 0], lse[:, :, 0]), (p_out[:, :, 0], p_lse[:, :, 0]), seen[:, :, 0],
                 epilogue, extras, query_pos)


def _finish(true, prior_seen, seen, epilogue, extras, query_pos=None):
  """The partials as they are, or the epilogue's ``(out, lse)`` with padding rows empty (their
  partials are empty already: they attended nothing)."""
  if epilogue is None:
    return (*true, *prior_seen, seen)
  return _common.empty_padding_rows(*epilogue(true, prior_seen, seen, *extras), query_pos)


def attends_nothing(q, epilogue, extras, query_pos=None):
  """What every backend returns when no block is listed: both partials ``0`` / ``-inf`` and
  ``seen`` 0 for each ``[B, N]`` row (through ``epilogue`` if one is given; padding rows of
  ``query_pos`` empty)."""
  b, hq, d = q.shape
  zeros, empty = jnp.zeros((b, hq, d), jnp.float32), jnp.full((b, hq), -jnp.inf, jnp.float32)
  return _finish((zeros, empty), (zeros, empty), jnp.zeros((b, hq), jnp.int32), epilogue, extras,
                 query_pos)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "num_splits", "impl",
                                             "interpret", "num_warps", "num_stages",
                                             "blocks_per_iter", "epilogue", "softcap"))
def sparse_decode_resa(q, k, v, prior, block_idx, n_valid, length, *, block_size: int,
                       scale: float | None = None, num_splits: int | None = None,
                       impl: _common.Impl = "auto", interpret: bool = False, num_warps: int = 4,
                       num_stages: int = 3, blocks_per_iter: int | None = None, pos=None,
                       epilogue=None, extras=(), softcap: float | None = None, query_pos=None):
  """``sparse_decode`` plus RESA's prior statistics over the same selected positions.

  Args:
    q: ``[B, N, D]`` queries.
    k, v: ``[B, K, T, D]`` cache.
    prior: ``[B, N, T]`` float32 RESA prior logits ``P_j`` (already scaled) of every slot.
    block_idx: ``[B, H, n]`` int32, ``H`` = K (group-shared) or N (per query head).
    n_valid: ``[B, H]`` int32; ``length``: ``[B]`` int32.
    pos: optional ``[B, K, T]`` int32 token position held by each slot (``KVCache.pos``; -1 =
      empty, never attended: a compacted cache has such holes below ``length``). None: every
      slot below ``length`` holds a token.
    block_size, scale, num_splits, impl, interpret, num_warps, num_stages, blocks_per_iter: as
      ``sparse_decode`` (``"mosaic"``: ``pallas_kernels.mosaic.sparse_decode_resa``).
    epilogue: optional hashable ``f((out, lse), (prior_out, prior_lse), seen, *extras) ->
      (out, lse)`` of elementwise jnp ops over rows (RESA's aggregator): the Pallas path runs
      it inside the split combine, the reference after; the op then returns its ``(out, lse)``.
    extras: the epilogue's per-head inputs, each ``[B, N]`` or ``[B, N, D]``.
    softcap: attention-logit soft-cap of the true logits (static, ``sparse_decode``'s); the
      prior logits are taken as given.
    query_pos: optional ``[B]`` int32 as ``sparse_decode``'s: a padding row attends nothing
      (empty partials, ``seen`` 0) and the epilogue's result for it is empty too (the Pallas
      path's split combine applies it).

  Returns:
    ``(out [B, N, D], lse [B, N])`` as ``sparse_decode`` (out in float32: a partial), and
    ``prior_out [B, N, D]``, ``prior_lse [B, N]``: the softmax of ``P_j`` over the attended
    positions applied to ``v`` and its log-sum-exp (``0`` / ``-inf`` when empty); all float32;
    and ``seen [B, N]`` int32, the prior members (finite ``P_j``) attended, counted in the same
    pass and summed by the split combine (RESA's test that the selection covered the prior).
  """
  resolved = _common.resolve_impl(impl, _common.list_op("sparse_decode_resa", block_size))
  if resolved == "xla":
    return sparse_decode_resa_reference(q, k, v, prior, block_idx, n_valid, length,
                                        block_size=block_size, scale=scale, pos=pos,
                                        epilogue=epilogue, extras=extras, softcap=softcap,
                                        query_pos=query_pos)
  if resolved == "mosaic":
    from pallas_kernels import mosaic  # pylint: disable=import-outside-toplevel (imports us)
    return mosaic.sparse_decode_resa(q, k, v, prior, block_idx, n_valid, length,
                                     block_size=block_size, scale=scale, num_splits=num_splits,
                                     impl="mosaic", interpret=interpret, num_stages=num_stages,
                                     pos=pos, epilogue=epilogue, extras=extras, softcap=softcap,
                                     query_pos=query_pos)
  softcap, lists = checked_lists(q, k, block_idx, n_valid, block_size, softcap)
  b, hq, d = q.shape
  hkv = k.shape[1]
  if lists is None:
    return attends_nothing(q, epilogue, extras, query_pos)
  idx, nv, bits = lists
  tiles = _common.TileConfig(num_warps=num_warps, num_stages=num_stages, num_splits=num_splits,
                             blocks_per_iter=blocks_per_iter)
  g = hq // hkv
  heads = lambda x: x.reshape(b, hkv, g, *x.shape[2:])  # [B, N, ...] -> [B, K, G, ...]
  got = decode_partials(
      q.reshape(b, hkv, g, d), k, v, idx, nv, length, pos=pos,
      prior=prior.reshape(b, hkv, g, -1),
      row_bits=bits, bits_per_word=g,
      block_size=block_size, scale=default_scale(d, scale), tiles=tiles, interpret=interpret,
      epilogue=epilogue, extras=tuple(map(heads, extras)), softcap=softcap,
      query_pos=query_pos)
  if epilogue is not None:
    return got[0].reshape(b, hq, d), got[1].reshape(b, hq)
  out, lse, p_out, p_lse, seen = got
  return (out.reshape(b, hq, d), lse.reshape(b, hq), p_out.reshape(b, hq, d),
          p_lse.reshape(b, hq), seen.reshape(b, hq))
