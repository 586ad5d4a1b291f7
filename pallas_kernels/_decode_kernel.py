"""The one Triton kernel behind the three sparse-decode ops: flash-decoding over a block list.

A program owns one (batch, program head, split). Its R query rows share one block list, so each
listed KV block is loaded once for all rows: with group-shared selection a program head is a kv
head and the rows are its G query heads (x W window queries); with per-query-head selection a
program head is a query head reading kv head ``p // G``. The program walks its split's slice of
the list with an online (max-shifted) softmax in float32 and writes a normalised partial
``(out, lse)``; ``combine_splits`` merges the splits (flash-decoding's second stage).

Optional extras, all static flags of the same body:
  * ``prior``: RESA prior logits ``P_j`` accumulated alongside (same blocks, same V loads).
  * ``row_mask`` / ``row_limit``: per-(row, list entry) block mask and per-row causal limit
    (RetroAttention's multi-query window).
  * ``pos``: the token position of each slot (-1 = empty; a compacted cache has holes below
    ``length``). A slot is attended iff ``slot < length`` and ``pos >= 0`` (``KVCache.valid``,
    the rule of the jnp path), and with ``row_limit`` iff ``pos <= limit``; without ``pos`` every
    slot holds the position equal to its index.

Letters: B batch, K kv heads, P program heads, R rows, n list length, S splits, T slots, D head dim.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from pallas_kernels._common import TileConfig, choose_num_splits, combine_splits, pad_rows

NEG_INF = float("-inf")


def _load(ref, mask, other=0):
  """Whole-view load, masked (``other`` where the mask is off) only when padding needs it."""
  return ref[...] if mask is None else plgpu.load(ref, mask=mask, other=other)


def _online_update(carry, s, v, precision):
  """One flash step: fold masked logits ``s [Rp, bs]`` (f32, -inf = skip) and ``v [bs, Dp]``."""
  acc, m, l = carry
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  # A row with nothing attended so far keeps m = -inf; shift it by 0 so exp never sees inf - inf.
  m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
  alpha = jnp.exp(m - m_safe)
  p = jnp.exp(s - m_safe[:, None])
  l = alpha * l + jnp.sum(p, axis=1)
  acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v, precision=precision)
  return acc, m_new, l


def _finish(carry):
  acc, m, l = carry
  ok = l > 0
  safe = jnp.where(ok, l, 1.0)
  out = jnp.where(ok[:, None], acc / safe[:, None], 0.0)
  lse = jnp.where(ok, m + jnp.log(safe), NEG_INF)
  return out, lse


def _decode_kernel(*refs, block_size: int, scale: float, rows: int, head_dim: int, chunk: int,
                   num_blocks: int, list_len: int, with_prior: bool, with_rows: bool,
                   with_pos: bool):
  """Kernel body; refs are one program's views (see ``decode_partials`` for the layout)."""
  it = iter(refs)
  q_ref, k_ref, v_ref, idx_ref, nvalid_ref, length_ref = (next(it) for _ in range(6))
  pos_ref = next(it) if with_pos else None
  prior_ref = next(it) if with_prior else None
  rmask_ref, rlim_ref = (next(it), next(it)) if with_rows else (None, None)
  o_ref, lse_ref = next(it), next(it)
  po_ref, plse_ref = (next(it), next(it)) if with_prior else (None, None)

  rp, dp = pad_rows(rows), pad_rows(head_dim)
  row_ok = jnp.arange(rp) < rows
  col_ok = jnp.arange(dp) < head_dim
  row_mask = None if rp == rows else row_ok[:, None]
  col_mask = None if dp == head_dim else col_ok[None, :]
  both = row_mask if col_mask is None else (col_mask if row_mask is None else row_mask & col_mask)
  rows_at, cols_at = pl.ds(0, rp), pl.ds(0, dp)

  # [Rp, Dp]
  q = _load(q_ref.at[rows_at, cols_at], both)
  cdt = jnp.promote_types(q_ref.dtype, k_ref.dtype)
  precision = lax.Precision.HIGHEST if cdt == jnp.float32 else None
  q = q.astype(cdt)
  if with_rows:
    # [Rp]
    limit = _load(rlim_ref.at[rows_at], None if rp == rows else row_ok, other=-1)

  n_valid = jnp.clip(nvalid_ref[()], 0, list_len)
  lo = pl.program_id(2) * chunk
  hi = jnp.minimum(lo + chunk, n_valid)
  length = length_ref[()]

  def body(i, carry):
    blk = jnp.clip(idx_ref[i], 0, num_blocks - 1)
    start = pl.multiple_of(blk * block_size, block_size)
    kv_at = (pl.ds(start, block_size), cols_at)
    # [bs]
    slots = start + jnp.arange(block_size)
    # [bs, Dp]
    k = _load(k_ref.at[kv_at], col_mask).astype(cdt)
    v = _load(v_ref.at[kv_at], col_mask)
    if cdt == jnp.float32:  # mixed f32 / bf16 inputs: an exact f32 p.v
      v = v.astype(cdt)
    # [Rp, bs]
    s = plgpu.dot(q, k, trans_b=True, precision=precision).astype(jnp.float32) * scale
    # [bs]: the token positions the slots hold
    pos = pos_ref[pl.ds(start, block_size)] if with_pos else slots
    ok = jnp.broadcast_to(((slots < length) & (pos >= 0))[None, :], s.shape)
    if with_rows:
      use = _load(rmask_ref.at[i, rows_at], None if rp == rows else row_ok)
      ok = ok & (use > 0)[:, None] & (pos[None, :] <= limit[:, None])
    s = jnp.where(ok, s, NEG_INF)
    main = _online_update(carry[0], s, v, precision)
    if not with_prior:
      return (main,)
    pr = _load(prior_ref.at[rows_at, pl.ds(start, block_size)], row_mask, other=NEG_INF)
    pr = jnp.where(ok, pr.astype(jnp.float32), NEG_INF)
    return main, _online_update(carry[1], pr, v, precision)

  def init():
    return (jnp.zeros((rp, dp), jnp.float32), jnp.full((rp,), NEG_INF, jnp.float32),
            jnp.zeros((rp,), jnp.float32))

  carry = (init(), init()) if with_prior else (init(),)
  carry = lax.fori_loop(lo, hi, body, carry)

  row_store = None if rp == rows else row_ok
  for (o_r, l_r), c in zip(((o_ref, lse_ref), (po_ref, plse_ref)), carry):
    out, lse = _finish(c)
    if both is None:
      o_r[...] = out
    else:
      plgpu.store(o_r.at[rows_at, cols_at], out, mask=both)
    if row_store is None:
      l_r[...] = lse
    else:
      plgpu.store(l_r.at[rows_at], lse, mask=row_store)


def decode_partials(q, k, v, block_idx, n_valid, length, prior=None, row_mask=None,
                    row_limit=None, pos=None, *, block_size: int, scale: float, tiles: TileConfig,
                    interpret: bool):
  """Runs the kernel and combines its splits.

  Args:
    q: ``[B, P, R, D]`` query rows of each program head.
    k, v: ``[B, K, T, D]`` cache; ``P`` is a multiple of ``K``.
    block_idx: ``[B, P, n]`` int32 block lists; ``n_valid [B, P]``; ``length [B]``.
    prior: optional ``[B, P, R, T]`` float32 RESA prior logits.
    row_mask: optional ``[B, P, n, R]`` int32 (nonzero: row may use list entry i).
    row_limit: optional ``[B, P, R]`` int32, the last token position each row may attend (with
      row_mask).
    pos: optional ``[B, K, T]`` int32 token position of each slot (-1 = empty); None: ``slot``.
    block_size, scale, tiles, interpret: static.

  Returns:
    ``[(out [B, P, R, D] f32, lse [B, P, R] f32)]``, plus the prior pair when ``prior`` is given.
  """
  b, p, r, d = q.shape
  kh, t = k.shape[1], k.shape[2]
  n = block_idx.shape[-1]
  ratio = p // kh
  with_prior, with_rows, with_pos = prior is not None, row_mask is not None, pos is not None
  splits = tiles.num_splits or choose_num_splits(b * p, n)
  splits = max(1, min(splits, n))
  chunk = -(-n // splits)

  kernel = functools.partial(
      _decode_kernel, block_size=block_size, scale=float(scale), rows=r, head_dim=d,
      chunk=chunk, num_blocks=t // block_size, list_len=n, with_prior=with_prior,
      with_rows=with_rows, with_pos=with_pos)
  head = lambda bi, pi, si: (bi, pi, 0, 0)
  kv = pl.BlockSpec((None, None, t, d), lambda bi, pi, si: (bi, pi // ratio, 0, 0))
  in_specs = [
      pl.BlockSpec((None, None, r, d), head), kv, kv,
      pl.BlockSpec((None, None, n), lambda bi, pi, si: (bi, pi, 0)),
      pl.BlockSpec((None, None), lambda bi, pi, si: (bi, pi)),
      pl.BlockSpec((None,), lambda bi, pi, si: (bi,)),
  ]
  args = [q, k, v, block_idx.astype(jnp.int32), n_valid.astype(jnp.int32),
          length.astype(jnp.int32)]
  if with_pos:
    in_specs.append(pl.BlockSpec((None, None, t), lambda bi, pi, si: (bi, pi // ratio, 0)))
    args.append(pos.astype(jnp.int32))
  if with_prior:
    in_specs.append(pl.BlockSpec((None, None, r, t), head))
    args.append(prior.astype(jnp.float32))
  if with_rows:
    in_specs += [pl.BlockSpec((None, None, n, r), head),
                 pl.BlockSpec((None, None, r), lambda bi, pi, si: (bi, pi, 0))]
    args += [row_mask.astype(jnp.int32), row_limit.astype(jnp.int32)]
  pair_specs = [pl.BlockSpec((None, None, None, r, d), lambda bi, pi, si: (bi, pi, si, 0, 0)),
                pl.BlockSpec((None, None, None, r), lambda bi, pi, si: (bi, pi, si, 0))]
  pair_shapes = [jax.ShapeDtypeStruct((b, p, splits, r, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, p, splits, r), jnp.float32)]
  n_pairs = 2 if with_prior else 1
  outs = pl.pallas_call(
      kernel,
      grid=(b, p, splits),
      in_specs=in_specs,
      out_specs=pair_specs * n_pairs,
      out_shape=pair_shapes * n_pairs,
      compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                           num_stages=tiles.num_stages),
      interpret=interpret,
      name="sparse_decode_resa" if with_prior else (
          "sparse_decode_multiquery" if with_rows else "sparse_decode"),
  )(*args)
  return [combine_splits(outs[2 * i], outs[2 * i + 1], axis=2) for i in range(n_pairs)]
