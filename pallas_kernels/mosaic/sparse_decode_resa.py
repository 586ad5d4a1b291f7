"""Sparse decode fused with RESA's prior accumulation on Mosaic GPU (Hopper):
``sparse_decode_resa``.

The Mosaic GPU twin of ``pallas_kernels.sparse_decode_resa`` (same signature, same reference,
``sparse_decode_resa_reference``): the Mosaic ``sparse_decode`` program (one warpgroup per
(batch, kv head, split), listed blocks TMA'd into an SMEM ring) with its ``with_prior`` path.
Beside each step's K/V tiles the ring holds the step's ``[R, W]`` prior logits ``P_j`` of the
listed slots (gathered in XLA in list order, so a step is one 128-byte-aligned TMA). With
16-bit caches the step's WGMMAs carry them in the 64-row tile's free rows (row ``R + r``: query
row ``r``'s prior logits), so one online softmax and one ``P V`` serve both pairs; with f32
caches each row runs a second CUDA-core online softmax over ``P_j`` with the same V tile. Both
count the attended members. The split partials (true, prior, counts) are merged, and RESA's
epilogue run, by ``split_combine_pairs``' jnp path.

Letters: B batch, N query heads, K kv heads, G = N // K, H selection heads, n list length, T
slots, D head dim, R rows of a program (G), W tokens per step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.mosaic.sparse_decode import decode_partials
from pallas_kernels.softmax import default_scale
from pallas_kernels.sparse_decode import checked_lists
from pallas_kernels.sparse_decode_resa import attends_nothing, sparse_decode_resa_reference


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "num_splits", "impl",
                                             "interpret", "num_warps", "num_stages",
                                             "blocks_per_iter", "epilogue", "softcap"))
def sparse_decode_resa(q, k, v, prior, block_idx, n_valid, length, *, block_size: int,
                       scale: float | None = None, num_splits: int | None = None,
                       impl: _common.Impl = "auto", interpret=False, num_warps: int = 4,
                       num_stages: int = 3, blocks_per_iter: int | None = None, pos=None,
                       epilogue=None, extras=(), softcap: float | None = None, query_pos=None):
  """``sparse_decode`` plus RESA's prior statistics over the same selected positions (Mosaic
  GPU kernel).

  Args: as ``pallas_kernels.sparse_decode_resa``:
    q: ``[B, N, D]``; k, v: ``[B, K, T, D]``; prior: ``[B, N, T]`` float32 ``P_j`` (-inf: not
      a prior member); block_idx ``[B, H, n]`` (``H`` = K or N); n_valid ``[B, H]``; length
      ``[B]``; pos: optional ``[B, K, T]`` int32 (-1 = empty).
    block_size: static, a power of 2 >= 16; scale, num_splits, num_stages, softcap: as the
      Mosaic ``sparse_decode``; num_warps, blocks_per_iter: accepted for the signature.
    impl: ``"xla"`` runs ``sparse_decode_resa_reference``; any other value the Mosaic kernel.
    interpret: False (lower for the GPU), True (Mosaic GPU interpret mode on the CPU, race
      detection on) or an ``InterpretGPUParams``.
    epilogue, extras: RESA's aggregator and its per-head inputs, run after the split merge.
    query_pos: optional ``[B]`` int32: a padding row (negative) attends nothing and comes out
      empty, the epilogue's result included.

  Returns:
    ``(out, lse, prior_out, prior_lse)`` float32 (``[B, N, D]`` / ``[B, N]``) and ``seen
    [B, N]`` int32; with an ``epilogue``, its ``(out, lse)``.
  """
  del num_warps, blocks_per_iter
  if impl == "xla":
    return sparse_decode_resa_reference(q, k, v, prior, block_idx, n_valid, length,
                                        block_size=block_size, scale=scale, pos=pos,
                                        epilogue=epilogue, extras=extras, softcap=softcap,
                                        query_pos=query_pos)
  softcap, lists = checked_lists(q, k, block_idx, n_valid, block_size, softcap)
  b, hq, d = q.shape
  hkv = k.shape[1]
  if lists is None:
    return attends_nothing(q, epilogue, extras, query_pos)
  idx, nv, bits = lists
  g = hq // hkv
  heads = lambda x: x.reshape(b, hkv, g, *x.shape[2:])  # [B, N, ...] -> [B, K, G, ...]
  got = decode_partials(
      heads(q), k, v, idx, nv, length, pos=pos,
      row_bits=None if bits is None else bits[..., 0], prior=heads(prior),
      block_size=block_size, scale=default_scale(d, scale), num_splits=num_splits,
      num_stages=num_stages, softcap=softcap, interpret=interpret, epilogue=epilogue,
      extras=tuple(map(heads, extras)), query_pos=query_pos)
  if epilogue is not None:
    return got[0].reshape(b, hq, d), got[1].reshape(b, hq)
  out, lse, p_out, p_lse, seen = got
  return (out.reshape(b, hq, d), lse.reshape(b, hq), p_out.reshape(b, hq, d),
          p_lse.reshape(b, hq), seen.reshape(b, hq))
