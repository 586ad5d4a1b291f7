"""Which methods of a batch can share one prefill, and in which order to run them.

Every ``Method`` prefills densely and ends the prompt with dense's cache, its enhancer state a
function of the prompt; every compression method of one (block size, capacity) evicts from the
same dense prefill, which a ``Method`` without an enhancer state takes too (its digests
computed from the keys). ``shared_key`` names the prefill a method can take, ``prefill_union`` the
one method whose prefill serves a dense group, ``project`` each member's part of its state, and
``prefill_order`` the order that runs each shared prefill once
(``experiments.tasks.decoding.prefill_all`` does the prefilling).
"""

from __future__ import annotations

import dataclasses

import jax

from models import sharding
from sparse_attn import cache as cache_lib
from sparse_attn.protocol import PrefillGroup


def prefill_union(group):
  """One method whose prefill serves every method of ``group`` (same block size, capacity).

  Every ``Method`` prefills densely, so their caches after the prompt are identical; only the
  enhancer state differs, and that is a function of the prompt alone: RESA's prior depends on
  ``typical_query``, retro's output ring on the window and the selection layout. The union
  carries the RESA part and the retro part of the first members that have them; members whose
  options differ get their own prefill (``shares_union``).
  """
  resa = next((m for m in group if m.resa), None)
  retro = next((m for m in group if m.window > 1), None)
  base = retro or resa or group[0]
  digests = tuple(k for k in cache_lib.DIGEST_KINDS if any(k in m.cache_digests for m in group))
  return dataclasses.replace(base, resa=resa.resa if resa else None, digests=digests)


def shares_union(m, union) -> bool:
  if m.prefill_group != PrefillGroup.DENSE:  # e.g. top-k reuse keeps state of its own
    return False
  if m.resa and m.resa.typical_query != union.resa.typical_query:
    return False
  return m.window == 1 or (m.window, m.selector.group_shared, m.granularity) == (
      union.window, union.selector.group_shared, union.granularity)


def project(full, like):
  """The part of the union's state ``full`` that has the structure of ``like`` (a subset of
  its dict keys and set dataclass fields at every level: RESA without retro drops the ring's
  RESA entries and the retro part, ...)."""
  if like is None:
    return None
  if isinstance(like, dict):
    return {k: project(full[k], v) for k, v in like.items()}
  if dataclasses.is_dataclass(like):  # a typed state (compose.MethodState, resa.ResaState)
    return dataclasses.replace(like, **{f.name: project(getattr(full, f.name),
                                                         getattr(like, f.name))
                                        for f in dataclasses.fields(like)})
  if full.shape != like.shape or full.dtype != like.dtype:
    raise AssertionError(f"union state {full.shape} {full.dtype} != {like.shape} {like.dtype}")
  return full


def shared_key(m, capacity, with_compression: bool = False, mesh=None):
  """The group of methods ``m`` shares a prefill with, or None (its own prefill).

  A ``Method`` whose prefill leaves its state as ``init_state`` made it (``joins_compression``:
  dense, or a selector without RESA or retro) joins the compression methods' group when there
  is one (``with_compression`` and a compression method of the same block size and capacity):
  their prefill is dense and leaves the cache at slots = positions, which is exactly such a
  method's cache once the block digests it reads are computed from the keys
  (``cache.with_digests``).
  """
  group = m.prefill_group
  if group == "dense" and with_compression and joins_compression(m, mesh):
    group = "compression"
  cap = sharding.wrap(m, mesh).round_capacity(capacity)  # whole blocks on every seq shard
  return None if group is None else (group, m.block_size, cap)


def joins_compression(m, mesh=None) -> bool:
  """Whether ``m`` can take the compression methods' shared prefill (``shared_key``): dense
  always; a selector's ``Method`` without an enhancer state (no RESA, no retro window) off a
  mesh (on one, its digests stay where its own sharded prefill places them)."""
  if m.prefill_group != PrefillGroup.DENSE or m.enhanced:
    return False
  return m.is_dense or mesh is None


def prefill_keys(cfg, method_list, capacity: int, mesh=None) -> list:
  """Per method, the key of the shared prefill it takes (``shared_key``; dense joins the
  compression group where there is one), or None where it prefills on its own."""
  # The shared compression prefill attends uncapped, unwindowed logits: on a soft-capped or
  # windowed model (Gemma, Mistral) each compression method prefills on its own.
  solo = cfg.attn_softcap is not None or cfg.sliding_window is not None
  alone = lambda m: solo and m.prefill_group == PrefillGroup.COMPRESSION
  compressed = {shared_key(m, capacity, mesh=mesh) for m in method_list
                if m.prefill_group == PrefillGroup.COMPRESSION and not alone(m)}
  return [None if alone(m) else
          k if (k := shared_key(m, capacity, True, mesh)) in compressed
          else shared_key(m, capacity, mesh=mesh) for m in method_list]


def prefill_order(model, method_list, capacity: int, mesh=None) -> list[int]:
  """Indices into ``method_list`` in the order that runs each shared prefill once.

  ``prefill_all`` keeps one shared prefill alive at a time, so methods of two groups taken in
  turn (dense, quest, rocketkv, hybrid: the dense union, the compression union, the dense one
  again) prefill their groups again at each change. This order puts the members of each
  shared prefill next to each other, the groups in order of their first member; the methods
  keep their order inside a group.
  """
  keys = prefill_keys(model.config, method_list, capacity, mesh)
  first = {}
  for i, k in enumerate(keys):
    first.setdefault(i if k is None else k, i)
  return sorted(range(len(keys)), key=lambda i: (first[i if keys[i] is None else keys[i]], i))
