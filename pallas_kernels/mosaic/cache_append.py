"""A decode step's cache write on Mosaic GPU (Hopper), in place: ``cache_append``.

The Mosaic GPU twin of ``pallas_kernels.cache_append`` (same signature, same reference,
``cache_append_reference``): one token per (batch, kv head) written at ``slot``, the touched
block's box digests recomputed, the length advanced. One program (one warpgroup) per (batch, kv
head):

  * TMA copies bring the touched block's keys (``[bs, D]``, as ``ceil(bs / 64)`` WGMMA-layout
    ``[64, D]`` SMEM tiles) and the new K and V rows into shared memory; the block's ``bs``
    positions are scalar loads (a TMA moves a multiple of 128 bytes per warpgroup: 32 int32);
  * once the copies have landed, the new rows leave for slot ``s`` by TMA stores (the block has
    been read, so they race with nothing) while the digests are reduced in registers with the
    new row merged in (``where(slot == s, new, old)``: no read-after-write through memory);
  * the two digest rows leave by TMA, the position by one scalar store; kv head 0's program
    stores the row's new length, ``max(length, s + 1)`` (the others compute the same value from
    the old or the stored length: a benign race, as in the Triton twin).

In place, one launch, no copy of the cache: ``plgpu.kernel`` has no ``input_output_aliases``,
so the kernel is a ``pl.core_map`` over a ``plgpu.Mesh`` on the Refs of ``pl.run_state``. Pallas
discharges it into one ``mosaic_gpu_v2`` custom call whose outputs alias the six inputs it
writes, the length included (``output_operand_aliases``; the Mosaic GPU interpreter honours
them too); with the cache donated to the enclosing ``jax.jit`` XLA reuses the buffers, as with
the Triton kernel's ``input_output_aliases``. ``after`` arrays are extra operands that order the
launch after their producers (each program loads one element of them and drops it: a Ref no
program touches is pruned from the call). A ``custom_vmap`` rule folds a vmapped axis into the batch (rows are
independent), since Pallas batches a mesh kernel only over an axis of size 1.

Limits: ``block_size`` a power of 2 >= 16; head dim a multiple of 64 (bf16/f16) or 32 (f32)
elements (whole 128-byte swizzled rows, as every Mosaic kernel here).

Letters: B batch, K kv heads, T slots, NB blocks, D head dim, NT = ceil(bs / 64) block tiles.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.cache_append import check_token_pos, cache_append_reference
from pallas_kernels.mosaic import _common as mc

TILE = mc.TILE_ROWS


def _append_body(k_ref, v_ref, pos_ref, kmin_ref, kmax_ref, knew_ref, vnew_ref, slot_ref,
                 tok_ref, len_ref, kb_s, pb_s, row_s, dig_s, blk_bar, row_bar, *,
                 block_size, t, regs):
  """One program. GMEM: the cache Refs (aliased in place; ``len [B]`` among them),
  ``knew/vnew [B, K, D]``, ``slot [B]``, ``tok [B]`` or ``[B, K]``. SMEM: ``kb_s [NT, 64, D]``
  block tiles (rows past ``bs`` unused), ``pb_s [NT, 64]`` their positions, ``row_s [2, D]``
  the new K / V rows, ``dig_s [2, D]`` the digests out. Barriers: ``blk_bar [2 NT]`` (keys,
  positions), ``row_bar [2]``."""
  bi, hi = lax.axis_index("b"), lax.axis_index("h")
  bs = block_size
  rows = min(bs, TILE)  # filled rows of each tile
  tiles = kb_s.shape[0]
  d = kb_s.shape[-1]
  # A TMA moves a multiple of 128 bytes per warpgroup: 16 positions (64 B) are scalar loads.
  pos_tma = rows * 4 % 128 == 0
  s = slot_ref[bi]

  @pl.when((s >= 0) & (s < t))
  def _():
    blk = s // bs
    start = blk * bs
    plgpu.copy_gmem_to_smem(knew_ref.at[bi, hi], row_s.at[0], row_bar.at[0])
    plgpu.copy_gmem_to_smem(vnew_ref.at[bi, hi], row_s.at[1], row_bar.at[1])
    for i in range(tiles):
      at = pl.ds(start + i * rows, rows)
      plgpu.copy_gmem_to_smem(k_ref.at[bi, hi, at], kb_s.at[i, pl.ds(0, rows)], blk_bar.at[i])
      if pos_tma:
        plgpu.copy_gmem_to_smem(pos_ref.at[bi, hi, at], pb_s.at[i, pl.ds(0, rows)],
                                blk_bar.at[tiles + i])
    for i in range(tiles * (1 + pos_tma)):
      plgpu.barrier_wait(blk_bar.at[i])
    plgpu.barrier_wait(row_bar.at[0])
    plgpu.barrier_wait(row_bar.at[1])
    # The block is in SMEM: the new rows may overwrite slot s now.
    plgpu.copy_smem_to_gmem(row_s.at[0], k_ref.at[bi, hi, s])
    plgpu.copy_smem_to_gmem(row_s.at[1], v_ref.at[bi, hi, s])

    tok = tok_ref[bi] if len(tok_ref.shape) == 1 else tok_ref[bi, hi]
    length = jnp.maximum(len_ref[bi], s + 1)
    k_new = regs.load_vec(row_s.at[0], regs.col).astype(jnp.float32)  # [D]
    row = regs.iota((TILE,), 0, regs.row)
    lo = hi_ = cnt = None
    for i in range(tiles):
      at = start + i * rows + row  # [64] slot of each tile row
      is_new = at == s
      kb = regs.load_tile(kb_s.at[i])  # [64, D]
      kb = mc.where(mc.bcast(is_new, (TILE, d), (0,)), mc.bcast(k_new, (TILE, d), (1,)), kb)
      if pos_tma:
        pb = regs.load_vec(pb_s.at[i], regs.row)  # [64] positions (rows past the block unused)
      else:
        pb = jnp.full((TILE,), -1, jnp.int32)
        for r in range(rows):
          pb = mc.where(row == r, pos_ref[bi, hi, start + i * rows + r], pb)
      pb = mc.where(is_new, tok, pb)
      ok = (row < rows) & (pb >= 0) & (at < length)
      ok2 = mc.bcast(ok, (TILE, d), (0,))
      t_lo = jnp.min(mc.where(ok2, kb, jnp.inf), axis=0)  # [D]
      t_hi = jnp.max(mc.where(ok2, kb, -jnp.inf), axis=0)
      t_cnt = jnp.sum(mc.where(ok2, 1.0, 0.0), axis=0)
      if lo is None:
        lo, hi_, cnt = t_lo, t_hi, t_cnt
      else:
        lo, hi_, cnt = jnp.minimum(lo, t_lo), jnp.maximum(hi_, t_hi), cnt + t_cnt
    # A block with no valid key gets zero digests.
    dig_s[0] = mc.where(cnt > 0, lo, 0.0).astype(dig_s.dtype)
    dig_s[1] = mc.where(cnt > 0, hi_, 0.0).astype(dig_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dig_s.at[0], kmin_ref.at[bi, hi, blk])
    plgpu.copy_smem_to_gmem(dig_s.at[1], kmax_ref.at[bi, hi, blk])
    pos_ref[bi, hi, s] = tok

    @pl.when(hi == 0)
    def _():
      len_ref[bi] = length

    plgpu.wait_smem_to_gmem(0)


def _launch(k, v, pos, kmin, kmax, k_new, v_new, slot, token_pos, length, *after, block_size,
            interpret):
  b, h, t, d = k.shape
  params = mc.interpret_params(interpret)
  tiles = max(1, block_size // TILE)
  scratch = (
      plgpu.SMEM((tiles, TILE, d), k.dtype, transforms=mc.smem_transforms(k.dtype)),
      plgpu.SMEM((tiles, TILE), jnp.int32),
      plgpu.SMEM((2, d), k.dtype),
      plgpu.SMEM((2, d), kmin.dtype),
      plgpu.Barrier(num_barriers=2 * tiles),
      plgpu.Barrier(num_barriers=2),
  )
  body = functools.partial(_append_body, block_size=block_size, t=t,
                           regs=mc.Regs(params is not None))

  mesh = plgpu.Mesh(grid=(b, h), grid_names=("b", "h"), kernel_name="cache_append_mosaic")

  def write(refs):
    @pl.core_map(mesh, interpret=params)
    def _():
      for r in refs[10:]:  # `after`: one element loaded and dropped, so the operand stays
        r[(0,) * len(r.shape)]  # (a Ref never touched is pruned from the call)
      pl.run_scoped(functools.partial(body, *refs[:10]), *scratch)

  args = (k, v, pos, kmin, kmax, k_new, v_new, slot, token_pos, length, *after)
  out = pl.run_state(write)(args)
  return (*out[:5], out[9])


@functools.partial(jax.jit, static_argnames=("block_size", "impl", "interpret"))
def cache_append(k, v, pos, kmin, kmax, k_new, v_new, slot, token_pos, length, *,
                 block_size: int, impl: _common.Impl = "auto", interpret=False, after=()):
  """One token per (batch, kv head) written at ``slot`` in place, the touched block's box
  digests recomputed, the length advanced (Mosaic GPU kernel).

  Args: as ``pallas_kernels.cache_append``:
    k, v: ``[B, K, T, D]`` cache; ``pos [B, K, T]`` int32 (-1 = empty).
    kmin, kmax: ``[B, K, NB, D]`` box digests (cache dtype).
    k_new, v_new: ``[B, K, D]``; slot ``[B]`` int32 (out of ``[0, T)``: no write); token_pos
      ``[B]`` (every kv head) or ``[B, K]`` int32; length ``[B]`` int32 before the write.
    block_size: static, a power of 2 >= 16.
    impl: ``"xla"`` runs ``cache_append_reference``; any other value runs the Mosaic kernel.
    interpret: False (lower for the GPU), True (Mosaic GPU interpret mode on the CPU, race
      detection on) or an ``InterpretGPUParams``.
    after: arrays the launch takes as operands and never reads (ordering only, as there).

  Returns:
    ``(k, v, pos, kmin, kmax, length)`` updated (in place where the inputs are donated).
  """
  check_token_pos(token_pos, slot, k.shape[1])
  after = jax.tree.leaves(after)
  if impl == "xla":
    k_new, v_new = (_common.order_after(x, *after) if after else x for x in (k_new, v_new))
    return cache_append_reference(k, v, pos, kmin, kmax, k_new, v_new, slot, token_pos, length,
                                  block_size=block_size)
  b, h, t, d = k.shape
  nb = _common.check_block_size(block_size, t)
  if kmin.shape != (b, h, nb, d) or kmax.shape != (b, h, nb, d):
    raise ValueError(f"box digests must be {(b, h, nb, d)}, got {kmin.shape} / {kmax.shape}")
  mc.check_minor_dim(d, k.dtype, kmin.dtype)
  args = (k, v, pos.astype(jnp.int32), kmin, kmax, k_new.astype(k.dtype),
          v_new.astype(v.dtype), slot.astype(jnp.int32), token_pos.astype(jnp.int32),
          length.astype(jnp.int32), *after)
  return _batched(block_size, interpret)(*args)


@functools.cache
def _batched(block_size: int, interpret):
  """``_launch`` with a vmap rule: a vmapped axis folds into the batch (rows are independent;
  Pallas batches a kernel taking Refs only over an axis of size 1)."""
  run = jax.custom_batching.custom_vmap(
      functools.partial(_launch, block_size=block_size, interpret=interpret))

  @run.def_vmap
  def _(axis_size, in_batched, *args):
    args = [x if bat else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, bat in zip(args, in_batched)]
    flat = [x.reshape(-1, *x.shape[2:]) for x in args]
    out = run(*flat)
    return tuple(x.reshape(axis_size, -1, *x.shape[1:]) for x in out), (True,) * len(out)

  return run
