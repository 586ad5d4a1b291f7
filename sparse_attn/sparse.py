"""Sparse decode attention over a selection: gather the selected entries, attend them exactly.

Letters: B batch, K kv heads, Hq query heads, H selection heads, n list length, g granularity.
This jnp path is the reference the Pallas kernels are checked against, and the CPU fast path:
it reads only the selected blocks (a gather), never a mask over the whole cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_attn import reference
from sparse_attn.cache import KVCache
from sparse_attn.selection import Selection

IMPLS = ("auto", "pallas", "xla")


def resolve_impl(impl: str) -> str:
  """``auto`` -> ``pallas`` on a GPU backend, ``xla`` elsewhere."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if impl == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "xla"
  return impl


def take_blocks(x, block_idx, block_size):
  """``cache.gather_blocks`` as one row gather over a flattened ``[B*K*N, block_size, ...]`` view.

  Same contract and result as ``sparse_attn.cache.gather_blocks`` (``x [B, K, T, ...]``,
  ``block_idx [B, H, n]`` clipped into range -> ``[B, H, n * block_size, ...]``), but XLA:CPU
  lowers a gather of contiguous rows with one flat index to a row copy loop: 1-5x faster than
  the three-index advanced indexing at Llama-8B decode shapes (32k context, 13.5 MB gathered:
  3.9 ms -> 0.75 ms in the best run, on a loaded 2-core machine).
  """
  b, hkv, t = x.shape[:3]
  h, n = block_idx.shape[1], block_idx.shape[2]
  if h % hkv:
    raise ValueError(f"selection has {h} heads, not a multiple of {hkv} kv heads")
  nb = t // block_size
  rows = x.reshape(b * hkv * nb, block_size, *x.shape[3:])
  kv_head = jnp.arange(h, dtype=jnp.int32) // (h // hkv)
  # [B, H, n] flat row ids
  flat = ((jnp.arange(b, dtype=jnp.int32)[:, None, None] * hkv + kv_head[None, :, None]) * nb
          + jnp.clip(block_idx, 0, nb - 1).astype(jnp.int32))
  out = jnp.take(rows, flat.reshape(-1), axis=0, mode="clip")
  return out.reshape(b, h, n * block_size, *x.shape[3:])


def gather_selection(cache: KVCache, sel: Selection):
  """Keys, values and the attend mask of the selected entries.

  Returns:
    ``k, v [B, H, n*g, D]``, ``ok [B, H, n*g]`` bool (entry valid, slot in use), and the token
    positions ``pos [B, H, n*g]`` of the gathered slots.
  """
  g = sel.granularity
  k = take_blocks(cache.k, sel.idx, g)
  v = take_blocks(cache.v, sel.idx, g)
  pos = take_blocks(cache.pos, sel.idx, g)
  slot = sel.idx[..., None] * g + jnp.arange(g)
  slot = slot.reshape(*sel.idx.shape[:2], -1)
  listed = jnp.arange(sel.idx.shape[-1])[None, None, :] < sel.n_valid[..., None]
  listed = jnp.repeat(listed, g, axis=-1)
  ok = listed & (pos >= 0) & (slot < cache.length[:, None, None])
  return k, v, ok, pos


def sparse_decode(q, cache: KVCache, sel: Selection, scale=None, *, impl: str = "xla",
                  interpret: bool = False):
  """Exact attention of one query per head over the selected entries.

  Args:
    q: ``[B, Hq, D]`` queries (Hq a multiple of the selection's H).
    cache: the layer cache.
    sel: the selection (``idx [B, H, n]``).
    scale: softmax scale (default ``1/sqrt(D)``).
    impl: ``"xla"`` (this jnp path), ``"pallas"`` (the Triton kernel; block selections only) or
      ``"auto"``.
    interpret: run the Pallas kernel in interpret mode.

  Returns:
    ``out [B, Hq, D]`` (q.dtype) and ``lse [B, Hq]`` float32.
  """
  if resolve_impl(impl) == "pallas" and sel.granularity == cache.block_size:
    import pallas_kernels  # pylint: disable=g-import-not-at-top (optional GPU path)
    return pallas_kernels.sparse_decode(q, cache.k, cache.v, sel.idx, sel.n_valid, cache.length,
                            block_size=cache.block_size, scale=scale, impl="pallas",
                            interpret=interpret)
  b, hq, d = q.shape
  h = sel.idx.shape[1]
  if hq % h:
    raise ValueError(f"selection heads {h} do not divide query heads {hq}")
  k, v, ok, _ = gather_selection(cache, sel)
  qg = q.reshape(b, h, hq // h, 1, d)
  out, lse = reference.grouped_attention(qg, k, v, ok[:, :, None, None, :], scale)
  return out.reshape(b, hq, d), lse.reshape(b, hq)
