"""Per-query-head block lists served per kv head: the union of a group's lists plus row words.

With per-query-head selection the G heads of a group list overlapping blocks (Quest's top blocks
of neighbouring heads mostly agree). One program per query head would read a shared block G
times; one program per kv head over the union of the G lists, with a per-(entry, head) mask,
reads it once. ``union_lists`` builds that union with one sort per kv head (jit / vmap safe, no
data-dependent shapes): the union has at most ``G * n`` entries, valid ones first.

Letters: B batch, N query heads, K kv heads, G = N // K, n list length, U = G * n.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_GROUP = 32  # one bit per head in an int32 word


def union_lists(block_idx, n_valid, group: int, num_blocks: int, payload=None):
  """Union of each group's G per-head block lists.

  Args:
    block_idx: ``[B, N, n]`` int32 per-query-head block lists (distinct ids per list).
    n_valid: ``[B, N]`` int32 valid entries per list.
    group: ``G`` (static); heads ``k * G .. k * G + G - 1`` share kv head ``k``.
    num_blocks: cache blocks (static); ids are clipped into ``[0, num_blocks)``.
    payload: optional ``[B, N, n]`` int32 per-(head, entry) word carried into the union (nonzero
      words only; default 1 = "listed").

  Returns:
    ``idx [B, K, U]`` int32 union block ids (ascending, valid ones first), ``n_union [B, K]``
    int32, and ``words [B, K, U, G]`` int32: head ``g``'s payload for union entry ``u`` (0 when
    head ``g`` does not list it).
  """
  b, hq, n = block_idx.shape
  if hq % group:
    raise ValueError(f"{hq} query heads are not a multiple of the group size {group}")
  kh, u = hq // group, group * n
  listed = jnp.arange(n)[None, None, :] < n_valid[..., None]
  # Unlisted entries sort last under the sentinel id num_blocks.
  blk = jnp.where(listed, jnp.clip(block_idx, 0, num_blocks - 1), num_blocks).astype(jnp.int32)
  head = jnp.broadcast_to((jnp.arange(hq, dtype=jnp.int32) % group)[None, :, None], blk.shape)
  word = jnp.ones_like(blk) if payload is None else payload.astype(jnp.int32)
  word = jnp.where(listed, word, 0)
  # [B, K, U], sorted by (block, head)
  key = (blk * group + head).reshape(b, kh, u)
  key, word = jax.lax.sort((key, word.reshape(b, kh, u)), dimension=2, num_keys=1)
  blk_s, head_s = key // group, key % group
  first = jnp.concatenate([jnp.ones((b, kh, 1), bool), blk_s[..., 1:] != blk_s[..., :-1]], -1)
  # A repeated (block, head) pair (a list with a duplicate id) contributes once.
  dup = jnp.concatenate([jnp.zeros((b, kh, 1), bool), key[..., 1:] == key[..., :-1]], -1)
  seg = jnp.cumsum(first, axis=-1, dtype=jnp.int32) - 1
  # Each store below has its own target (the rest go to distinct out-of-range slots and are
  # dropped), so the scatters are unique-index: plain stores on a GPU, no atomics.
  off = u + jnp.arange(u, dtype=jnp.int32)
  bi = jnp.arange(b)[:, None, None]
  ki = jnp.arange(kh)[None, :, None]
  idx = jnp.full((b, kh, u), num_blocks, jnp.int32).at[bi, ki, jnp.where(first, seg, off)].set(
      blk_s, mode="drop", unique_indices=True)
  # The first entry of each (block, head) pair carries the head's word; a repeated pair (a list
  # with a duplicate id) and the unlisted entries store nothing.
  keep = ~dup & (blk_s < num_blocks)
  flat = jnp.where(keep, seg * group + head_s, u * group + off)
  words = jnp.zeros((b, kh, u * group), jnp.int32).at[bi, ki, flat].set(
      word, mode="drop", unique_indices=True).reshape(b, kh, u, group)
  n_union = jnp.sum(first & (blk_s < num_blocks), axis=-1, dtype=jnp.int32)
  return jnp.minimum(idx, num_blocks - 1), n_union, words


def head_bits(words):
  """``[..., G]`` per-head words -> ``[..., 1]`` int32 with bit ``g`` set where word ``g != 0``."""
  g = words.shape[-1]
  if g > MAX_GROUP:
    raise ValueError(f"per-head selection supports groups of at most {MAX_GROUP}, got {g}")
  bits = jnp.left_shift(jnp.int32(1), jnp.arange(g, dtype=jnp.int32))
  return jnp.sum(jnp.where(words != 0, bits, 0), axis=-1, keepdims=True, dtype=jnp.int32)


def step_words(block_mask):
  """``[..., W, n]`` bool -> ``[..., n]`` int32 with bit ``w`` set where query ``w`` may use entry.

  W <= 32 (one bit per window query)."""
  w = block_mask.shape[-2]
  if w > 32:
    raise ValueError(f"multi-query decode supports windows of at most 32 queries, got {w}")
  bits = jnp.left_shift(jnp.int32(1), jnp.arange(w, dtype=jnp.int32))[:, None]
  return jnp.sum(jnp.where(block_mask, bits, 0), axis=-2, dtype=jnp.int32)
