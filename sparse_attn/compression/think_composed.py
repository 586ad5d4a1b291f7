"""A token press composed with ThinK's key-channel pruning: kvpress's ``ComposedPress([press,
ThinKPress])``.

ThinK (Xu et al., ICLR 2025, arXiv 2407.21018) prunes key *channels* and is orthogonal to token
eviction: the paper evaluates it on top of H2O and SnapKV (Sec. 4, each with and without
ThinK), as kvpress's
``ComposedPress([SnapKVPress(r), ThinKPress(key_channel_compression_ratio=rc)])`` does. Here
the spec is the token press's, then a ``think`` part with ThinK's own options:

  methods.make("snapkv:ratio=0.5+think:ratio=0.5")       # half the tokens, half the key channels
  methods.make("h2o+think:ratio=0.25,window_size=16", ratio=0.75)

Keyword options belong to the token press (``ratio=``, ``budget=``, its own); ThinK's are inline.
At ``end_prefill`` the press keeps and compacts its tokens exactly as alone; then ThinK scores
the channels by Eq. 4, ``s_d = mean_{g, w} q_{g,w,d}^2 * mean_t k_{t,d}^2``, over its window of
the last prompt queries and the *kept* keys (kvpress's ThinK sees the keys the press left), and
the kept keys are stored with ``D' = ceil((1 - rc) D)`` channels (``think.pruned_cache``: a
``ThinKCache``, real memory). Decoding attends the pruned kept keys and the full-width new ones.

Limits: the press must keep a per-head cache once after the prompt (``head_budget="uniform"``,
``phase="prefill"``) with the library's attention (not RocketKV's or rolling StreamingLLM's own).
"""

from __future__ import annotations

import dataclasses

from sparse_attn.cache import KVCache
from sparse_attn.compression import layout
from sparse_attn.compression.base import CompressionMethod
from sparse_attn.compression.think import ThinK, ThinKCache, pruned_cache
from sparse_attn.spec import check_options

# The options both the composition and its press hold (the press's are the truth).
SHARED = tuple(f.name for f in dataclasses.fields(CompressionMethod) if f.name != "spec")
THINK_OPTIONS = ("ratio", "window_size", "recent_size")
# (an own ``end_prefill`` may post-process the press's per-head cache; ``end_prefill`` below
# refuses any other layout)
_OWN_ATTENTION = ("decode", "extend", "_attend", "_append_and_attend")


@dataclasses.dataclass(frozen=True)
class ThinKComposed(CompressionMethod):
  """A token press, then ThinK's channel pruning (Xu et al., ICLR 2025, Sec. 3.2, Eq. 4) of
  the keys it kept (see the module docstring).

  The common options (``ratio``: the press's fraction of *tokens* evicted, ``decode_slots``,
  ``softcap``, ...) mirror the press's and are passed down to it when replaced.

  Attributes:
    press: the token-eviction method (a ``CompressionMethod``).
    think: the ``ThinK`` whose ``ratio`` is the fraction of key channels pruned.
  """

  press: CompressionMethod | None = None
  think: ThinK | None = None

  def __post_init__(self):
    press, think = self.press, self.think
    if not isinstance(press, CompressionMethod) or not isinstance(think, ThinK):
      raise TypeError("ThinKComposed(press=<a compression method>, think=<a ThinK>)")
    if isinstance(press, (ThinK, ThinKComposed)):
      raise ValueError(f"{self.spec}: the first part must be a token press, not ThinK")
    down = {f: getattr(self, f) for f in SHARED if getattr(press, f) != getattr(self, f)}
    if down:
      press = dataclasses.replace(press, **down)
      object.__setattr__(self, "press", press)
    down = {f: getattr(self, f) for f in ("softcap", "sliding_window")
            if getattr(think, f) != getattr(self, f)}
    if down:
      object.__setattr__(self, "think", dataclasses.replace(think, **down))
    super().__post_init__()
    if hasattr(press, "replay") or press.crosses_layers:
      raise ValueError(f"{self.spec}: {press.name} scores the prompt after the prefill (its "
                       "replay, a ranking over all layers, chunks handed between layers), which "
                       "ThinK's composition does not run; use it alone")
    if getattr(press, "rerotate_keys", False):
      raise ValueError(f"{self.spec}: FINCH's re-rotated keys end at the prompt's last position "
                       "(kvpress's start at 0), which moves ThinK's channel scores away from "
                       "kvpress's composition; use finch:rerotate_keys=false")
    own = [f for f in _OWN_ATTENTION
           if getattr(type(press), f) is not getattr(CompressionMethod, f)]
    if getattr(press, "positions", "original") == "original" and own == ["_attend"]:
      own = []  # StreamingLLM's _attend is the base one at original positions
    if own or press.phase != "prefill" or press.head_rule.layout is not layout.PER_HEAD:
      raise ValueError(
          f"{self.spec}: ThinK composes with a token press that compresses the prompt once into "
          "a per-head cache with the library's attention (phase='prefill', "
          f"head_budget='uniform'); {press.name} has " + (
              f"its own {own[0]}" if own else f"phase={press.phase!s}, "
              f"head_budget={press.head_budget!s}"))

  def _of(self, press) -> "ThinKComposed":
    """This composition around ``press`` (its common options taken from it)."""
    return dataclasses.replace(self, press=press, **{f: getattr(press, f) for f in SHARED})

  @property
  def name(self) -> str:
    return f"{self.press.name}+think"

  @property
  def PANELS(self):  # pylint: disable=invalid-name (the class attribute of every method)
    return self.press.PANELS

  @property
  def head_rule(self):
    return self.press.head_rule

  # ---- what the press decides (its tokens), delegated ----
  def prompt_keep(self, n):
    return self.press.prompt_keep(n)

  def check_context(self, context: int) -> None:
    self.press.check_context(context)

  def memory_access(self, context: int | None = None) -> float:
    """The press's kept fraction times ThinK's (keys ``1 - rc``, values whole)."""
    return self.press.memory_access(context) * self.think.memory_access(context)

  def for_layer(self, layer: int, num_layers: int):
    return self._of(self.press.for_layer(layer, num_layers))

  def with_rope(self, inv_freq):
    return self._of(self.press.with_rope(inv_freq))

  def with_softcap(self, softcap: float):
    return self._of(self.press.with_softcap(softcap))  # the press refuses what it cannot

  def with_sliding_window(self, window: int):
    return self._of(self.press.with_sliding_window(window))

  def with_question_room(self, n: int):
    """FINCH's question ring, if the press has one (``layer_inputs.sized_for``)."""
    room = getattr(self.press, "with_question_room", None)
    return self if room is None else self._of(room(n))

  def layer_state(self, state, layer: int, inputs=None):
    """The press's ``layer_state`` (CriticalKV's W^O, FINCH's question, ...), if any."""
    hook = getattr(self.press, "layer_state", None)
    return state if hook is None else hook(state, layer, inputs)

  def scores(self, cache, state, scale, n):
    return self.press.scores(cache, state, scale, n)

  def keep_mask(self, cache, state, scale, n, ceiling: int | None = None):
    return self.press.keep_mask(cache, state, scale, n, ceiling)

  def prefill_keep(self, cache: KVCache, state, scale=None):
    return self.press.prefill_keep(cache, state, scale)

  # ---- state: the press's, plus ThinK's query window ("think_obs") ----
  def init_state(self, batch, num_q_heads, num_kv_heads, head_dim, capacity, dtype=None):
    state = self.press.init_state(batch, num_q_heads, num_kv_heads, head_dim, capacity)
    ring = self.think.init_extra(batch, num_q_heads, num_kv_heads, head_dim, capacity)["obs"]
    return dict(state, think_obs=ring)

  def observe(self, q, cache, state, positions, lse, scale):
    if isinstance(cache, ThinKCache):  # after the prompt the channels are fixed
      return state
    state = self.press.observe(q, cache, state, positions, lse, scale)
    mine = self.think.observe(q, cache, {"obs": state["think_obs"]}, positions, lse, scale)
    return dict(state, think_obs=mine["obs"])

  def end_prefill(self, cache: KVCache, state, *, scale=None):
    """The press's ``end_prefill`` (its kept tokens, compacted), then ThinK's channels of the
    kept keys -> ``(ThinKCache, state)`` (the press's cache when ThinK's ratio is 0)."""
    capacity = cache.capacity
    cache, state = self.press.end_prefill(cache, state, scale=scale)
    if self.think.ratio == 0:
      return cache, state
    if not isinstance(cache, KVCache):
      raise ValueError(f"{self.spec}: the press left a {type(cache).__name__}, not a per-head "
                       "KVCache whose keys ThinK can prune")
    static = None
    if self.decode_slots is not None:  # traced lengths: the press's static kept count
      n = max(capacity - self.decode_slots, 0)
      static = int(self.press.prompt_keep(n)) if self.press.compresses_prefill else n
    channels = self.think.channels(cache, {"obs": state["think_obs"]})
    return pruned_cache(cache, channels, static, self.think.recent_size), state

  # ---- after the prompt: ThinK's attention over the pruned cache ----
  def _attend(self, q, cache, state, positions, scale):
    if isinstance(cache, ThinKCache):
      return self.think._attend(q, cache, state, positions, scale)  # pylint: disable=protected-access
    return super()._attend(q, cache, state, positions, scale)

  def _append_and_attend(self, q, k, v, cache, state, positions, scale):
    if isinstance(cache, ThinKCache):
      return self.think._append_and_attend(q, k, v, cache, state, positions, scale)  # pylint: disable=protected-access
    return super()._append_and_attend(q, k, v, cache, state, positions, scale)


def compose(spec: str, press: CompressionMethod, think_options: dict) -> ThinKComposed:
  """``press`` then ThinK with ``think_options`` (inline: ``ratio``, ``window_size``,
  ``recent_size``)."""
  check_options("think", think_options, THINK_OPTIONS)
  think = ThinK(spec="think", **think_options)
  return ThinKComposed(spec=spec, press=press, think=think,
                       **{f: getattr(press, f) for f in SHARED})
