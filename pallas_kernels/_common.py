"""Shared helpers of the Pallas kernels: impl dispatch, padding, split heuristic, tiles, combine.

Letters: B batch, K kv heads, P program heads (K for group-shared selection, N = query heads for
per-head selection), R query rows of one program (group heads x window queries), n list length,
S splits, T cache slots, D head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# pylint: disable-next=unused-import
from pallas_kernels.backends import IMPLS, Impl, list_op, resolve_impl

# Triton's tl.dot needs every operand dimension >= 16.
MIN_DOT_ROWS = 16
# Programs wanted in flight: 2 waves of an H100's 132 SMs.
TARGET_PROGRAMS = 264
# Fewest list entries a split should own: below this the fixed cost of a program (prologue,
# pipeline fill, partial write + combine) is no longer amortised over its loads.
MIN_BLOCKS_PER_SPLIT = 16
# The same floor in tokens, for lists of smaller entries (token lists: one slot an entry).
MIN_TOKENS_PER_SPLIT = 256
# Shared memory a decode program may fill with its K/V ring (stages x tile), so that two programs
# fit on one H100 SM (228 KB per SM, 227 KB per block).
KV_RING_BYTES = 112 * 1024
# Tokens gathered per decode loop iteration, at most (J = tokens / block_size blocks).
MAX_TOKENS_PER_ITER = 128


def next_pow2(x: int) -> int:
  """Smallest power of 2 >= ``x`` (1 for ``x <= 1``)."""
  return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def pad_rows(rows: int, minimum: int = MIN_DOT_ROWS) -> int:
  """Row count of a register tile: a power of 2, at least ``minimum`` (tl.dot's 16)."""
  return max(minimum, next_pow2(rows))


def tokens_per_iter(head_dim: int, itemsize: int, num_stages: int) -> int:
  """Tokens per decode iteration (a power of 2, 16..128): the K and V tiles of every pipeline
  stage fit ``KV_RING_BYTES`` of shared memory."""
  per_token = 2 * pad_rows(head_dim) * itemsize * max(num_stages, 1)
  fit = max(MIN_DOT_ROWS, KV_RING_BYTES // per_token)
  return min(MAX_TOKENS_PER_ITER, 1 << (fit.bit_length() - 1))


def choose_num_splits(num_programs: int, n_blocks: int, *, target: int = TARGET_PROGRAMS,
                      min_blocks: int = MIN_BLOCKS_PER_SPLIT) -> int:
  """Split-K count for a decode kernel with ``num_programs`` (batch x heads) programs.

  Enough splits to fill ``target`` programs, but never fewer than ``min_blocks`` list entries a
  split (flash-decoding's rule: split only when batch x heads cannot fill the GPU).
  """
  if n_blocks <= 0:
    return 1
  want = -(-target // max(num_programs, 1))
  cap = max(1, n_blocks // min_blocks)
  return int(max(1, min(want, cap)))


def min_entries_per_split(entry_size: int) -> int:
  """Fewest list entries of ``entry_size`` slots a split should own: ``MIN_BLOCKS_PER_SPLIT``
  blocks, and at least ``MIN_TOKENS_PER_SPLIT`` tokens for smaller entries (token lists)."""
  return max(MIN_BLOCKS_PER_SPLIT, MIN_TOKENS_PER_SPLIT // entry_size)


def split_bounds(n_valid, split, *, list_len: int, max_splits: int, blocks_per_iter: int,
                 min_blocks: int = MIN_BLOCKS_PER_SPLIT):
  """``[lo, hi)`` list entries of split ``split`` given the dynamic ``n_valid`` (traced ints).

  ``ceil(n_valid / min_blocks)`` splits (at most ``max_splits``, at least 1) share the list in
  slices of a multiple of ``blocks_per_iter`` entries; splits past them get ``lo == hi``.
  """
  nv = jnp.clip(n_valid, 0, list_len)
  used = jnp.clip((nv + min_blocks - 1) // min_blocks, 1, max_splits)
  chunk = (nv + used - 1) // used
  chunk = (chunk + blocks_per_iter - 1) // blocks_per_iter * blocks_per_iter
  lo = jnp.minimum(split * chunk, nv)
  return lo, jnp.minimum(lo + chunk, nv)


def check_entry_size(entry_size: int, t: int) -> int:
  """Validates the slots per list entry of a decode kernel: a block size
  (``check_block_size``) or 1, a token list (its tiles gather ``MIN_DOT_ROWS`` or more single
  slots); returns the entries a kv head has."""
  if entry_size == 1:
    return t
  return check_block_size(entry_size, t)


def check_block_size(block_size: int, t: int) -> int:
  """Validates ``block_size`` (a power of 2, >= 16 for tl.dot) against capacity ``t``; returns NB."""
  if block_size < 16 or block_size & (block_size - 1):
    raise ValueError(f"block_size must be a power of 2 >= 16, got {block_size}")
  if t % block_size:
    raise ValueError(f"cache capacity {t} is not a multiple of block_size {block_size}")
  return t // block_size


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Static launch configuration of a kernel (hashable: a jit static argument).

  Attributes:
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages (3: two K/V tiles in flight while one is used).
    num_splits: split-K count of the decode kernels (``None``: ``choose_num_splits``); the most
      splits a list may use, the kernel uses fewer for a short ``n_valid``.
    blocks_per_iter: listed blocks gathered per decode iteration (``None``: ``tokens_per_iter``).
    block_nb: blocks scored per program by ``block_score`` (a power of 2).
  """
  num_warps: int = 4
  num_stages: int = 3
  num_splits: int | None = None
  block_nb: int = 64
  blocks_per_iter: int | None = None

  def __post_init__(self):
    if self.block_nb < 16 or self.block_nb & (self.block_nb - 1):
      raise ValueError(f"block_nb must be a power of 2 >= 16, got {self.block_nb}")
    if self.blocks_per_iter is not None and (
        self.blocks_per_iter < 1 or self.blocks_per_iter & (self.blocks_per_iter - 1)):
      raise ValueError(f"blocks_per_iter must be a power of 2 >= 1, got {self.blocks_per_iter}")
    if self.num_splits is not None and self.num_splits < 1:
      raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")


# ----------------------------------------------------------------- reference building blocks


def gather_blocks(x, block_idx, block_size: int):
  """Gathers listed blocks of a cache without copying the whole cache.

  One row gather over a flattened ``[B*K*N, block_size, ...]`` view: XLA:CPU lowers a gather of
  contiguous rows with one flat index to a row-copy loop, 1-5x faster than three-index advanced
  indexing at Llama-8B decode shapes (32k context, 13.5 MB gathered).

  Args:
    x: ``[B, K, T, ...]`` cache array (keys, values, positions, or ``[B, P, T]`` priors).
    block_idx: ``[B, P, n]`` block ids, ``P`` a multiple of ``K``; program head ``p`` reads
      head ``p // (P // K)``. Ids are clipped into range.
    block_size: tokens per block (1 for token lists).

  Returns:
    ``[B, P, n * block_size, ...]`` the listed blocks' slots, in list order.
  """
  b, k, t = x.shape[:3]
  p, n = block_idx.shape[1:]
  if t % block_size:
    raise ValueError(f"capacity {t} is not a multiple of block_size {block_size}")
  if p % k:
    raise ValueError(f"selection has {p} heads, not a multiple of {k} kv heads")
  nb = t // block_size
  rows = x.reshape(b * k * nb, block_size, *x.shape[3:])
  kv_head = jnp.arange(p, dtype=jnp.int32) // (p // k)
  # [B, P, n] flat row ids
  flat = ((jnp.arange(b, dtype=jnp.int32)[:, None, None] * k + kv_head[None, :, None]) * nb
          + jnp.clip(block_idx, 0, nb - 1).astype(jnp.int32))
  out = jnp.take(rows, flat.reshape(-1), axis=0, mode="clip")
  return out.reshape(b, p, n * block_size, *x.shape[3:])


def listed_slots_ok(block_idx, n_valid, length, block_size: int, pos=None):
  """Which gathered slots may be attended: listed (``i < n_valid``), before ``length`` and
  holding a token (``pos >= 0``; the kernels' rule and ``KVCache.valid``).

  Args:
    block_idx: ``[B, P, n]``; n_valid: ``[B, P]``; length: ``[B]``.
    block_size: tokens per block.
    pos: optional ``[B, K, T]`` token position of each slot (-1 = empty); None: ``pos = slot``.

  Returns:
    ``ok [B, P, n * block_size]`` bool and the token positions ``[B, P, n * block_size]`` int32
    of the gathered slots (their slot ids when ``pos`` is None).
  """
  b, p, n = block_idx.shape
  # [B, P, n, bs]
  slot = block_idx[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)
  listed = (jnp.arange(n) < n_valid[..., None])[..., None]
  ok = (listed & (slot < length[:, None, None, None])).reshape(b, p, -1)
  if pos is None:
    return ok, slot.reshape(b, p, -1)
  pos_g = gather_blocks(pos, block_idx, block_size).astype(jnp.int32)
  return ok & (pos_g >= 0), pos_g


def attended_length(length, query_pos=None):
  """The slots a row may attend: ``length``, or 0 where the row's query is padding
  (``query_pos < 0``: an inactive row attends nothing). ``[B]`` arrays, or one row's scalars
  inside a kernel; ``query_pos`` None: every row is live."""
  return length if query_pos is None else jnp.where(query_pos >= 0, length, 0)


def empty_padding_rows(out, lse, query_pos):
  """``(out, lse)`` with the rows of padding queries (``query_pos [B] < 0``) empty: ``0`` and
  ``-inf``, the result of attending nothing (an epilogue such as RESA's would otherwise give
  such a row its estimate). ``out [B, ..., D]``, ``lse [B, ...]``; ``query_pos`` None: as
  given."""
  if query_pos is None:
    return out, lse
  live = (query_pos >= 0).reshape((-1,) + (1,) * (lse.ndim - 1))
  return (jnp.where(live[..., None], out, 0).astype(out.dtype),
          jnp.where(live, lse, -jnp.inf).astype(lse.dtype))


def order_after(x, *reads):
  """``x`` unchanged, made data-dependent on ``reads`` (so XLA computes them first).

  The dependency is ``x + 0 * isnan(sum(read))``: exactly zero for any read (inf and NaN
  included), and not folded away by XLA (``0 * y`` is not simplified for floats). A kernel
  orders itself without ops by taking the reads as operands instead (``cache_append``'s
  ``after``); this is the jnp form (``sparse_attn.ordering``).
  """
  dep = jnp.zeros((), jnp.float32)
  for r in jax.tree.leaves(reads):
    dep = dep + jnp.isnan(jnp.sum(r.astype(jnp.float32))).astype(jnp.float32)
  if jnp.issubdtype(x.dtype, jnp.floating):
    return x + (dep * 0).astype(x.dtype)
  return x + (dep * 0).astype(jnp.int32).astype(x.dtype)
