"""End of the prompt: which tokens a compression method keeps and the buffer they move into.

Letters: B batch, K kv heads, T slots of the prompt cache, C slots after compaction.

``end_prefill`` keeps ``ceil((1 - ratio) L)`` tokens per kv head (``L`` the prompt length of
the row; sinks first; PyramidKV's layer budgets: its own ``prompt_keep``) by the method's
head-budget rule (``keep``), and compacts them into a smaller buffer (``compact``) of
``capacity`` slots: ``round_up(max over rows of (kept per head + headroom))`` where
``headroom`` is the decode room the caller allocated the row (``capacity - length``: a row with
a shorter prompt keeps its larger room). With a decode phase the headroom is ``interval``
instead (the cache never grows past ``budget + interval``, ``decode_phase.DecodePhase.slots``).
With Ada-KV's flat layout the counts are the layer's: ``round_up(K * (kept per head) + K * headroom)`` slots in all, so the
buffer's bytes are the kept tokens' (less than one block of padding per layer) and every layer
has the same shape.

``end_prefill`` changes the cache shape, so it runs between the jitted prefill and decode. With
concrete lengths it sizes the buffer from the data; under ``jit``/``vmap`` (traced lengths) it
needs the static option ``decode_slots`` (the prompt then is assumed to fill
``capacity - decode_slots`` slots) and is then jittable. The functions take the method as a
static configuration (``Press``: the part of ``base.CompressionMethod`` they read; this module
never imports ``base``, which builds on it).
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from sparse_attn.cache import KVCache
from sparse_attn.compression import compact as compact_lib
from sparse_attn.compression import decode_phase



class Press(Protocol):
  """What these functions read of a compression method (``base.CompressionMethod``)."""

  ratio: float
  max_tokens: int | None
  block_size: int
  decode_slots: int | None
  head_rule: Any
  decode_phase: Any
  compresses_prefill: bool
  compresses_decode: bool

  def round_capacity(self, n: int) -> int: ...
  def compacted_capacity(self, n: int) -> int: ...
  def prompt_keep(self, n): ...
  def layer_keep_bound(self, n: int) -> int: ...
  def keep_mask(self, cache, state, scale, kept): ...
  def compact_state(self, state, idx): ...
  def merged(self, cache, keep): ...
  def prefill_keep(self, cache, state, scale): ...
  def keep_program(self): ...
  def with_keep_operand(self, operand): ...


def decode_capacity(method: Press, context: int, decode_room: int) -> int:
  """Cache slots while decoding: ``1 - ratio`` of the ``context - decode_room`` prompt tokens
  kept, plus the room for the generated ones."""
  if not method.compresses_prefill:
    return method.round_capacity(context)
  kept = method.prompt_keep(context - decode_room)
  return method.round_capacity(kept + decode_room)


def keep(method: Press, cache: KVCache, state, scale=None):
  """The slots ``end_prefill`` keeps and the decode-phase budget.

  Args:
    method: the compression method; cache: the prompt's ``[B, K, T]`` cache.
    state: the method's state after the prompt; scale: softmax scale or None.

  Returns:
    ``(keep [B, K, T] bool, budget [B] int32 tokens per head)``.
  """
  n = prompt_tokens(cache)
  kept = method.prompt_keep(n)
  budget = decode_phase.token_budget(n, kept, method.max_tokens)
  if method.compresses_prefill:
    return method.keep_mask(cache, state, scale, kept), budget
  return cache.valid, budget


def prompt_tokens(cache: KVCache):
  """``[B]`` int32 prompt tokens per kv head of the prompt's cache (its fullest head)."""
  return jnp.max(jnp.sum(cache.valid, axis=-1, dtype=jnp.int32), axis=-1)


def capacity(method: Press, cache: KVCache, kept_slots, budget) -> int:
  """Static slots of the compacted cache (per head; all heads' for the flat layout).

  Args:
    method: the compression method; cache: the prompt's cache.
    kept_slots: ``[B, K, T]`` bool, ``keep``'s choice; budget: ``[B]`` its decode budget.
  """
  lay = method.head_rule.layout
  heads = lay.heads(cache.num_kv_heads)
  phase = method.decode_phase
  # each row keeps the decode room the caller gave it (``capacity - length``): a row with a
  # shorter prompt has more, which a compacted cache sized for the longest row's would cut
  count = lay.count(kept_slots)
  row_kept = jnp.max(count.reshape(count.shape[0], -1), axis=-1)  # [B]
  concrete = None if method.decode_slots is not None else _concrete_ints(
      jnp.max(row_kept), jnp.max(budget),
      jnp.max(row_kept + heads * (cache.capacity - cache.length)))
  if concrete is not None:
    max_kept, max_budget, row_need = concrete
  else:
    if method.decode_slots is None:
      raise ValueError(
          "end_prefill needs concrete lengths to size the compacted cache; call it outside "
          "jit/vmap or set the static option decode_slots")
    headroom = method.decode_slots
    n_static = max(cache.capacity - headroom, 0)
    k_static = method.prompt_keep(n_static)
    # uniform: k_static per head; Ada-KV: K * k_static in all (its layer-wide total); a budget
    # ranked over all layers: what one layer may hold (``layer_keep_bound``)
    bound = method.layer_keep_bound(n_static)
    max_kept = (bound if method.compresses_prefill else n_static) * heads
    max_budget = phase.static_budget(k_static) if phase is not None else None
  if phase is not None:
    need = phase.slots(max_kept, max_budget, heads)
  elif concrete is not None:
    need = row_need
  else:
    need = max_kept + heads * headroom
  return method.compacted_capacity(need)


def compact(method: Press, cache: KVCache, state, kept_slots, budget, slots: int):
  """Compacts ``kept_slots [B, K, T]`` into ``slots`` slots in the rule's layout and starts the
  decode phase's counters -> ``(cache, state)``; with ``merge`` the evicted values are first
  folded into the kept ones (``merge_evicted``)."""
  new, idx, per_head = method.head_rule.layout.from_heads(
      method.merged(cache, kept_slots), kept_slots, slots, method.block_size)
  state = method.compact_state(state, idx)
  if method.decode_phase is not None:
    state = method.decode_phase.start(state, budget, per_head)
  return new, state


def end_prefill(method: Press, cache: KVCache, state, scale=None):
  """Prefill compression and re-allocation of the buffer -> ``(cache, state)``."""
  if not (method.compresses_prefill or method.compresses_decode):
    return cache, state
  # one compiled keep / compact for every layer of a method whose layers differ in a number
  program, operand = method.keep_program()
  kept_slots, budget = _keep(program, cache, state, scale, operand)
  slots = capacity(method, cache, kept_slots, budget)
  return _compact(program, cache, state, kept_slots, budget, slots)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _keep(program, cache, state, scale, operand):
  method = program.with_keep_operand(operand)
  return method.prefill_keep(cache, state, scale)  # ``keep``, or a method's own


@functools.partial(jax.jit, static_argnums=(0, 5))
def _compact(method, cache, state, kept_slots, budget, slots):
  return compact(method, cache, state, kept_slots, budget, slots)


def _concrete_ints(*xs):
  """Python ints of concrete scalars, or None when any is traced (under jit or vmap)."""
  try:
    return tuple(int(x) for x in xs)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
    return None
