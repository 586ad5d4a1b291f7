"""Decoding over one buffer that every kv head shares, each slot owned by one head: ``flat_decode``.

Ada-KV's head-adaptive budgets (Feng et al. 2024) keep a different number of tokens per kv head;
``sparse_attn.compression.flat`` stores them in one buffer ``k, v [B, T, D]`` with the owning kv
head of each slot (``head [B, T]``), so no head is padded to the largest. Query head ``n``
attends the valid slots its kv head ``n // G`` owns.

The jnp reference scores every query head against the whole buffer and masks the other heads'
slots: in XLA that can write and read back ``[B, N, T]`` float32 logits and probabilities, up
to as many bytes as the keys and values themselves (``N = 32``, ``D = 128``, bf16). The kernel
is the split-K decode kernel (``_decode_kernel``) in its identity mode over single slots: one
program head whose ``N`` rows are every query head, so each key and value is read once for all
of them, and a per-slot row-bit word marks which rows may use the slot (the bits of its owner's
``G`` query heads, from a ``[K, A]`` table). Beside ``K`` and ``V`` it reads ``4 + 4 A`` bytes a
slot (position, bits); the extra rows cost tensor-core work a memory-bound step has to spare (a
GQA group's rows are padded to 16 anyway). The reads are contiguous: no list is built or read.

Letters: B batch, N query heads, K kv heads, G = N // K, T slots, D head dim, A = ceil(N / 32)
bit words per slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _common
from pallas_kernels._decode_kernel import decode_partials
from pallas_kernels.softmax import (check_softcap, default_scale, scaled_logits,
                                    softmax_sum)

BITS_PER_WORD = 32
# Most splits by default: one program head holds every query row, so batch 1 needs splits alone
# to fill the GPU; up to 128 of them (one per SM of an H100) the split combine holds a row's
# [128, D] partials in registers (sm_90: 149 registers, no spill; 256 spill).
MAX_SPLITS = 128


def _group(num_heads: int, num_kv_heads: int) -> int:
  if num_kv_heads < 1 or num_heads % num_kv_heads:
    raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} kv heads")
  return num_heads // num_kv_heads


def owner_bits_table(num_heads: int, num_kv_heads: int) -> np.ndarray:
  """``[K, A]`` int32: bit ``j`` of word ``a`` of row ``h`` is set iff query head ``32 a + j``
  belongs to kv head ``h`` (the kernel's row-bit layout, ``BITS_PER_WORD`` rows a word)."""
  group = _group(num_heads, num_kv_heads)
  words = -(-num_heads // BITS_PER_WORD)
  table = np.zeros((num_kv_heads, words), np.uint32)
  for n in range(num_heads):
    table[n // group, n // BITS_PER_WORD] |= np.uint32(1 << (n % BITS_PER_WORD))
  return table.view(np.int32)


def flat_decode_reference(q, k, v, head, length, *, num_kv_heads: int,
                          scale: float | None = None, pos=None, softcap: float | None = None,
                          query_pos=None):
  """Plain-jnp ``flat_decode`` (the ``impl="xla"`` path): every query head's masked float32
  softmax over the whole buffer.

  Args: as ``flat_decode``.

  Returns:
    ``out [B, N, D]`` in ``q.dtype`` and ``lse [B, N]`` float32.
  """
  b, n, d = q.shape
  group = _group(n, num_kv_heads)
  length = _common.attended_length(length, query_pos)
  t = k.shape[1]
  ok = jnp.arange(t)[None, :] < length[:, None]  # [B, T]
  if pos is not None:
    ok = ok & (pos >= 0)
  own = head[:, None, :].astype(jnp.int32) == (jnp.arange(n) // group)[None, :, None]
  lg = scaled_logits(q[:, None], k[:, None], default_scale(d, scale), check_softcap(softcap))
  out, lse = softmax_sum(lg, v[:, None], (ok[:, None] & own)[:, None])
  return out[:, 0].astype(q.dtype), lse[:, 0]


@functools.partial(jax.jit, static_argnames=("num_kv_heads", "scale", "num_splits", "impl",
                                             "interpret", "num_warps", "num_stages",
                                             "blocks_per_iter", "softcap"))
def flat_decode(q, k, v, head, length, *, num_kv_heads: int, scale: float | None = None,
                pos=None, softcap: float | None = None, query_pos=None,
                num_splits: int | None = None, impl: _common.Impl = "auto",
                interpret: bool = False, num_warps: int | None = None, num_stages: int = 3,
                blocks_per_iter: int | None = None):
  """Exact attention of one query per head over the slots its kv head owns in a shared buffer.

  Args:
    q: ``[B, N, D]`` queries; query head ``n`` belongs to kv head ``n // (N // K)``.
    k, v: ``[B, T, D]`` the buffer's keys and values (every kv head's slots).
    head: ``[B, T]`` int, the kv head owning each slot (an empty slot's is ignored).
    length: ``[B]`` int32; slots ``>= length`` are never attended.
    num_kv_heads: static ``K``.
    scale: softmax scale (static), default ``1/sqrt(D)``.
    pos: optional ``[B, T]`` int32 token position of each slot, -1 = empty (never attended;
      a compacted buffer has such holes below ``length``).
    softcap: attention-logit soft-cap (static, ``softmax.soft_cap``), None = none.
    query_pos: optional ``[B]`` int32 query positions: a negative one marks a padding row, which
      attends nothing (``0`` / ``-inf``). Every valid slot is taken to be at or before its row's
      query (a decode step's newest token).
    num_splits: most split-K slices (static), default from the problem size, at most
      ``MAX_SPLITS``.
    impl: ``"pallas"``/``"triton"`` (the kernel; ``"mosaic"`` too: Mosaic GPU has no kernel
      over single slots), ``"xla"`` (``flat_decode_reference``) or ``"auto"``
      (``backends.resolve_impl``).
    interpret: run the Pallas kernel in interpret mode (CPU).
    num_warps, num_stages, blocks_per_iter: launch parameters (``num_warps`` default: 4, 8
      above 32 query heads).

  Returns:
    ``out [B, N, D]`` in ``q.dtype`` and ``lse [B, N]`` float32 (``0`` and ``-inf`` for a row
    that attends nothing).
  """
  if _common.resolve_impl(impl, "flat_decode") == "xla":
    return flat_decode_reference(q, k, v, head, length, num_kv_heads=num_kv_heads, scale=scale,
                                 pos=pos, softcap=softcap, query_pos=query_pos)
  b, n, d = q.shape
  table = jnp.asarray(owner_bits_table(n, num_kv_heads))
  owner = jnp.clip(head.astype(jnp.int32), 0, num_kv_heads - 1)
  bits = jnp.take(table, owner, axis=0)[:, None]  # [B, 1, T, A]
  if num_splits is None:
    num_splits = min(MAX_SPLITS, _common.choose_num_splits(
        b, k.shape[1], min_blocks=_common.min_entries_per_split(1)))
  tiles = _common.TileConfig(num_warps=num_warps or (4 if n <= 32 else 8),
                             num_stages=num_stages, num_splits=num_splits,
                             blocks_per_iter=blocks_per_iter)
  out, lse = decode_partials(
      q[:, None], k[:, None], v[:, None], None, None, length,
      pos=None if pos is None else pos[:, None], row_bits=bits, bits_per_word=BITS_PER_WORD,
      block_size=1, scale=default_scale(d, scale), tiles=tiles, interpret=interpret,
      softcap=check_softcap(softcap), query_pos=query_pos)
  return out[:, 0].astype(q.dtype), lse[:, 0]
