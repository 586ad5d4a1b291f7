"""A decode step's cache write in one launch: ``cache_append`` and its reference.

A decode step appends one token per (batch, kv head): its K and V rows and its position go to
slot ``s`` and the box digests (element-wise min / max of the valid keys, Quest's page digests)
of the block holding ``s`` are recomputed. Through XLA that is ~8 small ops on a GPU (three
scatters, the block's gather, two reductions, two digest scatters), ~2-3.5 us each, about a
third of a dense decode step at 32k. The kernel runs one program per (batch, kv head): it reads
the touched block once, merges the new row in registers (no read-after-write through memory),
reduces the digests and writes the row, the position and the two digest rows in place
(``input_output_aliases``; with the cache donated nothing else is copied).

A step that feeds a window of S tokens (RetroAttention re-reads its last S positions and
rewrites their K/V) goes through the same launch: the program walks its S tokens, and each
one's block is read once with all S new rows merged in registers, so blocks shared by several
of them get the same digests whichever is written last (through XLA the window's write is ~100
ops: scatters, gathers and the digests of every touched block).

The launch also advances the length: it takes the length before the write and returns
``max(length, s + 1)`` over the tokens it writes, so a decode step's write has no XLA op around
it (the slot's range check, the length's reduction and the positions' broadcast over kv heads
were one more small fusion a layer). A slot is valid when its position is ``>= 0`` and it lies
below that new length; a block with no valid key gets zero digests. Rows whose slot is out of
range (``s < 0`` or ``s >= T``: padding) write nothing.

Every program of a batch row computes the same new length from the one it reads; the program of
kv head 0 stores it in place. Another program of the row may read the stored value instead of
the old one, and ``max`` gives it the same result, so the race is benign (on a GPU as in the
sequential interpreters).

Letters: B batch, K kv heads, T slots, NB blocks, D head dim, S new tokens a row.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.backends import triton_module

plgpu = triton_module()  # jax.experimental.pallas.triton; see backends


# Most tokens per row one launch writes (a RetroAttention window is <= 32 queries).
MAX_TOKENS = 32


def _with_token_axis(k_new, v_new, slot, token_pos):
  """``(k_new [B, K, S, D], v_new, slot [B, S], token_pos [B, S] or [B, K, S])``: the arguments
  of one token (``k_new [B, K, D]``, ``slot [B]``, ``token_pos [B]`` or ``[B, K]``) with
  ``S = 1``."""
  if k_new.ndim == 3:
    return k_new[:, :, None], v_new[:, :, None], slot[:, None], token_pos[..., None]
  return k_new, v_new, slot, token_pos


def check_token_pos(token_pos, slot, kv_heads: int):
  """``token_pos`` is shaped as ``slot`` (shared by the kv heads) or has a kv-head axis after the
  batch axis."""
  per_head = (slot.shape[0], kv_heads, *slot.shape[1:])
  if token_pos.shape not in (slot.shape, per_head):
    raise ValueError(f"token_pos must be {slot.shape} or {per_head}, got {token_pos.shape}")


def new_length(slot, length, t: int):
  """``max(length, s + 1)`` over the in-range slots ``slot [B]`` or ``[B, S]`` (``[B]`` int32)."""
  slot = slot.reshape(slot.shape[0], -1)
  written = jnp.where((slot >= 0) & (slot < t), slot + 1, 0)
  return jnp.maximum(length.astype(jnp.int32), jnp.max(written, axis=-1, initial=0))


def cache_append_reference(k, v, pos, kmin, kmax, k_new, v_new, slot, token_pos, length, *,
                           block_size: int):
  """The jnp path (``impl="xla"``): scatter the rows, recompute the touched blocks' digests.

  Args:
    k, v: ``[B, K, T, D]`` cache; ``pos [B, K, T]`` int32 (-1 = empty).
    kmin, kmax: ``[B, K, NB, D]`` box digests (cache dtype).
    k_new, v_new: ``[B, K, D]`` the new rows (cache dtype), or ``[B, K, S, D]`` for S tokens a
      row (distinct slots).
    slot: ``[B]`` (``[B, S]``) int32 slot of each new token; out of ``[0, T)`` = no write.
    token_pos: int32 the tokens' positions, shaped as ``slot`` (the same for every kv head) or
      ``[B, K]`` (``[B, K, S]``).
    length: ``[B]`` int32 the cache length before the write (the length after it gives the same
      result: the new length is a maximum).
    block_size: static tokens per block.

  Returns:
    ``(k, v, pos, kmin, kmax, length)`` updated; ``length = max(length, s + 1)`` over the
    in-range slots.
  """
  check_token_pos(token_pos, slot, k.shape[1])
  k_new, v_new, slot, token_pos = _with_token_axis(k_new, v_new, slot, token_pos)
  b, h, t, _ = k.shape
  n = slot.shape[-1]
  length = new_length(slot, length, t)
  token_pos = jnp.broadcast_to(token_pos[:, None] if token_pos.ndim == 2 else token_pos,
                               (b, h, n))
  live = (slot >= 0) & (slot < t)  # [B, S]
  s = jnp.where(live, slot, t)  # out of range: dropped
  bi, hi = jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None]
  si = jnp.broadcast_to(s[:, None, :], (b, h, n))
  k = k.at[bi, hi, si].set(k_new.astype(k.dtype), mode="drop")
  v = v.at[bi, hi, si].set(v_new.astype(v.dtype), mode="drop")
  pos = pos.at[bi, hi, si].set(token_pos.astype(pos.dtype), mode="drop")
  blk = jnp.minimum(s, t - 1) // block_size  # [B, S]
  rows = (blk[..., None] * block_size + jnp.arange(block_size)).reshape(b, 1, n * block_size)
  kb = jnp.take_along_axis(k, rows[..., None], axis=2).astype(jnp.float32)
  pb = jnp.take_along_axis(pos, jnp.broadcast_to(rows, (b, h, n * block_size)), axis=2)
  ok = ((pb >= 0) & (rows < length[:, None, None]))[..., None]
  split = lambda x: x.reshape(b, h, n, block_size, *x.shape[3:])  # [B, K, S, bs, ...]
  kb, ok = split(kb), split(ok)
  any_ok = jnp.any(ok, axis=3)
  lo = jnp.where(any_ok, jnp.min(jnp.where(ok, kb, jnp.inf), axis=3), 0.0)
  hi_ = jnp.where(any_ok, jnp.max(jnp.where(ok, kb, -jnp.inf), axis=3), 0.0)
  bidx = jnp.broadcast_to(jnp.where(live, blk, kmin.shape[2])[:, None, :], (b, h, n))
  kmin = kmin.at[bi, hi, bidx].set(lo.astype(kmin.dtype), mode="drop")
  kmax = kmax.at[bi, hi, bidx].set(hi_.astype(kmax.dtype), mode="drop")
  return k, v, pos, kmin, kmax, length


def _append_kernel(*refs, block_size: int, t: int, head_dim: int, tokens: int):
  """One (batch, kv head): the new length, then per new token its row and position, and its
  block's digests from the block as read with every new token of the row merged in
  (registers, not memory: no read-after-write between the program's threads). ``refs``: the
  six aliased state inputs (used through the outputs), the four new-token inputs, the
  ``after`` operands (never read), the six outputs."""
  knew_ref, vnew_ref, slot_ref, tok_ref = refs[6:10]
  k_ref, v_ref, pos_ref, kmin_ref, kmax_ref, len_ref = refs[-6:]
  dp = _common.pad_rows(head_dim, 1)
  col = jnp.arange(dp)
  col_ok = col < head_dim
  row_at = lambda ref, j: plgpu.load(ref.at[j, pl.ds(0, dp)], mask=col_ok, other=0)

  def meta(j):
    """Token ``j``'s clipped slot, whether it writes, and its position."""
    s = slot_ref[j]
    return jnp.clip(s, 0, t - 1), (s >= 0) & (s < t), tok_ref[j]

  def reach(j, top):
    """The length after token ``j``'s write: ``max(top, s + 1)`` if it writes."""
    sc, live, _ = meta(j)
    return jnp.where(live, jnp.maximum(top, sc + 1), top)

  length = len_ref[()]  # the old length, or (benign) the new one stored by kv head 0
  length = reach(0, length) if tokens == 1 else lax.fori_loop(0, tokens, reach, length)

  @pl.when(pl.program_id(1) == 0)
  def _():
    len_ref[()] = length

  def put(acc, rows, sj, lj, kj, tj):
    """``[bs, D]`` keys and ``[bs]`` positions of the block ``rows`` with token j in place."""
    kb, pb = acc
    is_j = (rows == sj) & lj
    return jnp.where(is_j[:, None], kj[None, :].astype(kb.dtype), kb), jnp.where(is_j, tj, pb)

  def write(i, carry):
    sc, live, tok = meta(i)
    k_row = row_at(knew_ref, i)
    blk = sc // block_size
    rows = blk * block_size + jnp.arange(block_size)
    acc = (plgpu.load(k_ref.at[rows[:, None], col[None, :]], mask=col_ok[None, :], other=0),
           plgpu.load(pos_ref.at[rows]))
    if tokens == 1:  # a decode step's one token: its row is already loaded
      kb, pb = put(acc, rows, sc, live, k_row, tok)
    else:  # every token of the row (earlier ones may be in memory already: merged the same)
      def merge(j, acc):
        sj, lj, tj = meta(j)
        return put(acc, rows, sj, lj, row_at(knew_ref, j), tj)
      kb, pb = lax.fori_loop(0, tokens, merge, acc)
    kb = kb.astype(jnp.float32)
    ok = ((pb >= 0) & (rows < length))[:, None]
    any_ok = jnp.sum(ok.astype(jnp.int32)) > 0
    lo = jnp.where(any_ok, jnp.min(jnp.where(ok, kb, jnp.inf), axis=0), 0.0)
    hi = jnp.where(any_ok, jnp.max(jnp.where(ok, kb, -jnp.inf), axis=0), 0.0)
    row_mask = col_ok & live
    plgpu.store(k_ref.at[sc, pl.ds(0, dp)], k_row.astype(k_ref.dtype), mask=row_mask)
    plgpu.store(v_ref.at[sc, pl.ds(0, dp)], row_at(vnew_ref, i).astype(v_ref.dtype),
                mask=row_mask)
    plgpu.store(pos_ref.at[rows], jnp.broadcast_to(tok, rows.shape), mask=(rows == sc) & live)
    plgpu.store(kmin_ref.at[blk, pl.ds(0, dp)], lo.astype(kmin_ref.dtype), mask=row_mask)
    plgpu.store(kmax_ref.at[blk, pl.ds(0, dp)], hi.astype(kmax_ref.dtype), mask=row_mask)
    return carry

  if tokens == 1:  # the decode step's launch: straight-line code, as before windows
    write(jnp.int32(0), 0)
  else:
    lax.fori_loop(0, tokens, write, 0)


@functools.partial(jax.jit, static_argnames=("block_size", "impl", "interpret"))
def cache_append(k, v, pos, kmin, kmax, k_new, v_new, slot, token_pos, length, *,
                 block_size: int, impl: _common.Impl = "auto", interpret: bool = False,
                 after=()):
  """One token (or a window of S <= ``MAX_TOKENS``) per (batch, kv head) written at ``slot``,
  the touched blocks' box digests recomputed, in one launch.

  Args: as ``cache_append_reference`` (``length`` before the write); ``impl``:
    ``"pallas"``/``"triton"``, ``"mosaic"`` (``pallas_kernels.mosaic.cache_append``: one token;
    a window there takes the reference),
    ``"xla"`` or ``"auto"`` (``backends.resolve_impl``); ``interpret``: run the kernel in
    interpret mode (CPU); ``after``: arrays (a pytree) the launch takes as operands and never
    reads, so XLA runs their producers first with no op of its own: a read of the slots this
    write overwrites (RESA's prior update) stays before it and the cache stays in place (the
    reference route orders itself with ``_common.order_after``).

  Returns:
    ``(k, v, pos, kmin, kmax, length)`` updated (in place where the inputs are donated).
  """
  check_token_pos(token_pos, slot, k.shape[1])
  resolved = _common.resolve_impl(impl, "cache_append")
  if resolved == "mosaic" and k_new.ndim == 4 and k_new.shape[2] == 1:  # one token a row
    k_new, v_new, slot, token_pos = k_new[:, :, 0], v_new[:, :, 0], slot[:, 0], token_pos[..., 0]
  if resolved == "mosaic" and k_new.ndim == 3:
    from pallas_kernels import mosaic  # pylint: disable=import-outside-toplevel (imports us)
    return mosaic.cache_append(k, v, pos, kmin, kmax, k_new, v_new, slot, token_pos, length,
                               block_size=block_size, impl="mosaic", interpret=interpret,
                               after=after)
  k_new, v_new, slot, token_pos = _with_token_axis(k_new, v_new, slot, token_pos)
  after = jax.tree.leaves(after)
  if resolved != "pallas":  # XLA, or a window through Mosaic (its twin writes one token)
    k_new, v_new = (_common.order_after(x, *after) if after else x for x in (k_new, v_new))
    return cache_append_reference(k, v, pos, kmin, kmax, k_new, v_new, slot, token_pos, length,
                                  block_size=block_size)
  b, h, t, d = k.shape
  n = slot.shape[-1]
  if n > MAX_TOKENS:
    raise ValueError(f"at most {MAX_TOKENS} tokens a row per launch, got {n}")
  nb = _common.check_block_size(block_size, t)
  if kmin.shape != (b, h, nb, d) or kmax.shape != (b, h, nb, d):
    raise ValueError(f"box digests must be {(b, h, nb, d)}, got {kmin.shape} / {kmax.shape}")
  row = lambda *tail: pl.BlockSpec((None, None, *tail), lambda bi, hi: (bi, hi) + (0,) * len(tail))
  per_batch = lambda *tail: pl.BlockSpec((None, *tail), lambda bi, hi: (bi,) + (0,) * len(tail))
  specs = [row(t, d), row(t, d), row(t), row(nb, d), row(nb, d), per_batch()]
  state = (k, v, pos.astype(jnp.int32), kmin, kmax, length.astype(jnp.int32))
  kernel = functools.partial(_append_kernel, block_size=block_size, t=t, head_dim=d, tokens=n)
  return pl.pallas_call(
      kernel,
      out_shape=tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state),
      grid=(b, h),
      in_specs=specs + [row(n, d), row(n, d), per_batch(n),
                        per_batch(n) if token_pos.ndim == 2 else row(n)]
      + [pl.BlockSpec(memory_space=pl.ANY)] * len(after),
      out_specs=tuple(specs),
      input_output_aliases={i: i for i in range(len(state))},
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
      name="cache_append",
  )(*state, k_new.astype(k.dtype), v_new.astype(v.dtype), slot.astype(jnp.int32),
    token_pos.astype(jnp.int32), *after)
