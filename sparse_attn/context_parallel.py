"""Context-parallel sparse decode: the cache's slots split over a mesh axis, under ``shard_map``.

Letters: B batch, Hq query heads, K kv heads, H selection heads, T slots (global), t slots per
shard, NB blocks (global), n blocks per shard, D head dim. ``SH`` is the number of ``seq`` shards.

Shard ``i`` of the ``seq`` axis holds slots ``[i t, (i + 1) t)`` of every cache array (``t`` a
multiple of the block size, so blocks and their digests are whole on one shard) and the matching
slice of RESA's prior logits; ``length`` and every per-head statistic are replicated. One decode
step of a block selector (Quest, ArkVale) on each shard:

  1. the new token's K/V is written by the shard that owns its slot (with RESA, that shard updates
     ``Z``, ``Z O_est`` and the key sum for the new key and the copies are taken from it);
  2. block scores are local; each shard ranks its blocks exactly as one device would
     (``selection.rank_scores``: forced entries first, positions outside the context last) and
     keeps its best ``min(n_max, n)``; the candidates (score, global block id) are all-gathered
     and one final top-``n_max`` picks the global selection. Any block of the global top-k is in
     its shard's top-k, so the selected set equals one device's;
  3. each shard attends the selected blocks it holds (``kernels.sparse_decode``, or RESA's
     true and prior partials, ``kernels.resa_partials``) and the per-shard ``(out, lse)`` are
     merged exactly
     (``merge.merge_n``); RESA's seen-prior counts are summed and its aggregator runs on the
     merged partials with the replicated totals.

RESA's prior is formed the same way at the end of the prompt: local prior logits, the max shift
and the sums ``Z``, ``Z O_est``, ``sum k`` reduced across shards (``resa.form_prior(seq_axis=)``).

Supported: ``quest`` and ``arkvale`` with a fixed budget (``gqa`` head or group), with or without
RESA and rectification (whose dense pass runs under GSPMD). Adaptive budgets (``topp``, ``adakv``),
retro windows, token-level selectors and ``Method`` subclasses with their own ``select`` (or
``attend``, ``decode``, ``end_prefill``) decode under GSPMD on the sharded arrays instead.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sparse_attn import kernels, reference
from sparse_attn.cache import write
from sparse_attn.enhancers import resa
from sparse_attn.merge import merge_n
from sparse_attn.ordering import after
from sparse_attn.protocol import AttentionMethod, PrefillGroup
from sparse_attn.selection import Selection, rank_scores, selected_count
from sparse_attn.selector import BLOCK_SELECTORS

SEQ = "seq"
_RESA_SHARED = ("pmax", "zsum", "osum", "ksum", "kcount")  # replicated running statistics


# The Method steps this module re-implements from the selector's block scores; a subclass that
# replaces one of them (a custom selector overriding ``select``) is not decoded here.
_REIMPLEMENTED = ("select", "attend", "decode", "end_prefill")


def own_pipeline(m) -> tuple[str, ...]:
  """The steps of ``_REIMPLEMENTED`` that ``type(m)`` overrides (``methods.Method``'s)."""
  from sparse_attn.methods import Method  # pylint: disable=g-import-not-at-top (no cycle)
  if not isinstance(m, Method):
    return ()
  return tuple(f for f in _REIMPLEMENTED if getattr(type(m), f) is not getattr(Method, f))


def supports(m: AttentionMethod) -> bool:
  """Whether ``m`` (a ``methods.Method``) decodes context-parallel here.

  A subclass overriding ``select`` (``notebooks/custom_selector.ipynb``), ``attend``,
  ``decode`` or ``end_prefill`` is not: scoring it with its selector's ``block_scores`` would
  silently be Quest, so it decodes under GSPMD on the sharded arrays, with its own selection.
  """
  sel = m.selector if m.prefill_group == PrefillGroup.DENSE else None
  return (sel is not None and sel.name in BLOCK_SELECTORS and m.window == 1
          and sel.topp is None and sel.adakv is None and not own_pipeline(m))


def usable(m: AttentionMethod, cache_spec, mesh) -> bool:
  """``supports(m)``, the cache spec splits slots and blocks over ``seq``, and kv heads are
  split over ``model`` whenever it has several devices (query heads follow their kv head)."""
  k, kmin = tuple(cache_spec.k), tuple(cache_spec.kmin)
  heads_ok = mesh.shape.get("model", 1) == 1 or k[1] == "model"
  return supports(m) and k[2] == SEQ and kmin[2] == SEQ and heads_ok


def _local_view(cache, offset):
  """The shard's cache with ``length`` counted in its own slots."""
  return dataclasses.replace(cache, length=jnp.clip(cache.length - offset, 0, cache.capacity))


def _merge_shards(out, lse):
  """Exact merge of per-shard partials ``(out [..., D], lse [...])`` over the ``seq`` axis."""
  outs = jax.lax.all_gather(out.astype(jnp.float32), SEQ)  # [SH, ..., D]
  lses = jax.lax.all_gather(lse, SEQ)
  return merge_n(outs, lses, axis=0)


def global_selection(m, scores, length, num_blocks: int, capacity: int):
  """Global top-k block selection from local ``scores [B, H, n]`` (inside ``shard_map``).

  Returns the shard's ``Selection`` (local block ids of the selected blocks it holds).
  """
  bs = m.block_size
  n_loc = scores.shape[-1]
  first = jax.lax.axis_index(SEQ) * n_loc  # global id of the shard's first block
  ids = jnp.arange(num_blocks, dtype=jnp.int32)[None, :]
  valid = ids * bs < length[:, None]  # [B, NB]
  forced = m.budget.forced(length, num_blocks, bs)
  local = lambda x: jax.lax.dynamic_slice_in_dim(x, first, n_loc, axis=1)
  ranked = rank_scores(scores, local(valid), local(forced))  # [B, H, n]
  n_max = min(m.budget.max_count(capacity, bs), num_blocks)
  top_v, top_i = jax.lax.top_k(ranked, min(n_max, n_loc))
  pool_v = jax.lax.all_gather(top_v, SEQ, axis=2, tiled=True)  # [B, H, SH * min(n_max, n)]
  pool_i = jax.lax.all_gather(top_i + first, SEQ, axis=2, tiled=True)
  _, pick = jax.lax.top_k(pool_v, n_max)
  gidx = jnp.take_along_axis(pool_i, pick, axis=-1)  # [B, H, n_max] global block ids
  total = m.budget.total(length, jnp.sum(forced, axis=-1).astype(jnp.int32), bs)
  n = selected_count(valid, forced, total, n_max)  # [B], as selection.select_blocks
  listed = jnp.arange(n_max)[None, None, :] < n[:, None, None]
  own = listed & (gidx >= first) & (gidx < first + n_loc)
  order = jnp.argsort(~own, axis=-1, stable=True)  # the shard's blocks first
  lidx = jnp.clip(jnp.take_along_axis(gidx - first, order, axis=-1), 0, n_loc - 1)
  return Selection(idx=lidx.astype(jnp.int32), n_valid=jnp.sum(own, -1).astype(jnp.int32),
                   granularity=bs)


def _owner_update(st, new, owned, written):
  """RESA statistics after a write: the owning shard's, copied to all (``owned, written [B]``)."""
  out = dict(new)
  for name in _RESA_SHARED:
    x = new[name]
    mask = owned.reshape((-1,) + (1,) * (x.ndim - 1))
    got = jax.lax.psum(jnp.where(mask, x, jnp.zeros_like(x)), SEQ)
    out[name] = jnp.where(written.reshape(mask.shape), got, st[name])
  return out


def _local_decode(m, q, k, v, cache, state, positions, *, scale, capacity, num_blocks):
  t_loc = cache.capacity
  offset = jax.lax.axis_index(SEQ) * t_loc
  ok = (positions >= 0) & (positions < capacity)  # [B, 1]
  length = jnp.maximum(cache.length, jnp.max(jnp.where(ok, positions + 1, 0), axis=-1))
  slot = positions - offset
  mine = ok & (slot >= 0) & (slot < t_loc)
  slot = jnp.where(mine, slot, -1)
  local = _local_view(cache, offset)
  k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
  if m.resa:
    st = state["resa"]
    new = resa.update_prior(st, local, k, v, slot, scale, m.resa.prior_update == "incremental")
    st = _owner_update(st, new, jnp.any(mine, -1), jnp.any(ok, -1))
    state = {**state, "resa": st}
    k, v = (after(x, st["osum"], st["ksum"]) for x in (k, v))  # read old slots before writing
  local = write(local, k, v, slot, token_positions=positions)
  local = dataclasses.replace(local, length=jnp.clip(length - offset, 0, t_loc))
  qd = q[:, :, 0]
  sel = global_selection(m, m.selector.block_scores(qd, local, impl=m.impl, interpret=m.interpret), length, num_blocks, capacity)
  if m.resa:
    st = state["resa"]
    true, prior_seen, seen = kernels.resa_partials(qd, local, sel, st["prior"], scale,
                                                   impl=m.impl, interpret=m.interpret)
    true, prior_seen = _merge_shards(*true), _merge_shards(*prior_seen)
    covered = jax.lax.psum(seen, SEQ) >= resa.prior_count(st, qd.shape[1])
    out, _ = resa.aggregate(true, prior_seen, resa.total(st),
                            resa.online_bias(st, qd, scale, m.resa.lam_form), m.resa.lam,
                            covered, m.resa.lam_form)
  else:
    out, lse = kernels.sparse_decode(qd, local, sel, scale, impl=m.impl, interpret=m.interpret)
    out, _ = _merge_shards(out, lse)
  cache = dataclasses.replace(local, length=length)
  return out[:, :, None].astype(q.dtype), cache, state


def decode(m, q, k, v, cache, state, positions, scale, *, mesh, specs):
  """``m.decode`` with the cache's slots split over ``seq`` (see the module docstring).

  Args:
    m: a supported ``methods.Method`` (``supports``).
    q: ``[B, Hq, 1, D]``; k, v: ``[B, K, 1, D]``; positions: ``[B, 1]`` (global slots).
    cache, state: global arrays sharded by ``specs = (cache_spec, state_spec)`` (PartitionSpec
      pytrees; slots and blocks over ``seq``, kv heads over the same axis as the query heads).
    mesh: the device mesh.

  Returns:
    ``(out [B, Hq, 1, D], cache, state)``, equal to ``m.decode`` on one device.
  """
  scale = reference.default_scale(q.shape[-1], scale)
  cache_spec, state_spec = specs
  bax, hax = tuple(cache_spec.k)[:2]
  qspec, pspec = P(bax, hax, None, None), P(bax, None)
  fn = functools.partial(_local_decode, m, scale=scale, capacity=cache.capacity,
                         num_blocks=cache.num_blocks)
  return jax.shard_map(fn, mesh=mesh, in_specs=(qspec, qspec, qspec, cache_spec, state_spec,
                                                pspec),
                       out_specs=(qspec, cache_spec, state_spec), check_vma=False)(
                           q, k, v, cache, state,
                                                                  positions)


def _local_end_prefill(m, cache, state, *, scale):
  local = _local_view(cache, jax.lax.axis_index(SEQ) * cache.capacity)
  st = resa.form_prior(state["resa"], local, scale, m.resa.typical_query, seq_axis=SEQ)
  return cache, {**state, "resa": st}


def end_prefill(m, cache, state, scale, *, mesh, specs):
  """``m.end_prefill`` with RESA's prior statistics reduced across the ``seq`` shards."""
  if not m.resa:
    return m.end_prefill(cache, state, scale=scale)
  scale = reference.default_scale(cache.head_dim, scale)
  fn = functools.partial(_local_end_prefill, m, scale=scale)
  run = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False)
  return jax.jit(run)(cache, state)
