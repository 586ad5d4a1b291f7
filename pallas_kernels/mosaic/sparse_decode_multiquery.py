"""Multi-query sparse decode for RetroAttention on Mosaic GPU (Hopper):
``sparse_decode_multiquery``.

The Mosaic GPU twin of ``pallas_kernels.sparse_decode_multiquery`` (same signature, same
reference, ``sparse_decode_multiquery_reference``): the Mosaic ``sparse_decode`` program (one
warpgroup per (batch, kv head, split), listed blocks TMA'd into an SMEM ring, CUDA-core f32
online softmax per query row) with its ``with_limit`` path. The W window queries of the G heads
of a kv head are the program's R = G x W rows, so each listed block is read once for all of
them. Row ``g * W + w`` may use entry ``e`` iff bit ``w`` of the entry's word for head ``g``
is set (``block_mask``; the union's per-head words for per-head lists), and only slots whose
token position is ``<= q_limit[w]`` (the slot index, or with ``pos`` each step's listed-slot
positions, gathered in XLA in list order and TMA'd beside K/V). With RESA's ``prior`` the W rows
of a head share its prior row (one ``[G, W]`` prior tile per step). Groups of more than
``64 // W`` heads run as several launches of at most 64 rows each (whole heads).

Letters: B batch, N query heads, K kv heads, G = N // K, H selection heads, W window queries,
n list length, T slots, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.mosaic import _common as mc
from pallas_kernels.mosaic.sparse_decode import decode_partials
from pallas_kernels.softmax import default_scale
from pallas_kernels.sparse_decode_multiquery import (checked, entry_lists, merge_carry,
                                                     sparse_decode_multiquery_reference)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "num_splits", "impl",
                                             "interpret", "num_warps", "num_stages",
                                             "blocks_per_iter", "softcap", "count_attended"))
def sparse_decode_multiquery(q, k, v, block_idx, n_valid, block_mask, q_limit, length, *,
                             block_size: int, scale: float | None = None,
                             num_splits: int | None = None, impl: _common.Impl = "auto",
                             interpret=False, num_warps: int = 4, num_stages: int = 3,
                             blocks_per_iter: int | None = None, pos=None, prior=None,
                             softcap: float | None = None, count_attended: bool = False,
                             carry_in=None):
  """Sparse decode of W queries per head over one shared block list (Mosaic GPU kernel).

  Args: as ``pallas_kernels.sparse_decode_multiquery``:
    q: ``[B, N, W, D]`` queries (W <= 32); k, v: ``[B, K, T, D]`` cache.
    block_idx: ``[B, H, n]`` int32 (``H`` = K or N); n_valid: ``[B, H]`` int32.
    block_mask: ``[B, H, W, n]`` bool, query ``w`` may use listed block ``i``.
    q_limit: ``[B, W]`` int32, query ``w`` attends positions ``<= q_limit[b, w]`` only.
    length: ``[B]`` int32; pos: optional ``[B, K, T]`` int32 (-1 = empty slot).
    prior: optional ``[B, N, T]`` float32 RESA prior logits, shared by a head's W queries.
    count_attended: static; also return the keys each query attended.
    carry_in: optional ``[(out [B, N, W, D], lse [B, N, W])]`` partials, one per output
      pair, merged into the outputs as one more split of the kernel's (XLA) split merge.
    block_size: static, a power of 2 >= 16; scale, num_splits, num_stages, softcap: as the
      Mosaic ``sparse_decode``; num_warps, blocks_per_iter: accepted for the signature.
    impl: ``"xla"`` runs ``sparse_decode_multiquery_reference``; any other value the Mosaic
      kernel.
    interpret: False (lower for the GPU), True (Mosaic GPU interpret mode on the CPU, race
      detection on) or an ``InterpretGPUParams``.

  Returns:
    ``out [B, N, W, D]`` and ``lse [B, N, W]`` float32 partials (``0`` / ``-inf`` for a query
    that attends nothing); with ``prior`` also ``prior_out``, ``prior_lse`` (float32) and
    ``seen [B, N, W]`` int32; with ``count_attended`` then ``attended [B, N, W]`` int32.
  """
  del num_warps, blocks_per_iter
  if impl == "xla":
    return sparse_decode_multiquery_reference(q, k, v, block_idx, n_valid, block_mask, q_limit,
                                              length, block_size=block_size, scale=scale,
                                              pos=pos, prior=prior, softcap=softcap,
                                              count_attended=count_attended, carry_in=carry_in)
  softcap, empty = checked(q, k, block_idx, prior, block_size, softcap, count_attended)
  if empty is not None:
    return merge_carry(empty, carry_in)
  b, hq, w, d = q.shape
  hkv = k.shape[1]
  g = hq // hkv
  # row_bits [B, K, U, 1 or G]: row g * W + w reads bit w of word min(g, A - 1)
  idx, nv, row_bits = entry_lists(block_idx, n_valid, block_mask, hq, hkv,
                                  k.shape[2] // block_size)
  heads = lambda x: x.reshape(b, hkv, g, *x.shape[2:])  # [B, N, ...] -> [B, K, G, ...]
  per_launch = max(1, mc.TILE_ROWS // w)  # whole heads, at most 64 rows
  parts = []
  for g0 in range(0, g, per_launch):
    gs = slice(g0, min(g, g0 + per_launch))
    gc = gs.stop - g0
    rows = lambda x, gc=gc: x.reshape(b, hkv, gc * w, *x.shape[4:])  # [B, K, gc, W, ...]
    limit = jnp.broadcast_to(q_limit[:, None, None, :], (b, hkv, gc, w))
    carry = None if carry_in is None else [tuple(rows(heads(x)[:, :, gs]) for x in pair)
                                           for pair in carry_in]
    parts.append(decode_partials(
        rows(heads(q)[:, :, gs]), k, v, idx, nv, length, pos=pos,
        row_bits=row_bits if row_bits.shape[-1] == 1 else row_bits[..., gs],
        prior=None if prior is None else heads(prior)[:, :, gs], row_limit=rows(limit),
        block_size=block_size, scale=default_scale(d, scale), num_splits=num_splits,
        num_stages=num_stages, softcap=softcap, interpret=interpret, bits_per_word=w,
        rows_per_prior=w, count_attended=count_attended, carry_in=carry))
  def merged(*xs):  # [B, K, gc * W, ...] per launch -> [B, N, W, ...]
    xs = [x.reshape(b, hkv, -1, w, *x.shape[3:]) for x in xs]
    return jnp.concatenate(xs, axis=2).reshape(b, hq, w, *xs[0].shape[4:])
  return tuple(merged(*xs) for xs in zip(*parts))
