"""Quest block scoring: ``block_score``, ``block_score_pooled`` and their reference.

Quest (Tang et al. 2024, Eq. 1) bounds the logit of any key in block ``j`` by

  ``u_j = sum_d max(q_d * kmax_{j,d}, q_d * kmin_{j,d})``

from the block's per-channel bounding box. When ``kmin <= kmax`` (true of every digest the cache
keeps; empty blocks hold zeros) the max picks ``kmax`` where ``q_d >= 0`` and ``kmin`` elsewhere,
so ``u = relu(q) . kmax + min(q, 0) . kmin``: two matmuls per tile, on tensor cores in the kernel
and in float32 (never TF32) in the reference, so that both paths pick the same blocks at a
near-tie. Scores are unscaled; blocks starting at or past ``length`` get ``-inf``.

Letters: B batch, K kv heads, G query heads per kv head, NB blocks, D head dim.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.backends import triton_module

plgpu = triton_module()  # jax.experimental.pallas.triton; see backends

NEG_INF = float("-inf")


def _as_f32(x):
  """``x`` in float32, rounded to its own dtype first: on a GPU XLA may drop a round trip
  through a narrower float (``xla_allow_excess_precision``), so a query pooled in float32 and
  cast to bfloat16 upstream would reach the dots unrounded here while the kernel reads the
  rounded array (5e-4 relative apart on an H100)."""
  if x.dtype == jnp.float32 or not jnp.issubdtype(x.dtype, jnp.floating):
    return x.astype(jnp.float32)
  info = jnp.finfo(x.dtype)
  return lax.reduce_precision(x.astype(jnp.float32), exponent_bits=info.nexp,
                              mantissa_bits=info.nmant)


def block_score_reference(q, kmin, kmax, length, *, block_size: int):
  """Quest Eq. 1 as ``relu(q) . kmax + min(q, 0) . kmin`` in float32: the jnp path
  (``impl="xla"``).

  Args: as ``block_score``.

  Returns:
    ``[B, K, G, NB]`` float32.
  """
  q = _as_f32(q)
  exact = dict(preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
  # [B, K, G, NB]
  score = (jnp.einsum("bkgd,bknd->bkgn", jnp.maximum(q, 0.0), _as_f32(kmax), **exact)
           + jnp.einsum("bkgd,bknd->bkgn", jnp.minimum(q, 0.0), _as_f32(kmin), **exact))
  starts = jnp.arange(kmin.shape[2]) * block_size
  live = starts[None, :] < length[:, None]
  return jnp.where(live[:, None, None, :], score, NEG_INF)


def query_halves(q_ref, rows: int, head_dim: int, digest_dtype, *, pool: bool = False):
  """The kernel's query tile ``[Rp, Dp]`` split as ``(relu(q), min(q, 0))`` in the dots' dtype,
  and the dots' precision: what ``tile_scores`` multiplies the digests by.

  ``pool``: the ``rows`` query rows are averaged first (float32, rounded to the queries'
  dtype, as ``pooled_query``), and the tile holds that one row (the others zero)."""
  rp, dp = _common.pad_rows(rows), _common.pad_rows(head_dim)
  row_ok = jnp.arange(rp) < rows
  col_ok = jnp.arange(dp) < head_dim
  # [Rp, Dp]
  q = plgpu.load(q_ref.at[pl.ds(0, rp), pl.ds(0, dp)], mask=row_ok[:, None] & col_ok[None, :],
                 other=0)
  if pool:
    # [Dp]: masked rows loaded as zeros add nothing to the sum
    mean = (jnp.sum(q.astype(jnp.float32), axis=0) / rows).astype(q.dtype)
    first = jnp.arange(_common.pad_rows(1)) == 0
    q = jnp.where(first[:, None], mean[None, :], jnp.zeros((), q.dtype))
  cdt = jnp.promote_types(q.dtype, digest_dtype)
  precision = lax.Precision.HIGHEST if cdt == jnp.float32 else None
  q = q.astype(cdt)
  zero = jnp.zeros_like(q)
  return jnp.maximum(q, zero), jnp.minimum(q, zero), precision


def tile_scores(q_halves, kmin_ref, kmax_ref, first, length, *, block_size: int, head_dim: int,
                num_blocks: int, block_nb: int):
  """Quest bounds of the ``block_nb`` blocks from ``first`` for the rows of ``q_halves``
  (``query_halves``): ``(blocks [NBt], live [NBt], scores [Rp, NBt] f32)``, blocks at or past
  ``length`` (or ``num_blocks``) ``-inf`` and masked off the loads (no memory traffic). Shared
  by ``block_score`` and ``score_select``, so both rank blocks from the same bits."""
  q_pos, q_neg, precision = q_halves
  cdt = q_pos.dtype
  col = jnp.arange(_common.pad_rows(head_dim))
  col_ok = col < head_dim
  # [NBt]
  blocks = first + jnp.arange(block_nb)
  live = (blocks < num_blocks) & (blocks * block_size < length)
  at = (jnp.minimum(blocks, num_blocks - 1)[:, None], col[None, :])
  # [NBt, Dp]
  lo = plgpu.load(kmin_ref.at[at], mask=live[:, None] & col_ok[None, :], other=0).astype(cdt)
  hi = plgpu.load(kmax_ref.at[at], mask=live[:, None] & col_ok[None, :], other=0).astype(cdt)
  # [Rp, NBt]
  score = (plgpu.dot(q_pos, hi, trans_b=True, precision=precision)
           + plgpu.dot(q_neg, lo, trans_b=True, precision=precision))
  return blocks, live, jnp.where(live[None, :], score.astype(jnp.float32), NEG_INF)


def _score_kernel(q_ref, kmin_ref, kmax_ref, length_ref, out_ref, *, block_size: int, rows: int,
                  head_dim: int, num_blocks: int, block_nb: int, tiles_per_split: int,
                  pool: bool):
  """One program: rows of one kv head (or, with ``pool``, their mean: one output row) against
  ``tiles_per_split`` tiles of ``block_nb`` blocks.

  The tiles are a loop so Triton pipelines the digest loads (cp.async ring).
  """
  halves = query_halves(q_ref, rows, head_dim, kmin_ref.dtype, pool=pool)
  out_rows = 1 if pool else rows
  row_ok = jnp.arange(halves[0].shape[0]) < out_rows
  length = length_ref[()]
  first_tile = pl.program_id(2) * tiles_per_split  # (interpret mode: not inside the loop)

  def body(i, carry):
    first = (first_tile + i) * block_nb
    blocks, _, score = tile_scores(halves, kmin_ref, kmax_ref, first, length,
                                   block_size=block_size, head_dim=head_dim,
                                   num_blocks=num_blocks, block_nb=block_nb)
    plgpu.store(out_ref.at[pl.ds(0, score.shape[0]), pl.ds(first, block_nb)], score,
                mask=row_ok[:, None] & (blocks < num_blocks)[None, :])
    return carry

  lax.fori_loop(0, tiles_per_split, body, 0)


def _block_score_pallas(q, kmin, kmax, length, *, block_size: int, tiles: _common.TileConfig,
                        interpret: bool, pool: bool = False):
  b, kh, g, d = q.shape
  out_rows = 1 if pool else g
  nb = kmin.shape[2]
  block_nb = min(tiles.block_nb, _common.pad_rows(nb))
  n_tiles = pl.cdiv(nb, block_nb)
  # Enough programs to fill the GPU, each looping over >= 2 tiles when there are enough.
  splits = max(1, min(pl.cdiv(_common.TARGET_PROGRAMS, b * kh), n_tiles // 2))
  per_split = pl.cdiv(n_tiles, splits)
  splits = pl.cdiv(n_tiles, per_split)
  kernel = functools.partial(_score_kernel, block_size=block_size, rows=g, head_dim=d,
                             num_blocks=nb, block_nb=block_nb, tiles_per_split=per_split,
                             pool=pool)
  head = lambda bi, hi, ji: (bi, hi, 0, 0)
  digest = pl.BlockSpec((None, None, nb, d), head)
  return pl.pallas_call(
      kernel,
      grid=(b, kh, splits),
      in_specs=[pl.BlockSpec((None, None, g, d), head), digest, digest,
                pl.BlockSpec((None,), lambda bi, hi, ji: (bi,))],
      out_specs=pl.BlockSpec((None, None, out_rows, nb), head),
      out_shape=jax.ShapeDtypeStruct((b, kh, out_rows, nb), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                           num_stages=tiles.num_stages),
      interpret=interpret,
      name="block_score_pooled" if pool else "block_score",
  )(q, kmin, kmax, length.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("block_size", "impl", "interpret", "block_nb"))
def block_score(q, kmin, kmax, length, *, block_size: int, impl: _common.Impl = "auto",
                interpret: bool = False, block_nb: int = 64):
  """Quest upper-bound scores of every block for every query head (Quest Eq. 1, unscaled).

  Args:
    q: ``[B, K, G, D]`` queries grouped by kv head.
    kmin, kmax: ``[B, K, NB, D]`` per-block channel minima / maxima (``kmin <= kmax``).
    length: ``[B]`` int32; blocks with ``block * block_size >= length`` score ``-inf``.
    block_size: tokens per block (static).
    impl: ``"pallas"``/``"triton"``, ``"mosaic"`` (``pallas_kernels.mosaic.block_score``),
      ``"xla"`` (``block_score_reference``) or ``"auto"`` (``backends.resolve_impl``).
    interpret: run the Pallas kernel in interpret mode.
    block_nb: blocks per program (static, a power of 2 >= 16).

  Returns:
    ``[B, K, G, NB]`` float32 scores.
  """
  resolved = _common.resolve_impl(impl, "block_score")
  if resolved == "xla":
    return block_score_reference(q, kmin, kmax, length, block_size=block_size)
  if resolved == "mosaic":
    from pallas_kernels import mosaic  # pylint: disable=import-outside-toplevel (imports us)
    return mosaic.block_score(q, kmin, kmax, length, block_size=block_size, impl="mosaic",
                              interpret=interpret)
  tiles = _common.TileConfig(block_nb=block_nb)
  return _block_score_pallas(q, kmin, kmax, length, block_size=block_size, tiles=tiles,
                             interpret=interpret)


def pooled_query(q):
  """The group's mean query ``q [B, K, G, D]`` -> ``[B, K, 1, D]``: averaged in float32 and
  rounded to ``q.dtype`` (the rounding ``sparse_attn.scoring.pool_group`` makes)."""
  return jnp.mean(q.astype(jnp.float32), axis=2, keepdims=True).astype(q.dtype)


def block_score_pooled_reference(q, kmin, kmax, length, *, block_size: int):
  """Eq. 1 for the group's mean query (``pooled_query``): ``[B, K, NB]``."""
  return block_score_reference(pooled_query(q), kmin, kmax, length,
                               block_size=block_size)[:, :, 0]


@functools.partial(jax.jit, static_argnames=("block_size", "impl", "interpret", "block_nb"))
def block_score_pooled(q, kmin, kmax, length, *, block_size: int, impl: _common.Impl = "auto",
                       interpret: bool = False, block_nb: int = 64):
  """Quest scores for the group's mean query (ReSA's group-shared block selection).

  The Triton kernel averages each program's G query rows itself (``query_halves``), so the
  pooling is no XLA op before the launch; the Mosaic kernel is given ``pooled_query``.

  Args: as ``block_score``.

  Returns:
    ``[B, K, NB]`` float32 scores of ``pooled_query(q)``.
  """
  resolved = _common.resolve_impl(impl, "block_score")
  if resolved == "xla":
    return block_score_pooled_reference(q, kmin, kmax, length, block_size=block_size)
  if resolved == "mosaic":
    from pallas_kernels import mosaic  # pylint: disable=import-outside-toplevel (imports us)
    return mosaic.block_score(pooled_query(q), kmin, kmax, length, block_size=block_size,
                              impl="mosaic", interpret=interpret)[:, :, 0]
  tiles = _common.TileConfig(block_nb=block_nb)
  return _block_score_pallas(q, kmin, kmax, length, block_size=block_size, tiles=tiles,
                             interpret=interpret, pool=True)[:, :, 0]
