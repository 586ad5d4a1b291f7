"""Quest block scoring on Mosaic GPU (Hopper): ``block_score``.

The Mosaic GPU twin of ``pallas_kernels.block_score`` (same signature, same reference,
``block_score_reference``: Quest Eq. 1 as ``relu(q) . kmax + min(q, 0) . kmin``, unscaled,
``-inf`` for blocks starting at or past ``length``). One program (one warpgroup) per (batch, kv
head, split) walks its tiles of 64 digest rows: the ``kmin`` / ``kmax`` tiles of the next
``num_stages - 1`` steps are in flight (TMA into a SMEM ring, one mbarrier per tile and tensor)
while one is scored on CUDA cores in float32 (exact for f32 digests, like the reference's
HIGHEST-precision dots); each ``[G, 64]`` score tile leaves by a TMA store.

Letters: B batch, K kv heads, G query heads per kv head, NB blocks, D head dim.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.block_score import _as_f32, block_score_reference
from pallas_kernels.mosaic import _common as mc

TILE = mc.TILE_ROWS
STAGES = 2


def _score_body(q_ref, kmin_ref, kmax_ref, len_ref, o_ref, q_s, lo_s, hi_s, o_s, q_bar, lo_bar,
                hi_bar, *, rows, block_size, tiles_per_split, num_tiles, regs):
  bi, hi, si = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
  d = lo_s.shape[-1]
  first = si * tiles_per_split
  steps = jnp.clip(num_tiles - first, 0, tiles_per_split)
  length = len_ref[bi]

  def issue(step, slot):
    at = pl.ds((first + step) * TILE, TILE)
    plgpu.copy_gmem_to_smem(kmin_ref.at[bi, hi, at], lo_s.at[slot], lo_bar.at[slot])
    plgpu.copy_gmem_to_smem(kmax_ref.at[bi, hi, at], hi_s.at[slot], hi_bar.at[slot])

  plgpu.copy_gmem_to_smem(q_ref.at[bi, hi], q_s, q_bar.at[0])
  for st in range(STAGES):
    @pl.when(st < steps)
    def _():
      issue(st, st)
  plgpu.barrier_wait(q_bar.at[0])
  q_rows = mc.rows_of(regs.load_tile(q_s), rows, regs)  # G x [D]
  q_pos = [mc.bcast(jnp.maximum(q, 0.0), (TILE, d), (1,)) for q in q_rows]
  q_neg = [mc.bcast(jnp.minimum(q, 0.0), (TILE, d), (1,)) for q in q_rows]
  blk = regs.iota((TILE,), 0, regs.row)

  @pl.loop(0, steps)
  def _(step):
    slot = lax.rem(step, STAGES)
    plgpu.barrier_wait(lo_bar.at[slot])
    plgpu.barrier_wait(hi_bar.at[slot])
    lo = regs.load_tile(lo_s.at[slot])  # [64, D]
    up = regs.load_tile(hi_s.at[slot])
    live = (first + step) * TILE + blk < pl.cdiv(length, block_size)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store read o_s
    for r in range(rows):
      u = jnp.sum(q_pos[r] * up + q_neg[r] * lo, axis=1)  # [64] one score per block
      o_s[r] = mc.where(live, u, mc.NEG_INF)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_ref.at[bi, hi, :, pl.ds((first + step) * TILE, TILE)])

    @pl.when(step + STAGES < steps)
    def _():
      issue(step + STAGES, slot)

  plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("block_size", "impl", "interpret", "block_nb"))
def block_score(q, kmin, kmax, length, *, block_size: int, impl: _common.Impl = "auto",
                interpret=False, block_nb: int = 64):
  """Quest upper-bound scores of every block for every query head (Mosaic GPU kernel).

  Args: as ``pallas_kernels.block_score``:
    q: ``[B, K, G, D]`` queries grouped by kv head (G <= 64).
    kmin, kmax: ``[B, K, NB, D]`` per-block channel minima / maxima (``kmin <= kmax``).
    length: ``[B]`` int32; blocks with ``block * block_size >= length`` score ``-inf``.
    block_size: tokens per block (static).
    impl: ``"xla"`` runs ``block_score_reference``; any other value runs the Mosaic kernel.
    interpret: False (lower for the GPU), True (Mosaic GPU interpret mode, race detection on)
      or an ``InterpretGPUParams``.
    block_nb: accepted for the Triton twin's signature; the Mosaic tile is 64 blocks.

  Returns:
    ``[B, K, G, NB]`` float32 scores.
  """
  del block_nb
  if impl == "xla":
    return block_score_reference(q, kmin, kmax, length, block_size=block_size)
  b, kh, g, d = q.shape
  nb = kmin.shape[2]
  if g > TILE:
    raise ValueError(f"at most {TILE} query heads per kv head, got {g}")
  # Whole swizzled 128-byte rows: a head dim such as 80 gets zero channels (they add 0).
  dp = pl.cdiv(d, TILE) * TILE
  # The query rounded to its own dtype first (as the reference), then scored in f32.
  q_pad = jnp.pad(_as_f32(q), ((0, 0), (0, 0), (0, TILE - g), (0, dp - d)))
  num_tiles = pl.cdiv(nb, TILE)
  pad = ((0, 0), (0, 0), (0, num_tiles * TILE - nb), (0, dp - d))
  kmin, kmax = jnp.pad(kmin, pad), jnp.pad(kmax, pad)  # whole 64-row TMA tiles (a copy
  # of the digests, 1 / block_size of the cache, only when NB or D is not a multiple of 64)
  splits = max(1, min(pl.cdiv(_common.TARGET_PROGRAMS, b * kh), num_tiles // 2))
  per_split = pl.cdiv(num_tiles, splits)
  splits = pl.cdiv(num_tiles, per_split)
  params = mc.interpret_params(interpret)
  kernel = functools.partial(_score_body, rows=g, block_size=block_size,
                             tiles_per_split=per_split, num_tiles=num_tiles,
                             regs=mc.Regs(params is not None))
  dig = lambda: plgpu.SMEM((STAGES, TILE, dp), kmin.dtype,
                           transforms=mc.smem_transforms(kmin.dtype))
  out = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((b, kh, g, num_tiles * TILE), jnp.float32),
      scratch_types=[plgpu.SMEM((TILE, dp), jnp.float32,
                                transforms=mc.smem_transforms(jnp.float32)),
                     dig(), dig(), plgpu.SMEM((g, TILE), jnp.float32),
                     plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=STAGES),
                     plgpu.Barrier(num_barriers=STAGES)],
      grid=(b, kh, splits), grid_names=("b", "h", "s"), interpret=params,
      kernel_name="block_score_mosaic",
  )(q_pad, kmin, kmax, length.astype(jnp.int32))
  return out[..., :nb]
