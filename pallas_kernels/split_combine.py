"""The split-K combine of the decode kernels as a second small Pallas pass: ``split_combine``
(one pair) and ``split_combine_pairs`` (several pairs of the same splits, plus per-split counts,
in one launch: RESA's true and prior partials and its prior-member count).

A decode kernel writes one ``(out, lse)`` partial per split (flash-decoding); this pass merges
them exactly (``softmax.lse_combine``, the reference): ``lse = log sum_s e^lse_s`` and
``out = sum_s e^(lse_s - lse) out_s``, ``0`` / ``-inf`` where every split is empty. One program
per (batch, program head) holds its ``[S, R, D]`` partials in registers (S and R are small: a
few splits of a few query rows), so the partials are read once and the result written once,
instead of XLA's separate max, exp-sum and weighted-sum fusions.

Letters: B batch, P program heads, S splits, R rows, D head dim.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.softmax import lse_combine

NEG_INF = float("-inf")


def _merge(out_ref, lse_ref, splits: int, rows: int, head_dim: int):
  """One pair's merged ``(out [Rp, Dp], lse [Rp])`` from its ``[S, R, D]`` / ``[S, R]`` refs."""
  sp, rp, dp = (_common.next_pow2(splits), _common.pad_rows(rows, 1),
                _common.pad_rows(head_dim, 1))
  s, r, c = jnp.arange(sp), jnp.arange(rp), jnp.arange(dp)
  sr_ok = (s[:, None] < splits) & (r[None, :] < rows)
  lse = plgpu.load(lse_ref.at[pl.ds(0, sp), pl.ds(0, rp)], mask=sr_ok, other=NEG_INF)  # [S, R]
  m = jnp.max(lse, axis=0)
  m_safe = jnp.where(m == NEG_INF, 0.0, m)
  w = jnp.exp(lse - m_safe[None, :])  # 0 for empty splits
  denom = jnp.sum(w, axis=0)
  ok = denom > 0
  safe = jnp.where(ok, denom, 1.0)
  mask = sr_ok[:, :, None] & (c < head_dim)[None, None, :]
  parts = plgpu.load(out_ref.at[pl.ds(0, sp), pl.ds(0, rp), pl.ds(0, dp)], mask=mask,
                     other=0)  # [S, R, D]
  out = jnp.sum(w[:, :, None] * parts.astype(jnp.float32), axis=0) / safe[:, None]
  return jnp.where(ok[:, None], out, 0.0), jnp.where(ok, m_safe + jnp.log(safe), NEG_INF)


def _combine_kernel(*refs, pairs: int, with_counts: bool, splits: int, rows: int,
                    head_dim: int):
  ins, outs = refs[:2 * pairs + with_counts], refs[2 * pairs + with_counts:]
  rp, dp = _common.pad_rows(rows, 1), _common.pad_rows(head_dim, 1)
  r, c = jnp.arange(rp), jnp.arange(dp)
  for i in range(pairs):
    out, lse = _merge(ins[2 * i], ins[2 * i + 1], splits, rows, head_dim)
    plgpu.store(outs[2 * i].at[pl.ds(0, rp), pl.ds(0, dp)], out,
                mask=(r < rows)[:, None] & (c < head_dim)[None, :])
    plgpu.store(outs[2 * i + 1].at[pl.ds(0, rp)], lse, mask=r < rows)
  if with_counts:  # per-split counts (e.g. RESA's prior members attended) add up
    sp = _common.next_pow2(splits)
    s = jnp.arange(sp)
    counts = plgpu.load(ins[-1].at[pl.ds(0, sp), pl.ds(0, rp)],
                        mask=(s[:, None] < splits) & (r[None, :] < rows), other=0)
    plgpu.store(outs[-1].at[pl.ds(0, rp)], jnp.sum(counts, axis=0), mask=r < rows)


def split_combine_reference(pairs, counts=None):
  """``split_combine_pairs``' jnp path: ``lse_combine`` per pair, counts summed."""
  merged = [lse_combine(out, lse, axis=2) for out, lse in pairs]
  return merged, None if counts is None else jnp.sum(counts, axis=2)


@functools.partial(jax.jit, static_argnames=("impl", "interpret", "num_warps"))
def split_combine_pairs(pairs, counts=None, *, impl: _common.Impl = "auto",
                        interpret: bool = False, num_warps: int = 4):
  """Merges several split-partial pairs over ``S`` in one pass (one program per head).

  Args:
    pairs: ``[(out [B, P, S, R, D], lse [B, P, S, R])]`` (f32), e.g. RESA's true and prior
      partials of the same splits.
    counts: optional ``[B, P, S, R]`` int32 per-split counts, summed over ``S``.

  Returns:
    ``([(out [B, P, R, D] f32, lse [B, P, R] f32)], counts [B, P, R] int32 or None)``, each
    pair equal to ``lse_combine(out, lse, axis=2)``.
  """
  if _common.resolve_impl(impl) == "xla":
    return split_combine_reference(pairs, counts)
  b, p, s, r, d = pairs[0][0].shape
  if s == 1:  # nothing to merge: a split's partial is already normalised
    return ([(out[:, :, 0].astype(jnp.float32), lse[:, :, 0].astype(jnp.float32))
             for out, lse in pairs], None if counts is None else counts[:, :, 0])
  with_counts = counts is not None
  kernel = functools.partial(_combine_kernel, pairs=len(pairs), with_counts=with_counts,
                             splits=s, rows=r, head_dim=d)
  pair_in = [pl.BlockSpec((None, None, s, r, d), lambda bi, pi: (bi, pi, 0, 0, 0)),
             pl.BlockSpec((None, None, s, r), lambda bi, pi: (bi, pi, 0, 0))]
  pair_out = [pl.BlockSpec((None, None, r, d), lambda bi, pi: (bi, pi, 0, 0)),
              pl.BlockSpec((None, None, r), lambda bi, pi: (bi, pi, 0))]
  shapes = [jax.ShapeDtypeStruct((b, p, r, d), jnp.float32),
            jax.ShapeDtypeStruct((b, p, r), jnp.float32)]
  args = [x for out, lse in pairs for x in (out, lse.astype(jnp.float32))]
  if with_counts:
    args.append(counts.astype(jnp.int32))
  merged = pl.pallas_call(
      kernel,
      grid=(b, p),
      in_specs=pair_in * len(pairs) + pair_in[1:] * with_counts,
      out_specs=pair_out * len(pairs) + pair_out[1:] * with_counts,
      out_shape=shapes * len(pairs)
      + [jax.ShapeDtypeStruct((b, p, r), jnp.int32)] * with_counts,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="split_combine",
  )(*args)
  return ([(merged[2 * i], merged[2 * i + 1]) for i in range(len(pairs))],
          merged[-1] if with_counts else None)


def split_combine(out, lse, *, impl: _common.Impl = "auto", interpret: bool = False,
                  num_warps: int = 4):
  """Merges split partials ``out [B, P, S, R, D]``, ``lse [B, P, S, R]`` (f32) over ``S``.

  Returns:
    ``(out [B, P, R, D] f32, lse [B, P, R] f32)``, equal to ``lse_combine(out, lse, axis=2)``.
  """
  (pair,), _ = split_combine_pairs(((out, lse),), impl=impl, interpret=interpret,
                                   num_warps=num_warps)
  return pair
