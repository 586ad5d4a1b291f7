"""RESA's partials over gathered cache slots: the true and the prior softmax sums side by side.

The jnp reference of the RESA decode kernel (``pallas_kernels.sparse_decode_resa``) and the path
``impl="xla"`` runs (``sparse_attn.kernels``). It sits below ``sparse_attn.enhancers`` so the
kernel dispatch never reaches up into the enhancers: ``enhancers.resa`` forms the prior these
functions read.

Letters: B batch, N query heads, H kv heads (or selection heads), R = N / H, S queries per head,
T capacity, L gathered slots, D head dim.
"""

from __future__ import annotations

import jax.numpy as jnp

from sparse_attn import reference
from sparse_attn.cache import gather_blocks
from sparse_attn.selection import Selection

NEG_INF = float("-inf")


def gather_prior(prior, sel: Selection):
  """The prior logits of the selected slots: ``[B,N,T]`` -> ``[B,H,R,L]``."""
  b, n, t = prior.shape
  h = sel.idx.shape[1]
  # [B, H, T, R]: slots first so blocks gather like keys (H plays the kv-head role).
  pr = jnp.swapaxes(prior.reshape(b, h, n // h, t), 2, 3)
  return jnp.swapaxes(gather_blocks(pr, sel.idx, sel.granularity), 2, 3)


def masked_partials(q, kg, vg, ok, pg, scale):
  """True and prior partials of ``q [B,N,S,D]`` over gathered slots with a per-query mask.

  Args:
    q: ``[B, N, S, D]``; kg, vg: ``[B, H, L, D]``; ok: ``[B, H, S, L]`` bool.
    pg: ``[B, H, R, L]`` prior logits of the gathered slots, or None.
    scale: softmax scale.

  Returns:
    ``(out [B,N,S,D] f32, lse [B,N,S])``, the prior pair (or None), ``seen [B,N,S]`` int32 (prior
    members attended) and ``exposed [B,N,S]`` int32 (keys attended).
  """
  b, n, s, d = q.shape
  h = kg.shape[1]
  r = n // h
  # R and S merged into one row axis (XLA:CPU's fast batched-matmul path, see reference.py).
  # [B, H, R, S, L]
  lg = jnp.einsum("bhmd,bhld->bhml", q.reshape(b, h, r * s, d), kg,
                  preferred_element_type=jnp.float32).reshape(b, h, r, s, -1) * scale
  okb = jnp.broadcast_to(ok[:, :, None], lg.shape)
  lg = jnp.where(okb, lg, NEG_INF)
  exposed = jnp.broadcast_to(jnp.sum(ok, -1)[:, :, None], (b, h, r, s)).reshape(b, n, s)
  shape = lambda x: x.reshape(b, n, s, *x.shape[4:])  # [B, H, R, S, ...] -> [B, N, S, ...]
  if pg is None:
    out, lse = reference.softmax_sum(lg, vg)
    return (shape(out), shape(lse)), None, jnp.zeros_like(exposed), exposed.astype(jnp.int32)
  pmask = okb & jnp.isfinite(pg)[:, :, :, None, :]
  pl = jnp.where(pmask, pg[:, :, :, None, :], NEG_INF)
  # True and prior logits stacked on the row axis: one pass over the gathered values.
  # [B, H, 2R, S, D], [B, H, 2R, S]
  both_out, both_lse = reference.softmax_sum(jnp.concatenate([lg, pl], axis=2), vg)
  out, pout = both_out[:, :, :r], both_out[:, :, r:]
  lse, plse = both_lse[:, :, :r], both_lse[:, :, r:]
  seen = jnp.sum(pmask, -1).reshape(b, n, s).astype(jnp.int32)
  return (shape(out), shape(lse)), (shape(pout), shape(plse)), seen, exposed.astype(jnp.int32)
