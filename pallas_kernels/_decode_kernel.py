"""The one Triton kernel behind the three sparse-decode ops: flash-decoding over a block list.

A program owns one (batch, program head, split). Its R query rows share one block list, so each
listed KV block is loaded once for all rows. The program head is a kv head: with group-shared
selection its rows are the G query heads (x W window queries); per-query-head selection is served
through the union of the G lists (``_union.union_head_bits``) with a per-(entry, row) bit mask, so a
block listed by several heads of a group is still read once.

Memory pipeline (what makes it bandwidth bound rather than latency bound on an H100):
  * each loop iteration gathers J listed blocks at once, one ``[J * block_size, D]`` tile of K and
    of V (J from ``tokens_per_iter``: 64-128 tokens, under a shared-memory budget);
  * the next iteration's block ids (and row bits) are loaded one iteration ahead and carried, so
    the K/V addresses of iteration i+1 are known while iteration i computes;
  * ``num_stages >= 3`` lets Triton's pipeliner keep two K/V tiles in flight (cp.async ring).
Splits are a static grid axis sized from the list length, but a program derives its slice from
the dynamic ``n_valid``: ``ceil(n_valid / MIN_BLOCKS_PER_SPLIT)`` splits are used (the rest exit at
once), so a short list (early in decoding, a small filled length) is not cut into tiny slices.

Token lists (``block_size == 1``: an entry is one slot, TidalDecode's or RocketKV's selection)
run the same body: a tile gathers J = 64-128 scattered slots (at least ``MIN_DOT_ROWS``), and a
split owns at least ``MIN_TOKENS_PER_SPLIT`` of them (``min_entries_per_split``).

Optional extras, all static flags of the same body:
  * ``prior``: RESA prior logits ``P_j`` accumulated alongside (same blocks, same V tile); row
    ``r`` reads prior row ``r // rows_per_prior`` (RetroAttention's W window queries of a head
    share the head's prior). Up to ``MAX_STACKED_ROWS`` rows, the prior rows ride in the same
    register tile as the query rows (its second half: row ``Rh + r`` is query row ``r``'s
    prior, ``Rh`` the query rows padded), so one online softmax and one ``P V`` product per
    iteration serve both; more rows (RetroAttention's windows) run a second online softmax.
  * ``row_bits``: ``[n, A]`` int32; row ``r`` may use entry ``e`` iff bit ``r % C`` of word
    ``row_bits[e, min(r // C, A - 1)]`` is set (``C = bits_per_word``).
  * ``row_limit``: per-row last token position (RetroAttention's causal limit per window query).
  * ``pos``: ``[T]`` token position of each slot of the kv head (-1 = empty; a compacted cache has
    holes below ``length``), loaded for the tile's slots next to K. A slot is attended iff
    ``slot < length`` and ``pos >= 0`` (``KVCache.valid``, the jnp path's rule), and under
    ``row_limit`` iff ``pos <= limit``. Without it every slot holds the position equal to its
    index.
  * ``softcap``: Gemma 2's attention-logit soft-cap, ``s -> cap * tanh(s / cap)`` on the scaled
    logits before the masks (``softmax.soft_cap``): the softmax, the lse and the split combine
    all see the capped scores. The RESA prior logits are given as they are.
  * ``query_pos``: the batch row's query position; a negative one (a padding row) attends
    nothing (length and list count 0: no iteration runs), and with an epilogue the combine
    returns the row empty, so the decode step needs no masking op of its own.
  * ``count_attended``: per row, the keys it attended (RetroAttention's effective budget,
    Fig. 2c), counted from the masks already built; with a stacked prior one count vector
    holds both halves (query rows: keys attended, prior rows: prior members seen).

Letters: B batch, K kv heads, P program heads, R rows, n list length, NS splits, T slots, D head
dim, J blocks per iteration, A row-bit words per entry.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from pallas_kernels._common import (MIN_DOT_ROWS, TileConfig, attended_length,
                                    choose_num_splits, min_entries_per_split, pad_rows,
                                    split_bounds, tokens_per_iter)
from pallas_kernels.softmax import soft_cap
from pallas_kernels.split_combine import split_combine_pairs
from pallas_kernels.backends import triton_module

plgpu = triton_module()  # jax.experimental.pallas.triton; see backends

NEG_INF = float("-inf")
# Most query rows whose RESA prior rows share their register tile (a 2 x 16-row tile for a GQA
# group of up to 16 heads; RetroAttention's G x W rows keep two tiles: 2 x 64 rows of logits
# and prior blew the shared-memory ring past an H100's limit).
MAX_STACKED_ROWS = 16


def _online_update(carry, s, v, precision):
  """One flash step: fold masked logits ``s [Rp, L]`` (f32, -inf = skip) and ``v [L, Dp]``."""
  acc, m, l = carry
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  # A row with nothing attended so far keeps m = -inf; shift it by 0 so exp never sees inf - inf.
  m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
  alpha = jnp.exp(m - m_safe)
  p = jnp.exp(s - m_safe[:, None])
  l = alpha * l + jnp.sum(p, axis=1)
  acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v, precision=precision)
  return acc, m_new, l


def _finish(carry):
  acc, m, l = carry
  ok = l > 0
  safe = jnp.where(ok, l, 1.0)
  out = jnp.where(ok[:, None], acc / safe[:, None], 0.0)
  lse = jnp.where(ok, m + jnp.log(safe), NEG_INF)
  return out, lse


def _decode_kernel(*refs, block_size: int, scale: float, rows: int, head_dim: int,
                   blocks_per_iter: int, min_entries: int, max_splits: int, num_blocks: int,
                   list_len: int,
                   bit_words: int, bits_per_word: int, with_prior: bool, with_bits: bool,
                   with_limit: bool, with_pos: bool, rows_per_prior: int = 1,
                   softcap: float | None = None, with_idx: bool = True,
                   count_attended: bool = False, with_query_pos: bool = False):
  """Kernel body; refs are one program's views (see ``decode_partials`` for the layout).
  Without ``with_idx`` the list is the identity (entry ``i`` is block ``i``) and its length
  ``ceil(length / block_size)``: no list is read."""
  it = iter(refs)
  q_ref, k_ref, v_ref = (next(it) for _ in range(3))
  idx_ref, nvalid_ref = (next(it), next(it)) if with_idx else (None, None)
  length_ref = next(it)
  qpos_ref = next(it) if with_query_pos else None
  pos_ref = next(it) if with_pos else None
  prior_ref = next(it) if with_prior else None
  bits_ref = next(it) if with_bits else None
  lim_ref = next(it) if with_limit else None
  o_ref, lse_ref = next(it), next(it)
  po_ref, plse_ref, cnt_ref = (next(it), next(it), next(it)) if with_prior else (None,) * 3
  att_ref = next(it) if count_attended else None

  # Tile rows: the R query rows padded to Rh; with a stacked prior, its Rh rows after them (tile
  # row Rh + r holds query row r's prior), so Rp = 2 Rh.
  stacked = with_prior and rows <= MAX_STACKED_ROWS
  rh, dp = pad_rows(rows), pad_rows(head_dim)
  rp = 2 * rh if stacked else rh
  width = blocks_per_iter * block_size
  row = jnp.arange(rp)
  src = row % rh  # the query row whose list entries, bits and limit a tile row follows
  row_ok = row < rows  # the query rows
  tile_ok = src < rows  # the query rows and their priors' rows
  col = jnp.arange(dp)
  col_ok = col < head_dim
  rows_at, cols_at = pl.ds(0, rh), pl.ds(0, dp)
  pad_r, pad_c = rh != rows, dp != head_dim

  # [Rp, Dp] (the prior rows zero)
  q = plgpu.load(q_ref.at[pl.ds(0, rp), cols_at], mask=row_ok[:, None] & col_ok[None, :],
                 other=0)
  cdt = jnp.promote_types(q_ref.dtype, k_ref.dtype)
  precision = lax.Precision.HIGHEST if cdt == jnp.float32 else None
  q = q.astype(cdt)
  if with_limit:
    # [Rp]
    limit = plgpu.load(lim_ref.at[src], mask=tile_ok, other=-1)

  length = length_ref[()]
  if with_query_pos:  # a padding row: nothing to attend, no iteration
    length = attended_length(length, qpos_ref[()])
  n_valid = nvalid_ref[()] if with_idx else (length + block_size - 1) // block_size
  if with_query_pos and with_idx:
    n_valid = jnp.where(length > 0, n_valid, 0)
  lo, hi = split_bounds(n_valid, pl.program_id(2), list_len=list_len,
                        max_splits=max_splits, blocks_per_iter=blocks_per_iter,
                        min_blocks=min_entries)
  # [W]: token t of a tile is offset t % bs of the tile's (t // bs)-th listed block.
  tok = jnp.arange(width)
  tile_entry, in_block = tok // block_size, tok % block_size
  # Row bits: row r reads bit r % C of word min(r // C, A - 1).
  word_of_row = jnp.minimum(src // bits_per_word, bit_words - 1)
  bit_of_row = src % bits_per_word

  def entry_meta(first):
    """Block id and row-bit words of the tile starting at list entry ``first`` ([W] each)."""
    entry = first + tile_entry
    live = entry < hi
    at = jnp.minimum(entry, list_len - 1)
    blk = plgpu.load(idx_ref.at[at], mask=live, other=0) if with_idx else at
    if not with_bits:
      return blk, live, None
    if bit_words == 1:  # [W]
      words = plgpu.load(bits_ref.at[at], mask=live, other=0)
    else:  # [Rp, W]
      words = plgpu.load(bits_ref.at[at[None, :], word_of_row[:, None]],
                         mask=live[None, :] & tile_ok[:, None], other=0)
    return blk, live, words

  def body(step, carry):
    blk, live, words = carry[0]
    nxt = entry_meta(lo + (step + 1) * blocks_per_iter)
    slots = jnp.clip(blk, 0, num_blocks - 1) * block_size + in_block
    use = live & (slots < length)
    kv_mask = use[:, None] & col_ok[None, :]
    # [W, Dp]: masked-off tokens (past length, past the slice) cost no memory traffic.
    at = (slots[:, None], col[None, :])
    k = plgpu.load(k_ref.at[at], mask=kv_mask, other=0).astype(cdt)
    v = plgpu.load(v_ref.at[at], mask=kv_mask, other=0)
    # [W] token positions, loaded beside K/V rather than gating their loads (an empty slot holds
    # zero K/V, so its lanes stay finite until masked below).
    pos = slots
    if with_pos:
      pos = plgpu.load(pos_ref.at[slots], mask=use, other=-1)
      use = use & (pos >= 0)
    if cdt == jnp.float32:  # mixed f32 / bf16 inputs: an exact f32 p.v
      v = v.astype(cdt)
    # [Rp, W]
    s = plgpu.dot(q, k, trans_b=True, precision=precision).astype(jnp.float32) * scale
    s = soft_cap(s, softcap)
    ok = jnp.broadcast_to(use[None, :], s.shape)
    if with_bits:
      w2 = words[None, :] if bit_words == 1 else words
      ok = ok & ((jnp.right_shift(w2, bit_of_row[:, None]) & 1) > 0)
    if with_limit:
      ok = ok & (pos[None, :] <= limit[:, None])
    count = lambda c, x: c + jnp.sum(x.astype(jnp.int32), axis=1)
    attended = (count(carry[-1], ok),) if count_attended and not stacked else ()
    if not with_prior:
      return (nxt, _online_update(carry[1], jnp.where(ok, s, NEG_INF), v, precision)) + attended
    if not stacked:  # a second online softmax of the prior beside the first
      pr = plgpu.load(prior_ref.at[(row // rows_per_prior)[:, None], slots[None, :]],
                      mask=ok & row_ok[:, None], other=NEG_INF)
      pr = jnp.where(ok, pr, NEG_INF)
      seen = count(carry[3], pr > NEG_INF)
      return (nxt, _online_update(carry[1], jnp.where(ok, s, NEG_INF), v, precision),
              _online_update(carry[2], pr, v, precision), seen) + attended
    # The second half's rows: the prior logits of their query row's attended slots (-inf: not
    # a member), in place of the (zero-query) logits there.
    prior_rows = (row >= rh)[:, None]
    ok = ok & tile_ok[:, None]
    pr = plgpu.load(prior_ref.at[(src // rows_per_prior)[:, None], slots[None, :]],
                    mask=ok & prior_rows, other=NEG_INF)
    s = jnp.where(ok, jnp.where(prior_rows, pr, s), NEG_INF)
    # Prior members seen (prior rows); with count_attended the same count vector holds the
    # query rows' keys attended.
    seen = count(carry[2], jnp.where(prior_rows, s > NEG_INF, ok) if count_attended
                 else prior_rows & (s > NEG_INF))
    return nxt, _online_update(carry[1], s, v, precision), seen

  def init():
    return (jnp.zeros((rp, dp), jnp.float32), jnp.full((rp,), NEG_INF, jnp.float32),
            jnp.zeros((rp,), jnp.float32))

  counts = (jnp.zeros((rp,), jnp.int32),)  # prior members seen (and keys attended, stacked)
  prior_carry = () if not with_prior else counts if stacked else (init(),) + counts
  attended_carry = counts if count_attended and not stacked else ()
  carry = (entry_meta(lo), init()) + prior_carry + attended_carry
  steps = (hi - lo + blocks_per_iter - 1) // blocks_per_iter
  carry = lax.fori_loop(0, steps, body, carry)

  out, lse = _finish(carry[1])
  finished = [(out, lse)]
  out_ok = jnp.arange(rh) < rows
  attended = carry[-1] if count_attended else None
  if stacked:  # the tile's two halves, [Rh, ...] each (selects: NaN and -inf stay put)
    half = lambda x, i: jnp.sum(jnp.where(
        (jnp.arange(2) == i).reshape((2,) + (1,) * x.ndim),
        x.reshape((2, rh) + x.shape[1:]), jnp.zeros((), x.dtype)), axis=0)
    finished = [(half(out, 0), half(lse, 0)), (half(out, 1), half(lse, 1))]
    seen, attended = half(carry[2], 1), half(carry[2], 0)
  elif with_prior:
    finished.append(_finish(carry[2]))
    seen = carry[3]
  # Per row: prior members seen (RESA's coverage test), keys attended (Retro's budget).
  for ref, total in ((cnt_ref, seen if with_prior else None), (att_ref, attended)):
    if ref is None:
      continue
    if pad_r:
      plgpu.store(ref.at[rows_at], total, mask=out_ok)
    else:
      ref[...] = total
  store_mask = out_ok[:, None] & col_ok[None, :]
  for (o_r, l_r), (out, lse) in zip(((o_ref, lse_ref), (po_ref, plse_ref)), finished):
    if pad_r or pad_c:
      plgpu.store(o_r.at[rows_at, cols_at], out, mask=store_mask)
    else:
      o_r[...] = out
    if pad_r:
      plgpu.store(l_r.at[rows_at], lse, mask=out_ok)
    else:
      l_r[...] = lse


def decode_partials(q, k, v, block_idx, n_valid, length, prior=None, row_bits=None,
                    row_limit=None, pos=None, *, block_size: int, scale: float, tiles: TileConfig,
                    interpret: bool, bits_per_word: int = 1, rows_per_prior: int = 1,
                    epilogue=None, extras=(), softcap: float | None = None,
                    count_attended: bool = False, carry_in=None, query_pos=None):
  """Runs the kernel and combines its splits (``split_combine``, a second Pallas pass).

  Args:
    q: ``[B, P, R, D]`` query rows of each program head.
    k, v: ``[B, K, T, D]`` cache; ``P`` is a multiple of ``K`` (program head p reads kv head
      ``p // (P // K)``).
    block_idx: ``[B, P, n]`` int32 block lists; ``n_valid [B, P]``; ``length [B]``. Both
      None: every block in order, ``ceil(length / block_size)`` of them (dense decode; no list
      in memory).
    prior: optional ``[B, P, R // rows_per_prior, T]`` float32 RESA prior logits (row ``r``
      reads prior row ``r // rows_per_prior``).
    row_bits: optional ``[B, P, n, A]`` int32 per-(entry, row) bits (see the module doc).
    row_limit: optional ``[B, P, R]`` int32, the last token position each row may attend.
    pos: optional ``[B, K, T]`` int32 token position of each slot (-1 = empty); None: ``slot``.
    block_size, scale, tiles, interpret: static; ``bits_per_word``: static ``C``;
      ``rows_per_prior``: static.
    epilogue, extras: with ``prior``, an elementwise finish of the merged values run inside the
      split combine (``split_combine_pairs``; RESA's aggregator), extras ``[B, P, R(, D)]``.
    softcap: static attention-logit soft-cap (``softmax.soft_cap``), None = none.
    count_attended: static; also count the keys each row attended (not with an epilogue).
    carry_in: optional ``[(out [B, P, R, D], lse [B, P, R])]`` per pair (true, then prior):
      partials of an earlier pass merged into the result as one more split.
    query_pos: optional ``[B]`` int32 query position of each batch row: a negative one (a
      padding row) attends nothing and comes out empty (``0`` / ``-inf``), an epilogue's or a
      carried partial's values included.

  Returns:
    ``(out [B, P, R, D] f32, lse [B, P, R] f32)``; with ``prior`` also the prior pair and
    ``seen [B, P, R]`` int32, the prior members (finite ``P_j``) each row attended; with
    ``count_attended`` then ``attended [B, P, R]`` int32; with an ``epilogue``, its ``(out,
    lse)`` instead.
  """
  b, p, r, d = q.shape
  kh, t = k.shape[1], k.shape[2]
  with_idx = block_idx is not None
  if with_idx != (n_valid is not None):
    raise ValueError("block_idx and n_valid go together (both None: the identity list)")
  n = block_idx.shape[-1] if with_idx else t // block_size
  ratio = p // kh
  with_prior, with_bits, with_limit, with_pos = (prior is not None, row_bits is not None,
                                                 row_limit is not None, pos is not None)
  per_iter = tiles.blocks_per_iter or max(
      1, tokens_per_iter(d, jnp.dtype(k.dtype).itemsize, tiles.num_stages) // block_size)
  # A tile of at least MIN_DOT_ROWS tokens (the rule of every tl.dot here), however short a
  # token list.
  per_iter = max(min(per_iter, pad_rows(n, 1)), -(-MIN_DOT_ROWS // block_size))
  min_entries = min_entries_per_split(block_size)
  splits = tiles.num_splits or choose_num_splits(b * p, n, min_blocks=min_entries)
  splits = max(1, min(splits, -(-n // per_iter)))
  bit_words = row_bits.shape[-1] if with_bits else 1

  kernel = functools.partial(
      _decode_kernel, block_size=block_size, scale=float(scale), rows=r, head_dim=d,
      blocks_per_iter=per_iter, min_entries=min_entries, max_splits=splits,
      num_blocks=t // block_size, list_len=n,
      bit_words=bit_words, bits_per_word=bits_per_word, with_prior=with_prior,
      with_bits=with_bits, with_limit=with_limit, with_pos=with_pos,
      rows_per_prior=rows_per_prior, softcap=softcap, with_idx=with_idx,
      count_attended=count_attended, with_query_pos=query_pos is not None)
  head = lambda bi, pi, si: (bi, pi, 0, 0)
  kv = pl.BlockSpec((None, None, t, d), lambda bi, pi, si: (bi, pi // ratio, 0, 0))
  in_specs = [pl.BlockSpec((None, None, r, d), head), kv, kv]
  args = [q, k, v]
  if with_idx:
    in_specs += [pl.BlockSpec((None, None, n), lambda bi, pi, si: (bi, pi, 0)),
                 pl.BlockSpec((None, None), lambda bi, pi, si: (bi, pi))]
    args += [block_idx.astype(jnp.int32), n_valid.astype(jnp.int32)]
  in_specs.append(pl.BlockSpec((None,), lambda bi, pi, si: (bi,)))
  args.append(length.astype(jnp.int32))
  if query_pos is not None:
    in_specs.append(pl.BlockSpec((None,), lambda bi, pi, si: (bi,)))
    args.append(query_pos.astype(jnp.int32))
  if with_pos:
    in_specs.append(pl.BlockSpec((None, None, t), lambda bi, pi, si: (bi, pi // ratio, 0)))
    args.append(pos.astype(jnp.int32))
  if with_prior:
    if r % rows_per_prior or prior.shape[2] != r // rows_per_prior:
      raise ValueError(f"prior rows {prior.shape[2]} != {r} rows / {rows_per_prior}")
    in_specs.append(pl.BlockSpec((None, None, r // rows_per_prior, t), head))
    args.append(prior.astype(jnp.float32))
  if with_bits:
    if bit_words == 1:
      in_specs.append(pl.BlockSpec((None, None, n), lambda bi, pi, si: (bi, pi, 0)))
      args.append(row_bits[..., 0].astype(jnp.int32))
    else:
      in_specs.append(pl.BlockSpec((None, None, n, bit_words), head))
      args.append(row_bits.astype(jnp.int32))
  if with_limit:
    in_specs.append(pl.BlockSpec((None, None, r), lambda bi, pi, si: (bi, pi, 0)))
    args.append(row_limit.astype(jnp.int32))
  pair_specs = [pl.BlockSpec((None, None, None, r, d), lambda bi, pi, si: (bi, pi, si, 0, 0)),
                pl.BlockSpec((None, None, None, r), lambda bi, pi, si: (bi, pi, si, 0))]
  pair_shapes = [jax.ShapeDtypeStruct((b, p, splits, r, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, p, splits, r), jnp.float32)]
  n_pairs = 2 if with_prior else 1
  n_counts = with_prior + count_attended  # seen, then attended
  count_spec = pair_specs[1:] * n_counts
  count_shape = [jax.ShapeDtypeStruct((b, p, splits, r), jnp.int32)] * n_counts
  outs = pl.pallas_call(
      kernel,
      grid=(b, p, splits),
      in_specs=in_specs,
      out_specs=pair_specs * n_pairs + count_spec,
      out_shape=pair_shapes * n_pairs + count_shape,
      compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                           num_stages=tiles.num_stages),
      interpret=interpret,
      name=("sparse_decode_multiquery" if with_limit else "sparse_decode")
      + ("_resa" if with_prior else ""),
  )(*args)
  if epilogue is not None and (not with_prior or count_attended):
    raise ValueError("an epilogue finishes the prior path: give a prior (and no attended count)")
  counts = tuple(outs[2 * n_pairs:])
  combined = split_combine_pairs([(outs[2 * i], outs[2 * i + 1]) for i in range(n_pairs)],
                                 counts[0] if epilogue is not None else counts,
                                 epilogue=epilogue, extras=extras, carry_in=carry_in,
                                 query_pos=None if epilogue is None and carry_in is None
                                 else query_pos,
                                 impl="pallas", interpret=interpret)
  if epilogue is not None:
    return combined
  pairs, totals = combined
  return tuple(x for pair in pairs for x in pair) + tuple(totals)
