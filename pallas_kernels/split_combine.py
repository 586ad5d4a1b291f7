"""The split-K combine of the decode kernels as a second small Pallas pass: ``split_combine``
(one pair) and ``split_combine_pairs`` (several pairs of the same splits, plus per-split counts,
in one launch: RESA's true and prior partials and its prior-member count, RetroAttention's
attended-key count, optionally finished by an elementwise epilogue such as RESA's aggregator;
``carry_in``: partials from an earlier pass merged in as one more split, such as RetroAttention's
cached outputs of the window's past queries).

A decode kernel writes one ``(out, lse)`` partial per split (flash-decoding); this pass merges
them exactly (``softmax.lse_combine``, the reference): ``lse = log sum_s e^lse_s`` and
``out = sum_s e^(lse_s - lse) out_s``, ``0`` / ``-inf`` where every split is empty. One program
per (batch, program head, tile of rows) holds its ``[S, R', D]`` partials in registers, so the
partials are read once and the result written once, instead of XLA's separate max, exp-sum and
weighted-sum fusions. The row tile ``R'`` (``row_tile``) bounds what a program holds: a whole
head's ``[64, 32, 128]`` (33 splits of RetroAttention's 4 x 8 window rows) would spill ~18 KB a
thread to local memory on sm_90 (``ptxas``), and one program per head fills only 8 of an H100's
132 SMs at Llama-3.1-8B's shape.

Letters: B batch, P program heads, S splits, R rows, D head dim.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels._common import empty_padding_rows
from pallas_kernels.softmax import lse_combine
from pallas_kernels.backends import triton_module

plgpu = triton_module()  # jax.experimental.pallas.triton; see backends

NEG_INF = float("-inf")
# Partial elements (f32) one program holds per pair: 32 registers a thread at 4 warps (8192
# spilled at sm_90 for a prefill chunk's [2, 64, 64] partials of Qwen2.5's 7 heads).
TILE_ELEMENTS = 4096


def row_tile(splits: int, rows: int, head_dim: int) -> int:
  """Rows ``R'`` of a program: the largest power of 2 dividing ``rows`` whose
  ``[next_pow2(S), R', next_pow2(D)]`` partials stay within ``TILE_ELEMENTS`` (at least 1)."""
  per_row = _common.next_pow2(splits) * _common.next_pow2(head_dim)
  tile = 1
  while rows % (2 * tile) == 0 and 2 * tile * per_row <= TILE_ELEMENTS:
    tile *= 2
  return tile


def _merge(out_ref, lse_ref, splits: int, rows: int, head_dim: int, carry=None):
  """One pair's merged ``(out [Rp, Dp], lse [Rp])`` from its ``[S, R, D]`` / ``[S, R]`` refs
  and, with ``carry`` (``[R, D]`` / ``[R]`` refs), one more partial."""
  sp, rp, dp = (_common.next_pow2(splits), _common.pad_rows(rows, 1),
                _common.pad_rows(head_dim, 1))
  s, r, c = jnp.arange(sp), jnp.arange(rp), jnp.arange(dp)
  sr_ok = (s[:, None] < splits) & (r[None, :] < rows)
  rc_ok = (r < rows)[:, None] & (c < head_dim)[None, :]
  lse = plgpu.load(lse_ref.at[pl.ds(0, sp), pl.ds(0, rp)], mask=sr_ok, other=NEG_INF)  # [S, R]
  m = jnp.max(lse, axis=0)
  if carry is not None:
    lse_c = plgpu.load(carry[1].at[pl.ds(0, rp)], mask=r < rows, other=NEG_INF)  # [R]
    m = jnp.maximum(m, lse_c)
  m_safe = jnp.where(m == NEG_INF, 0.0, m)
  w = jnp.exp(lse - m_safe[None, :])  # 0 for empty splits
  denom = jnp.sum(w, axis=0)
  mask = sr_ok[:, :, None] & (c < head_dim)[None, None, :]
  parts = plgpu.load(out_ref.at[pl.ds(0, sp), pl.ds(0, rp), pl.ds(0, dp)], mask=mask,
                     other=0)  # [S, R, D]
  acc = jnp.sum(w[:, :, None] * parts.astype(jnp.float32), axis=0)
  if carry is not None:
    w_c = jnp.exp(lse_c - m_safe)
    denom = denom + w_c
    out_c = plgpu.load(carry[0].at[pl.ds(0, rp), pl.ds(0, dp)], mask=rc_ok, other=0)
    acc = acc + w_c[:, None] * out_c.astype(jnp.float32)
  ok = denom > 0
  safe = jnp.where(ok, denom, 1.0)
  out = acc / safe[:, None]
  return jnp.where(ok[:, None], out, 0.0), jnp.where(ok, m_safe + jnp.log(safe), NEG_INF)


def _combine_kernel(*refs, pairs: int, n_counts: int, with_carry: bool, extra_ranks: tuple,
                    epilogue, splits: int, rows: int, head_dim: int, with_query_pos: bool):
  n_carry = 2 * pairs * with_carry
  n_in = 2 * pairs + n_counts + n_carry + len(extra_ranks) + with_query_pos
  ins, outs = refs[:n_in], refs[n_in:]
  rp, dp = _common.pad_rows(rows, 1), _common.pad_rows(head_dim, 1)
  r, c = jnp.arange(rp), jnp.arange(dp)
  r_ok, rc_ok = r < rows, (r < rows)[:, None] & (c < head_dim)[None, :]
  carries = ins[2 * pairs + n_counts:2 * pairs + n_counts + n_carry]
  merged = [_merge(ins[2 * i], ins[2 * i + 1], splits, rows, head_dim,
                   carries[2 * i:2 * i + 2] if with_carry else None) for i in range(pairs)]
  sp = _common.next_pow2(splits)
  sr_ok = (jnp.arange(sp)[:, None] < splits) & r_ok[None, :]
  # Per-split counts (RESA's prior members, Retro's keys attended) add up.
  counts = [jnp.sum(plgpu.load(ref.at[pl.ds(0, sp), pl.ds(0, rp)], mask=sr_ok, other=0), axis=0)
            for ref in ins[2 * pairs:2 * pairs + n_counts]]
  if epilogue is not None:
    extras = [plgpu.load(ref.at[pl.ds(0, rp)], mask=r_ok, other=0) if rank == 1 else
              plgpu.load(ref.at[pl.ds(0, rp), pl.ds(0, dp)], mask=rc_ok, other=0)
              for ref, rank in zip(ins[2 * pairs + n_counts + n_carry:], extra_ranks)]
    merged, counts = [epilogue(*merged, *counts, *extras)], []
  if with_query_pos:  # a padding row comes out empty, whatever the epilogue or carry gave it
    live = ins[n_in - 1][()] >= 0
    merged = [(jnp.where(live, out, 0.0), jnp.where(live, lse, NEG_INF)) for out, lse in merged]
    counts = [jnp.where(live, total, 0) for total in counts]
  for i, (out, lse) in enumerate(merged):
    plgpu.store(outs[2 * i].at[pl.ds(0, rp), pl.ds(0, dp)], out.astype(jnp.float32),
                mask=rc_ok)
    plgpu.store(outs[2 * i + 1].at[pl.ds(0, rp)], lse.astype(jnp.float32), mask=r_ok)
  for ref, total in zip(outs[2 * len(merged):], counts):
    plgpu.store(ref.at[pl.ds(0, rp)], total, mask=r_ok)


def split_combine_reference(pairs, counts=None, epilogue=None, extras=(), carry_in=None,
                            query_pos=None):
  """``split_combine_pairs``' jnp path: ``lse_combine`` per pair (``carry_in``'s partial one
  more split), counts summed, then the epilogue, then padding rows emptied."""
  if carry_in is not None:
    pairs = [tuple(jnp.concatenate([x, y[:, :, None].astype(x.dtype)], axis=2)
                   for x, y in zip(pair, carry)) for pair, carry in zip(pairs, carry_in)]
  merged = [lse_combine(out, lse, axis=2) for out, lse in pairs]
  return _finish(merged, jax.tree.map(lambda c: jnp.sum(c, axis=2), counts), epilogue, extras,
                 query_pos)


def _finish(merged, counts, epilogue, extras, query_pos=None):
  if epilogue is not None:
    merged, counts = [epilogue(*merged, *_count_list(counts, epilogue), *extras)], None
  if query_pos is not None:
    live = lambda x: (query_pos >= 0).reshape((-1,) + (1,) * (x.ndim - 1))
    merged = [empty_padding_rows(out, lse, query_pos) for out, lse in merged]
    counts = jax.tree.map(lambda c: jnp.where(live(c), c, 0), counts)
  return merged[0] if epilogue is not None else (merged, counts)


def _count_list(counts, epilogue) -> tuple:
  """``counts`` (None, one array or a tuple of them) as a tuple; an epilogue takes one."""
  listed = () if counts is None else tuple(counts) if isinstance(counts, (tuple, list)) else (
      counts,)
  if epilogue is not None and len(listed) != 1:
    raise ValueError(f"an epilogue takes one count array, got {len(listed)}")
  return listed


@functools.partial(jax.jit, static_argnames=("epilogue", "impl", "interpret", "num_warps"))
def split_combine_pairs(pairs, counts=None, *, epilogue=None, extras=(), carry_in=None,
                        query_pos=None, impl: _common.Impl = "auto", interpret: bool = False,
                        num_warps: int = 4):
  """Merges several split-partial pairs over ``S`` in one pass (one program per head and
  ``row_tile`` rows).

  Args:
    pairs: ``[(out [B, P, S, R, D], lse [B, P, S, R])]`` (f32), e.g. RESA's true and prior
      partials of the same splits.
    counts: optional ``[B, P, S, R]`` int32 per-split counts (or a tuple of them), each summed
      over ``S``.
    epilogue: optional hashable ``f(*merged_pairs, counts, *extras) -> (out, lse)`` of
      elementwise jnp ops over rows (``[..., D]`` / ``[...]``), run on the merged values in the
      same pass (RESA's aggregator); the reference runs it on the merged arrays.
    extras: the epilogue's per-row inputs, each ``[B, P, R]`` or ``[B, P, R, D]``.
    carry_in: optional ``[(out [B, P, R, D], lse [B, P, R])]``, one per pair: a partial from an
      earlier pass merged in as one more split (``-inf`` lse: nothing to merge).
    query_pos: optional ``[B]`` int32 query position of each batch row: a negative one (a
      padding row) comes out empty (``0`` / ``-inf``, counts 0) whatever the epilogue or the
      carried partial gives it (the decode kernels attend nothing for such a row).

  Returns:
    ``([(out [B, P, R, D] f32, lse [B, P, R] f32)], counts)``, each pair equal to
    ``lse_combine(out, lse, axis=2)`` and ``counts`` the sums ``[B, P, R]`` int32 in the form
    given (None, an array or a tuple); with an epilogue, its ``(out, lse)``.
  """
  if carry_in is not None and len(carry_in) != len(pairs):
    raise ValueError(f"carry_in holds one partial per pair: {len(carry_in)} for {len(pairs)}")
  if _common.resolve_impl(impl, "split_combine") == "xla":
    return split_combine_reference(pairs, counts, epilogue, extras, carry_in, query_pos)
  b, p, s, r, d = pairs[0][0].shape
  listed = _count_list(counts, epilogue)
  if s == 1 and carry_in is None:  # nothing to merge: a split's partial is already normalised
    return _finish([(out[:, :, 0].astype(jnp.float32), lse[:, :, 0].astype(jnp.float32))
                    for out, lse in pairs], jax.tree.map(lambda c: c[:, :, 0], counts),
                   epilogue, extras, query_pos)
  ranks = tuple(x.ndim - 2 for x in extras)
  rt = row_tile(s, r, d)
  kernel = functools.partial(_combine_kernel, pairs=len(pairs), n_counts=len(listed),
                             with_carry=carry_in is not None,
                             extra_ranks=ranks, epilogue=epilogue, splits=s, rows=rt,
                             head_dim=d, with_query_pos=query_pos is not None)
  split_in = [pl.BlockSpec((None, None, s, rt, d), lambda bi, pi, ri: (bi, pi, 0, ri, 0)),
              pl.BlockSpec((None, None, s, rt), lambda bi, pi, ri: (bi, pi, 0, ri))]
  row_spec = [pl.BlockSpec((None, None, rt, d), lambda bi, pi, ri: (bi, pi, ri, 0)),
              pl.BlockSpec((None, None, rt), lambda bi, pi, ri: (bi, pi, ri))]
  shapes = [jax.ShapeDtypeStruct((b, p, r, d), jnp.float32),
            jax.ShapeDtypeStruct((b, p, r), jnp.float32)]
  args = [x for out, lse in pairs for x in (out, lse.astype(jnp.float32))]
  in_specs = split_in * len(pairs)
  args += [c.astype(jnp.int32) for c in listed]
  in_specs += [split_in[1]] * len(listed)
  if carry_in is not None:
    args += [x.astype(jnp.float32) for pair in carry_in for x in pair]
    in_specs += row_spec * len(pairs)
  if epilogue is not None:
    args += list(extras)
    in_specs += [row_spec[1] if rank == 1 else row_spec[0] for rank in ranks]
  if query_pos is not None:
    args.append(query_pos.astype(jnp.int32))
    in_specs.append(pl.BlockSpec((None,), lambda bi, pi, ri: (bi,)))
  n_pairs = 1 if epilogue is not None else len(pairs)
  count_out = 0 if epilogue is not None else len(listed)
  merged = pl.pallas_call(
      kernel,
      grid=(b, p, r // rt),
      in_specs=in_specs,
      out_specs=row_spec * n_pairs + row_spec[1:] * count_out,
      out_shape=shapes * n_pairs + [jax.ShapeDtypeStruct((b, p, r), jnp.int32)] * count_out,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="split_combine",
  )(*args)
  if epilogue is not None:
    return merged[0], merged[1]
  totals = merged[2 * n_pairs:]
  return ([(merged[2 * i], merged[2 * i + 1]) for i in range(n_pairs)],
          jax.tree.unflatten(jax.tree.structure(counts), totals))


def split_combine(out, lse, *, impl: _common.Impl = "auto", interpret: bool = False,
                  num_warps: int = 4):
  """Merges split partials ``out [B, P, S, R, D]``, ``lse [B, P, S, R]`` (f32) over ``S``.

  Returns:
    ``(out [B, P, R, D] f32, lse [B, P, R] f32)``, equal to ``lse_combine(out, lse, axis=2)``.
  """
  (pair,), _ = split_combine_pairs(((out, lse),), impl=impl, interpret=interpret,
                                   num_warps=num_warps)
  return pair
