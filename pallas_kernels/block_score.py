"""Quest block scoring: ``block_score``, ``block_score_pooled`` and their reference.

Quest (Tang et al. 2024, Eq. 1) bounds the logit of any key in block ``j`` by

  ``u_j = sum_d max(q_d * kmax_{j,d}, q_d * kmin_{j,d})``

from the block's per-channel bounding box. When ``kmin <= kmax`` (true of every digest the cache
keeps; empty blocks hold zeros) the max picks ``kmax`` where ``q_d >= 0`` and ``kmin`` elsewhere,
so ``u = relu(q) . kmax + min(q, 0) . kmin``: two tensor-core matmuls per tile. The reference
evaluates Eq. 1 literally. Scores are unscaled; blocks starting at or past ``length`` get ``-inf``.

Letters: B batch, K kv heads, G query heads per kv head, NB blocks, D head dim.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from pallas_kernels import _common

NEG_INF = float("-inf")


def block_score_reference(q, kmin, kmax, length, *, block_size: int):
  """Quest Eq. 1 in float32, literally.

  Args: as ``block_score``.

  Returns:
    ``[B, K, G, NB]`` float32.
  """
  q = q.astype(jnp.float32)[:, :, :, None, :]
  lo = kmin.astype(jnp.float32)[:, :, None]
  hi = kmax.astype(jnp.float32)[:, :, None]
  # [B, K, G, NB]
  score = jnp.sum(jnp.maximum(q * hi, q * lo), axis=-1)
  starts = jnp.arange(kmin.shape[2]) * block_size
  live = starts[None, :] < length[:, None]
  return jnp.where(live[:, None, None, :], score, NEG_INF)


def _score_kernel(q_ref, kmin_ref, kmax_ref, length_ref, out_ref, *, block_size: int, rows: int,
                  head_dim: int, num_blocks: int, block_nb: int):
  """One program: rows of one kv head against ``block_nb`` blocks."""
  rp, dp = _common.pad_rows(rows), _common.pad_rows(head_dim)
  row_ok = jnp.arange(rp) < rows
  col_ok = jnp.arange(dp) < head_dim
  first = pl.program_id(2) * block_nb
  # [NBt]
  blocks = first + jnp.arange(block_nb)
  blk_ok = blocks < num_blocks
  cols_at = pl.ds(0, dp)
  # [Rp, Dp]
  q = plgpu.load(q_ref.at[pl.ds(0, rp), cols_at], mask=row_ok[:, None] & col_ok[None, :],
                 other=0)
  # [NBt, Dp]
  digest_at = (pl.ds(first, block_nb), cols_at)
  digest_mask = blk_ok[:, None] & col_ok[None, :]
  lo = plgpu.load(kmin_ref.at[digest_at], mask=digest_mask, other=0)
  hi = plgpu.load(kmax_ref.at[digest_at], mask=digest_mask, other=0)
  cdt = jnp.promote_types(q.dtype, lo.dtype)
  precision = lax.Precision.HIGHEST if cdt == jnp.float32 else None
  q, lo, hi = q.astype(cdt), lo.astype(cdt), hi.astype(cdt)
  zero = jnp.zeros_like(q)
  # [Rp, NBt]
  score = (plgpu.dot(jnp.maximum(q, zero), hi, trans_b=True, precision=precision)
           + plgpu.dot(jnp.minimum(q, zero), lo, trans_b=True, precision=precision))
  live = (blocks * block_size < length_ref[()])[None, :]
  score = jnp.where(live, score.astype(jnp.float32), NEG_INF)
  plgpu.store(out_ref.at[pl.ds(0, rp), pl.ds(first, block_nb)], score,
              mask=row_ok[:, None] & blk_ok[None, :])


def _block_score_pallas(q, kmin, kmax, length, *, block_size: int, tiles: _common.TileConfig,
                        interpret: bool):
  b, kh, g, d = q.shape
  nb = kmin.shape[2]
  block_nb = min(tiles.block_nb, _common.pad_rows(nb))
  kernel = functools.partial(_score_kernel, block_size=block_size, rows=g, head_dim=d,
                             num_blocks=nb, block_nb=block_nb)
  head = lambda bi, hi, ji: (bi, hi, 0, 0)
  digest = pl.BlockSpec((None, None, nb, d), head)
  return pl.pallas_call(
      kernel,
      grid=(b, kh, pl.cdiv(nb, block_nb)),
      in_specs=[pl.BlockSpec((None, None, g, d), head), digest, digest,
                pl.BlockSpec((None,), lambda bi, hi, ji: (bi,))],
      out_specs=pl.BlockSpec((None, None, g, nb), head),
      out_shape=jax.ShapeDtypeStruct((b, kh, g, nb), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                           num_stages=tiles.num_stages),
      interpret=interpret,
      name="block_score",
  )(q, kmin, kmax, length.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("block_size", "impl", "interpret", "block_nb"))
def block_score(q, kmin, kmax, length, *, block_size: int, impl: str = "auto",
                interpret: bool = False, block_nb: int = 64):
  """Quest upper-bound scores of every block for every query head (Quest Eq. 1, unscaled).

  Args:
    q: ``[B, K, G, D]`` queries grouped by kv head.
    kmin, kmax: ``[B, K, NB, D]`` per-block channel minima / maxima (``kmin <= kmax``).
    length: ``[B]`` int32; blocks with ``block * block_size >= length`` score ``-inf``.
    block_size: tokens per block (static).
    impl: ``"pallas"``, ``"xla"`` (``block_score_reference``) or ``"auto"``.
    interpret: run the Pallas kernel in interpret mode.
    block_nb: blocks per program (static, a power of 2 >= 16).

  Returns:
    ``[B, K, G, NB]`` float32 scores.
  """
  if _common.resolve_impl(impl) == "xla":
    return block_score_reference(q, kmin, kmax, length, block_size=block_size)
  tiles = _common.TileConfig(block_nb=block_nb)
  return _block_score_pallas(q, kmin, kmax, length, block_size=block_size, tiles=tiles,
                             interpret=interpret)


def block_score_pooled_reference(q, kmin, kmax, length, *, block_size: int):
  """Eq. 1 with the group mean-pooled query (float32): ``[B, K, NB]``."""
  pooled = jnp.mean(q.astype(jnp.float32), axis=2, keepdims=True)
  return block_score_reference(pooled, kmin, kmax, length, block_size=block_size)[:, :, 0]


@functools.partial(jax.jit, static_argnames=("block_size", "impl", "interpret", "block_nb"))
def block_score_pooled(q, kmin, kmax, length, *, block_size: int, impl: str = "auto",
                       interpret: bool = False, block_nb: int = 64):
  """Quest scores for the group mean-pooled query (ReSA's group-shared block selection).

  Args: as ``block_score``.

  Returns:
    ``[B, K, NB]`` float32 scores of ``mean_g q[:, :, g]`` (pooled in float32).
  """
  if _common.resolve_impl(impl) == "xla":
    return block_score_pooled_reference(q, kmin, kmax, length, block_size=block_size)
  pooled = jnp.mean(q.astype(jnp.float32), axis=2, keepdims=True)
  tiles = _common.TileConfig(block_nb=block_nb)
  return _block_score_pallas(pooled, kmin, kmax, length, block_size=block_size, tiles=tiles,
                             interpret=interpret)[:, :, 0]
