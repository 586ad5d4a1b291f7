"""Context-parallel sparse decode: the cache's slots split over a mesh axis, under ``shard_map``.

Letters: B batch, Hq query heads, K kv heads, H selection heads, T slots (global), t slots per
shard, NB blocks (global), n blocks per shard, D head dim. ``SH`` is the number of ``seq`` shards.

Shard ``i`` of the ``seq`` axis holds slots ``[i t, (i + 1) t)`` of every cache array (``t`` a
multiple of the block size, so blocks and their digests are whole on one shard) and the matching
slice of RESA's prior logits; ``length`` and every per-head statistic are replicated. Each shard
runs the method's own decode pipeline (``enhancers.compose.decode``) on its local cache, with the
placement :class:`SeqShards` supplying the steps that differ:

  1. the new token's K/V is written by the shard that owns its slot (with RESA, that shard updates
     ``Z``, ``Z O_est`` and the key sum for the new key and the copies are taken from it);
  2. block scores are the selector's own, on the local blocks; each shard ranks its blocks exactly
     as one device would (``selection.rank_scores``: forced entries first, positions outside the
     context last) and keeps its best ``min(n_max, n)``; the candidates (score, global block id)
     are all-gathered and one final top-``n_max`` picks the global selection. Any block of the
     global top-k is in its shard's top-k, so the selected set equals one device's;
  3. each shard attends the selected blocks it holds and the per-shard ``(out, lse)`` are merged
     exactly (``merge.merge_n``); with RESA the true and prior partials are merged, the
     seen-prior counts summed, and the aggregator runs on the merged partials with the
     replicated totals.

RESA's prior is formed the same way at the end of the prompt: local prior logits, the max shift
and the sums ``Z``, ``Z O_est``, ``sum k`` reduced across shards (``resa.form_prior(seq_axis=)``).

Supported: any block selector with a fixed budget rule (``Selector.context_parallel``: Quest,
ArkVale, a ``BlockSelector`` of your own), with or without RESA and rectification (whose dense
pass runs under GSPMD), decoded by ``methods.Method``'s pipeline (``Method.context_parallel``).
Adaptive budgets (``topp``, ``adakv``), retro windows and token-level selectors decode under
GSPMD on the sharded arrays instead.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sparse_attn import reference
from sparse_attn.cache import write
from sparse_attn.merge import merge_n
from sparse_attn.protocol import AttentionMethod, PrefillGroup
from sparse_attn.selection import Selection, rank_scores, selected_count

SEQ = "seq"
_RESA_SHARED = ("pmax", "zsum", "osum", "ksum", "kcount")  # replicated running statistics


def supports(m: AttentionMethod) -> bool:
  """Whether ``m`` decodes context-parallel here: a method whose decode is the shared pipeline
  (``context_parallel`` class flag, ``methods.Method``'s), with a selector that supports it
  (``Selector.context_parallel``) one query per step (no retro window) and no
  sliding window."""
  sel = getattr(m, "selector", None)
  return (getattr(m, "context_parallel", False) and m.prefill_group == PrefillGroup.DENSE
          and sel is not None and sel.context_parallel and m.window == 1
          and getattr(m, "sliding_window", None) is None)


def usable(m: AttentionMethod, cache_spec, mesh) -> bool:
  """``supports(m)``, the cache spec splits slots and blocks over ``seq``, and kv heads are
  split over ``model`` whenever it has several devices (query heads follow their kv head)."""
  k, kmin = tuple(cache_spec.k), tuple(cache_spec.kmin)
  heads_ok = mesh.shape.get("model", 1) == 1 or k[1] == "model"
  return supports(m) and k[2] == SEQ and kmin[2] == SEQ and heads_ok


def _merge_shards(out, lse):
  """Exact merge of per-shard partials ``(out [..., D], lse [...])`` over the ``seq`` axis."""
  outs = jax.lax.all_gather(out.astype(jnp.float32), SEQ)  # [SH, ..., D]
  lses = jax.lax.all_gather(lse, SEQ)
  return merge_n(outs, lses, axis=0)


def global_selection(budget, block_size: int, scores, length, num_blocks: int, capacity: int):
  """Global top-k block selection from local ``scores [B, H, n]`` (inside ``shard_map``).

  Returns the shard's ``Selection`` (local block ids of the selected blocks it holds).
  """
  bs = block_size
  n_loc = scores.shape[-1]
  first = jax.lax.axis_index(SEQ) * n_loc  # global id of the shard's first block
  ids = jnp.arange(num_blocks, dtype=jnp.int32)[None, :]
  valid = ids * bs < length[:, None]  # [B, NB]
  forced = budget.forced(length, num_blocks, bs)
  local = lambda x: jax.lax.dynamic_slice_in_dim(x, first, n_loc, axis=1)
  ranked = rank_scores(scores, local(valid), local(forced))  # [B, H, n]
  n_max = min(budget.max_count(capacity, bs), num_blocks)
  top_v, top_i = jax.lax.top_k(ranked, min(n_max, n_loc))
  pool_v = jax.lax.all_gather(top_v, SEQ, axis=2, tiled=True)  # [B, H, SH * min(n_max, n)]
  pool_i = jax.lax.all_gather(top_i + first, SEQ, axis=2, tiled=True)
  _, pick = jax.lax.top_k(pool_v, n_max)
  gidx = jnp.take_along_axis(pool_i, pick, axis=-1)  # [B, H, n_max] global block ids
  total = budget.total(length, jnp.sum(forced, axis=-1).astype(jnp.int32), bs)
  n = selected_count(valid, forced, total, n_max)  # [B], as selection.select_blocks
  listed = jnp.arange(n_max)[None, None, :] < n[:, None, None]
  own = listed & (gidx >= first) & (gidx < first + n_loc)
  order = jnp.argsort(~own, axis=-1, stable=True)  # the shard's blocks first
  lidx = jnp.clip(jnp.take_along_axis(gidx - first, order, axis=-1), 0, n_loc - 1)
  return Selection(idx=lidx.astype(jnp.int32), n_valid=jnp.sum(own, -1).astype(jnp.int32),
                   granularity=bs)


def _owner_update(st, new, owned, written):
  """RESA statistics after a write: the owning shard's, copied to all (``owned, written [B]``)."""
  out = {}
  for name in _RESA_SHARED:
    x = getattr(new, name)
    mask = owned.reshape((-1,) + (1,) * (x.ndim - 1))
    got = jax.lax.psum(jnp.where(mask, x, jnp.zeros_like(x)), SEQ)
    out[name] = jnp.where(written.reshape(mask.shape), got, getattr(st, name))
  return dataclasses.replace(new, **out)


@dataclasses.dataclass(frozen=True)
class SeqShards:
  """This shard's place in a cache split over ``seq`` (a ``placement``; inside ``shard_map``).

  Attributes:
    capacity: global slots T; num_blocks: global blocks NB; local: this shard's slots t.
    offset: this shard's first global slot (traced); length: ``[B]`` global context length
      after this step's write (traced).
  """

  capacity: int
  num_blocks: int
  local: int
  offset: jax.Array
  length: jax.Array

  seq_axis = SEQ
  fused = False

  @classmethod
  def here(cls, cache, capacity: int, num_blocks: int, positions=None) -> "SeqShards":
    """The placement of the local ``cache`` shard; the length counts ``positions [B, S]``."""
    length = cache.length
    if positions is not None:
      ok = (positions >= 0) & (positions < capacity)
      length = jnp.maximum(length, jnp.max(jnp.where(ok, positions + 1, 0), axis=-1))
    return cls(capacity, num_blocks, cache.capacity, jax.lax.axis_index(SEQ) * cache.capacity,
               length)

  def _local_length(self, length):
    return jnp.clip(length - self.offset, 0, self.local)

  def view(self, cache):
    return dataclasses.replace(cache, length=self._local_length(cache.length))

  def slots(self, positions):
    slot = positions - self.offset
    mine = (positions >= 0) & (positions < self.capacity) & (slot >= 0) & (slot < self.local)
    return jnp.where(mine, slot, -1)

  def store(self, cache, k, v, slots, positions, *, impl, interpret, after=()):
    del impl, interpret  # a shard's slots are not its positions: the jnp write
    cache = write(cache, k, v, slots, token_positions=positions, after=after)
    return dataclasses.replace(cache, length=self._local_length(self.length))

  def share(self, old, new, slots, positions):
    written = jnp.any((positions >= 0) & (positions < self.capacity), axis=-1)
    return _owner_update(old, new, jnp.any(slots >= 0, axis=-1), written)

  def select_blocks(self, scores, cache, budget, *, impl, interpret) -> Selection:
    del impl, interpret
    return global_selection(budget, cache.block_size, scores, self.length, self.num_blocks,
                            self.capacity)

  def merge(self, out, lse):
    return _merge_shards(out, lse)

  def sum(self, x):
    return jax.lax.psum(x, SEQ)

  def finish(self, cache):
    return dataclasses.replace(cache, length=self.length)


def _local_decode(m, q, k, v, cache, state, positions, *, scale, capacity, num_blocks):
  place = SeqShards.here(cache, capacity, num_blocks, positions)
  return m.decode(q, k, v, cache, state, positions, scale=scale, place=place)


def decode(m, q, k, v, cache, state, positions, scale, *, mesh, specs):
  """``m.decode`` with the cache's slots split over ``seq`` (see the module docstring).

  Args:
    m: a supported method (``supports``).
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
                           q, k, v, cache, state, positions)


def _local_end_prefill(m, cache, state, *, scale, capacity, num_blocks):
  place = SeqShards.here(cache, capacity, num_blocks)
  return m.end_prefill(cache, state, scale=scale, place=place)


def end_prefill(m, cache, state, scale, *, mesh, specs):
  """``m.end_prefill`` with RESA's prior statistics reduced across the ``seq`` shards."""
  if not m.resa:
    return m.end_prefill(cache, state, scale=scale)
  scale = reference.default_scale(cache.head_dim, scale)
  fn = functools.partial(_local_end_prefill, m, scale=scale, capacity=cache.capacity,
                         num_blocks=cache.num_blocks)
  run = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False)
  return jax.jit(run)(cache, state)
