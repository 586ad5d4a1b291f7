"""The split-K combine of the decode kernels as a second small Pallas pass: ``split_combine``.

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


def _combine_kernel(out_ref, lse_ref, o_ref, l_ref, *, splits: int, rows: int, head_dim: int):
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
  out = jnp.where(ok[:, None], out, 0.0)
  plgpu.store(o_ref.at[pl.ds(0, rp), pl.ds(0, dp)], out,
              mask=(r < rows)[:, None] & (c < head_dim)[None, :])
  plgpu.store(l_ref.at[pl.ds(0, rp)], jnp.where(ok, m_safe + jnp.log(safe), NEG_INF),
              mask=r < rows)


@functools.partial(jax.jit, static_argnames=("impl", "interpret", "num_warps"))
def split_combine(out, lse, *, impl: _common.Impl = "auto", interpret: bool = False,
                  num_warps: int = 4):
  """Merges split partials ``out [B, P, S, R, D]``, ``lse [B, P, S, R]`` (f32) over ``S``.

  Returns:
    ``(out [B, P, R, D] f32, lse [B, P, R] f32)``, equal to ``lse_combine(out, lse, axis=2)``.
  """
  if _common.resolve_impl(impl) == "xla":
    return lse_combine(out, lse, axis=2)
  b, p, s, r, d = out.shape
  if s == 1:  # nothing to merge: a split's partial is already normalised
    return out[:, :, 0].astype(jnp.float32), lse[:, :, 0].astype(jnp.float32)
  kernel = functools.partial(_combine_kernel, splits=s, rows=r, head_dim=d)
  return pl.pallas_call(
      kernel,
      grid=(b, p),
      in_specs=[pl.BlockSpec((None, None, s, r, d), lambda bi, pi: (bi, pi, 0, 0, 0)),
                pl.BlockSpec((None, None, s, r), lambda bi, pi: (bi, pi, 0, 0))],
      out_specs=[pl.BlockSpec((None, None, r, d), lambda bi, pi: (bi, pi, 0, 0)),
                 pl.BlockSpec((None, None, r), lambda bi, pi: (bi, pi, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, p, r, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, p, r), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="split_combine",
  )(out, lse.astype(jnp.float32))
