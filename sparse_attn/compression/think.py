"""ThinK: query-driven pruning of key channels (Xu et al., ICLR 2025, arXiv 2407.21018).

Letters: B batch, K kv heads, G query heads per kv head, N = K G query heads, W observation
window, S new tokens, Tp prompt slots, Tr decode slots, D head dim, D' kept key channels.

ThinK evicts no token: it drops the least useful *channels* of the cached keys. At the end of
the prompt, per layer and kv head, channel ``d`` scores (Sec. 3.2, Eq. 4, the authors'
``key_pruner_query_driven`` and kvpress's ``ThinKPress``)

  ``s_d = mean_{g, w} q_{g,w,d}^2 * mean_t k_{t,d}^2``

over the last ``window_size`` (32) prompt queries ``q`` (post-RoPE, as the keys) of the
group's ``G`` query heads and every prompt key ``k``: within one query head that is
``||Q_w[:, d]||^2 ||K[:, d]||^2 / (W L)``, the paper's norm product squared; a GQA group pools
the squared query norms of its heads (kvpress). The ``floor(ratio D)`` lowest channels are
pruned (``D' = ceil((1 - ratio) D)`` kept, ties to the lower channel).

Real memory: ``end_prefill`` returns a ``ThinKCache`` whose prompt keys are stored with ``D'``
channels (values keep ``D``) beside the kept channel ids ``[B, K, D']``; the tokens generated
after the prompt (and a question read by ``extend``) go to a second, full-width buffer, as in
kvpress (its hook prunes the prompt only) and the authors' code (new keys are appended
unpruned). Attention is exact over the pruned keys: the prompt part is ``q[..., kept] . k'``
(a pruned channel contributes 0: the masked computation) at the full ``1/sqrt(D)`` scale, the
decode part ``q . k``, combined by ``merge`` (one softmax over both).

``ratio`` here is the fraction of key *channels* pruned (kvpress's
``key_channel_compression_ratio``); the cache shrinks by ``ratio / 2`` (keys and values),
kvpress's ``compression_ratio``. ``ratio=0`` keeps the ordinary cache (dense attention).

``recent_size`` (default 0, kvpress's: every prompt key pruned) keeps the last ``recent_size``
prompt keys of each row whole, as the authors' code does (``key_pruner_query_driven``, its
LongBench runs' default 32): the channels are still scored over every prompt key, the last
``recent_size`` prompt tokens go to the front of the full-width part, and the pruned part holds
the others. Composition with a token-eviction press (kvpress's
``ComposedPress([SnapKVPress, ThinKPress])``): the spec ``"snapkv:ratio=0.5+think:ratio=0.5"``
(``think_composed``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.chunk_attention import visibility
from pallas_kernels.softmax import grouped_attention
from sparse_attn import reference
from sparse_attn.cache import KVCache, SlotBuffer, init_cache, keep_digests
from sparse_attn.compression import compact as compact_lib
from sparse_attn.compression import layout, observe
from sparse_attn.compression.base import CompressionMethod
from sparse_attn.merge import merge


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ThinKCache(SlotBuffer):
  """One layer's cache after ThinK's prefill: pruned prompt keys and full-width decode keys.

  Attributes:
    prompt: ``KVCache`` with ``k [B, K, Tp, D']`` (kept channels only), ``v [B, K, Tp, D]``,
      no block digests (never written again).
    recent: ``KVCache [B, K, Tr, D]`` of the tokens appended after the prompt.
    channels: ``[B, K, D']`` int32 kept channel ids of each kv head, ascending.
  """

  prompt: KVCache
  recent: KVCache
  channels: jax.Array

  # SlotBuffer's properties read k, pos, length: both parts' slots, as one row per head.
  @property
  def k(self):
    return self.recent.k

  @property
  def pos(self):
    return jnp.concatenate([self.prompt.pos, self.recent.pos], axis=-1)

  @property
  def length(self):
    return self.recent.length

  @property
  def valid(self):
    """``[B, K, Tp + Tr]`` bool: the filled slots of both parts."""
    return jnp.concatenate([self.prompt.valid, self.recent.valid], axis=-1)

  @property
  def capacity(self) -> int:
    return self.prompt.capacity + self.recent.capacity

  @property
  def num_kv_heads(self) -> int:
    return self.recent.num_kv_heads


def channel_scores(qw, qvalid, k, kvalid):
  """``[B, K, D]`` float32 ThinK channel scores (module docstring).

  Args:
    qw: ``[B, W, N, D]`` window queries; qvalid: ``[B, W]`` bool.
    k: ``[B, K, T, D]`` prompt keys; kvalid: ``[B, K, T]`` bool.
  """
  b, w, n, d = qw.shape
  kk = k.shape[1]
  q2 = jnp.where(qvalid[:, :, None, None], jnp.square(qw.astype(jnp.float32)), 0.0)
  nq = jnp.maximum(jnp.sum(qvalid, axis=-1), 1)[:, None, None]  # [B, 1, 1]
  # [B, N, D] -> [B, K, D]: mean over the window, then over the group
  qn = jnp.mean((jnp.sum(q2, axis=1) / nq).reshape(b, kk, n // kk, d), axis=2)
  k2 = jnp.where(kvalid[..., None], jnp.square(k.astype(jnp.float32)), 0.0)
  kn = jnp.sum(k2, axis=2) / jnp.maximum(jnp.sum(kvalid, axis=-1), 1)[..., None]  # [B, K, D]
  return qn * kn


def kept_channels(score, kept: int):
  """``[B, K, kept]`` int32 ids of the ``kept`` highest channels (ties: lower id), ascending."""
  return jnp.sort(jnp.argsort(-score, axis=-1, stable=True)[..., :kept], axis=-1).astype(jnp.int32)


def query_channels(q, channels):
  """``q [B, N, S, D]`` at its kv head's kept ``channels [B, K, D']`` -> ``[B, N, S, D']``."""
  group = q.shape[1] // channels.shape[1]
  ch = jnp.repeat(channels, group, axis=1)[:, :, None, :]  # [B, N, 1, D']
  return jnp.take_along_axis(q, ch, axis=-1)


def pruned_cache(cache: KVCache, channels, static_slots: int | None,
                 recent_size: int = 0) -> ThinKCache:
  """``cache`` with its keys cut to ``channels [B, K, D']`` -> ``ThinKCache``.

  The prompt part holds the longest row's ``n`` slots (with traced lengths: ``static_slots``,
  the caller's static bound; None raises), the decode part the room the caller allocated each
  row (``capacity - length``: the shortest row's, which is the most). Exact slot counts (block
  size 1): neither part reads block digests. ``recent_size`` (``r``): each row's last
  ``min(r, length)`` prompt slots move, whole, to the front of the decode part (``r`` more
  slots), and the prompt part holds ``n - r`` slots.
  """
  try:
    n, shortest = int(jnp.max(cache.length)), int(jnp.min(cache.length))
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
    if static_slots is None:
      raise ValueError("end_prefill needs concrete lengths to size the pruned cache; call "
                       "it outside jit/vmap or set the static option decode_slots") from None
    n = shortest = static_slots
  t, d = cache.capacity, cache.head_dim
  tp, tr = max(n - recent_size, 1), max(t - shortest, 1) + recent_size
  whole = jnp.minimum(cache.length, recent_size)  # [B] prompt slots each row keeps whole
  k = jnp.take_along_axis(cache.k[:, :, :tp], channels[:, :, None, :], axis=-1)
  prompt = keep_digests(dataclasses.replace(
      cache, k=k, v=cache.v[:, :, :tp], pos=cache.pos[:, :, :tp],
      length=jnp.minimum(cache.length - whole, tp), block_size=1), ())
  recent = init_cache(cache.batch, cache.num_kv_heads, tr, d, 1, cache.v.dtype, ())
  if recent_size:
    recent = _with_last_prompt_slots(recent, cache, whole, recent_size)
  return ThinKCache(prompt=prompt, recent=recent, channels=channels)


def _with_last_prompt_slots(recent: KVCache, cache: KVCache, whole, r: int) -> KVCache:
  """``recent`` (empty) holding ``cache``'s slots ``length - whole .. length - 1`` of each row
  at ``0 .. whole - 1``, whole width; its other slots stay empty."""
  j = jnp.arange(r)
  src = jnp.clip(cache.length[:, None] - whole[:, None] + j, 0, cache.capacity - 1)  # [B, r]
  filled = j < whole[:, None]  # [B, r]
  take = lambda x: jnp.take_along_axis(x, src[:, None, :, None], axis=2)
  put = lambda buf, x, empty: buf.at[:, :, :r].set(
      jnp.where(filled[:, None, :, None], x, empty).astype(buf.dtype))
  pos = jnp.where(filled[:, None], jnp.take_along_axis(cache.pos, src[:, None], axis=2), -1)
  return dataclasses.replace(
      recent, k=put(recent.k, take(cache.k), 0), v=put(recent.v, take(cache.v), 0),
      pos=recent.pos.at[:, :, :r].set(pos), length=whole.astype(recent.length.dtype))


def attend_part(q, cache: KVCache, positions, scale, softcap=None, window=None):
  """Causal attention of ``q [B, N, S, Dq]`` over one part (``k [B, K, T, Dq]``, ``v`` of any
  width ``Dv``) by position, as ``dense_over_cache``'s one masked softmax (which ties ``v`` to
  ``q``'s width) -> ``(out [B, N, S, Dv], lse [B, N, S])``."""
  b, n, s, dq = q.shape
  kk = cache.num_kv_heads
  ok = visibility(positions, cache.pos, cache.length, window)[:, :, None]  # [B, K, 1, S, T]
  out, lse = grouped_attention(q.reshape(b, kk, n // kk, s, dq), cache.k, cache.v, ok,
                               scale, softcap)
  return out.reshape(b, n, s, -1), lse.reshape(b, n, s)


@dataclasses.dataclass(frozen=True)
class ThinK(CompressionMethod):
  """ThinK key-channel pruning (Xu et al. 2025, Sec. 3.2); see the module docstring.

  ``ratio`` is the fraction of key channels pruned (not of tokens).

  Attributes:
    window_size: observation window: the last prompt queries that score the channels (32).
    recent_size: the last prompt keys of each row kept whole (0, kvpress's; the authors' code
      keeps 32).
  """

  window_size: int = 32
  recent_size: int = 0

  name = "think"
  SIGNAL = "queries"  # window queries' channel norms times the keys'

  def __post_init__(self):
    super().__post_init__()
    if isinstance(self.window_size, bool) or not isinstance(self.window_size, int) \
        or self.window_size < 1:
      raise ValueError(f"window_size must be an int >= 1, got {self.window_size!r}")
    if isinstance(self.recent_size, bool) or not isinstance(self.recent_size, int) \
        or self.recent_size < 0:
      raise ValueError(f"recent_size must be an int >= 0, got {self.recent_size!r}")
    if self.phase != "prefill" or self.head_budget != "uniform" or self.max_tokens is not None:
      raise ValueError(f"{self.spec or self.name}: ThinK prunes key channels once after the "
                       "prompt (phase='prefill', head_budget='uniform', no max_tokens)")
    if self.merge:
      raise ValueError(f"{self.spec or self.name}: ThinK evicts no token, so none merges "
                       "(merge=true merges a token press's evicted values: 'snapkv:merge=true')")

  def kept_dim(self, head_dim: int) -> int:
    """``D' = ceil((1 - ratio) D)`` key channels kept."""
    return int(compact_lib.keep_count(head_dim, self.ratio))

  # Every token stays: the context's slots, channels pruned.
  def prompt_keep(self, n):
    return n

  def decode_capacity(self, context: int, decode_room: int) -> int:
    del decode_room
    return self.round_capacity(context)

  def memory_access(self, context: int | None = None) -> float:
    """Cache read per decode step relative to dense: keys ``1 - ratio``, values whole (the
    ``recent_size`` last prompt keys whole too, where ``context`` is given)."""
    pruned = 1.0 if not context else max(context - self.recent_size, 0) / context
    return 1.0 - self.ratio / 2 * pruned

  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity):
    return {"obs": observe.init_ring(batch, num_q_heads, self.window_size, head_dim)}

  def observe(self, q, cache, state, positions, lse, scale):
    if isinstance(cache, ThinKCache):  # after the prompt the channels are fixed
      return state
    return dict(state, obs=observe.ring_push(state["obs"], q, positions, positions >= 0))

  def scores(self, cache, state, scale, n):
    raise TypeError("ThinK scores key channels (channel_scores), not tokens")

  def end_prefill(self, cache: KVCache, state, *, scale=None):
    """Prunes the prompt keys to their kept channels -> ``(ThinKCache, state)``.

    The prompt part holds the longest row's ``n`` slots (with traced lengths: ``capacity -
    decode_slots``), the decode part each row's room (``pruned_cache``).
    """
    del scale
    if self.ratio == 0:
      return cache, state
    static = None if self.decode_slots is None else max(cache.capacity - self.decode_slots, 0)
    return pruned_cache(cache, self.channels(cache, state), static, self.recent_size), state

  def channels(self, cache: KVCache, state):
    """``[B, K, D']`` kept channels from the window queries in ``state["obs"]`` and the keys
    of ``cache`` (Eq. 4, ``channel_scores``)."""
    ring = state["obs"]
    score = channel_scores(ring["buf"], observe.ring_filled(ring), cache.k, cache.valid)
    return kept_channels(score, self.kept_dim(cache.head_dim))

  def _attend(self, q, cache, state, positions, scale):
    if not isinstance(cache, ThinKCache):
      return super()._attend(q, cache, state, positions, scale)
    scale = reference.default_scale(q.shape[-1], scale)  # the full D's, not D'
    opts = dict(softcap=self.softcap, window=self.sliding_window)
    part = attend_part(query_channels(q, cache.channels), cache.prompt, positions, scale, **opts)
    out, _ = merge(part, attend_part(q, cache.recent, positions, scale, **opts))
    state = dict(state, next_pos=jnp.maximum(
        state["next_pos"], jnp.max(positions, axis=-1).astype(jnp.int32) + 1))
    return out.astype(q.dtype), state

  def _append_and_attend(self, q, k, v, cache, state, positions, scale):
    if not isinstance(cache, ThinKCache):
      return super()._append_and_attend(q, k, v, cache, state, positions, scale)
    recent = layout.PER_HEAD.append(cache.recent, k, v, positions, impl=self.impl,
                                    interpret=self.interpret)
    cache = dataclasses.replace(cache, recent=recent)
    out, state = self._attend(q, cache, state, positions, scale)
    return out, cache, state
