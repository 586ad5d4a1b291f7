"""Sparse decode attention over a selection (jnp): gather the selected entries, attend exactly.

Letters: B batch, K kv heads, Hq query heads, H selection heads, n list length, g granularity.
This jnp path is the reference the Pallas kernels are checked against and the CPU fast path
(``sparse_attn.kernels`` chooses between them):
it reads only the selected blocks (a gather), never a mask over the whole cache.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import listed_slots_ok
from sparse_attn import reference
from sparse_attn.cache import KVCache, gather_blocks
from sparse_attn.selection import Selection


def mask_rows(out, lse, positions):
  """Rows whose query is padding attended nothing: ``out = 0``, ``lse = -inf``.

  A selection is chosen per head without looking at the query's position, so a padding row
  (``positions [B] < 0``) would attend whatever its query selected; this enforces the
  ``(out, lse)`` contract of an empty row (DESIGN invariant 7) on every sparse path.

  Args:
    out: ``[B, Hq, ..., D]``; lse: ``[B, Hq, ...]``; positions: ``[B]`` int.
  """
  live = (positions >= 0).reshape((-1,) + (1,) * (lse.ndim - 1))
  return jnp.where(live[..., None], out, 0).astype(out.dtype), jnp.where(live, lse, -jnp.inf)


def gather_selection(cache: KVCache, sel: Selection):
  """Keys, values and the attend mask of the selected entries.

  Returns:
    ``k, v [B, H, n*g, D]``, ``ok [B, H, n*g]`` bool (entry valid, slot in use), and the token
    positions ``pos [B, H, n*g]`` of the gathered slots.
  """
  g = sel.granularity
  k = gather_blocks(cache.k, sel.idx, g)
  v = gather_blocks(cache.v, sel.idx, g)
  # The kernels' rule: listed, slot < length, pos >= 0.
  ok, pos = listed_slots_ok(sel.idx, sel.n_valid, cache.length, g, cache.pos)
  return k, v, ok, pos


def attend_selection(q, cache: KVCache, sel: Selection, scale=None):
  """The jnp path of ``kernels.sparse_decode``: exact attention of one query per head over the
  selected entries (a gather of the listed blocks, never a mask over the whole cache).

  Args:
    q: ``[B, Hq, D]`` queries (Hq a multiple of the selection's H).
    cache: the layer cache; sel: the selection (``idx [B, H, n]``).
    scale: softmax scale (default ``1/sqrt(D)``).

  Returns:
    ``out [B, Hq, D]`` (q.dtype) and ``lse [B, Hq]`` float32.
  """
  b, hq, d = q.shape
  h = sel.idx.shape[1]
  if hq % h:
    raise ValueError(f"selection heads {h} do not divide query heads {hq}")
  k, v, ok, _ = gather_selection(cache, sel)
  qg = q.reshape(b, h, hq // h, 1, d)
  out, lse = reference.grouped_attention(qg, k, v, ok[:, :, None, None, :], scale)
  return out.reshape(b, hq, d), lse.reshape(b, hq)
