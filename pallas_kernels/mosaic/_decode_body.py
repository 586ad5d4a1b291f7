"""The Mosaic GPU decode kernel's program body (``decode_body``), shared by
``mosaic.sparse_decode``, ``dense_decode`` (its identity mode), ``sparse_decode_resa`` and
``sparse_decode_multiquery``; ``sparse_decode.decode_partials`` launches it. The design is in
``mosaic/sparse_decode.py``'s docstring and docs/kernels_mosaic.md.

Letters: as ``mosaic/sparse_decode.py``.
"""

from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels._common import attended_length, split_bounds
from pallas_kernels.mosaic import _common as mc
from pallas_kernels.softmax import soft_cap

NEG_INF = mc.NEG_INF


def _online(carry, s, v, row_ok, regs):
  """One flash step of one row: logits ``s [W]`` (row layout, -inf = masked), ``v [W, D]``."""
  acc, m, l = carry
  m_new = jnp.maximum(m, jnp.max(s))
  # A row that attended nothing keeps m = -inf: shift by 0 so exp never sees inf - inf.
  m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
  alpha = jnp.exp(m - m_safe)
  p = mc.where(row_ok, jnp.exp(s - m_safe), 0.0)
  w, d = v.shape
  pv = jnp.sum(mc.bcast(p, (w, d), (0,)) * v, axis=0)  # [D] column layout
  return alpha * acc + pv, m_new, alpha * l + jnp.sum(p)


def decode_body(*refs, rows, block_size, blocks_per_step, stages, num_blocks, list_len,
                 max_splits, scale, softcap, with_pos, bits, with_limit, with_positions,
                 with_prior, rows_per_prior, mma, identity, regs, count_attended=False,
                 with_query_pos=False):
  """One program; refs: inputs (GMEM), outputs (GMEM), scratch (SMEM, barriers). With
  ``with_pos``, ``slot_ref [B, K, n, ceil(bs / 32)]``: each listed entry's slot-validity words.
  ``bits``: None or ``(A, C)``, row ``r`` may use an entry iff bit ``r % C`` of its word
  ``min(r // C, A - 1)`` is set. With a limit (multi-query): ``lim_ref [B, K, R]`` and, with
  ``with_positions``, ``ps_ref [B, K, n / J, W]`` the listed slots' positions per step, in a
  ring ``ps_s [ST, W]`` (they replace the slot words; with ``identity``, ``ps_ref`` is the
  cache's ``pos [B, K, T]`` and a step's window of it comes by TMA). With a prior (RESA):
  ``prior_ref [B, K, n / J, R / rows_per_prior, W]`` the listed slots' prior logits per step,
  outputs ``po, plse, cnt`` and their SMEM tiles, and a ring ``pr_s`` filled beside K/V.
  ``mma``: the two products of a step on the tensor cores for all 64 tile rows (``mma_body``;
  16-bit caches, no limit; a prior's rows ride in the tile below the query rows), else per row
  on CUDA cores (``body``).
  ``identity`` (dense decoding): entry ``i`` is block ``i`` and a row's list holds
  ``ceil(length / bs)`` entries, so there are no ``idx_ref`` / ``nv_ref`` and a step is one
  ``[W]``-token TMA per tensor (its window moved back to end at ``T`` where it would pass it,
  the tokens before the step's own start masked). ``count_attended`` (CUDA-core body only):
  an output ``att`` and its SMEM tile ``att_s`` (the last scratch), the keys each row
  attended. ``with_query_pos``: ``qp_ref [B]`` after the lengths, each row's query position (a
  negative one, a padding row, attends nothing: no step runs)."""
  it = iter(refs)
  q_ref, k_ref, v_ref = next(it), next(it), next(it)
  idx_ref, nv_ref = (None, None) if identity else (next(it), next(it))
  len_ref = next(it)
  qp_ref = next(it) if with_query_pos else None
  slot_ref = next(it) if with_pos else None
  bits_ref = next(it) if bits else None
  lim_ref = next(it) if with_limit else None
  ps_ref = next(it) if with_positions else None
  prior_ref = next(it) if with_prior else None
  o_ref, lse_ref = next(it), next(it)
  po_ref, plse_ref, cnt_ref = (next(it) for _ in range(3)) if with_prior else (None,) * 3
  att_ref = next(it) if count_attended else None
  q_s, k_s, v_s = next(it), next(it), next(it)  # [64, D], [ST, W, D] x 2
  o_s, lse_s, q_bar, k_bar, v_bar = (next(it) for _ in range(5))
  if with_prior:
    pr_s, po_s, plse_s, cnt_s, p_bar = (next(it) for _ in range(5))
  if with_positions:
    ps_s, ps_bar = next(it), next(it)
  att_s = next(it) if count_attended else None
  if count_attended and mma:
    raise ValueError("the keys attended are counted on the CUDA-core path (mma=False)")

  bi, hi, si = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
  bs, jn = block_size, blocks_per_step
  w = bs * jn
  d = k_s.shape[-1]
  words = -(-bs // 32)  # slot-validity words per block
  length = len_ref[bi]
  if with_query_pos:
    length = attended_length(length, qp_ref[bi])
  copies = 1 if identity else jn  # TMA copies (and barriers) per tensor and step
  row_blocks = (length + bs - 1) // bs if identity else nv_ref[bi, hi]
  if with_query_pos and not identity:
    row_blocks = jnp.where(length > 0, row_blocks, 0)
  lo, hi_e = split_bounds(row_blocks, si, list_len=list_len, max_splits=max_splits,
                          blocks_per_iter=jn)
  steps = (hi_e - lo + jn - 1) // jn
  last_step = -(-list_len // jn) - 1

  plgpu.copy_gmem_to_smem(q_ref.at[bi, hi], q_s, q_bar.at[0])

  def entry(step, j):
    return jnp.minimum(lo + step * jn + j, list_len - 1)

  def window(step):
    """Identity mode: the step's first slot, and the first slot its TMA reads (the same, or
    moved back so that the ``W`` tokens end at ``T``)."""
    start = (lo + step * jn) * bs
    return start, jnp.minimum(start, num_blocks * bs - w)

  def issue(step, slot):
    """TMA the J blocks of ``step`` into ring slot ``slot`` (past the slice: a clamped, masked
    block, so every barrier of the step is always armed)."""
    if identity:
      src = pl.ds(window(step)[1], w)
      plgpu.copy_gmem_to_smem(k_ref.at[bi, hi, src], k_s.at[slot], k_bar.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[bi, hi, src], v_s.at[slot], v_bar.at[slot])
    for j in range(0 if identity else jn):
      blk = jnp.clip(idx_ref[bi, hi, entry(step, j)], 0, num_blocks - 1)
      src, dst = pl.ds(blk * bs, bs), pl.ds(j * bs, bs)
      plgpu.copy_gmem_to_smem(k_ref.at[bi, hi, src], k_s.at[slot, dst],
                              k_bar.at[slot * jn + j])
      plgpu.copy_gmem_to_smem(v_ref.at[bi, hi, src], v_s.at[slot, dst],
                              v_bar.at[slot * jn + j])
    at = jnp.minimum(lo // jn + step, last_step)  # per-step tiles (lo is a multiple of J)
    if with_prior:  # [R / rows_per_prior, W]
      plgpu.copy_gmem_to_smem(prior_ref.at[bi, hi, at], pr_s.at[slot], p_bar.at[slot])
    if with_positions:  # [W]: the step's tile, or with identity the window of pos itself
      src = ps_ref.at[bi, hi, pl.ds(window(step)[1], w)] if identity else ps_ref.at[bi, hi, at]
      plgpu.copy_gmem_to_smem(src, ps_s.at[slot], ps_bar.at[slot])

  for st in range(stages):
    @pl.when(st < steps)
    def _():
      issue(st, st)

  plgpu.barrier_wait(q_bar.at[0])
  q_rows = None if mma else mc.rows_of(regs.load_tile(q_s), rows, regs)  # R x [D]
  limits = [lim_ref[bi, hi, r] for r in range(rows)] if with_limit else None

  def wait_step(slot):
    for j in range(copies):
      plgpu.barrier_wait(k_bar.at[slot * copies + j])
      plgpu.barrier_wait(v_bar.at[slot * copies + j])
    if with_prior:
      plgpu.barrier_wait(p_bar.at[slot])
    if with_positions:
      plgpu.barrier_wait(ps_bar.at[slot])

  def step_tokens(step, slot, layout):
    """``[W]`` in ``layout`` per token of ``step``: its position, whether it may be attended,
    its entry's words. Tokens are the K tile's rows on the CUDA-core path (``regs.row``) and
    the logit tile's columns with MMA (``regs.col``)."""
    tok = regs.iota((w,), 0, layout)
    tok_entry, tok_in_block = tok // bs, tok % bs
    first = jnp.zeros((w,), jnp.int32)  # its block's first slot
    live = jnp.zeros((w,), jnp.int32)  # listed in this slice
    word = [jnp.zeros((w,), jnp.int32) for _ in range(bits[0] if bits else 0)]
    held = jnp.zeros((w,), jnp.int32)  # with pos: the slot-validity word of the token
    if identity:  # the window's slots; with pos, their positions came by TMA
      start, read = window(step)
      tpos = read + tok
      ok = (tpos >= start) & (tpos < hi_e * bs) & (tpos < length)
      if with_positions:
        ok = ok & (regs.load_vec(ps_s.at[slot], layout) >= 0)
      return tpos, ok, word
    for j in range(jn):
      e = lo + step * jn + j
      at_j = tok_entry == j
      blk = jnp.clip(idx_ref[bi, hi, entry(step, j)], 0, num_blocks - 1)
      first = mc.where(at_j, blk * bs, first)
      live = mc.where(at_j, (e < hi_e).astype(jnp.int32), live)
      for a in range(len(word)):
        word[a] = mc.where(at_j, bits_ref[bi, hi, entry(step, j), a], word[a])
      for c in range(words if with_pos else 0):
        held = mc.where(at_j & (tok_in_block // 32 == c), slot_ref[bi, hi, entry(step, j), c],
                        held)
    tpos = first + tok_in_block  # [W] token positions (the slot when pos is not given)
    ok = (live > 0) & (tpos < length)
    if with_pos:
      ok = ok & ((lax.shift_right_logical(held, tok_in_block % 32) & 1) > 0)
    if with_positions:
      tpos = regs.load_vec(ps_s.at[slot], layout)
      ok = ok & (tpos >= 0)
    return tpos, ok, word

  def row_ok(ok, word, r):
    """Row ``r``'s tokens: ``ok`` and, with bits, its bit of the entry's word."""
    if not bits:
      return ok
    wd = word[min(r // bits[1], bits[0] - 1)]
    return ok & ((lax.shift_right_logical(wd, jnp.int32(r % bits[1])) & 1) > 0)

  def mma_body(step, carry):
    """One step of all 64 tile rows on the tensor cores: ``s = Q K^T``, ``acc += P V``. With a
    prior, tile rows ``R + r`` hold query row ``r``'s prior logits in place of their (zero-query)
    logits, so the same softmax and product accumulate RESA's prior pair; ``seen`` counts
    their attended members."""
    acc, m, l = carry[:3]  # [64, D] tile, [64] row
    slot = lax.rem(step, stages)
    wait_step(slot)
    _, ok, word = step_tokens(step, slot, regs.col)
    s = mc.mma(q_s, k_s.at[slot], (mc.TILE_ROWS, w), a_in_smem=True, transpose_b=True,
               regs=regs) * scale
    s = soft_cap(s, softcap)
    shape = (mc.TILE_ROWS, w)
    rid = regs.iota(shape, 0, regs.tile)
    src = mc.where(rid >= rows, rid - rows, rid) if with_prior else rid  # whose bits
    mask = mc.bcast(ok, shape, (1,))
    if bits:  # row r's bit r % C of word min(r // C, A - 1) of its token's entry
      sel = jnp.minimum(src // bits[1], bits[0] - 1)
      wd = mc.bcast(word[0], shape, (1,))
      for a in range(1, bits[0]):
        wd = mc.where(sel == a, mc.bcast(word[a], shape, (1,)), wd)
      mask = mask & ((lax.shift_right_logical(wd, src % bits[1]) & 1) > 0)
    if with_prior:  # [R', W] prior rows, each broadcast to the tile rows of its query rows
      mask = mask & (rid < 2 * rows)
      for i in range(rows // rows_per_prior):
        lo_row = rows + i * rows_per_prior
        s = mc.where((rid >= lo_row) & (rid < lo_row + rows_per_prior),
                     mc.bcast(regs.load_vec(pr_s.at[slot, i], regs.col), shape, (1,)), s)
    s = mc.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = mc.where(m_new == NEG_INF, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = mc.where(mask, jnp.exp(s - mc.bcast(m_safe, shape, (0,))), 0.0)

    # A masked slot's V may be stale or non-finite: zero it in SMEM (0 * NaN would reach acc),
    # with the mask rebuilt for the V tile's rows (only steps with a masked token pay this).
    @pl.when(jnp.min(ok.astype(jnp.int32)) == 0)
    def _():
      _, ok_rows, _ = step_tokens(step, slot, regs.row)
      vt = regs.cast(v_s[slot], regs.tile)
      v_s[slot] = mc.where(mc.bcast(ok_rows, (w, d), (0,)), vt, jnp.zeros((), vt.dtype))
      plgpu.commit_smem()

    pv = mc.mma(p.astype(v_s.dtype), v_s.at[slot], (mc.TILE_ROWS, d), a_in_smem=False,
                transpose_b=False, regs=regs)
    acc = mc.bcast(alpha, (mc.TILE_ROWS, d), (0,)) * acc + pv

    @pl.when(step + stages < steps)
    def _():
      issue(step + stages, slot)
    out = (acc, m_new, alpha * l + jnp.sum(p, axis=1))
    if with_prior:  # counted in f32 (exact below 2^24 members)
      out += (carry[3] + jnp.sum(mc.where((rid >= rows) & (s > NEG_INF), 1.0, 0.0), axis=1),)
    return out

  def body(step, carry):
    """One step of the R rows on CUDA cores (f32 caches, and the multi-query variant)."""
    slot = lax.rem(step, stages)
    wait_step(slot)
    k = regs.load_tile(k_s.at[slot])  # [W, D]
    v = regs.load_tile(v_s.at[slot])
    tpos, ok, word = step_tokens(step, slot, regs.row)
    # Masked slots never reach p.v (stale or non-finite values are zeroed, not multiplied by 0).
    v = mc.where(mc.bcast(ok, (w, d), (0,)), v, 0.0)
    new, ok_rows = [], []
    for r in range(rows):
      s = jnp.sum(k * mc.bcast(q_rows[r], (w, d), (1,)), axis=1) * scale  # [W]
      s = soft_cap(s, softcap)
      ok_r = row_ok(ok, word, r)
      if with_limit:
        ok_r = ok_r & (tpos <= limits[r])
      ok_rows.append(ok_r)
      new.append(_online(carry[r], mc.where(ok_r, s, NEG_INF), v, ok_r, regs))
    prs = [regs.load_vec(pr_s.at[slot, i], regs.row)  # [W] prior logits, -inf: no member
           for i in range(rows // rows_per_prior if with_prior else 0)]
    for r in range(rows if with_prior else 0):  # RESA: the prior over the same slots and V
      pr = prs[r // rows_per_prior]
      seen = (pr > NEG_INF) & ok_rows[r]
      pc, cnt = carry[rows + r]
      new.append((_online(pc, mc.where(seen, pr, NEG_INF), v, seen, regs),
                  cnt + jnp.sum(seen.astype(jnp.int32))))
    if count_attended:  # the keys each row attended, after the rows (and prior rows)
      new += [c + jnp.sum(ok_r.astype(jnp.int32))
              for c, ok_r in zip(carry[len(carry) - rows:], ok_rows)]

    @pl.when(step + stages < steps)
    def _():
      issue(step + stages, slot)
    return tuple(new)

  if mma:
    tile_rows = lambda x: regs.cast(jnp.full((mc.TILE_ROWS,), x, jnp.float32), regs.row)
    out = lax.fori_loop(0, steps, mma_body, (
        regs.cast(jnp.zeros((mc.TILE_ROWS, d), jnp.float32), regs.tile), tile_rows(NEG_INF),
        tile_rows(0.0)) + ((tile_rows(0.0),) if with_prior else ()))
    acc, m, l = out[:3]
    rid = regs.iota((mc.TILE_ROWS,), 0, regs.row)
    pick = lambda x, r, reduce, fill: reduce(mc.where(rid == r, x, fill))
    tiled = 2 * rows if with_prior else rows
    carry = [(a, pick(m, r, jnp.max, NEG_INF), pick(l, r, jnp.sum, 0.0))
             for r, a in enumerate(mc.rows_of(acc, tiled, regs))]
    if with_prior:  # the prior rows, each with its attended members
      carry = carry[:rows] + [(c, pick(out[3], rows + r, jnp.sum, 0.0).astype(jnp.int32))
                              for r, c in enumerate(carry[rows:])]
  else:
    init = (regs.cast(jnp.zeros((d,), jnp.float32), regs.col), jnp.float32(NEG_INF),
            jnp.float32(0.0))
    carry = lax.fori_loop(0, steps, body, (init,) * rows + ((init, jnp.int32(0)),) * (
        rows if with_prior else 0) + (jnp.int32(0),) * (rows if count_attended else 0))
    if count_attended:
      for r, att in enumerate(carry[len(carry) - rows:]):
        att_s[r] = att
      carry = carry[:len(carry) - rows]
  pairs = [(carry[:rows], o_s, lse_s, o_ref, lse_ref)]
  if with_prior:
    pairs.append(([c for c, _ in carry[rows:]], po_s, plse_s, po_ref, plse_ref))
    for r, (_, cnt) in enumerate(carry[rows:]):
      cnt_s[r] = cnt
  for rows_carry, out_s, l_s, _, _ in pairs:
    for r, (acc, m, l) in enumerate(rows_carry):
      ok = l > 0
      safe = jnp.where(ok, l, 1.0)
      out_s[r] = acc / safe * ok.astype(jnp.float32)
      l_s[r] = jnp.where(ok, m + jnp.log(safe), NEG_INF)
  plgpu.commit_smem()
  for _, out_s, l_s, out_ref, l_ref in pairs:
    plgpu.copy_smem_to_gmem(out_s, out_ref.at[bi, hi, si])
    plgpu.copy_smem_to_gmem(l_s, l_ref.at[bi, hi, si])
  if with_prior:
    plgpu.copy_smem_to_gmem(cnt_s, cnt_ref.at[bi, hi, si])
  if count_attended:
    plgpu.copy_smem_to_gmem(att_s, att_ref.at[bi, hi, si])
  plgpu.wait_smem_to_gmem(0)
