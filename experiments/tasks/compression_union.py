"""One prefill for many compression methods: the attention once, each method's observations.

Every ``CompressionMethod`` prefills the same way (``sparse_attn/compression/base.py``): it
writes the chunk at slots = positions and attends densely and causally; methods differ only in
what they record of the queries (``observe``) and in which slots ``end_prefill`` keeps. So one
prefill that attends once and calls every member's ``observe`` on its own part of the state
serves them all; ``split`` then runs each member's ``end_prefill`` on the shared dense cache
(which it does not modify: compaction builds new buffers). Members that differ only in options
read at ``end_prefill`` (the ratio, the head budget) share one observation state. A member that
scores the prompt by replaying it after the prefill (KVzip) makes the union a
``ReplayingUnion``: the replays run once and each such member records its scores.

Letters: B batch, N query heads, S chunk length, D head dim, L layers.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from models import llama, sharding, steps
from sparse_attn import layer_inputs, reference
from sparse_attn.cache import write
from sparse_attn.cache_attention import dense_over_cache
from sparse_attn.compression import HeadBudget
from sparse_attn.compression import cross_layer, kvzip
from sparse_attn.compression.base import CompressionMethod

# Options only ``end_prefill`` / ``keep_mask`` read: members differing in them observe alike.
_KEEP_ONLY = dict(spec="", ratio=0.0, head_budget=HeadBudget.UNIFORM, floor=0.2, max_tokens=None,
                  merge=False, merge_threshold=0.0, merge_fraction=1.0)


# The same, for options only some methods have (KVzip's ranking over all layers or per layer,
# FINCH's key re-rotation after the compaction, the prompt cut block by block).
_KEEP_ONLY_IF_PRESENT = dict(layerwise=True, rerotate_keys=True, prompt_block=0)


def observation_key(method: CompressionMethod) -> CompressionMethod:
  """``method`` with its keep-only options neutralised (equal keys = equal observations)."""
  fields = {f.name for f in dataclasses.fields(method)}
  return dataclasses.replace(method, **_KEEP_ONLY, **{
      k: v for k, v in _KEEP_ONLY_IF_PRESENT.items() if k in fields})


@dataclasses.dataclass(frozen=True)
class CompressionUnion(CompressionMethod):
  """A prefill-only method whose state holds every observer's state (``"m0"``, ``"m1"``, ...).

  Attributes:
    observers: one member per distinct observation configuration (``observation_key``).
  """

  observers: tuple = ()
  prefill_group: ClassVar[PrefillGroup | None] = None  # it is the shared prefill itself

  @classmethod
  def of(cls, methods) -> "CompressionUnion":
    """The union observing for every method in ``methods`` (same ``block_size``)."""
    sizes = {m.block_size for m in methods}
    if len(sizes) != 1:
      raise ValueError(f"a compression union needs one block size, got {sorted(sizes)}")
    observers = {}
    for m in methods:
      observers.setdefault(observation_key(m), m)
    observers = tuple(observers.values())
    if any(hasattr(m, "replay") for m in observers):
      cls = ReplayingUnion
    return cls(spec="compression-union", block_size=sizes.pop(), observers=observers)

  def with_softcap(self, softcap: float):
    raise NotImplementedError(
        "the shared compression prefill (CompressionUnion) attends and observes uncapped "
        f"logits; a soft-capped model (cap {softcap}) needs each compression method's own "
        "prefill, which this harness does not run yet")

  def with_sliding_window(self, window: int):
    raise NotImplementedError(
        "the shared compression prefill (CompressionUnion) has no sliding-window mask; a model "
        f"with windowed layers (window {window}) needs each compression method's own prefill, "
        "which this harness does not run yet")

  def slot(self, method: CompressionMethod) -> str:
    """The state key holding ``method``'s observations."""
    key = observation_key(method)
    for i, m in enumerate(self.observers):
      if observation_key(m) == key:
        return f"m{i}"
    raise ValueError(f"{method.spec!r} is not observed by this union")

  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity) -> dict:
    return {f"m{i}": m.init_state(batch, num_q_heads, num_kv_heads, head_dim, capacity)
            for i, m in enumerate(self.observers)}

  def layer_state(self, state, layer: int, inputs=None):
    """Every observer's layer state (``sparse_attn.layer_inputs``: W^O, the question...)."""
    return dict(state, **{f"m{i}": m.layer_state(state[f"m{i}"], layer, inputs)
                          for i, m in enumerate(self.observers) if hasattr(m, "layer_state")})

  def prefill(self, q, k, v, cache, state, positions, *, scale=None):
    """The chunk ``q [B, N, S, D]`` attends once; every observer records it (base ``prefill``)."""
    cache = write(cache, k.astype(cache.k.dtype), v.astype(cache.v.dtype), positions)
    out, lse = dense_over_cache(q, cache, positions, scale)
    scale = reference.default_scale(q.shape[-1], scale)
    nxt = jnp.maximum(state["next_pos"], jnp.max(positions, axis=-1).astype(jnp.int32) + 1)
    new = dict(state, next_pos=nxt)
    for i, m in enumerate(self.observers):
      mine = dict(state[f"m{i}"], next_pos=nxt)
      new[f"m{i}"] = m.observe(q, cache, mine, positions, lse, scale)
    return out, cache, new

  def decode(self, q, k, v, cache, state, positions, *, scale=None):
    del q, k, v, cache, state, positions, scale
    raise ValueError("a compression union only prefills; decode with its members (split)")


@dataclasses.dataclass(frozen=True)
class ReplayingUnion(CompressionUnion):
  """A union with members that score the prompt by replaying it (KVzip).

  ``models.decode.prefill`` runs the replays (``models.kvzip_replay``) between the shared
  prefill and ``end_prefill`` with this union as the method: the replay's attention is computed
  once (the cache is the same dense one for every member) and each replaying member records its
  scores of the chunk ``state["span"]`` in its own part of the state. All replaying members
  share one ``chunk_size`` (the replay's tokens depend on it).
  """

  def __post_init__(self):
    super().__post_init__()
    sizes = {m.chunk_size for m in self._replaying()}
    if len(sizes) != 1:
      raise ValueError(f"one shared prefill replays with one chunk size, got {sorted(sizes)}: "
                       "run KVzip rows of other chunk sizes in a run of their own")

  def _replaying(self):
    return [m for m in self.observers if hasattr(m, "replay")]

  @property
  def chunk_size(self) -> int:
    """The replaying members' chunk size (``models.kvzip_replay``)."""
    return self._replaying()[0].chunk_size

  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity) -> dict:
    extra = super().init_extra(batch, num_q_heads, num_kv_heads, head_dim, capacity)
    return dict(extra, span=jnp.zeros((batch, 2), jnp.int32))

  @property
  def reads_hidden_norm(self) -> bool:
    """Whether a replaying member needs the replay's attention-input norms (KVzip+)."""
    return any(m.reads_hidden_norm for m in self._replaying())

  def replay(self, q, k, v, cache, state, positions, *, scale=None, hidden_norm=None):
    """One replay chunk ``q [B, N, S, D]`` (``kvzip.KVzip.replay``) for every replaying member:
    ``(out, cache, state)``, the cache unwritten."""
    out = kvzip.replay_attention(q, k, v, cache, positions, scale)
    new = dict(state)
    for i, m in enumerate(self.observers):
      if hasattr(m, "replay"):
        mine = dict(state[f"m{i}"], span=state["span"])
        new[f"m{i}"] = m.record_replay(q, k, cache, mine, positions, scale=scale,
                                       hidden_norm=hidden_norm)
    return out, cache, new


def split(union: CompressionUnion, method: CompressionMethod, caches, states, config,
          mesh=None):
  """``method``'s per-layer ``(caches, states)`` after its own ``end_prefill``.

  Args:
    caches, states: the union's per-layer lists after ``models.steps.end_prefill`` (the union
      itself evicts nothing there).
    mesh: the device mesh the caches live on (the evicted cache is placed there too).
  """
  scale = llama.softmax_scale(config)
  key = union.slot(method)
  run = sharding.wrap(method, mesh)
  n = config.num_layers  # a method's layer (PyramidKV's budgets): steps.per_layer
  # The member's own layer_state over the shared one: what it reads of its keep-only options
  # (DuoAttention's streaming heads follow its ratio); the run's inputs stay as the union set.
  mine = layer_inputs.apply(method, [s[key] for s in states], None)
  mine = cross_layer.apply(method, caches, mine, scale)  # KVzip, ChunkKV's reuse
  out = [steps.per_layer(run, i, n).end_prefill(c, s, scale=scale)
         for i, (c, s) in enumerate(zip(caches, mine))]
  return [c for c, _ in out], [s for _, s in out]
