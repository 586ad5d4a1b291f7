"""Sparse flash-decoding over a list of selected KV blocks: ``sparse_decode`` and its reference.

One query per head attends exactly the listed blocks of its kv head (Quest / ArkVale style block
selection), with token-level masking of slots ``>= length`` and of empty slots (``pos < 0``, a
compacted cache's holes). The Pallas path runs one program per (batch, kv head, split) over the kv
head's list (the union of its query heads' lists for per-head selection) and merges the splits by
log-sum-exp (flash-decoding).

The reference (the ``impl="xla"`` path) gathers the listed blocks and attends them with one
masked float32 softmax, ``gathered_partials``: the core the references of the RESA and the
multi-query variants share (one softmax over true and prior logits stacked, so the prior costs
no second pass over the values).

Letters: B batch, N query heads (Hq), K kv heads (Hkv), G = N // K, H selection heads (K or N),
R = N // H query heads per list, S queries per head, n list length, L = n * block_size gathered
slots, T cache slots, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels import _union
from pallas_kernels._decode_kernel import decode_partials
from pallas_kernels.softmax import check_softcap, default_scale, scaled_logits, softmax_sum

NEG_INF = float("-inf")


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


def checked_lists(q, k, block_idx, n_valid, block_size: int, softcap):
  """What every single-query sparse-decode kernel wrapper checks and prepares: the soft-cap,
  the entry size, the selection heads; then each kv head's list: as given (group-shared) or
  the union of its group's lists (``_union.union_head_bits``).

  Returns:
    ``(softcap, lists)``: ``lists`` is ``(idx [B, K, U], n_valid [B, K], row_bits)`` with
    ``row_bits [B, K, U, 1]`` int32 (bit ``g``: query head ``g`` of the group lists the entry;
    None for group-shared lists), or None for empty lists (``n == 0``: the caller returns its
    empty result).
  """
  softcap = check_softcap(softcap)
  _common.check_entry_size(block_size, k.shape[2])
  hq, hkv = q.shape[1], k.shape[1]
  selection_rows(hq, hkv, block_idx.shape[1])
  if block_idx.shape[2] == 0:
    return softcap, None
  if block_idx.shape[1] == hkv:
    return softcap, (block_idx, n_valid, None)
  return softcap, _union.union_head_bits(block_idx, n_valid, hq // hkv,
                                         k.shape[2] // block_size)


def gather_prior(prior, block_idx, block_size: int):
  """RESA's prior logits of the listed slots: ``[B, N, T]`` -> ``[B, H, R, L]`` float32.

  Args:
    prior: ``[B, N, T]`` prior logit of every slot for every query head.
    block_idx: ``[B, H, n]`` list of each selection head (query head ``h`` uses list
      ``h // R``); block_size: tokens per listed entry.
  """
  b, hq, t = prior.shape
  hs, n = block_idx.shape[1:]
  nb = t // block_size
  # [B, H, R, NB, bs], gathered along NB in place: a swap of the slots first would copy the
  # whole [B, N, T] prior every step.
  pr = prior.reshape(b, hs, hq // hs, nb, block_size)
  ids = jnp.clip(block_idx, 0, nb - 1).astype(jnp.int32)[:, :, None, :, None]
  got = jnp.take_along_axis(pr, ids, axis=3, mode="clip")  # [B, H, R, n, bs]
  return got.reshape(b, hs, hq // hs, n * block_size).astype(jnp.float32)


def gather_listed(k, v, block_idx, n_valid, length, block_size: int, pos=None):
  """Keys, values and the attend mask of the listed blocks (``_common.listed_slots_ok``).

  Returns:
    ``kg, vg [B, H, L, D]``, ``ok [B, H, L]`` bool and the slots' token positions
    ``[B, H, L]`` int32.
  """
  kg = _common.gather_blocks(k, block_idx, block_size)
  vg = _common.gather_blocks(v, block_idx, block_size)
  ok, pos_g = _common.listed_slots_ok(block_idx, n_valid, length, block_size, pos)
  return kg, vg, ok, pos_g


def gathered_partials(q, kg, vg, ok, prior=None, *, scale: float,
                      softcap: float | None = None):
  """Exact softmax partials of ``S`` queries per head over gathered slots (the decode
  references' core).

  Args:
    q: ``[B, N, S, D]`` queries (N a multiple of H).
    kg, vg: ``[B, H, L, D]`` gathered keys and values of each list.
    ok: ``[B, H, S, L]`` bool, query ``s`` of the list's heads may attend slot ``l``.
    prior: optional ``[B, H, R, L]`` prior logits of the gathered slots (``gather_prior``;
      ``-inf``: not a prior member).
    scale: softmax scale; softcap: attention-logit soft-cap of the true logits
      (``softmax.soft_cap``; the prior logits are taken as given).

  Returns:
    ``(out [B, N, S, D] f32, lse [B, N, S] f32)`` and, with ``prior``, the prior's softmax over
    the attended slots applied to ``vg``, ``(prior_out, prior_lse)`` of the same shapes, and
    ``seen [B, N, S]`` int32, the prior members each query attended (else None). Empty rows:
    ``0`` and ``-inf``.
  """
  b, n, s, d = q.shape
  h = kg.shape[1]
  r = n // h
  # [B, H, R, S, L]
  lg = scaled_logits(q.reshape(b, h, r * s, d), kg, scale, softcap).reshape(b, h, r, s, -1)
  okb = jnp.broadcast_to(ok[:, :, None], lg.shape)
  lg = jnp.where(okb, lg, NEG_INF)
  rows = lambda x: x.reshape(b, n, s, *x.shape[4:])  # [B, H, R, S, ...] -> [B, N, S, ...]
  if prior is None:
    out, lse = softmax_sum(lg, vg)
    return (rows(out), rows(lse)), None
  # [B, H, R, S, L]: the prior over the same slots
  member = okb & jnp.isfinite(prior)[:, :, :, None, :]
  plg = jnp.where(member, prior[:, :, :, None, :], NEG_INF)
  # True and prior logits stacked on the row axis: one pass over the gathered values.
  # [B, H, 2R, S, D], [B, H, 2R, S]
  out, lse = softmax_sum(jnp.concatenate([lg, plg], axis=2), vg)
  seen = rows(jnp.sum(member, -1, dtype=jnp.int32))
  return ((rows(out[:, :, :r]), rows(lse[:, :, :r])),
          (rows(out[:, :, r:]), rows(lse[:, :, r:]), seen))


def sparse_decode_reference(q, k, v, block_idx, n_valid, length, *, block_size: int,
                            scale: float | None = None, pos=None,
                            softcap: float | None = None, query_pos=None):
  """Plain-jnp sparse decode (the ``impl="xla"`` path): gather the listed blocks, masked
  float32 softmax (``gathered_partials``). Any ``block_size`` dividing ``T`` (1: token lists).

  Args: as ``sparse_decode``.

  Returns:
    ``out [B, N, D]`` in ``q.dtype`` and ``lse [B, N]`` float32.
  """
  _, hq, d = q.shape
  selection_rows(hq, k.shape[1], block_idx.shape[1])
  length = _common.attended_length(length, query_pos)
  kg, vg, ok, _ = gather_listed(k, v, block_idx, n_valid, length, block_size, pos)
  (out, lse), _ = gathered_partials(q[:, :, None], kg, vg, ok[:, :, None],
                                    scale=default_scale(d, scale),
                                    softcap=check_softcap(softcap))
  return out[:, :, 0].astype(q.dtype), lse[:, :, 0]


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "num_splits", "impl",
                                             "interpret", "num_warps", "num_stages",
                                             "blocks_per_iter", "softcap"))
def sparse_decode(q, k, v, block_idx, n_valid, length, *, block_size: int,
                  scale: float | None = None, num_splits: int | None = None,
                  impl: _common.Impl = "auto", interpret: bool = False, num_warps: int = 4,
                  num_stages: int = 3, blocks_per_iter: int | None = None, pos=None,
                  softcap: float | None = None, query_pos=None):
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
    block_size: tokens per block (static; the kernel needs a power of 2 >= 16, the reference
      any divisor of ``T``).
    scale: softmax scale (static), default ``1/sqrt(D)``.
    num_splits: most split-K slices (static), default from the problem size; fewer are used
      when ``n_valid`` is short.
    impl: ``"pallas"``/``"triton"``, ``"mosaic"`` (``pallas_kernels.mosaic.sparse_decode``),
      ``"xla"`` (``sparse_decode_reference``) or ``"auto"`` (``backends.resolve_impl``).
    interpret: run the Pallas kernel in interpret mode (CPU).
    num_warps, num_stages: Triton launch parameters.
    blocks_per_iter: blocks gathered per loop iteration (static), default from shared memory.
    softcap: attention-logit soft-cap (static; Gemma 2's ``s -> cap * tanh(s / cap)`` on the
      scaled logits, ``softmax.soft_cap``), None = none.
    query_pos: optional ``[B]`` int32 position of each row's query: a negative one marks a
      padding row, which attends nothing (``0`` / ``-inf``; the kernel reads none of its
      blocks), so the decode step needs no masking op after the launch. None: every row live.

  Per-query-head lists (``H = N``) run one program per kv head over the union of the group's
  lists with a per-head mask, so a block listed by several heads is read once.

  Returns:
    ``out [B, N, D]`` in ``q.dtype`` and ``lse [B, N]`` float32 (``0`` and ``-inf`` for a row
    that attends nothing).
  """
  resolved = _common.resolve_impl(impl, _common.list_op("sparse_decode", block_size))
  if resolved == "xla":
    return sparse_decode_reference(q, k, v, block_idx, n_valid, length, block_size=block_size,
                                   scale=scale, pos=pos, softcap=softcap, query_pos=query_pos)
  if resolved == "mosaic":
    from pallas_kernels import mosaic  # pylint: disable=import-outside-toplevel (imports us)
    return mosaic.sparse_decode(q, k, v, block_idx, n_valid, length, block_size=block_size,
                                scale=scale, num_splits=num_splits, impl="mosaic",
                                interpret=interpret, num_stages=num_stages, pos=pos,
                                softcap=softcap, query_pos=query_pos)
  softcap, lists = checked_lists(q, k, block_idx, n_valid, block_size, softcap)
  b, hq, d = q.shape
  hkv = k.shape[1]
  if lists is None:
    return jnp.zeros_like(q), jnp.full((b, hq), -jnp.inf, jnp.float32)
  idx, nv, bits = lists
  tiles = _common.TileConfig(num_warps=num_warps, num_stages=num_stages, num_splits=num_splits,
                             blocks_per_iter=blocks_per_iter)
  out, lse = decode_partials(
      q.reshape(b, hkv, hq // hkv, d), k, v, idx, nv, length, pos=pos,
      row_bits=bits, bits_per_word=hq // hkv,
      block_size=block_size, scale=default_scale(d, scale), tiles=tiles, interpret=interpret,
      softcap=softcap, query_pos=query_pos)
  return out.reshape(b, hq, d).astype(q.dtype), lse.reshape(b, hq)


def identity_lists(b: int, hkv: int, num_blocks: int, length, block_size: int):
  """Every block in order, as lists: ``idx [B, K, NB]``, ``n_valid [B, K]`` (``ceil(length /
  block_size)``): the list ``dense_decode``'s kernel walks without reading one."""
  idx = jnp.broadcast_to(jnp.arange(num_blocks, dtype=jnp.int32), (b, hkv, num_blocks))
  blocks = -(-length.astype(jnp.int32) // block_size)
  return idx, jnp.broadcast_to(blocks[:, None], (b, hkv)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "num_splits", "impl",
                                             "interpret", "num_warps", "num_stages",
                                             "blocks_per_iter", "softcap"))
def dense_decode(q, k, v, length, *, block_size: int, scale: float | None = None,
                 num_splits: int | None = None, impl: _common.Impl = "auto",
                 interpret: bool = False, num_warps: int = 4, num_stages: int = 3,
                 blocks_per_iter: int | None = None, pos=None, softcap: float | None = None,
                 query_pos=None):
  """``sparse_decode`` over every block of the context: exact attention of one query per head.

  The split-K kernel in its identity mode: list entry ``i`` is block ``i`` and the list holds
  ``ceil(length / block_size)`` entries, so no list is built or read (the XLA ops that
  broadcast one and the kernel's id loads are gone). Equal to ``sparse_decode`` with
  ``identity_lists`` (its reference, and its path on the XLA backend); on the Mosaic backend
  ``mosaic.dense_decode``, that kernel's identity mode.

  Args:
    q: ``[B, N, D]``; k, v: ``[B, K, T, D]``; length: ``[B]`` int32 (0: the row attends
      nothing); pos, query_pos and the launch options: as ``sparse_decode``.

  Returns:
    ``out [B, N, D]`` in ``q.dtype`` and ``lse [B, N]`` float32.
  """
  kw = dict(block_size=block_size, scale=scale, pos=pos, softcap=softcap, query_pos=query_pos)
  resolved = _common.resolve_impl(impl, "sparse_decode")
  if resolved == "mosaic":
    from pallas_kernels import mosaic  # pylint: disable=import-outside-toplevel (imports us)
    return mosaic.dense_decode(q, k, v, length, num_splits=num_splits, impl="mosaic",
                               interpret=interpret, num_stages=num_stages, **kw)
  if resolved != "pallas":
    idx, nv = identity_lists(q.shape[0], k.shape[1], k.shape[2] // block_size, length,
                             block_size)
    return sparse_decode(q, k, v, idx, nv, length, num_splits=num_splits, impl=impl,
                         interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                         blocks_per_iter=blocks_per_iter, **kw)
  softcap = check_softcap(softcap)
  _common.check_block_size(block_size, k.shape[2])
  b, hq, d = q.shape
  hkv = k.shape[1]
  selection_rows(hq, hkv, hkv)
  tiles = _common.TileConfig(num_warps=num_warps, num_stages=num_stages, num_splits=num_splits,
                             blocks_per_iter=blocks_per_iter)
  out, lse = decode_partials(
      q.reshape(b, hkv, hq // hkv, d), k, v, None, None, length, pos=pos,
      block_size=block_size, scale=default_scale(d, scale), tiles=tiles, interpret=interpret,
      softcap=softcap, query_pos=query_pos)
  return out.reshape(b, hq, d).astype(q.dtype), lse.reshape(b, hq)
