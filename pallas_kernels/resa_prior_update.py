"""RESA's prior update of a decode step's write in one launch: ``resa_prior_update`` and its
reference.

RESA (residual estimation) keeps, per query head, the prior logits ``P_j`` of every slot and
max-shifted running sums of the prior set: ``pmax``, ``zsum`` (``Z = e^pmax zsum``), ``osum``
(``Z O_est``), and per kv head the key sum and count (``mu_K``). When a step writes one token per
(batch, kv head) at slot ``s``, the old key's share leaves the sums and the new key's joins them
(``sparse_attn.enhancers.resa.update_prior``, the general form over ``S`` slots). Through XLA
that is a dozen small ops on a GPU (gathers of the old prior, key and value, the new logits, the
rescaled sums, a scatter of the prior), and XLA keeps copies of ``pmax`` / ``zsum`` alive across
the in-place writes. The kernel runs one program per (batch, kv head) over its ``G`` query
heads: it reads the slot's old prior logits, key and value once, updates the sums in registers
and writes them and the slot's new prior logits in place (``input_output_aliases``; with the
state donated nothing is copied). Call it before the cache write (it reads the old row).

Letters: B batch, K kv heads, G query heads per kv head, N = K*G, T slots, D head dim.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.backends import triton_module

plgpu = triton_module()  # jax.experimental.pallas.triton; see backends

NEG_INF = float("-inf")


def resa_prior_update_reference(prior, pmax, zsum, osum, ksum, kcount, mu_q, k, v, k_new, v_new,
                                slot, *, scale: float, incremental: bool):
  """The jnp path (``impl="xla"``) for one new token per (batch, kv head).

  Args:
    prior: ``[B, N, T]`` f32 prior logits (``-inf`` outside the prior set).
    pmax, zsum: ``[B, N]`` f32; osum: ``[B, N, D]`` f32 (``Z O_est``, max-shifted).
    ksum: ``[B, K, D]`` f32; kcount: ``[B, K]`` int32 (keys in the prior set).
    mu_q: ``[B, N, D]`` f32 the typical query.
    k, v: ``[B, K, T, D]`` the cache *before* the write.
    k_new, v_new: ``[B, K, D]`` the new rows; slot: ``[B]`` int32 (out of ``[0, T)``: no write).
    scale: softmax scale (static); incremental: a new slot joins the prior set (static).

  Returns:
    ``(prior, pmax, zsum, osum, ksum, kcount)`` updated.
  """
  b, n, t = prior.shape
  kh = k.shape[1]
  g = n // kh
  ok = (slot >= 0) & (slot < t)  # [B]
  sc = jnp.clip(slot, 0, t - 1).astype(jnp.int32)
  old_p = jnp.take_along_axis(prior, jnp.broadcast_to(sc[:, None, None], (b, n, 1)),
                              axis=-1)[..., 0]  # [B, N]
  old_in = jnp.isfinite(old_p) & ok[:, None]
  new_in = jnp.broadcast_to(ok[:, None], old_in.shape) if incremental else old_in
  rep = lambda x: jnp.repeat(x, g, axis=1)  # [B, K, ...] -> [B, N, ...]
  kn, vn = k_new.astype(jnp.float32), v_new.astype(jnp.float32)
  logit = scale * jnp.sum(mu_q * rep(kn), axis=-1)  # [B, N]
  new_p = jnp.where(new_in, logit, NEG_INF)
  bi, ki = jnp.arange(b)[:, None], jnp.arange(kh)[None, :]
  old_k = k[bi, ki, sc[:, None]].astype(jnp.float32)  # [B, K, D]
  old_v = v[bi, ki, sc[:, None]].astype(jnp.float32)
  new_max = jnp.maximum(pmax, new_p)
  new_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
  rescale = jnp.exp(pmax - new_max)
  w_old = jnp.where(old_in, jnp.exp(old_p - new_max), 0.0)  # [B, N]
  w_new = jnp.where(new_in, jnp.exp(new_p - new_max), 0.0)
  zsum = jnp.maximum(zsum * rescale - w_old + w_new, 0.0)
  osum = (osum * rescale[..., None] - w_old[..., None] * rep(old_v)
          + w_new[..., None] * rep(vn))
  o_k, n_k = old_in[:, ::g], new_in[:, ::g]  # membership is shared by a kv group
  ksum = ksum - o_k[..., None] * old_k + n_k[..., None] * kn
  kcount = (kcount - o_k + n_k).astype(jnp.int32)
  put = jnp.where(ok, sc, t)
  prior = prior.at[jnp.arange(b)[:, None], jnp.arange(n)[None, :], put[:, None]].set(
      new_p, mode="drop")
  return prior, new_max, zsum, osum, ksum, kcount


def _update_kernel(prior_in, pmax_in, zsum_in, osum_in, ksum_in, kcount_in, muq_ref, k_ref,
                   v_ref, knew_ref, vnew_ref, slot_ref, prior_ref, pmax_ref, zsum_ref, osum_ref,
                   ksum_ref, kcount_ref, *, rows: int, t: int, head_dim: int, scale: float,
                   incremental: bool):
  # Refs of one (batch, kv head): prior [G, T], pmax / zsum [G], osum / mu_q [G, D], ksum [D],
  # kcount [], k / v [T, D], k_new / v_new [D], slot [].
  del prior_in, pmax_in, zsum_in, osum_in, ksum_in, kcount_in  # aliased with the outputs
  rp, dp = _common.pad_rows(rows, 1), _common.pad_rows(head_dim, 1)
  r, c = jnp.arange(rp), jnp.arange(dp)
  r_ok, c_ok = r < rows, c < head_dim
  rc_ok = r_ok[:, None] & c_ok[None, :]
  s = slot_ref[()]
  live = (s >= 0) & (s < t)
  sc = jnp.clip(s, 0, t - 1)
  # [G]: the slot's old prior logits (column sc of the [G, T] rows)
  old_p = plgpu.load(prior_ref.at[r, sc], mask=r_ok, other=NEG_INF)
  old_in = (old_p > NEG_INF) & live & r_ok
  new_in = (live & r_ok) if incremental else old_in
  kn = plgpu.load(knew_ref.at[pl.ds(0, dp)], mask=c_ok, other=0).astype(jnp.float32)
  vn = plgpu.load(vnew_ref.at[pl.ds(0, dp)], mask=c_ok, other=0).astype(jnp.float32)
  old_k = plgpu.load(k_ref.at[sc, pl.ds(0, dp)], mask=c_ok, other=0).astype(jnp.float32)
  old_v = plgpu.load(v_ref.at[sc, pl.ds(0, dp)], mask=c_ok, other=0).astype(jnp.float32)
  mu_q = plgpu.load(muq_ref.at[pl.ds(0, rp), pl.ds(0, dp)], mask=rc_ok, other=0)
  new_p = jnp.where(new_in, scale * jnp.sum(mu_q * kn[None, :], axis=1), NEG_INF)  # [G]
  pmax = plgpu.load(pmax_ref.at[pl.ds(0, rp)], mask=r_ok, other=0)
  new_max = jnp.maximum(pmax, new_p)
  new_max = jnp.where(new_max > NEG_INF, new_max, 0.0)  # pmax is finite: never +inf
  rescale = jnp.exp(pmax - new_max)
  w_old = jnp.where(old_in, jnp.exp(old_p - new_max), 0.0)
  w_new = jnp.where(new_in, jnp.exp(new_p - new_max), 0.0)
  zsum = plgpu.load(zsum_ref.at[pl.ds(0, rp)], mask=r_ok, other=0)
  osum = plgpu.load(osum_ref.at[pl.ds(0, rp), pl.ds(0, dp)], mask=rc_ok, other=0)
  zsum = jnp.maximum(zsum * rescale - w_old + w_new, 0.0)
  osum = (osum * rescale[:, None] - w_old[:, None] * old_v[None, :]
          + w_new[:, None] * vn[None, :])
  # Membership is shared by the group: row 0's flags are the kv head's.
  o_k = jnp.sum(jnp.where(r == 0, old_in, False).astype(jnp.int32))
  n_k = jnp.sum(jnp.where(r == 0, new_in, False).astype(jnp.int32))
  ksum = plgpu.load(ksum_ref.at[pl.ds(0, dp)], mask=c_ok, other=0)
  ksum = ksum - o_k.astype(jnp.float32) * old_k + n_k.astype(jnp.float32) * kn
  plgpu.store(prior_ref.at[r, sc], new_p, mask=r_ok & live)
  plgpu.store(pmax_ref.at[pl.ds(0, rp)], new_max, mask=r_ok)
  plgpu.store(zsum_ref.at[pl.ds(0, rp)], zsum, mask=r_ok)
  plgpu.store(osum_ref.at[pl.ds(0, rp), pl.ds(0, dp)], osum, mask=rc_ok)
  plgpu.store(ksum_ref.at[pl.ds(0, dp)], ksum, mask=c_ok)
  kcount_ref[()] = kcount_ref[()] - o_k + n_k


@functools.partial(jax.jit, static_argnames=("scale", "incremental", "impl", "interpret"))
def resa_prior_update(prior, pmax, zsum, osum, ksum, kcount, mu_q, k, v, k_new, v_new, slot, *,
                      scale: float, incremental: bool, impl: _common.Impl = "auto",
                      interpret: bool = False):
  """RESA's prior update for one token per (batch, kv head) written at ``slot``, in one launch
  (in place where the state is donated).

  Args: as ``resa_prior_update_reference``; ``impl``: ``"pallas"``/``"triton"``/``"mosaic"``
    (Triton: no Mosaic twin), ``"xla"`` or ``"auto"`` (``backends.resolve_impl``);
    ``interpret``: run the kernel in interpret mode (CPU).

  Returns:
    ``(prior, pmax, zsum, osum, ksum, kcount)`` updated.
  """
  kw = dict(scale=scale, incremental=incremental)
  if _common.resolve_impl(impl, "resa_prior_update") == "xla":
    return resa_prior_update_reference(prior, pmax, zsum, osum, ksum, kcount, mu_q, k, v, k_new,
                                       v_new, slot, **kw)
  b, n, t = prior.shape
  kh, d = k.shape[1], k.shape[3]
  g = n // kh
  grp = lambda x: x.reshape(b, kh, g, *x.shape[2:])  # [B, N, ...] -> [B, K, G, ...]
  spec = lambda *tail: pl.BlockSpec((None, None, *tail),
                                    lambda bi, hi: (bi, hi) + (0,) * len(tail))
  per_batch = pl.BlockSpec((None,), lambda bi, hi: (bi,))
  state_specs = [spec(g, t), spec(g), spec(g), spec(g, d), spec(d), spec()]
  state = (grp(prior), grp(pmax), grp(zsum), grp(osum), ksum, kcount.astype(jnp.int32))
  kernel = functools.partial(_update_kernel, rows=g, t=t, head_dim=d, incremental=incremental,
                             scale=float(scale))
  out = pl.pallas_call(
      kernel,
      out_shape=tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state),
      grid=(b, kh),
      in_specs=state_specs + [spec(g, d), spec(t, d), spec(t, d), spec(d), spec(d), per_batch],
      out_specs=tuple(state_specs),
      input_output_aliases={i: i for i in range(6)},
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
      name="resa_prior_update",
  )(*state, grp(mu_q.astype(jnp.float32)), k, v, k_new.astype(k.dtype), v_new.astype(v.dtype),
    slot.astype(jnp.int32))
  prior, pmax, zsum, osum, ksum, kcount = out
  return (prior.reshape(b, n, t), pmax.reshape(b, n), zsum.reshape(b, n), osum.reshape(b, n, d),
          ksum, kcount)
