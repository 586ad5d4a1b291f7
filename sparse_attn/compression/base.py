"""The per-layer interface of every compression (permanent eviction) method.

Letters: B batch, K kv heads, N query heads, S chunk length, T cache slots, D head dim.

A :class:`CompressionMethod` implements ``sparse_attn.protocol.AttentionMethod``. It is one
frozen configuration holding every option, and a subclass only says how it scores keys and what
it remembers to do so (``scorer.Scorer``). The rest is composed around that scorer:

  scorer (the subclass)  ->  head_rule: head_budget.Uniform | AdaKV  (which slots a budget keeps;
                                        its layout: per head or Ada-KV's flat buffer)
                         ->  decode_phase: decode_phase.DecodePhase | None  (compress while
                                        generating, by the same rule)
  prefill sizing (prefill): the prompt's cut and the compacted buffer at ``end_prefill``.

Schedule:
  * ``prefill`` (before ``end_prefill``; chunks allowed) writes the chunk at slots = token
    positions and attends densely and causally; scoring methods record what they need of the
    queries in their state (``observe``).
  * ``end_prefill`` (phase ``prefill`` | ``both``) keeps ``ceil((1 - ratio) L)`` tokens per kv
    head and compacts them into a smaller buffer (``prefill``'s docstring has the sizes); with
    ``head_budget="adakv"`` the compacted cache is a ``flat.FlatKVCache``.
  * ``decode`` appends at slot ``length`` recording the token position it is given, attends the
    whole (compacted) cache (``extend``: the same for a chunk read after the prompt), and with
    phase ``decode`` | ``both`` compresses a row back to its budget once ``interval`` tokens were
    added since its last compression or its buffer is full (``decode_phase``); without it no
    score is taken again and the scorer's state stays as the prompt left it.

With ``ratio=0`` (and no ``max_tokens``) nothing is evicted: the method equals dense attention.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from pallas_kernels import Impl, check_softcap
from sparse_attn import reference
from sparse_attn import sliding_window as sliding_window_lib
from sparse_attn.cache import KVCache, init_cache, write
from sparse_attn.compression import compact as compact_lib
from sparse_attn.compression import decode_phase as phase_lib
from sparse_attn.compression import head_budget as head_budget_lib
from sparse_attn.compression import layout, prefill
from sparse_attn.compression.decode_phase import Phase
from sparse_attn.compression.head_budget import HeadBudget
from sparse_attn.compression.merge_evicted import MergeOnEvict
from sparse_attn.compression.scorer import Scorer
from sparse_attn.protocol import PrefillGroup

# What a method's token scores are computed from (``CompressionMethod.SIGNAL``).
SIGNALS = {"attention": "attention weights of the prompt's queries",
           "queries": "query statistics, no attention weights",
           "keys": "keys, values or position alone (no query)"}


@dataclasses.dataclass(frozen=True)
class CompressionMethod(Scorer, MergeOnEvict):
  """Static configuration of a compression method (hashable; a jit static argument).

  Attributes:
    spec: the spec string it was built from.
    ratio: fraction of the tokens evicted, in [0, 1).
    phase: ``Phase``: ``"prefill"`` (one shot after the prompt), ``"decode"`` (keep the cache
      within a budget while generating) or ``"both"``.
    n_sink: leading token positions never evicted (StreamingLLM's attention sinks).
    head_budget: ``HeadBudget``: ``"uniform"`` (every kv head keeps the same count) or
      ``"adakv"`` (Ada-KV, Feng et al. 2024: one layer-wide top-k over all heads).
    floor: Ada-KV's per-head floor ``alpha``: each head keeps at least ``floor(alpha n)``.
    interval: decode phase: compress every this many generated tokens (the buffer holds
      ``budget + interval`` slots).
    max_tokens: decode phase budget in tokens per head (default ``ceil((1 - ratio) L)``).
    decode_slots: static decode room, making ``end_prefill`` jittable (see ``prefill``).
    block_size: cache block size.
    softcap: the model's attention-logit soft-cap (Gemma 2; None = none), set by
      ``with_softcap`` (the decode loop does it): the attention and every scorer that reads
      attention weights (SnapKV, TOVA, H2O) see capped logits.
    sliding_window: the layer's attention window (Mistral, Gemma's local layers; None =
      unlimited), set by ``with_sliding_window``: see there.
    impl: ``kernels.dense_attention`` / ``dense_decode`` / ``flat_decode``'s (a decode step
      over Ada-KV's flat buffer); ``"auto"``: the kernels on a GPU (per-head caches need
      ``block_size`` a power of 2 >= 16), jnp elsewhere and in the scorers' own passes.
    interpret: run those kernels in Pallas interpret mode (tests on a CPU).
    capacity_bits: None (the compacted cache holds the block multiple it needs), or the
      significant bits of its size (``compact.bucket``: ``2 ** bits`` sizes per doubling), so
      that layers and batches that keep nearby counts (PyramidKV's layer budgets, KVzip's
      model-wide ranking, ragged batches) share compiled shapes, for at most ``2 ** -bits``
      more slots. The extra slots are empty: per-head caches attend bit for bit as exact
      sizes, Ada-KV's flat buffer to float rounding (``test_compression_buckets.py``).
    merge, merge_threshold, merge_fraction: merge on evict (``merge_evicted.MergeOnEvict``).
  """

  spec: str = ""
  ratio: float = 0.0
  phase: Phase = Phase.PREFILL
  n_sink: int = 0
  head_budget: HeadBudget = HeadBudget.UNIFORM
  floor: float = 0.2
  interval: int = 512
  max_tokens: int | None = None
  decode_slots: int | None = None
  block_size: int = 16
  softcap: float | None = None
  sliding_window: int | None = None
  capacity_bits: int | None = None
  impl: Impl = "auto"
  interpret: bool = False

  name: ClassVar[str] = ""
  prefill_group: ClassVar[PrefillGroup | None] = PrefillGroup.COMPRESSION
  DEFAULTS: ClassVar[dict] = {}  # per-method defaults of the common options
  # True for a scorer whose attention weights model uncapped, unwindowed logits (Expected
  # Attention's): it refuses a soft-capped model and a window (``with_softcap`` / ``_window``).
  estimates_raw_attention: ClassVar[bool] = False
  # The leaderboard panels it runs on (kvpress's evaluation/leaderboard.sh): "query_agnostic"
  # (the question arrives after compression) and/or "query_aware" (the question is compressed
  # with the context: the methods whose paper scores with the question in view).
  PANELS: ClassVar[tuple[str, ...]] = ("query_agnostic",)
  # True when each decode step also reads only a subset of the kept cache (RocketKV's stage 2):
  # compared beside the sparse decoders (the leaderboard figure draws it in their panel).
  SPARSE_DECODE: ClassVar[bool] = False
  # What its token scores are computed from (``SIGNALS``; the catalog lists it and the
  # leaderboard figure splits a crowded compression panel by it). None: not stated.
  SIGNAL: ClassVar[str | None] = None

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if cls.SIGNAL is not None and cls.SIGNAL not in SIGNALS:
      raise ValueError(f"{cls.__name__}.SIGNAL must be one of {tuple(SIGNALS)}, got "
                       f"{cls.SIGNAL!r}")
    if cls.__dict__.get("prefill_group") is not None:  # a subclass's own group, checked once
      cls.prefill_group = PrefillGroup.parse(cls.prefill_group, "prefill_group")

  def __post_init__(self):
    r = self.ratio
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r < 1.0:
      raise ValueError(f"ratio (fraction evicted) must be in [0, 1), got {r!r}")
    self.check_merge()
    object.__setattr__(self, "phase", Phase.parse(self.phase, "phase"))
    object.__setattr__(self, "head_budget", HeadBudget.parse(self.head_budget, "head_budget"))
    if not 0.0 <= self.floor <= 1.0:
      raise ValueError(f"floor must be in [0, 1], got {self.floor}")
    for field, lo in (("n_sink", 0), ("interval", 1), ("block_size", 1)):
      val = getattr(self, field)
      if isinstance(val, bool) or not isinstance(val, int) or val < lo:
        raise ValueError(f"{field} must be an int >= {lo}, got {val!r}")
    for field, lo in (("max_tokens", 1), ("decode_slots", 0), ("capacity_bits", 0)):
      val = getattr(self, field)
      if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < lo):
        raise ValueError(f"{field} must be None or an int >= {lo}, got {val!r}")

  # ---- the parts composed around the scorer ----
  @property
  def compresses_prefill(self) -> bool:
    return self.phase.at_prefill and self.ratio > 0

  @property
  def compresses_decode(self) -> bool:
    return self.phase.at_decode and (self.ratio > 0 or self.max_tokens is not None)

  @property
  def crosses_layers(self) -> bool:
    """Whether ``end_prefill`` needs the ``across_layers`` pass over every layer's prompt cache
    first (``cross_layer``): KVzip's model-wide ranking, ChunkKV's index reuse."""
    return hasattr(self, "across_layers")

  @property
  def head_rule(self) -> head_budget_lib.Uniform | head_budget_lib.AdaKV:
    """Which slots a budget keeps: ``head_budget``'s rule around this scorer."""
    return head_budget_lib.rule(self.head_budget, self, self.floor)

  @property
  def decode_phase(self) -> phase_lib.DecodePhase | None:
    """The decode-phase wrapper around ``head_rule``, None when decoding never compresses."""
    if not self.compresses_decode:
      return None
    return phase_lib.DecodePhase(self.head_rule, self.interval, self.max_tokens)

  # ---- schedule flags the decode loop obeys (as methods.Method's; constant here) ----
  window: ClassVar[int] = 1  # one query per step
  rect_interval: ClassVar[int] = 0  # never rectifies
  is_dense: ClassVar[bool] = False
  budget: ClassVar[None] = None  # no selection budget: eviction keeps 1 - ratio of the cache

  def with_sliding_window(self, window: int):
    """This method on a sliding-window layer: its attention (prefill, decode, extend) sees only
    keys at positions ``> p - window`` (``dense_over_cache``'s window, by token position, so a
    compacted cache is masked alike), and the scorers that read attention weights (SnapKV,
    TOVA, H2O) read the windowed weights: a key that left the window of every recorded query
    scores 0 and is evicted first (the layer never attends it again). Scorers of keys alone
    (KNorm, KeyDiff, LagKV, CUR, random, StreamingLLM) rank the kept keys as on a global layer.
    With ``ratio=0`` nothing is evicted and it equals dense attention under the window.

    Raises:
      NotImplementedError: a scorer that models attention without the window
        (``estimates_raw_attention``: Expected Attention).
    """
    window = sliding_window_lib.check_window(window)
    if self.estimates_raw_attention:
      raise NotImplementedError(
          f"{self.spec!r} has no sliding-window mask (its attention estimate sees every "
          f"key); the model's window is {window} tokens: use a context within the window, "
          "another compression method, dense, or a selector")
    return dataclasses.replace(self, sliding_window=window)

  def with_softcap(self, softcap: float):
    """This method on a model whose attention logits are soft-capped (Gemma 2): its attention
    and the attention weights its scorer reads (``observe.window_probs``,
    ``observe.column_sums``) are over ``cap * tanh(s / cap)``; scorers that read no attention
    (KNorm, KeyDiff, LagKV, CUR, random, StreamingLLM) are unchanged.

    Raises:
      NotImplementedError: a scorer that models attention from uncapped logits
        (``estimates_raw_attention``: Expected Attention).
    """
    cap = check_softcap(softcap)
    if cap is not None and self.estimates_raw_attention:
      raise NotImplementedError(
          f"{self.spec!r} estimates attention from uncapped logits, and the model soft-caps "
          f"its attention logits (softcap={cap:g}); use another compression method")
    return dataclasses.replace(self, softcap=cap)

  def round_capacity(self, n: int) -> int:
    return compact_lib.round_up(n, self.block_size)

  def compacted_capacity(self, n: int) -> int:
    """Slots of the compacted cache holding ``n`` (``prefill.capacity``): a block multiple,
    bucketed by ``capacity_bits``. The prompt's cache keeps the caller's capacity, so dense
    and every compression method still share one prefill."""
    if self.capacity_bits is None:
      return self.round_capacity(n)
    return compact_lib.bucket(n, self.capacity_bits, self.block_size)

  def with_capacity_bits(self, bits: int | None):
    """This method with its compacted caches bucketed to ``bits`` significant bits."""
    return dataclasses.replace(self, capacity_bits=bits)

  @property
  def layer_free_decode(self) -> bool:
    """Whether ``decode`` / ``extend`` are the same on every layer (``for_layer`` changes only
    the prompt's cut), so the decode loop runs one method on every layer: true unless it
    compresses while decoding (by a layer's own budget)."""
    return not self.compresses_decode

  def prompt_keep(self, n):
    """Tokens per kv head kept of an ``n``-token prompt (int or int array): ``ceil((1 -
    ratio) n)``. PyramidKV's layer budgets override it."""
    return compact_lib.keep_count(n, self.ratio)

  def layer_keep_bound(self, n: int) -> int:
    """Most tokens per kv head (a layer's average) one layer may keep of an ``n``-token prompt:
    ``prompt_keep(n)``; a budget ranked over all layers may put more in one layer (KVzip).
    Sizes the compacted cache when the lengths are traced (``prefill.capacity``)."""
    return self.prompt_keep(n)

  def for_layer(self, layer: int, num_layers: int):
    """This method on layer ``layer`` of ``num_layers`` (``models.steps.per_layer`` asks):
    itself, unless its budget depends on the layer (PyramidKV)."""
    del layer, num_layers
    return self

  def keep_program(self):
    """``(program, operand)``: the method ``end_prefill``'s jitted keep and compact steps
    compile for, and a traced operand that ``program.with_keep_operand`` turns back into this
    method's cut. ``(self, None)`` here; PyramidKV hands its layer as the operand, so its
    layers share one program instead of compiling one each. ``program`` compacts as this
    method does (they differ only in ``prompt_keep``)."""
    return self, None

  def with_keep_operand(self, operand):
    """The method ``keep_program``'s operand stands for (inside the keep step): itself."""
    del operand
    return self

  def with_rope(self, inv_freq):
    """Methods that model RoPE take the model's frequencies (``rope.RopeOptions``)."""
    del inv_freq
    return self

  def decode_capacity(self, context: int, decode_room: int) -> int:
    """Cache slots while decoding (``prefill.decode_capacity``)."""
    return prefill.decode_capacity(self, context, decode_room)

  def memory_access(self, context: int | None = None) -> float:
    """Cache read per decode step relative to dense: the kept fraction ``1 - ratio``."""
    del context
    return 1.0 - self.ratio

  def check_context(self, context: int) -> None:
    """Any prompt length works (a ratio keeps at least one token per head)."""
    del context

  def attended_tokens(self, context: int, num_layers: int | None = None) -> None:
    """None: what a compressed cache holds is measured from it (``kv_kept``), not predicted."""
    del context, num_layers

  # ---- per-layer interface ----
  def init_cache(self, batch, num_kv_heads, capacity, head_dim, dtype=jnp.float32) -> KVCache:
    """An empty cache with the box digests only (compression never reads the sphere)."""
    return init_cache(batch, num_kv_heads, capacity, head_dim, self.block_size, dtype, ("box",))

  def init_state(self, batch, num_q_heads, num_kv_heads, head_dim, capacity,
                 dtype=jnp.float32) -> dict:
    """``next_pos``, ``budget`` (-1: none yet), ``since`` ``[B]`` int32 and ``init_extra``'s."""
    del dtype
    state = {"next_pos": jnp.zeros((batch,), jnp.int32),
             "budget": jnp.full((batch,), -1, jnp.int32),
             "since": jnp.zeros((batch,), jnp.int32)}
    state.update(self.init_extra(batch, num_q_heads, num_kv_heads, head_dim, capacity))
    return state

  def _attend(self, q, cache, state, positions, scale):
    """Exact attention of ``q [B, N, S, D]`` over either layout, then ``observe`` ->
    ``(out [B, N, S, D], state)``."""
    out, lse, seen = layout.of(cache).attend(q, cache, positions, scale, self.softcap,
                                             self.sliding_window, impl=self.impl,
                                             interpret=self.interpret)
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

  def keep_mask(self, cache, state, scale, n, ceiling: int | None = None):
    """The slots kept when every kv head is cut to ``n [B]`` tokens (or Ada-KV's layer total).

    Sinks (token position < ``n_sink``) are kept first; empty slots never.
    Returns ``[B, K, T]`` bool (``head_rule.keep``).
    """
    return self.head_rule.keep(cache, state, scale, n, ceiling)

  def prefill_keep(self, cache: KVCache, state, scale=None):
    """The slots ``end_prefill`` keeps ``[B, K, T]`` and the decode budget ``[B]``."""
    return prefill.keep(self, cache, state, scale)

  def end_prefill(self, cache: KVCache, state, *, scale=None):
    """Prefill compression and re-allocation of the buffer (``prefill.end_prefill``)."""
    return prefill.end_prefill(self, cache, state, scale)

  def decode(self, q, k, v, cache, state, positions, *, scale=None):
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

  def extend(self, q, k, v, cache, state, positions, *, scale=None):
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
    cache = layout.of(cache).append(cache, k, v, positions, impl=self.impl,
                                    interpret=self.interpret)
    out, seen = self._attend(q, cache, state, positions, scale)
    phase = self.decode_phase  # None: no score is taken again, the scorer's state stays put
    state = seen if phase is not None else dict(state, next_pos=seen["next_pos"])
    state = dict(state, since=state["since"] + jnp.sum(positions >= 0, -1, dtype=jnp.int32))
    if phase is not None:
      cache, state = phase.maybe_compress(cache, state, scale)
    return out, cache, state
