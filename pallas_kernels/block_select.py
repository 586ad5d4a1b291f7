"""Top-k block selection without a sort: ``block_select`` and its reference.

A decode step keeps the ``count`` best of ``NB`` ranked blocks per (batch, head) row. XLA's
``lax.top_k`` with ``k >= 100`` sorts the whole row on a GPU; a selection only needs the *set*.
The kernel finds it with a radix select in one program per row, the row held in registers:

  1. every score is mapped to an unsigned key with the same order (``order_keys``);
  2. counting passes build the ``count``-th largest key ``t``, ``bits_per_pass`` bits a pass
     (a digit of ``t`` is the largest one whose prefix at least ``count`` keys are ``>=``; the
     ``2^bits`` candidate digits are counted together, so a pass costs one reduction's
     latency and ``32 / bits`` passes run one after the other); with ``early_exit`` (one bit a
     pass) the passes stop once exactly ``count`` keys are ``>= t``: that set is the answer
     whatever the lower bits, ~22 passes instead of 32 on distinct scores (8192 entries);
  3. the chosen entries are the keys ``> t`` and, among the keys ``== t``, the lowest ids until
     ``count`` are chosen (``lax.top_k``'s tie rule);
  4. a prefix sum places the chosen ids first, in ascending id order, and the other ids after
     them (distinct padding); one masked scatter writes the list.

No sort, one read of the scores, one write of the list. The order inside the chosen set is by
id, not by score: every consumer of a ``Selection`` treats its first ``n_valid`` ids as a set.
The reference (the ``impl="xla"`` path) is ``lax.top_k``: the same set, listed best first.

Letters: R rows (batch x selection heads), NB entries per row, n list length.
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

MAX_ENTRIES = 16384  # one row in registers (8 warps: 64 keys per thread); longer rows: XLA
BITS_PER_PASS = 1  # bits per counting pass: 1 ran fastest on an H100 (decode_sweep.py)
EARLY_EXIT = False  # not yet timed on a GPU (decode_sweep.py --select_early=0,1 decides)


def order_keys(scores):
  """``scores`` float32 -> uint32 keys in the same order (no NaN; ``-0.0`` below ``0.0``)."""
  bits = lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.uint32)
  sign = bits >> 31
  return jnp.where(sign == 1, ~bits, bits | jnp.uint32(0x80000000))


def block_select_reference(scores, count, *, n: int):
  """The ``n`` best ids of each row by ``lax.top_k`` (ties: lower id first), best first: the
  jnp path (``impl="xla"``; a sort on GPUs).

  Its first ``count`` ids are the kernel's chosen set (the kernel lists them in ascending id
  order, then the other ids); every id of a row is distinct.

  Args:
    scores: ``[..., NB]`` float32 ranking (``[R, NB]`` for ``block_select``).
    count: ``[...]`` entries to choose; a full top-``n`` does not need it.
    n: static list length (``<= NB``).

  Returns:
    ``[..., n]`` int32 ids.
  """
  del count
  return lax.top_k(scores, n)[1].astype(jnp.int32)


FORCED = 3.0e38  # a forced entry's rank: above any real score, finite (no inf arithmetic)


def rank_scores(scores, valid, forced):
  """The ranking a selection sorts by (``selection.rank_scores``): forced entries ``FORCED``,
  entries outside the context ``-inf``, NaN scores ``-FORCED``, others clipped to
  ``[-FORCED, FORCED / 2]``. Elementwise; ``valid`` and ``forced`` broadcast against
  ``scores``."""
  s = jnp.where(jnp.isnan(scores), -FORCED, jnp.clip(scores, -FORCED, FORCED / 2))
  s = jnp.where(forced, FORCED, s)
  return jnp.where(valid, s, -jnp.inf)


def threshold(keys, need, *, padded: int, bits_per_pass: int, early_exit: bool):
  """The ``need``-th largest of ``keys`` (``order_keys`` of one row held in registers; padding
  lanes 0) by counting passes (the module docstring's step 2)."""

  def bit(i, t):
    cand = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
    enough = jnp.sum((keys >= cand).astype(jnp.int32)) >= need
    return jnp.where(enough, cand, t)

  digits = jnp.arange(1 << bits_per_pass, dtype=jnp.uint32)

  def digit(i, t):
    shift = (32 - (i + 1) * bits_per_pass).astype(jnp.uint32)
    # [C]: keys >= each candidate prefix; digit 0 (t itself) always has enough, and the counts
    # fall as the digit grows, so the largest digit with enough is the number with enough - 1.
    counts = jnp.sum((keys[None, :] >= (t | (digits << shift))[:, None]).astype(jnp.int32),
                     axis=1)
    best = jnp.sum((counts >= need).astype(jnp.int32)) - 1
    return t | (best.astype(jnp.uint32) << shift)

  def bit_counted(carry):
    i, t, c = carry  # c: the keys >= t
    cand = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
    got = jnp.sum((keys >= cand).astype(jnp.int32))
    enough = got >= need
    return i + 1, jnp.where(enough, cand, t), jnp.where(enough, got, c)

  if early_exit:
    # Padding keys (0) count at t = 0, so the loop never stops there with a padded row.
    _, t, _ = lax.while_loop(lambda carry: (carry[0] < 32) & (carry[2] != need), bit_counted,
                             (jnp.int32(0), jnp.uint32(0), jnp.int32(padded)))
    return t
  if bits_per_pass == 1:
    return lax.fori_loop(0, 32, bit, jnp.uint32(0))
  return lax.fori_loop(0, 32 // bits_per_pass, digit, jnp.uint32(0))


def destinations(keys, live, t, need, count):
  """Each lane's slot in the list (the module docstring's steps 3-4): the chosen ids (keys
  ``> t``, then ties ``== t`` lowest id first, ``need`` in all; none when ``count == 0``) at
  ``0..count-1`` in id order, every other lane after them in id order. A permutation of the
  lanes, so masked lanes never share a target with a written one (interpret mode would let
  them overwrite it).

  One prefix sum: the running counts of keys above ``t`` and of ties are packed in one int32
  (16 bits each; rows of at most ``MAX_ENTRIES``), and the first ``need - above`` ties are the
  chosen ones, so the chosen lanes up to a lane number ``above + min(ties, need - above)``."""
  ids = jnp.arange(keys.shape[0], dtype=jnp.int32)
  above = keys > t
  tied = (keys == t) & live
  allowed = need - jnp.sum(above.astype(jnp.int32))  # ties to choose; t is the need-th key
  running = jnp.cumsum(above.astype(jnp.int32) | (tied.astype(jnp.int32) << 16))
  running_tied = running >> 16
  some = count > 0
  chosen = (above | (tied & (running_tied <= allowed))) & some
  chosen_upto = jnp.where(some, (running & 0xFFFF) + jnp.minimum(running_tied, allowed), 0)
  return jnp.where(chosen, chosen_upto - 1, count + ids - chosen_upto)


# What a timing run may leave out of the kernel (``block_select_phases``): the threshold's
# counting passes and the list placement (prefix sum and scatter).
PHASES = ("io", "threshold", "place", "all")


def _select_kernel(*refs, num_entries: int, padded: int, n: int, bits_per_pass: int,
                   early_exit: bool, block_size: int | None, n_sink_blocks: int,
                   phases: str = "all", row_budget=None, heads: int = 1):
  """One row's select; with ``block_size`` the scores are raw and ranked here (``refs``: the
  row lengths and local starts before the output: ``block_select_ranked``; with
  ``row_budget`` the batch lengths only, the count and local start derived here and the count
  written after the list: ``block_select_budgeted``). ``phases`` other than ``"all"`` leave
  parts out, for timing only (``block_select_phases``)."""
  row = pl.program_id(0)
  ids = jnp.arange(padded, dtype=jnp.int32)
  live = ids < num_entries
  if row_budget is not None:
    scores_ref, length_ref, out_ref, count_out = refs
    length = length_ref[row // heads]
    start, count = (x.astype(jnp.int32) for x in row_budget(length))
    count_out[row] = count
  else:
    scores_ref, count_ref, out_ref = refs[0], refs[1], refs[-1]
    count = count_ref[row]
    if block_size is not None:
      length, start = refs[2][row], refs[3][row]
  x = plgpu.load(scores_ref.at[row, pl.ds(0, padded)], mask=live, other=0.0)
  if block_size is not None:  # the forced and valid blocks from two numbers, not masks in HBM
    forced = (ids < n_sink_blocks) | (ids >= start)
    x = rank_scores(x, ids * block_size < length, forced)
  keys = jnp.where(live, order_keys(x), jnp.uint32(0))  # padding below every real key
  need = jnp.maximum(count, 1)
  if phases in ("threshold", "all"):
    t = threshold(keys, need, padded=padded, bits_per_pass=bits_per_pass,
                  early_exit=early_exit)
  else:  # a fixed key (the order of 0.0), and the entries at or above it chosen: the placement
    t = jnp.uint32(0x80000000)  # still sees a data-dependent split, and stays a permutation
    need = count = jnp.sum((keys >= t).astype(jnp.int32))
  if phases in ("place", "all"):
    dest = destinations(keys, live, t, need, count)
  else:  # each lane its own slot: no prefix sum, no scatter
    dest = jnp.where(keys >= t, ids, n)
  plgpu.store(out_ref.at[row, dest], ids, mask=dest < n)


@functools.partial(jax.jit, static_argnames=("n", "phases", "interpret", "num_warps",
                                             "bits_per_pass", "early_exit"))
def block_select_phases(scores, count, *, n: int, phases: str, interpret: bool = False,
                        num_warps: int | None = None, bits_per_pass: int = BITS_PER_PASS,
                        early_exit: bool = EARLY_EXIT):
  """The ``block_select`` kernel with parts left out, to time each part on a GPU
  (``experiments.decode_sweep --select_phases``); only ``phases="all"`` returns a selection.

  ``phases``: ``"io"`` (load, key mapping, one store of the ids: the launch and memory floor),
  ``"threshold"`` (+ the counting passes; each lane at or above the threshold stores its id
  at its own index), ``"place"`` (the floor + the prefix sum and scatter of the entries
  ``>= 0.0``, in place of the ``count`` best), ``"all"`` (``block_select``).

  Returns:
    ``[R, n]`` int32; entries a phase run does not write are unspecified.
  """
  if phases not in PHASES:
    raise ValueError(f"phases must be one of {PHASES}, got {phases!r}")
  if pl.next_power_of_2(scores.shape[-1]) > MAX_ENTRIES:
    raise ValueError(f"rows of more than {MAX_ENTRIES} entries take the reference, not the "
                     f"kernel; got {scores.shape[-1]}")
  return _launch(scores, count, (), n=n, impl="pallas", interpret=interpret,
                 num_warps=num_warps, bits_per_pass=bits_per_pass, early_exit=early_exit,
                 block_size=None, n_sink_blocks=0, phases=phases)


def default_warps(padded: int) -> int:
  """Warps for a row of ``padded`` entries: at most 64 keys per thread (no register spills at
  16384 entries on sm_90, checked by ``tests/pallas_kernels/test_pk_block_select.py``)."""
  return 4 if padded <= 2048 else 8 if padded <= 8192 else 16


@functools.partial(jax.jit, static_argnames=("n", "impl", "interpret", "num_warps",
                                             "bits_per_pass", "early_exit"))
def block_select(scores, count, *, n: int, impl: _common.Impl = "auto",
                 interpret: bool = False, num_warps: int | None = None,
                 bits_per_pass: int = BITS_PER_PASS, early_exit: bool = EARLY_EXIT):
  """The ``count`` best entries of each row, without sorting.

  Args:
    scores: ``[R, NB]`` float32 ranking (no NaN; ``selection.rank_scores``: forced entries
      ``3e38``, entries outside the context ``-inf``).
    count: ``[R]`` int32 entries to choose, ``0 <= count <= min(n, NB)``.
    n: static list length (``<= NB``).
    impl: ``"pallas"``, ``"xla"`` (``block_select_reference``) or ``"auto"``; rows longer than
      ``MAX_ENTRIES`` always take the reference.
    interpret: run the Pallas kernel in interpret mode (CPU).
    num_warps: Triton launch parameter (default ``default_warps``).
    bits_per_pass: bits of the threshold found per counting pass (1, 2, 4 or 8; static).
    early_exit: stop the one-bit passes once exactly ``count`` keys are at or above the
      threshold found so far (a data-dependent loop; needs ``bits_per_pass=1``).

  Returns:
    ``[R, n]`` int32, the first ``count`` the chosen ids: the kernel lists them in ascending
    order, then the other ids ascending; the reference lists the ``n`` best, best first.
  """
  return _launch(scores, count, (), n=n, impl=impl, interpret=interpret, num_warps=num_warps,
                 bits_per_pass=bits_per_pass, early_exit=early_exit, block_size=None,
                 n_sink_blocks=0)


@functools.partial(jax.jit, static_argnames=("n", "block_size", "n_sink_blocks", "impl",
                                             "interpret", "num_warps", "bits_per_pass",
                                             "early_exit"))
def block_select_ranked(scores, count, length, local_start, *, n: int, block_size: int,
                        n_sink_blocks: int, impl: _common.Impl = "auto",
                        interpret: bool = False, num_warps: int | None = None,
                        bits_per_pass: int = BITS_PER_PASS, early_exit: bool = EARLY_EXIT):
  """``block_select`` of block scores as a decode step has them, ranked inside the kernel.

  The ranking (``rank_scores``) is built from two numbers per row instead of ``[R, NB]`` masks:
  a block is inside the context when ``id * block_size < length`` and forced when ``id <
  n_sink_blocks`` or ``id >= local_start`` (``Budget.forced_span``). So the XLA fusion that
  ranks the scores between ``block_score`` and ``block_select`` is gone, and the list is
  ``block_select(rank_scores(scores, valid, forced), count, n=n)``'s.

  Args:
    scores: ``[R, NB]`` float32 raw block scores (any value; NaN ranks last of the context).
    count: ``[R]`` int32 entries to choose (``selection.block_count``).
    length: ``[R]`` int32 tokens in the row's context.
    local_start: ``[R]`` int32 first forced local block.
    n, impl, interpret, num_warps, bits_per_pass, early_exit: as ``block_select``.
    block_size: static tokens per block; n_sink_blocks: static forced leading blocks.

  Returns:
    ``[R, n]`` int32, as ``block_select``.
  """
  if block_size < 1 or n_sink_blocks < 0:
    raise ValueError(f"block_size must be >= 1 and n_sink_blocks >= 0, got {block_size}, "
                     f"{n_sink_blocks}")
  return _launch(scores, count, (length.astype(jnp.int32), local_start.astype(jnp.int32)),
                 n=n, impl=impl, interpret=interpret, num_warps=num_warps,
                 bits_per_pass=bits_per_pass, early_exit=early_exit, block_size=block_size,
                 n_sink_blocks=n_sink_blocks)


@functools.partial(jax.jit, static_argnames=("n", "block_size", "n_sink_blocks", "row_budget",
                                             "impl", "interpret", "num_warps",
                                             "bits_per_pass", "early_exit"))
def block_select_budgeted(scores, length, *, row_budget, n: int, block_size: int,
                          n_sink_blocks: int, impl: _common.Impl = "auto",
                          interpret: bool = False, num_warps: int | None = None,
                          bits_per_pass: int = BITS_PER_PASS, early_exit: bool = EARLY_EXIT):
  """``block_select_ranked`` with the row's bookkeeping inside the kernel too: each program
  derives its count and local start from its batch row's length by ``row_budget`` (a static,
  hashable rule of jnp ops: ``sparse_attn.kernels.RowBudget``), so nothing but the scores and
  the lengths enters the launch (no XLA op before it, no broadcast of ``[B]`` to the rows).

  Args:
    scores: ``[B, H, NB]`` float32 raw block scores.
    length: ``[B]`` int32 tokens in each batch row's context.
    row_budget: ``length -> (local_start, count)``.
    n, block_size, n_sink_blocks, impl, interpret, num_warps, bits_per_pass, early_exit: as
      ``block_select_ranked``.

  Returns:
    ``(idx [B, H, n], n_valid [B, H])`` int32: the lists, as ``block_select_ranked``'s, and
    each row's count.
  """
  b, h, nb = scores.shape
  ids, count = _launch(scores.reshape(b * h, nb), None, (length.astype(jnp.int32),), n=n,
                       impl=impl, interpret=interpret, num_warps=num_warps,
                       bits_per_pass=bits_per_pass, early_exit=early_exit,
                       block_size=block_size, n_sink_blocks=n_sink_blocks,
                       row_budget=row_budget, heads=h)
  return ids.reshape(b, h, n), count.reshape(b, h)


def block_valid_forced(num_entries: int, length, local_start, block_size: int,
                       n_sink_blocks: int):
  """``(valid, forced)`` ``[R, NB]`` bool of ``block_select_ranked``'s rows (its reference)."""
  ids = jnp.arange(num_entries, dtype=jnp.int32)[None, :]
  valid = ids * block_size < length[:, None]
  return valid, (ids < n_sink_blocks) | (ids >= local_start[:, None])


def _launch(scores, count, row_args, *, n, impl, interpret, num_warps, bits_per_pass,
            early_exit, block_size, n_sink_blocks, phases="all", row_budget=None, heads=1):
  """The select's checks and launch (or its reference); ``row_args``: ``(length, local_start)``
  ``[R]`` when ``block_size`` is set (the ranked variant), ``(length [R / heads],)`` with
  ``row_budget`` (then ``count`` is None and the rows' counts are returned too), else empty."""
  r, nb = scores.shape
  if not 0 < n <= nb:
    raise ValueError(f"list length n={n} must be in [1, {nb}]")
  if bits_per_pass not in (1, 2, 4, 8):
    raise ValueError(f"bits_per_pass must be 1, 2, 4 or 8, got {bits_per_pass}")
  if early_exit and bits_per_pass != 1:
    raise ValueError(f"early_exit counts one bit a pass, got bits_per_pass={bits_per_pass}")
  padded = max(16, pl.next_power_of_2(nb))
  if _common.resolve_impl(impl, "block_select") == "xla" or padded > MAX_ENTRIES:
    if row_budget is not None:
      start, count = (jnp.repeat(x.astype(jnp.int32), heads) for x in row_budget(*row_args))
      row_args = (jnp.repeat(row_args[0], heads), start)
      return _launch(scores, count, row_args, n=n, impl="xla", interpret=interpret,
                     num_warps=num_warps, bits_per_pass=bits_per_pass, early_exit=early_exit,
                     block_size=block_size, n_sink_blocks=n_sink_blocks), count
    if block_size is not None:
      valid, forced = block_valid_forced(nb, *row_args, block_size, n_sink_blocks)
      scores = rank_scores(scores, valid, forced)
    return block_select_reference(scores, count, n=n)
  kernel = functools.partial(_select_kernel, num_entries=nb, padded=padded, n=n,
                             bits_per_pass=bits_per_pass, early_exit=early_exit,
                             block_size=block_size, n_sink_blocks=n_sink_blocks,
                             phases=phases, row_budget=row_budget, heads=heads)
  ids = jax.ShapeDtypeStruct((r, n), jnp.int32)
  return pl.pallas_call(
      kernel,
      out_shape=ids if row_budget is None else (ids, jax.ShapeDtypeStruct((r,), jnp.int32)),
      grid=(r,),
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps or default_warps(padded),
                                           num_stages=1),
      name="block_select",
  )(scores.astype(jnp.float32),
    *(() if row_budget is not None else (count.astype(jnp.int32),)), *row_args)
