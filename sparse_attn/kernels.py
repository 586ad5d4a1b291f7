"""The ops with a Pallas kernel, over a ``KVCache`` and a ``Selection``.

One function per op (dense causal attention over the cache and its split-K decode step, the
decode over Ada-KV's flat buffer, block scores, the top-k select, sparse decode, RESA's
partials, retro's window partials). Each adapts the cache and selection arrays to its
``pallas_kernels`` op and passes ``impl`` through: the op resolves it
(``pallas_kernels.resolve_impl``, the one dispatcher) and runs its Triton kernel or its jnp
``*_reference``, the one jnp implementation of the op. A token selection
(``granularity`` 1, not the cache's block size) runs the same ops over lists of single slots:
the Triton kernels gather a tile of scattered slots (Mosaic GPU has no such kernel:
``backends.list_op``). Besides the attention, the RESA and retro steps count prior members
attended (the op counts them in its own pass) and retro counts keys attended (computed here
from the masks the references use).

Attention-logit soft-capping (Gemma 2, ``softcap``): the attention ops take a static
``softcap`` and pass it to their op, which caps the scaled logits (``cap * tanh(s / cap)``,
``pallas_kernels.soft_cap``) before the masks and the softmax in the kernel and the reference
alike; ``lse`` is then over the capped logits. The block scores (Quest's bound, ``quest_scores``)
and the top-k select are not capped: tanh is monotone, so they rank blocks alike with or
without it. RESA's partials take no cap (RESA refuses soft-capped models,
``methods.Method.with_softcap``).

Letters: B batch, K kv heads, N query heads, H selection heads, R = N // H, S queries per head
(the retro window ``w``), L gathered slots, NB blocks, D head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import Impl, resolve_impl  # pylint: disable=unused-import (re-exported)
from sparse_attn import selection
from sparse_attn.budget import Budget
from sparse_attn.cache import KVCache
from sparse_attn.selection import Selection, block_count


def dense_attention(q, cache: KVCache, positions, scale=None, *, window: int | None = None,
                    softcap: float | None = None, impl: Impl = "xla", interpret: bool = False):
  """Exact causal attention of ``q [B, N, S, D]`` at ``positions [B, S]`` over the cache ->
  ``(out [B, N, S, D], lse [B, N, S])``: prefill chunks, rectification, dense decode
  (``pallas_kernels.chunk_attention``; ``softcap``: the module's soft-cap)."""
  return pallas_kernels.chunk_attention(q, cache.k, cache.v, positions, cache.pos, cache.length,
                                        scale=scale, window=window, impl=impl,
                                        interpret=interpret, softcap=softcap)


# Pipeline stages of the dense decode's split-K kernel. 2 (64-token tiles, one cp.async buffer,
# 38 KB of shared memory, so more programs share an SM) ran 7% faster than 3 at 32k and 3.5%
# at 128k on an H100 (experiments/decode_sweep.py; results/gpu_decode/decode_sweep.jsonl).
DENSE_DECODE_STAGES = 2


def dense_decode(q, cache: KVCache, positions, scale=None, *, impl: Impl = "xla",
                 interpret: bool = False, num_stages: int = DENSE_DECODE_STAGES,
                 softcap: float | None = None, **launch):
  """Exact attention of one query per head ``q [B, N, D]`` at ``positions [B]`` (the newest
  token: every valid slot is at or before it; negative = an inactive row) over the cache ->
  ``(out [B, N, D], lse [B, N])``: dense decode.

  ``"pallas"``: split-K flash decoding, ``pallas_kernels.dense_decode`` over every block (one
  program per batch x kv head x split, the G query heads of a group together, splits sized to
  fill the GPU), where a query-tiled kernel would run only B x N programs; otherwise
  ``dense_attention``'s reference. Inactive rows come back empty either way. ``num_stages`` and
  ``launch`` (``num_splits``, ``blocks_per_iter``, ``num_warps``) set the kernel's launch
  (``experiments/decode_sweep.py`` sweeps them). ``softcap``: the module's soft-cap.
  """
  if resolve_impl(impl, "sparse_decode") == "xla":
    out, lse = dense_attention(q[:, :, None], cache, positions[:, None], scale, impl="xla",
                               softcap=softcap)
    return out[:, :, 0], lse[:, :, 0]
  # an inactive row attends nothing: the kernel reads its position (no op before the launch)
  return pallas_kernels.dense_decode(q, cache.k, cache.v, cache.length,
                                     block_size=cache.block_size, scale=scale, pos=cache.pos,
                                     impl=impl, interpret=interpret, num_stages=num_stages,
                                     softcap=softcap, query_pos=positions, **launch)


def flat_decode(q, cache, positions, scale=None, *, impl: Impl = "xla",
                interpret: bool = False, softcap: float | None = None):
  """Dense decode of one query per head ``q [B, N, D]`` at ``positions [B]`` (the newest token;
  negative = an inactive row) over Ada-KV's flat buffer (``compression.flat.FlatKVCache``:
  every kv head's slots in one ``[B, Tf, D]`` buffer, query head ``n`` attends its kv head's)
  -> ``(out [B, N, D], lse [B, N])`` from ``pallas_kernels.flat_decode``'s kernel; None where
  ``impl`` resolves to the jnp reference (the caller runs ``compression.flat.attend``, the
  general form). ``softcap``: the module's soft-cap."""
  if resolve_impl(impl, "flat_decode") == "xla":
    return None
  return pallas_kernels.flat_decode(q, cache.k, cache.v, cache.head, cache.length,
                                    num_kv_heads=cache.num_kv_heads, scale=scale, pos=cache.pos,
                                    softcap=softcap, query_pos=positions, impl=impl,
                                    interpret=interpret)


def quest_scores(qs, cache: KVCache, *, impl: Impl = "xla", interpret: bool = False,
                 pool: bool = False):
  """Quest's digest upper bounds of ``qs [B, H, D]`` for every block -> ``[B, H, NB]`` float32
  (``pallas_kernels.block_score``; blocks past the context ``-inf``).

  ``pool``: ``qs`` are the ``[B, Hq, D]`` query heads, scored as each kv group's mean query
  (``scoring.pool_group``'s ``gqa="group"``, H = K), averaged inside the kernel
  (``pallas_kernels.block_score_pooled``).
  """
  b, h, d = qs.shape
  qg = qs.reshape(b, cache.num_kv_heads, h // cache.num_kv_heads, d)
  score = pallas_kernels.block_score_pooled if pool else pallas_kernels.block_score
  s = score(qg, cache.kmin, cache.kmax, cache.length, block_size=cache.block_size, impl=impl,
            interpret=interpret)
  return s.reshape(b, cache.num_kv_heads if pool else h, -1)


def top_ids(ranked, count, n_max: int, *, impl: Impl = "xla", interpret: bool = False):
  """Ids ``[B, H, n_max]`` whose first ``count [B]`` are the best of ``ranked [B, H, NB]``
  (``selection.rank_scores``; ``pallas_kernels.block_select``: ``lax.top_k`` or the sort-free
  radix select)."""
  b, h, nb = ranked.shape
  rows = jnp.broadcast_to(count[:, None], (b, h)).reshape(b * h)
  ids = pallas_kernels.block_select(ranked.reshape(b * h, nb), rows, n=n_max, impl=impl,
                                    interpret=interpret)
  return ids.reshape(b, h, n_max)


@dataclasses.dataclass(frozen=True)
class RowBudget:
  """A block selection's per-row bookkeeping in closed form, as a static (hashable) rule:
  ``length -> (local_start, count)``, the forced span's start (``Budget.forced_span``) and the
  block count (``selection.block_count``). jnp ops only, so it maps ``[B]`` lengths here and one
  row's scalar length inside a kernel (``pallas_kernels.score_select``'s ``row_budget``)."""
  budget: Budget
  num_blocks: int
  block_size: int
  n_max: int

  @classmethod
  def of(cls, cache: KVCache, budget: Budget) -> "RowBudget":
    nb, bs = cache.num_blocks, cache.block_size
    return cls(budget, nb, bs, min(budget.max_count(cache.capacity, bs), nb))

  @property
  def sink(self) -> int:
    """Blocks ``< sink`` (inside the context) are forced: a static count."""
    return self.budget.sink_entries(self.block_size)

  def __call__(self, length):
    _, start = self.budget.forced_span(length, self.block_size)
    return start, block_count(length, self.budget, self.num_blocks, self.block_size, self.n_max)


def select_blocks(scores, cache: KVCache, budget, *, impl: Impl = "xla",
                  interpret: bool = False) -> Selection:
  """``selection.select_blocks`` of ``scores [B, H, NB]`` under ``budget`` with ``top_ids``'s
  select: the same selection. On the Pallas path the ranking happens inside the select
  (``pallas_kernels.block_select_budgeted``), and so does the bookkeeping: each program applies
  ``RowBudget`` (closed-form ``Budget.forced_span`` and ``selection.block_count``) to its row's
  length, so no XLA op runs between the score and select kernels."""
  if resolve_impl(impl, "block_select") != "pallas":
    pick = functools.partial(top_ids, impl=impl, interpret=interpret)
    return selection.select_blocks(scores, cache, budget, pick)
  rule = RowBudget.of(cache, budget)
  idx, n_valid = pallas_kernels.block_select_budgeted(
      scores, cache.length, row_budget=rule, n=rule.n_max, block_size=cache.block_size,
      n_sink_blocks=rule.sink, impl=impl, interpret=interpret)
  return Selection(idx=idx, n_valid=n_valid, granularity=cache.block_size)


def quest_select(q, cache: KVCache, budget, *, impl: Impl = "xla",
                 interpret: bool = False) -> Selection | None:
  """Quest's group-shared block selection in one launch (``pallas_kernels.score_select``):
  the selection ``quest_scores(pool=True)`` + ``selection.select_blocks`` with ``top_ids``
  make, the same blocks in the same order, for the query heads ``q [B, Hq, D]`` (each kv
  group's mean, formed inside the kernel) under ``budget`` (a ``Budget``). None where that
  kernel does not run (``impl`` not resolving to the Triton scorer and select, or more than
  ``score_select.FUSED_MAX_ENTRIES`` blocks): the caller then scores and selects as before.

  The bookkeeping is closed-form arithmetic (``RowBudget``: ``Budget.forced_span``,
  ``selection.block_count``) that each program applies to its row's length inside the kernel,
  so no XLA op runs before the launch (the two-kernel path builds ``[B, NB]`` masks and sums
  them).
  """
  nb, bs = cache.num_blocks, cache.block_size
  if (resolve_impl(impl, "block_score") != "pallas"
      or resolve_impl(impl, "block_select") != "pallas"
      or not pallas_kernels.score_select_supported(nb)):
    return None
  rule = RowBudget.of(cache, budget)
  b, hq, d = q.shape
  qg = q.reshape(b, cache.num_kv_heads, hq // cache.num_kv_heads, d)
  idx, n_valid = pallas_kernels.score_select(qg, cache.kmin, cache.kmax, cache.length,
                                             block_size=bs, n=rule.n_max,
                                             n_sink_blocks=rule.sink, row_budget=rule,
                                             impl=impl, interpret=interpret)
  return Selection(idx=idx, n_valid=n_valid, granularity=bs)


def _listed(cache: KVCache, sel: Selection):
  """The selection's lists as op arguments: ``(k, v, idx, n_valid, length)``."""
  return cache.k, cache.v, sel.idx, sel.n_valid, cache.length


def _run(op, reference, cache: KVCache, sel: Selection, impl: Impl, interpret: bool, *args,
         **kw):
  """``op`` over the selection's entries (blocks, or single slots for a token selection)."""
  if sel.granularity not in (1, cache.block_size):
    raise ValueError(f"a selection of {sel.granularity}-slot entries over a cache of "
                     f"{cache.block_size}-slot blocks")
  return op(*args, block_size=sel.granularity, pos=cache.pos, impl=impl, interpret=interpret,
            **kw)


def sparse_decode(q, cache: KVCache, sel: Selection, scale=None, *, impl: Impl = "xla",
                  interpret: bool = False, softcap: float | None = None, positions=None):
  """Exact attention of ``q [B, N, D]`` over the selected entries -> ``(out [B, N, D] q.dtype,
  lse [B, N] f32)`` (``pallas_kernels.sparse_decode``; ``softcap``: the module's soft-cap;
  ``positions [B]``: the queries' positions, a negative one a padding row, which attends
  nothing: ``0`` / ``-inf``)."""
  return _run(pallas_kernels.sparse_decode, pallas_kernels.sparse_decode_reference, cache, sel,
              impl, interpret, q, *_listed(cache, sel), scale=scale, softcap=softcap,
              query_pos=positions)


def resa_partials(q, cache: KVCache, sel: Selection, prior, scale, *, impl: Impl = "xla",
                  interpret: bool = False):
  """RESA's true and prior partials of one query per head over the selection (RESA Eq. 3-5;
  ``pallas_kernels.sparse_decode_resa``).

  Args:
    q: ``[B, N, D]``; prior: ``[B, N, T]`` prior logits (``-inf`` = not in the prior set).

  Returns:
    ``(out [B,N,D] f32, lse [B,N]), (prior_out, prior_lse), seen [B,N] int32`` (prior members
    attended).
  """
  k, v, idx, n_valid, length = _listed(cache, sel)
  out, lse, pout, plse, seen = _run(pallas_kernels.sparse_decode_resa,
                                    pallas_kernels.sparse_decode_resa_reference, cache, sel, impl,
                                    interpret, q, k, v, prior, idx, n_valid, length, scale=scale)
  return (out, lse), (pout, plse), seen


def resa_attend(q, cache: KVCache, sel: Selection, prior, scale, aggregator, extras, *,
                impl: Impl = "xla", interpret: bool = False, positions=None):
  """RESA's completed attention of one query per head: ``resa_partials`` finished by
  ``aggregator(true, prior_seen, seen, *extras)`` (``resa.Aggregator``), which the Pallas path
  runs inside the kernel's split combine (no pass of its own) -> ``(out [B,N,D], lse [B,N])``.

  Args: as ``resa_partials``; extras: the aggregator's per-head inputs (``[B,N]`` / ``[B,N,D]``);
  positions: optional ``[B]`` query positions, a padding row's (negative) result empty
  (``0`` / ``-inf``: the split combine applies it, after the aggregator).
  """
  k, v, idx, n_valid, length = _listed(cache, sel)
  return _run(pallas_kernels.sparse_decode_resa, pallas_kernels.sparse_decode_resa_reference,
              cache, sel, impl, interpret, q, k, v, prior, idx, n_valid, length, scale=scale,
              epilogue=aggregator, extras=tuple(extras), query_pos=positions)


def resa_prior_update(state, cache: KVCache, k_new, v_new, slot, scale, incremental: bool, *,
                      impl: Impl = "xla", interpret: bool = False):
  """RESA's prior update of a one-token write ``k_new, v_new [B, K, D]`` at ``slot [B]``
  (``pallas_kernels.resa_prior_update``: one in-place launch) -> the updated ``ResaState``;
  None where ``impl`` does not resolve to the kernel (the caller runs
  ``resa.update_prior``, the general form). ``cache``: before the write."""
  if resolve_impl(impl, "resa_prior_update") != "pallas":
    return None
  names = ("prior", "pmax", "zsum", "osum", "ksum", "kcount")
  got = pallas_kernels.resa_prior_update(
      *(getattr(state, x) for x in names), state.mu_q, cache.k, cache.v, k_new, v_new, slot,
      scale=float(scale), incremental=incremental, impl=impl, interpret=interpret)
  return dataclasses.replace(state, **dict(zip(names, got)))


def window_partials(q, cache: KVCache, sel: Selection, use, positions, prior, scale, *,
                    impl: Impl = "xla", interpret: bool = False, softcap: float | None = None,
                    exposed: str = "kernel", carry_in=None):
  """RetroAttention's partials of a window of queries over the newest query's selection
  (``pallas_kernels.sparse_decode_multiquery``).

  Args:
    q: ``[B, N, w, D]``; use: ``[B, H, w, n]`` which listed entries each query still lacks;
      positions: ``[B, w]`` (a key is attended only at or before its query); prior: RESA's
      ``[B, N, T]`` prior logits, or None; softcap: the module's soft-cap; exposed: where
      the keys attended are counted (``"kernel"``: in the kernel's pass; ``"xla"``: over the
      gathered slots in XLA ops; ``options.Retro``); carry_in: the queries' cached partials
      per output pair (``[B,N,w,D]``, ``[B,N,w]``; -inf where none), merged into the outputs
      (in the kernel's split combine where it runs).

  Returns:
    ``(out [B,N,w,D] f32, lse [B,N,w])``, the prior pair (None without a prior), ``seen`` and
    ``exposed`` ``[B,N,w]`` int32 (prior members / keys attended).
  """
  k, v, idx, n_valid, length = _listed(cache, sel)
  in_kernel = exposed == "kernel"
  outs = _run(pallas_kernels.sparse_decode_multiquery,
              pallas_kernels.sparse_decode_multiquery_reference, cache, sel, impl, interpret,
              q, k, v, idx, n_valid, use, positions, length, scale=scale, prior=prior,
              softcap=softcap, count_attended=in_kernel, carry_in=carry_in)
  if in_kernel:
    *outs, attended = outs
  else:
    b, n, _, _ = q.shape
    h, g = idx.shape[1], sel.granularity
    ok, pos_g = pallas_kernels.listed_slots_ok(idx, n_valid, length, g, cache.pos)
    ok = pallas_kernels.window_slots_ok(ok, pos_g, use, positions, g)  # [B, H, w, L]
    attended = jnp.repeat(jnp.sum(ok, -1), n // h, axis=1).astype(jnp.int32)
  if prior is None:
    return tuple(outs), None, jnp.zeros_like(attended), attended
  return tuple(outs[:2]), tuple(outs[2:4]), outs[4], attended
