"""Quest's group-shared block selection in one kernel: ``score_select`` and its reference.

Today's group-shared Quest step (``quest:gqa=group``) scores every block for the pooled query
(``block_score``, which writes ``[B, K, NB]`` float32 to HBM), then ranks and selects
(``block_select_ranked``, which reads them back): two launches and a round trip (before the
ranking moved into the select, three). ``score_select`` does all of it in one program per
(batch, kv head):

  1. a loop over tiles of ``block_nb`` blocks scores each tile from ``kmin`` / ``kmax``
     (``block_score.tile_scores``: the same dots, so the same bits), ranks it
     (``block_select.rank_scores``; the forced blocks, sinks ``< n_sink_blocks`` and local
     ``>= local_start``, built from two numbers, not a mask in HBM), maps it to order keys and
     keeps the keys on chip, in a ``[NB / block_nb, block_nb]`` register tile (8192 blocks: 32
     per thread at 8 warps); the digest loads are the loop's pipelined traffic;
  2. the keys' ``count``-th largest is found by ``block_select``'s counting passes over those
     registers (``block_select.threshold``; ``bits_per_pass`` / ``early_exit`` as there);
  3. ``block_select.destinations`` places the chosen ids first in ascending order, then the
     others, and one scatter writes the list; the program also writes its ``n_valid``.

The row's local start and block count come as ``[B]`` arrays, or as ``row_budget``, a static
rule the program applies to its own length (Quest's budget in closed form: a few scalar ops), so
no XLA op runs before the launch.

The query tile is each kv head's group mean (``block_score.query_halves`` pools the G rows),
so the list, its order and ``n_valid`` are exactly those of ``block_score_pooled`` then
``selection.rank_scores`` then ``block_select`` (the Pallas path it replaces), in the layout
``sparse_decode`` reads. The reference (``impl="xla"``) is those ops' references composed:
``lax.top_k``'s set, listed best first.

Grid: one program per (batch, kv head), so the digests (4 MB per kv head at 128k, block 16,
D 128, bf16) stream through B x K programs only; at batch 1 with 8 kv heads that is 8 SMs,
where ``block_score`` splits them over ~264 programs (``roofline.score_select_cost``).

Letters: B batch, K kv heads, NB blocks, D head dim, n list length, Rp padded query rows (16).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.backends import triton_module
from pallas_kernels.block_score import (block_score_reference, pooled_query, query_halves,
                                        tile_scores)
from pallas_kernels.block_select import (BITS_PER_PASS, EARLY_EXIT, block_select_reference,
                                         default_warps, destinations, order_keys, rank_scores,
                                         threshold)

plgpu = triton_module()  # jax.experimental.pallas.triton; see backends

# Most blocks a row may have: 8192 (128k tokens in 16-token blocks) compile for sm_90 at 8 warps
# with 128 registers and no spill; 16384 at 16 warps spill (432 bytes: the digest tiles and
# the dots need registers beside the 32 keys a thread), so longer rows take the two kernels.
FUSED_MAX_ENTRIES = 8192


def padded_entries(num_blocks: int) -> int:
  """Lanes of a program's key tile: ``NB`` rounded up to a power of 2 (at least 16)."""
  return max(16, pl.next_power_of_2(num_blocks))


def supported(num_blocks: int) -> bool:
  """Whether a row of ``num_blocks`` keys fits the kernel's registers (``FUSED_MAX_ENTRIES``)."""
  return padded_entries(num_blocks) <= FUSED_MAX_ENTRIES


def _grouped(q):
  """``q`` as ``[B, K, G, D]`` (a ``[B, K, D]`` query per kv head is a group of one)."""
  return q[:, :, None] if q.ndim == 3 else q


def _check_counts(local_start, count, row_budget):
  if (row_budget is None) == (local_start is None or count is None):
    raise ValueError("give local_start and count, or row_budget (not both)")


def _row_counts(length, local_start, count, row_budget):
  """``(local_start, count)``: as given, or ``row_budget(length)`` (exactly one of the two)."""
  _check_counts(local_start, count, row_budget)
  return (local_start, count) if row_budget is None else row_budget(length)


def score_select_reference(q, kmin, kmax, length, local_start=None, count=None, *,
                           block_size: int, n: int, n_sink_blocks: int, row_budget=None):
  """``block_score_reference`` -> ``block_select.rank_scores`` -> ``block_select_reference``
  (the ``impl="xla"`` path).

  Args: as ``score_select``.

  Returns:
    ``idx [B, K, n]`` int32 (``lax.top_k``: best first; its first ``count`` are the kernel's
    set) and ``n_valid [B, K]`` int32 (``count`` per kv head).
  """
  local_start, count = _row_counts(length, local_start, count, row_budget)
  b, kh, nb, _ = kmin.shape
  # [B, K, NB]
  scores = block_score_reference(pooled_query(_grouped(q)), kmin, kmax, length,
                                 block_size=block_size)[:, :, 0]
  blocks = jnp.arange(nb, dtype=jnp.int32)[None, :]
  valid = blocks * block_size < length[:, None]
  forced = ((blocks < n_sink_blocks) | (blocks >= local_start[:, None])) & valid
  ranked = rank_scores(scores, valid[:, None], forced[:, None])
  idx = block_select_reference(ranked, count, n=n)
  return idx, jnp.broadcast_to(count[:, None], (b, kh)).astype(jnp.int32)


def _kernel(q_ref, kmin_ref, kmax_ref, length_ref, *refs, block_size: int, group: int,
            head_dim: int, num_blocks: int, block_nb: int, padded: int, n: int,
            n_sink_blocks: int, bits_per_pass: int, early_exit: bool, row_budget):
  """One (batch, kv head): refs ``q [G, D]`` (pooled here), ``kmin, kmax [NB, D]``, scalars
  ``length`` and (without ``row_budget``) ``local_start``, ``count``; writes ``idx [n]`` and
  the scalar ``n_valid``."""
  length = length_ref[()]
  if row_budget is None:
    start_ref, count_ref, idx_ref, n_valid_ref = refs
    start, count = start_ref[()], count_ref[()]
  else:
    idx_ref, n_valid_ref = refs
    start, count = (x.astype(jnp.int32) for x in row_budget(length))
  halves = query_halves(q_ref, group, head_dim, kmin_ref.dtype, pool=True)
  n_tiles = padded // block_nb
  # [Rp, 1]: the one real query row (the others pad the dot to 16 rows)
  top_row = (jnp.arange(halves[0].shape[0]) == 0)[:, None]
  tile_rows = jnp.arange(n_tiles)[:, None]

  def body(i, keys):
    blocks, live, score = tile_scores(halves, kmin_ref, kmax_ref, i * block_nb, length,
                                      block_size=block_size, head_dim=head_dim,
                                      num_blocks=num_blocks, block_nb=block_nb)
    forced = (blocks < n_sink_blocks) | (blocks >= start)
    # [Rp, NBt] -> [NBt]: row 0's keys (a sum of it and zeros: exact on integers)
    row = jnp.where(top_row, order_keys(rank_scores(score, live[None, :], forced[None, :])),
                    jnp.uint32(0))
    row = jnp.where(blocks < num_blocks, jnp.sum(row, axis=0), jnp.uint32(0))  # padding: 0
    return jnp.where(tile_rows == i, row[None, :], keys)

  # [NB / NBt, NBt] -> [padded]: every key of the row, in block order
  keys = lax.fori_loop(0, n_tiles, body, jnp.zeros((n_tiles, block_nb), jnp.uint32))
  keys = keys.reshape(padded)
  ids = jnp.arange(padded, dtype=jnp.int32)
  need = jnp.maximum(count, 1)
  t = threshold(keys, need, padded=padded, bits_per_pass=bits_per_pass, early_exit=early_exit)
  dest = destinations(keys, ids < num_blocks, t, need, count)
  plgpu.store(idx_ref.at[dest], ids, mask=dest < n)
  n_valid_ref[()] = count


@functools.partial(jax.jit, static_argnames=(
    "block_size", "n", "n_sink_blocks", "impl", "interpret", "block_nb", "num_warps",
    "num_stages", "bits_per_pass", "early_exit", "row_budget"))
def score_select(q, kmin, kmax, length, local_start=None, count=None, *, block_size: int,
                 n: int, n_sink_blocks: int, impl: _common.Impl = "auto",
                 interpret: bool = False, block_nb: int = 64, num_warps: int | None = None,
                 num_stages: int = 3, bits_per_pass: int = BITS_PER_PASS,
                 early_exit: bool = EARLY_EXIT, row_budget=None):
  """Quest's group-shared selection: score every block for one query per kv head, keep the
  ``count`` best with the forced blocks first, list them (module docstring).

  Args:
    q: ``[B, K, D]`` one query per kv head, or ``[B, K, G, D]`` each kv head's G query heads,
      scored as their mean (``block_score.pooled_query``, formed inside the kernel).
    kmin, kmax: ``[B, K, NB, D]`` block digests (``kmin <= kmax``).
    length: ``[B]`` int32; blocks starting at or past it are never chosen.
    local_start: ``[B]`` int32; blocks ``>= local_start`` (inside the context) are forced.
    count: ``[B]`` int32 blocks to choose, forced ones included, ``0 <= count <= min(n,
      NB)``, at least the forced and at most the valid blocks (``selection.selected_count``).
    row_budget: instead of ``local_start`` and ``count``, a static (hashable) rule mapping a
      length (``[B]``, or a row's scalar inside the kernel) to ``(local_start, count)`` with
      jnp ops (``sparse_attn.kernels.RowBudget``).
    block_size: tokens per block (static).
    n: static list length (``<= NB``).
    n_sink_blocks: blocks ``< n_sink_blocks`` (inside the context) are forced (static).
    impl: ``"pallas"``/``"triton"``/``"mosaic"`` (the Triton kernel; no Mosaic twin), ``"xla"``
      (``score_select_reference``) or ``"auto"``; rows past ``FUSED_MAX_ENTRIES`` take the
      reference.
    interpret: run the Pallas kernel in interpret mode (CPU).
    block_nb: blocks scored per loop iteration (a power of 2 >= 16).
    num_warps, num_stages: Triton launch parameters (``block_select.default_warps``).
    bits_per_pass, early_exit: the counting passes (``block_select.block_select``).

  Returns:
    ``idx [B, K, n]`` int32, the first ``count`` the chosen ids (the kernel: ascending, then
    the other ids ascending; the reference: best first), and ``n_valid [B, K]`` int32.
  """
  b, kh, nb, d = kmin.shape
  if not 0 < n <= nb:
    raise ValueError(f"list length n={n} must be in [1, {nb}]")
  _common.TileConfig(block_nb=block_nb)  # validates block_nb
  _check_counts(local_start, count, row_budget)
  if _common.resolve_impl(impl, "score_select") == "xla" or not supported(nb):
    return score_select_reference(q, kmin, kmax, length, local_start, count,
                                  block_size=block_size, n=n, n_sink_blocks=n_sink_blocks,
                                  row_budget=row_budget)
  padded = padded_entries(nb)
  block_nb = min(block_nb, padded)
  q = _grouped(q)
  kernel = functools.partial(_kernel, block_size=block_size, group=q.shape[2], head_dim=d,
                             num_blocks=nb, block_nb=block_nb, padded=padded, n=n,
                             n_sink_blocks=n_sink_blocks, bits_per_pass=bits_per_pass,
                             early_exit=early_exit, row_budget=row_budget)
  head = lambda bi, hi: (bi, hi, 0, 0)
  digest = pl.BlockSpec((None, None, nb, d), head)
  row = pl.BlockSpec((None,), lambda bi, hi: (bi,))
  return pl.pallas_call(
      kernel,
      grid=(b, kh),
      in_specs=[pl.BlockSpec((None, None, q.shape[2], d), head), digest, digest, row]
      + [row, row] * (row_budget is None),
      out_specs=[pl.BlockSpec((None, None, n), lambda bi, hi: (bi, hi, 0)),
                 pl.BlockSpec((None, None), lambda bi, hi: (bi, hi))],
      out_shape=[jax.ShapeDtypeStruct((b, kh, n), jnp.int32),
                 jax.ShapeDtypeStruct((b, kh), jnp.int32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps or default_warps(padded),
                                           num_stages=num_stages),
      interpret=interpret,
      name="score_select",
  )(q, kmin, kmax, length.astype(jnp.int32),
    *(() if row_budget is not None else (local_start.astype(jnp.int32), count.astype(jnp.int32))))
