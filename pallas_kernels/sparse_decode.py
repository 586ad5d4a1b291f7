"""Sparse flash-decoding over a list of selected KV blocks: ``sparse_decode`` and its reference.

One query per head attends exactly the listed blocks of its kv head (Quest / ArkVale style block
selection), with token-level masking of slots ``>= length`` and of empty slots (``pos < 0``, a
compacted cache's holes). The Pallas path runs one program per (batch, kv head, split) over the kv
head's list (the union of its query heads' lists for per-head selection) and merges the splits by
log-sum-exp (flash-decoding).

Letters: B batch, N query heads (Hq), K kv heads (Hkv), G = N // K, H selection heads (K or N),
n list length, T cache slots, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels import _union
from pallas_kernels._decode_kernel import decode_partials
from pallas_kernels.softmax import default_scale, softmax_sum


def selection_rows(hq: int, hkv: int, hs: int) -> int:
  """Query heads sharing one selection list: ``G`` (group-shared) or 1 (per query head)."""
  if hq % hkv or hs not in (hkv, hq):
    raise ValueError(f"selection heads {hs} must be Hkv={hkv} or Hq={hq} (Hq % Hkv == 0)")
  return hq // hs


def kv_head_lists(block_idx, n_valid, hq: int, hkv: int, num_blocks: int, payload=None):
  """The block list of each kv head's program: as given (group-shared selection) or the union
  of the group's G per-query-head lists (``_union.union_lists``).

  Returns:
    ``idx [B, K, U]``, ``n_valid [B, K]`` and the per-head words ``[B, K, U, G]`` of the union
    (``None`` for group-shared lists).
  """
  if block_idx.shape[1] == hkv:
    return block_idx, n_valid, None
  return _union.union_lists(block_idx, n_valid, hq // hkv, num_blocks, payload)


def sparse_decode_reference(q, k, v, block_idx, n_valid, length, *, block_size: int,
                            scale: float | None = None, pos=None):
  """Plain-jnp sparse decode: gather the listed blocks, masked softmax in float32.

  Args: as ``sparse_decode``.

  Returns:
    ``out [B, N, D]`` in ``q.dtype`` and ``lse [B, N]`` float32.
  """
  b, hq, d = q.shape
  hs = block_idx.shape[1]
  rows = selection_rows(hq, k.shape[1], hs)
  scale = default_scale(d, scale)
  # [B, H, L, D] with L = n * block_size
  kg = _common.gather_blocks(k, block_idx, block_size)
  vg = _common.gather_blocks(v, block_idx, block_size)
  ok, _ = _common.listed_slots_ok(block_idx, n_valid, length, block_size, pos)
  # [B, H, R, D]
  qr = q.reshape(b, hs, rows, d)
  # [B, H, R, L]
  logits = jnp.einsum("bhrd,bhld->bhrl", qr.astype(jnp.float32), kg.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) * scale
  out, lse = softmax_sum(logits, vg, ok=ok[:, :, None, :])
  return out.reshape(b, hq, d).astype(q.dtype), lse.reshape(b, hq)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "num_splits", "impl",
                                             "interpret", "num_warps", "num_stages",
                                             "blocks_per_iter"))
def sparse_decode(q, k, v, block_idx, n_valid, length, *, block_size: int,
                  scale: float | None = None, num_splits: int | None = None, impl: str = "auto",
                  interpret: bool = False, num_warps: int = 4, num_stages: int = 3,
                  blocks_per_iter: int | None = None, pos=None):
  """Exact attention of one query per head over the listed KV blocks.

  Args:
    q: ``[B, N, D]`` queries.
    k, v: ``[B, K, T, D]`` cache, ``T`` a multiple of ``block_size``.
    block_idx: ``[B, H, n]`` int32 block ids, ``H = K`` (all G query heads of kv head ``h`` use
      list ``h``) or ``H = N`` (query head ``h`` uses its own list, reading kv head ``h // G``).
      Ids are distinct; entries at ``i >= n_valid`` are ignored.
    n_valid: ``[B, H]`` int32 number of valid list entries.
    length: ``[B]`` int32; slots ``>= length`` are never attended.
    pos: optional ``[B, K, T]`` int32 token position held by each slot (``KVCache.pos``; -1 =
      empty, never attended: a compacted cache has such holes below ``length``). None: every
      slot below ``length`` holds a token.
    block_size: tokens per block (static; a power of 2 >= 16).
    scale: softmax scale (static), default ``1/sqrt(D)``.
    num_splits: most split-K slices (static), default from the problem size; fewer are used
      when ``n_valid`` is short.
    impl: ``"pallas"``, ``"xla"`` (``sparse_decode_reference``) or ``"auto"``.
    interpret: run the Pallas kernel in interpret mode (CPU).
    num_warps, num_stages: Triton launch parameters.
    blocks_per_iter: blocks gathered per loop iteration (static), default from shared memory.

  Per-query-head lists (``H = N``) run one program per kv head over the union of the group's
  lists with a per-head mask, so a block listed by several heads is read once.

  Returns:
    ``out [B, N, D]`` in ``q.dtype`` and ``lse [B, N]`` float32 (``0`` and ``-inf`` for a row
    that attends nothing).
  """
  _common.check_block_size(block_size, k.shape[2])
  if _common.resolve_impl(impl) == "xla":
    return sparse_decode_reference(q, k, v, block_idx, n_valid, length, block_size=block_size,
                                   scale=scale, pos=pos)
  b, hq, d = q.shape
  hkv, n = k.shape[1], block_idx.shape[2]
  selection_rows(hq, hkv, block_idx.shape[1])
  if n == 0:
    return jnp.zeros_like(q), jnp.full((b, hq), -jnp.inf, jnp.float32)
  idx, nv, words = kv_head_lists(block_idx, n_valid, hq, hkv, k.shape[2] // block_size)
  tiles = _common.TileConfig(num_warps=num_warps, num_stages=num_stages, num_splits=num_splits,
                             blocks_per_iter=blocks_per_iter)
  [(out, lse)] = decode_partials(
      q.reshape(b, hkv, hq // hkv, d), k, v, idx, nv, length, pos=pos,
      row_bits=None if words is None else _union.head_bits(words), bits_per_word=hq // hkv,
      block_size=block_size, scale=default_scale(d, scale), tiles=tiles, interpret=interpret)
  return out.reshape(b, hq, d).astype(q.dtype), lse.reshape(b, hq)
