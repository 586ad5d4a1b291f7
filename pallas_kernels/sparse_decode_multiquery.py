"""Multi-query sparse decode for RetroAttention: ``sparse_decode_multiquery`` and its reference.

RetroAttention (Algorithm 2) revisits the last W decode steps: query ``w`` of the window may use a
listed block only if the block was available at its step (``block_mask``, from the cache's
``block_last_seen``), and only keys at or before its own position (``q_limit``, compared with the
slots' token positions ``pos``: the slot index when ``pos`` is not given). All W queries of
all G heads of a group share one block list, so the kernel loads each listed block once for
G x W query rows. With RESA's ``prior`` the same pass also accumulates the prior statistics of
every query over the positions it attends (``sparse_decode_resa``'s fusion, for
``quest+resa+retro``). Its outputs are partials that retro merges, all float32; with
``count_attended`` the pass also counts the keys each query attended (Retro's effective budget,
Fig. 2c), which XLA would otherwise rebuild over every gathered slot of every window query.

Letters: B batch, N query heads, K kv heads, H selection heads, W window queries, n list length,
T slots, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels import _union
from pallas_kernels._decode_kernel import decode_partials
from pallas_kernels.softmax import check_softcap, default_scale, lse_combine
from pallas_kernels.sparse_decode import (gather_listed, gather_prior, gathered_partials,
                                          kv_head_lists, selection_rows)


def window_slots_ok(ok, pos_g, block_mask, q_limit, block_size: int):
  """Which gathered slots each window query attends: listed and valid (``ok``), in a block the
  query may use (``block_mask``) and at or before its position (``q_limit``).

  Args:
    ok: ``[B, H, L]`` bool and pos_g: ``[B, H, L]`` int32 (``sparse_decode.gather_listed``).
    block_mask: ``[B, H, W, n]``; q_limit: ``[B, W]``; block_size: tokens per listed entry.

  Returns:
    ``[B, H, W, L]`` bool.
  """
  use = jnp.repeat(block_mask.astype(bool), block_size, axis=-1)
  return ok[:, :, None] & use & (pos_g[:, :, None, :] <= q_limit[:, None, :, None])


def sparse_decode_multiquery_reference(q, k, v, block_idx, n_valid, block_mask, q_limit, length,
                                       *, block_size: int, scale: float | None = None,
                                       pos=None, prior=None, softcap: float | None = None,
                                       count_attended: bool = False, carry_in=None):
  """Plain-jnp multi-query sparse decode (the ``impl="xla"`` path): gather the listed blocks,
  one masked float32 softmax (``gathered_partials``). Any ``block_size`` dividing ``T``.

  Args: as ``sparse_decode_multiquery``.

  Returns:
    ``out [B, N, W, D]`` and ``lse [B, N, W]``; with ``prior`` also ``prior_out [B, N, W, D]``
    and ``prior_lse [B, N, W]``, all float32, and ``seen [B, N, W]`` int32; with
    ``count_attended`` then ``attended [B, N, W]`` int32.
  """
  _, hq, _, d = q.shape
  selection_rows(hq, k.shape[1], block_idx.shape[1])
  kg, vg, ok, pos_g = gather_listed(k, v, block_idx, n_valid, length, block_size, pos)
  ok = window_slots_ok(ok, pos_g, block_mask, q_limit, block_size)
  pg = None if prior is None else gather_prior(prior, block_idx, block_size)
  true, prior_part = gathered_partials(q, kg, vg, ok, pg, scale=default_scale(d, scale),
                                       softcap=check_softcap(softcap))
  outs = true if prior is None else true + prior_part
  outs = merge_carry(outs, carry_in)
  if not count_attended:
    return outs
  attended = jnp.sum(ok, axis=-1, dtype=jnp.int32)  # [B, H, W]
  return outs + (jnp.repeat(attended, hq // ok.shape[1], axis=1),)


def merge_carry(outs, carry_in):
  """``outs`` (``(out, lse)`` pairs, then any counts) with each pair merged with its
  ``carry_in`` partial (``softmax.lse_combine`` of the two); ``carry_in`` None: unchanged."""
  if carry_in is None:
    return outs
  outs = list(outs)
  for i, (out_c, lse_c) in enumerate(carry_in):
    o, l = outs[2 * i], outs[2 * i + 1]
    outs[2 * i:2 * i + 2] = lse_combine(jnp.stack([o, out_c.astype(o.dtype)]),
                                        jnp.stack([l, lse_c.astype(l.dtype)]), axis=0)
  return tuple(outs)


def checked(q, k, block_idx, prior, block_size: int, softcap, count_attended: bool = False):
  """The kernels' shared checks: ``(softcap, None)``, or ``(softcap, the outputs)`` of an
  empty list (``n = 0``: zero outputs, -inf LSE, the prior's three outputs with one, and a
  zero count with ``count_attended``)."""
  softcap = check_softcap(softcap)
  _common.check_entry_size(block_size, k.shape[2])
  b, hq, w, _ = q.shape
  selection_rows(hq, k.shape[1], block_idx.shape[1])
  if block_idx.shape[2]:
    return softcap, None
  empty = (jnp.zeros(q.shape, jnp.float32), jnp.full((b, hq, w), -jnp.inf, jnp.float32))
  zero = (jnp.zeros((b, hq, w), jnp.int32),)
  empty = empty if prior is None else empty + empty + zero
  return softcap, empty + zero * count_attended


def entry_lists(block_idx, n_valid, block_mask, hq: int, hkv: int, num_blocks: int):
  """``(idx, n_valid, row_bits)`` per kv head: the union of its query heads' lists and, per
  entry, the window steps that may use it (``row_bits [B, K, U, 1 or G]``: one word for
  shared lists, a word per query head of the group otherwise; bit w = window step w)."""
  steps = _union.step_words(block_mask)  # [B, H, n]
  idx, nv, words = kv_head_lists(block_idx, n_valid, hq, hkv, num_blocks, payload=steps)
  return idx, nv, steps[..., None] if words is None else words


# Rows of a program's register tiles (its query rows padded, twice with a prior, whose softmax
# runs beside the true one) from which 4 warps and 64-128 token iterations spill on sm_90.
WIDE_ROWS = 64
WIDE_TOKENS = 32


def default_launch(rows: int, with_prior: bool, block_size: int) -> tuple[int, int | None]:
  """``(num_warps, blocks_per_iter)`` of a program of ``rows`` (G x W) query rows: from
  ``WIDE_ROWS`` tile rows on, 8 warps over ``WIDE_TOKENS``-token iterations (one block when
  blocks are longer); otherwise 4 warps and ``tokens_per_iter``'s default (None).

  From ``ptxas`` on the sm_90 builds (2026-12-04, ``tests/pallas_kernels/test_pk_ptx.py``): with
  RESA's prior, Llama-3.1-8B's 4 x 8 window spilled 916-1,852 bytes a thread at 4 warps and 64
  tokens, 0-12 at 8 warps, none at 8 warps and 32 tokens; Qwen2.5's 7 x 8 (D = 64) spilled
  192 bytes without a prior at 128 tokens, 6,648-15,736 with one, and none at 8 warps and 32.
  """
  if _common.pad_rows(rows, 1) * (2 if with_prior else 1) < WIDE_ROWS:
    return 4, None
  return 8, max(1, WIDE_TOKENS // block_size)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "num_splits", "impl",
                                             "interpret", "num_warps", "num_stages",
                                             "blocks_per_iter", "softcap", "count_attended"))
def sparse_decode_multiquery(q, k, v, block_idx, n_valid, block_mask, q_limit, length, *,
                             block_size: int, scale: float | None = None,
                             num_splits: int | None = None, impl: _common.Impl = "auto",
                             interpret: bool = False, num_warps: int | None = None,
                             num_stages: int = 3,
                             blocks_per_iter: int | None = None, pos=None, prior=None,
                             softcap: float | None = None, count_attended: bool = False,
                             carry_in=None):
  """Sparse decode of W queries per head over one shared block list.

  Args:
    q: ``[B, N, W, D]`` queries (W per head: the retro window).
    k, v: ``[B, K, T, D]`` cache.
    block_idx: ``[B, H, n]`` int32, ``H`` = K (group-shared) or N (per query head).
    n_valid: ``[B, H]`` int32 valid list entries.
    block_mask: ``[B, H, W, n]`` bool; query ``w`` may use listed block ``i``.
    q_limit: ``[B, W]`` int32; query ``w`` attends only keys at positions ``<= q_limit[b, w]``
      (negative: nothing).
    length: ``[B]`` int32; slots ``>= length`` are never attended.
    pos: optional ``[B, K, T]`` int32 token position held by each slot (``KVCache.pos``; -1 =
      empty, never attended: a compacted cache has such holes below ``length``). None: every
      slot below ``length`` holds a token.
    prior: optional ``[B, N, T]`` float32 RESA prior logits ``P_j`` of each head, shared by its
      W queries (as ``sparse_decode_resa``).
    block_size, scale, num_splits, impl, interpret, num_stages, blocks_per_iter: as
      ``sparse_decode`` (W <= 32; ``"mosaic"``: ``pallas_kernels.mosaic.sparse_decode_multiquery``).
    num_warps: Triton warps per program; None (and ``blocks_per_iter=None``): ``default_launch``.
    softcap: attention-logit soft-cap (static, ``sparse_decode``'s), None = none.
    count_attended: static; also return the keys each query attended.
    carry_in: optional ``[(out [B, N, W, D], lse [B, N, W])]``, one per output pair (with
      ``prior``: the true pair's, then the prior pair's): partials of an earlier pass merged
      into the outputs (RetroAttention's cached outputs of past queries, ``-inf`` lse where
      there is none); the Pallas path merges them in its split combine, as one more split.

  Returns:
    ``out [B, N, W, D]`` and ``lse [B, N, W]`` (``0`` / ``-inf`` for a query that attends
    nothing); with ``prior`` also ``prior_out [B, N, W, D]`` and ``prior_lse [B, N, W]``: the
    softmax of ``P_j`` over the positions each query attends, applied to ``v``. All float32
    (partials, merged by the caller); and ``seen [B, N, W]`` int32, the prior members each
    query attended (counted in the kernel's pass). With ``count_attended``, last, ``attended
    [B, N, W]`` int32: the keys each query attended (listed, valid, usable, at or before its
    limit; the reference's ``window_slots_ok`` count).
  """
  resolved = _common.resolve_impl(impl, _common.list_op("sparse_decode_multiquery", block_size))
  if resolved == "xla":
    return sparse_decode_multiquery_reference(q, k, v, block_idx, n_valid, block_mask, q_limit,
                                              length, block_size=block_size, scale=scale,
                                              pos=pos, prior=prior, softcap=softcap,
                                              count_attended=count_attended, carry_in=carry_in)
  if resolved == "mosaic":
    from pallas_kernels import mosaic  # pylint: disable=import-outside-toplevel (imports us)
    return mosaic.sparse_decode_multiquery(
        q, k, v, block_idx, n_valid, block_mask, q_limit, length, block_size=block_size,
        scale=scale, num_splits=num_splits, impl="mosaic", interpret=interpret,
        num_stages=num_stages, pos=pos, prior=prior, softcap=softcap,
        count_attended=count_attended, carry_in=carry_in)
  softcap, empty = checked(q, k, block_idx, prior, block_size, softcap, count_attended)
  if empty is not None:
    return merge_carry(empty, carry_in)
  b, hq, w, d = q.shape
  hkv = k.shape[1]
  g = hq // hkv
  # Row r = g * W + w of kv head k is query head k * G + g at window step w; it may use entry e
  # iff bit w of word min(r // W, A - 1) of entry e is set.
  idx, nv, row_bits = entry_lists(block_idx, n_valid, block_mask, hq, hkv,
                                  k.shape[2] // block_size)
  # [B, K, G * W]
  row_limit = jnp.broadcast_to(q_limit[:, None, None, :], (b, hkv, g, w))
  warps, per_iter = default_launch(g * w, prior is not None, block_size)
  tiles = _common.TileConfig(num_warps=num_warps or warps, num_stages=num_stages,
                             num_splits=num_splits, blocks_per_iter=blocks_per_iter or per_iter)
  rows = lambda x: x.reshape(b, hq, w, *x.shape[3:])  # [B, K, G * W, ...] -> [B, N, W, ...]
  carry = None if carry_in is None else [  # [B, N, W, ...] -> [B, K, G * W, ...]
      tuple(x.reshape(b, hkv, g * w, *x.shape[3:]) for x in pair) for pair in carry_in]
  parts = decode_partials(
      q.reshape(b, hkv, g * w, d), k, v, idx, nv, length, pos=pos, row_bits=row_bits,
      row_limit=row_limit.reshape(b, hkv, g * w), bits_per_word=w, block_size=block_size,
      scale=default_scale(d, scale), tiles=tiles, interpret=interpret,
      prior=None if prior is None else prior.reshape(b, hkv, g, -1), rows_per_prior=w,
      softcap=softcap, count_attended=count_attended, carry_in=carry)
  return tuple(map(rows, parts))
