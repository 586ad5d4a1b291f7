"""The shared per-layer machinery of every compression (permanent eviction) method.

Letters: B batch, K kv heads, N query heads, S chunk length, T cache slots, D head dim.

A :class:`CompressionMethod` implements ``sparse_attn.protocol.AttentionMethod``, the per-layer
interface of every method; a subclass only says how it scores keys (and what it remembers to do
so).

Schedule:
  * ``prefill`` (before ``end_prefill``; chunks allowed) writes the chunk at slots = token
    positions and attends densely and causally; scoring methods record what they need of the
    queries in their state.
  * ``end_prefill`` (phase ``prefill`` | ``both``) keeps ``ceil((1 - ratio) L)`` tokens per kv
    head (``L`` the prompt length of the row; sinks first), and compacts them into a smaller
    buffer of ``round_up(max kept per head + headroom)`` slots, where ``headroom`` is the decode
    room the caller allocated (``capacity - max(length)``); with a decode phase the headroom is
    ``interval`` instead (the cache never grows past ``budget + interval``). With
    ``head_budget="adakv"`` the heads keep different counts, and the compacted cache is a
    ``flat.FlatKVCache``: all heads' kept tokens in one buffer of
    ``round_up(K * (kept per head) + K * headroom)`` slots, so its bytes are the kept tokens'
    (less than one block of padding per layer) and every layer has the same shape.
  * ``decode`` appends at slot ``length`` recording the token position it is given, attends the
    whole (compacted) cache (``extend``: the same for a chunk read after the prompt), and with
    phase ``decode`` | ``both`` compresses a row back to its budget (``max_tokens``, default
    ``ceil((1 - ratio) L)``) once ``interval`` tokens were added since its last compression or
    its buffer is full. Shapes stay static under jit: the buffer is
    ``budget + interval`` slots and compression is an in-place compaction.

``end_prefill`` changes the cache shape, so it is called between the jitted prefill and decode.
With concrete lengths it sizes the buffer from the data; under ``jit``/``vmap`` (traced lengths) it
needs the static option ``decode_slots`` (the prompt then is assumed to fill
``capacity - decode_slots`` slots) and is then jittable. With ``ratio=0`` (and no ``max_tokens``)
nothing is ever evicted and the method equals dense attention.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from sparse_attn import reference
from sparse_attn.cache import KVCache, init_cache, write
from sparse_attn.cache_attention import dense_over_cache
from sparse_attn.compression import compact as compact_lib
from sparse_attn.compression import flat, head_budget

PHASES = ("prefill", "decode", "both")


@dataclasses.dataclass(frozen=True)
class CompressionMethod:
  """Static configuration of a compression method (hashable; a jit static argument).

  Attributes:
    spec: the spec string it was built from.
    ratio: fraction of the tokens evicted, in [0, 1).
    phase: ``"prefill"`` (one shot after the prompt), ``"decode"`` (keep the cache within a budget
      while generating) or ``"both"``.
    n_sink: leading token positions never evicted (StreamingLLM's attention sinks).
    head_budget: ``"uniform"`` (every kv head keeps the same count) or ``"adakv"`` (Ada-KV,
      Feng et al. 2024: one layer-wide top-k over all heads).
    floor: Ada-KV's per-head floor ``alpha``: each head keeps at least ``floor(alpha n)``.
    interval: decode phase: compress every this many generated tokens (the buffer holds
      ``budget + interval`` slots).
    max_tokens: decode phase budget in tokens per head (default ``ceil((1 - ratio) L)``).
    decode_slots: static decode room, making ``end_prefill`` jittable (see module docstring).
    block_size: cache block size.
  """

  spec: str = ""
  ratio: float = 0.0
  phase: str = "prefill"
  n_sink: int = 0
  head_budget: str = "uniform"
  floor: float = 0.2
  interval: int = 512
  max_tokens: int | None = None
  decode_slots: int | None = None
  block_size: int = 16

  name: ClassVar[str] = ""
  prefill_group: ClassVar[str | None] = "compression"  # see sparse_attn.protocol
  DEFAULTS: ClassVar[dict] = {}  # per-method defaults of the common options

  def __post_init__(self):
    r = self.ratio
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r < 1.0:
      raise ValueError(f"ratio (fraction evicted) must be in [0, 1), got {r!r}")
    if self.phase not in PHASES:
      raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
    if self.head_budget not in head_budget.HEAD_BUDGETS:
      raise ValueError(
          f"head_budget must be one of {head_budget.HEAD_BUDGETS}, got {self.head_budget!r}")
    if not 0.0 <= self.floor <= 1.0:
      raise ValueError(f"floor must be in [0, 1], got {self.floor}")
    for field, lo in (("n_sink", 0), ("interval", 1), ("block_size", 1)):
      val = getattr(self, field)
      if isinstance(val, bool) or not isinstance(val, int) or val < lo:
        raise ValueError(f"{field} must be an int >= {lo}, got {val!r}")
    for field, lo in (("max_tokens", 1), ("decode_slots", 0)):
      val = getattr(self, field)
      if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < lo):
        raise ValueError(f"{field} must be None or an int >= {lo}, got {val!r}")

  # ---- schedule flags the decode loop obeys (as methods.Method's; constant here) ----
  window: ClassVar[int] = 1  # one query per step
  rect_interval: ClassVar[int] = 0  # never rectifies
  is_dense: ClassVar[bool] = False
  budget: ClassVar[None] = None  # no selection budget: eviction keeps 1 - ratio of the cache
  sliding_window: ClassVar[None] = None  # no windowed variant (see with_sliding_window)

  @property
  def compresses_prefill(self) -> bool:
    return self.phase in ("prefill", "both") and self.ratio > 0

  @property
  def compresses_decode(self) -> bool:
    return self.phase in ("decode", "both") and (self.ratio > 0 or self.max_tokens is not None)

  def with_sliding_window(self, window: int):
    raise NotImplementedError(
        f"{self.spec!r} has no sliding-window mask (its eviction scores see every key); the "
        f"model's window is {window} tokens: use a context within the window, dense, or a "
        "selector")

  def round_capacity(self, n: int) -> int:
    return compact_lib.round_up(n, self.block_size)

  def with_rope(self, inv_freq):
    """Methods that model RoPE take the model's frequencies (``rope.RopeOptions``)."""
    del inv_freq
    return self

  def decode_capacity(self, context: int, decode_room: int) -> int:
    """Cache slots while decoding: ``1 - ratio`` of the ``context - decode_room`` prompt
    tokens kept, plus the room for the generated ones."""
    if not self.compresses_prefill:
      return self.round_capacity(context)
    kept = math.ceil((1 - self.ratio) * (context - decode_room))
    return self.round_capacity(kept + decode_room)

  def memory_access(self, context: int | None = None) -> float:
    """Cache read per decode step relative to dense: the kept fraction ``1 - ratio``."""
    del context
    return 1.0 - self.ratio

  def check_context(self, context: int) -> None:
    """Any prompt length works (a ratio keeps at least one token per head)."""
    del context

  def attended_tokens(self, context: int) -> None:
    """None: what a compressed cache holds is measured from it (``kv_kept``), not predicted."""
    del context

  # ---- hooks a method overrides ----
  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity) -> dict:
    """Method-specific state (every leaf leads with the batch axis)."""
    del batch, num_q_heads, num_kv_heads, head_dim, capacity
    return {}

  def observe(self, q, cache: KVCache, state, positions, lse, scale):
    """Records what scoring needs of the queries ``q [B, N, S, D]`` (after they attended)."""
    del q, cache, positions, lse, scale
    return state

  def scores(self, cache: KVCache, state, scale, n):
    """``[B, K, T]`` float32 importance of every slot (higher = keep; ``+inf`` = forced).

    ``n [B]`` is the number of tokens per head about to be kept (H2O's recent window uses it).
    Every registered method overrides this; the base class only defines the contract.
    """
    raise TypeError(f"{type(self).__name__} does not define scores(); every compression "
                    "method must (see sparse_attn/compression/*.py)")

  def compact_state(self, state, idx):
    """Moves slot-aligned state along with a compaction ``idx [B, K, C]`` (old slot per slot)."""
    del idx
    return state

  # ---- per-layer interface ----
  def init_cache(self, batch, num_kv_heads, capacity, head_dim, dtype=jnp.float32) -> KVCache:
    """An empty cache with the box digests only (compression never reads the sphere)."""
    return init_cache(batch, num_kv_heads, capacity, head_dim, self.block_size, dtype, ("box",))

  def init_state(self, batch, num_q_heads, num_kv_heads, head_dim, capacity,
                 dtype=jnp.float32) -> dict:
    del dtype
    state = {"next_pos": jnp.zeros((batch,), jnp.int32),
             "budget": jnp.full((batch,), -1, jnp.int32),  # -1: no decode budget yet
             "since": jnp.zeros((batch,), jnp.int32)}
    state.update(self.init_extra(batch, num_q_heads, num_kv_heads, head_dim, capacity))
    return state

  @property
  def flat_layout(self) -> bool:
    """Whether ``end_prefill`` compacts into a ``flat.FlatKVCache`` (head-adaptive budgets)."""
    return self.head_budget == "adakv"

  def _attend(self, q, cache, state, positions, scale):
    if isinstance(cache, flat.FlatKVCache):
      out, lse = flat.attend(q, cache, positions, scale)
      seen = flat.heads_view(cache)
    else:
      out, lse = dense_over_cache(q, cache, positions, scale)
      seen = cache
    state = dict(state, next_pos=jnp.maximum(
        state["next_pos"], jnp.max(positions, axis=-1).astype(jnp.int32) + 1))
    scale = reference.default_scale(q.shape[-1], scale)
    return out, self.observe(q, seen, state, positions, lse, scale)

  def prefill(self, q, k, v, cache: KVCache, state, positions, *, scale=None):
    """Writes the chunk at slots = positions and attends it densely and causally.

    Returns ``(out [B, N, S, D], cache, state)``.
    """
    cache = write(cache, k.astype(cache.k.dtype), v.astype(cache.v.dtype), positions)
    out, state = self._attend(q, cache, state, positions, scale)
    return out, cache, state

  def rectify(self, q, k, v, cache: KVCache, state, positions, *, scale=None):
    """Not supported: evicted tokens cannot be re-encoded (``rect_interval`` is 0)."""
    del q, k, v, cache, state, positions, scale
    raise ValueError(f"{self.spec}: compression methods do not rectify (rect_interval=0)")

  def keep_mask(self, cache: KVCache, state, scale, n, ceiling: int | None = None):
    """The slots kept when every kv head is cut to ``n [B]`` tokens (or Ada-KV's layer total).

    Sinks (token position < ``n_sink``) are kept first; empty slots never.
    Returns ``[B, K, T]`` bool.
    """
    scale = reference.default_scale(cache.head_dim, scale)
    valid = cache.valid
    score = self.scores(cache, state, scale, n).astype(jnp.float32)
    score = jnp.where(valid & (cache.pos < self.n_sink), jnp.inf, score)
    score = jnp.where(valid, score, -jnp.inf)
    keep = head_budget.select(score, n.astype(jnp.int32), self.head_budget, self.floor, ceiling)
    return keep & valid

  def end_prefill(self, cache: KVCache, state, *, scale=None):
    """Prefill compression and re-allocation of the buffer (see the module docstring)."""
    if not (self.compresses_prefill or self.compresses_decode):
      return cache, state
    keep, budget = _prefill_keep(self, cache, state, scale)
    capacity = self._capacity_after_prefill(cache, keep, budget)
    return _prefill_compact(self, cache, state, keep, budget, capacity)

  def prefill_keep(self, cache: KVCache, state, scale=None):
    """The slots ``end_prefill`` keeps ``[B, K, T]`` and the decode budget ``[B]``."""
    # [B] prompt tokens per head
    n = jnp.max(jnp.sum(cache.valid, axis=-1, dtype=jnp.int32), axis=-1)
    kept = compact_lib.keep_count(n, self.ratio)
    # decode-phase budget; at least 1 so an empty prompt row still keeps its newest token
    budget = (jnp.full_like(n, self.max_tokens) if self.max_tokens is not None
              else jnp.maximum(kept, 1))
    if self.compresses_prefill:
      return self.keep_mask(cache, state, scale, kept), budget
    return cache.valid, budget

  def apply_prefill_keep(self, cache: KVCache, state, keep, budget, capacity: int):
    """Compacts ``keep`` into ``capacity`` slots and sets the decode-phase counters.

    ``capacity`` counts slots per head, or all heads' slots for the flat layout.
    """
    if self.flat_layout:
      new, idx = flat.from_heads(cache.k, cache.v, cache.pos, keep & cache.valid, capacity,
                                 self.block_size)
      per_head = jnp.max(flat.per_head_counts(new), axis=-1)
    else:
      new, idx = compact_lib.compact(cache, keep, capacity)
      per_head = new.length
    state = self.compact_state(state, idx)
    if self.compresses_decode:
      state = dict(state, budget=budget.astype(jnp.int32),
                   since=jnp.maximum(per_head - budget, 0).astype(jnp.int32))
    return new, state

  def _capacity_after_prefill(self, cache: KVCache, keep, budget) -> int:
    """Static slots of the compacted cache (per head; all heads' for the flat layout)."""
    heads = cache.num_kv_heads if self.flat_layout else 1
    kept = jnp.sum(keep, axis=(-2, -1)) if self.flat_layout else jnp.sum(keep, axis=-1)
    concrete = None if self.decode_slots is not None else _concrete_ints(
        jnp.max(cache.length), jnp.max(kept), jnp.max(budget))
    if concrete is not None:
      max_len, max_kept, max_budget = concrete
      headroom = cache.capacity - max_len
    else:
      if self.decode_slots is None:
        raise ValueError(
            "end_prefill needs concrete lengths to size the compacted cache; call it outside "
            "jit/vmap or set the static option decode_slots")
      headroom = self.decode_slots
      n_static = max(cache.capacity - headroom, 0)
      k_static = compact_lib.keep_count(n_static, self.ratio)
      # uniform: k_static per head; Ada-KV: K * k_static in all (its layer-wide total)
      max_kept = (k_static if self.compresses_prefill else n_static) * heads
      max_budget = self.max_tokens if self.max_tokens is not None else k_static
    if self.compresses_decode:
      need = max(max_kept, heads * max_budget) + heads * self.interval
    else:
      need = max_kept + heads * headroom
    return self.round_capacity(need)

  def decode(self, q, k, v, cache: KVCache, state, positions, *, scale=None):
    """Appends the new token at slot ``length`` and attends the cache; may compress.

    Args:
      q: ``[B, N, 1, D]`` post-RoPE query.
      k, v: ``[B, K, 1, D]`` the new key (post-RoPE) and value.
      cache, state: as returned by ``end_prefill`` or a previous ``decode``.
      positions: ``[B, 1]`` token positions (-1 = padding row, nothing written).

    Returns:
      ``(out [B, N, 1, D], cache, state)``.
    """
    if q.shape[2] != 1:
      raise ValueError(f"{self.spec} decodes 1 query per step, got {q.shape[2]}")
    return self._append_and_attend(q, k, v, cache, state, positions, scale)

  def extend(self, q, k, v, cache: KVCache, state, positions, *, scale=None):
    """Reads a chunk after ``end_prefill`` (a query-agnostic question) through the kept cache.

    The tokens are appended after the cache's slots in order and attend causally by position:
    ``S`` decode steps in one pass.

    Args:
      q: ``[B, N, S, D]`` post-RoPE queries; k, v: ``[B, K, S, D]``.
      positions: ``[B, S]`` token positions (-1 = padding, nothing written).

    Returns ``(out [B, N, S, D], cache, state)``. Raises NotImplementedError for ``S > 1``
    with decode-phase compression (it compresses between tokens: such methods read one
    ``decode`` step at a time).
    """
    if q.shape[2] > 1 and self.compresses_decode:
      raise NotImplementedError(
          f"{self.spec!r} compresses while decoding (every {self.interval} tokens); it reads a "
          "chunk one decode step at a time")
    return self._append_and_attend(q, k, v, cache, state, positions, scale)

  def _append_and_attend(self, q, k, v, cache, state, positions, scale):
    """``decode`` / ``extend``: append ``S`` tokens after the cache's slots, attend, count."""
    ok = positions >= 0
    if isinstance(cache, flat.FlatKVCache):
      cache = flat.append(cache, k, v, positions)
    else:
      rank = jnp.cumsum(ok, axis=-1, dtype=jnp.int32) - 1
      slots = jnp.where(ok, cache.length[:, None] + rank, -1)
      cache = write(cache, k.astype(cache.k.dtype), v.astype(cache.v.dtype), slots,
                    token_positions=positions)
    out, state = self._attend(q, cache, state, positions, scale)
    state = dict(state, since=state["since"] + jnp.sum(ok, axis=-1, dtype=jnp.int32))
    if self.compresses_decode:
      cache, state = self._maybe_compress(cache, state, scale)
    return out, cache, state

  def _maybe_compress(self, cache, state, scale):
    """Compresses the rows that added ``interval`` tokens (or filled up) back to their budget."""
    cap = cache.capacity
    is_flat = isinstance(cache, flat.FlatKVCache)
    # a flat buffer is full when the next step's K slots no longer fit; it needs no per-head cap
    full = cache.length + cache.num_kv_heads > cap if is_flat else cache.length >= cap
    ceiling = None if is_flat else max(cap - self.interval, 1)
    due = (state["budget"] >= 0) & ((state["since"] >= self.interval) | full)

    def run(operands):
      c, s = operands
      n = jnp.maximum(s["budget"], 0)
      if is_flat:
        keep = jnp.any(self.keep_mask(flat.heads_view(c), s, scale, n), axis=1)
        new, idx = flat.compact(c, keep)
      else:
        new, idx = compact_lib.compact(c, self.keep_mask(c, s, scale, n, ceiling), cap)
      ns = dict(self.compact_state(s, idx), since=jnp.zeros_like(s["since"]))
      return compact_lib.select_rows(due, new, c), compact_lib.select_rows(due, ns, s)

    return jax.lax.cond(jnp.any(due), run, lambda operands: operands, (cache, state))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _prefill_keep(method, cache, state, scale):
  return method.prefill_keep(cache, state, scale)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _prefill_compact(method, cache, state, keep, budget, capacity):
  return method.apply_prefill_keep(cache, state, keep, budget, capacity)


def _concrete_ints(*xs):
  """Python ints of concrete scalars, or None when any is traced (under jit or vmap)."""
  try:
    return tuple(int(x) for x in xs)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
    return None

