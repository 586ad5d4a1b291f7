"""``Method``: a decoding attention method as one frozen config with pure per-layer functions.

``methods.make`` builds one from a spec string; ``Method(selector=...)`` builds one from a
selector object. Per layer the model calls, with post-RoPE ``q [B, Hq, S, D]``,
``k, v [B, Hkv, S, D]`` and token ``positions [B, S]`` (-1 = padding, not written):

  cache = m.init_cache(batch, num_kv_heads, capacity, head_dim, dtype)
  state = m.init_state(batch, num_q_heads, num_kv_heads, head_dim, capacity, dtype)
  out, cache, state = m.prefill(q, k, v, cache, state, positions, scale=s)   # dense, causal
  cache, state = m.end_prefill(cache, state, scale=s)                         # after the prompt
  out, cache, state = m.decode(q, k, v, cache, state, positions, scale=s)    # S == m.window
  out, cache, state = m.rectify(q, k, v, cache, state, positions, scale=s)   # every rect_interval
  out, cache, state = m.extend(q, k, v, cache, state, positions, scale=s)    # dense: a chunk

Every step runs one pipeline (``enhancers.compose``); a method is a hashable static argument
under ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from pallas_kernels import Impl
from pallas_kernels import check_softcap as _check_softcap
from sparse_attn import placement, selection, sliding_window
from sparse_attn.budget import Budget
from sparse_attn.cache import DIGEST_KINDS, KVCache, init_cache
from sparse_attn.enhancers import compose
from sparse_attn.enhancers import options as enhancer_options
from sparse_attn.enhancers import rectify as rect_lib
from sparse_attn.protocol import PrefillGroup
from sparse_attn.selectors.base import Selector
from sparse_attn.spec import parse_spec

@dataclasses.dataclass(frozen=True)
class Method:
  """A decoding attention method (static configuration; all functions are pure).

  A method is a selector (None = dense) plus optional enhancers, applied by one pipeline
  (``enhancers.compose``: write -> select -> attend -> RESA aggregate -> retro merge), the same
  on one device and on each shard of a context-parallel cache. New selection rules are
  ``selectors.Selector`` subclasses (``Method(selector=MySelector(budget=0.1))``), not
  subclasses of this class: a subclass may not replace ``select`` or ``attend``.

  Attributes:
    spec: the canonical spec string ("" = from the selector: ``"dense"`` or its name).
    selector: which entries a decode step attends (a ``selectors.Selector``: Quest, ArkVale,
      TopK, Streaming or your own, with its budget), or None for dense attention.
    block_size: cache block (page) size (None = the selector's, else 16).
    impl: ``"auto" | "pallas" | "xla"`` for the attention ops.
    interpret: run Pallas kernels in interpret mode.
    resa: RESA residual estimation (``enhancers.options.Resa``: lam, lam_form, typical_query,
      prior_update; Yang et al., ICLR 2026), or None.
    rect: ReSA dense rectification (``enhancers.options.Rectify``: every ``f`` generated
      tokens; Sun et al. 2025), or None.
    retro: RetroAttention (``enhancers.options.Retro``: window ``w``; Choi et al. 2025), or None.
    sliding_window: Mistral's attention window (None = unlimited); set from the model by
      ``with_sliding_window`` (``models.generate`` does it), see ``sparse_attn.sliding_window``.
    softcap: the model's attention-logit soft-cap (Gemma 2; None = none), set by
      ``with_softcap`` (the decode loop does it per layer), see ``with_softcap``.
    digests: the block digest kinds the cache keeps (``cache.DIGEST_KINDS``); None: the box
      (every cache's, docs/architecture.md) plus what the selector reads (``cache_digests``). A shared
      prefill keeps the union of its members'.
    dense_layers: the first this many decoder layers decode with dense attention
      (``for_layer``), the others with the selector. Quest's evaluation code keeps layers 0 and
      1 dense (github mit-han-lab/Quest, ``evaluation/quest_attention.py``: ``layer_id < 2``
      runs the flash forward), as do Twilight's runs (``skip_first_two_layers``); RESA and ReSA
      sparsify every layer (RESA Sec. 4.1, ReSA Sec. 3.1), the library's default (0).
  """

  spec: str = ""
  selector: Selector | None = None
  block_size: int | None = None
  impl: Impl = "auto"
  interpret: bool = False
  resa: enhancer_options.Resa | None = None
  rect: enhancer_options.Rectify | None = None
  retro: enhancer_options.Retro | None = None
  sliding_window: int | None = None
  digests: tuple[str, ...] | None = None
  softcap: float | None = None
  dense_layers: int = 0

  # Methods of one prefill group (with the same block size and capacity) end the prompt with
  # identical caches, so experiments share one prefill among them (dense prefill: every Method).
  prefill_group: ClassVar[PrefillGroup | None] = PrefillGroup.DENSE
  # Its decode is the shared pipeline, which runs on a shard of the cache too
  # (``context_parallel``); a subclass with a decode of its own sets this False.
  context_parallel: ClassVar[bool] = True

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    own = [f for f in ("select", "attend") if f in cls.__dict__]
    if own:  # it would be bypassed where the pipeline selects (context-parallel decode)
      raise TypeError(
          f"{cls.__name__} overrides Method.{own[0]}: a selection rule is a Selector, not a "
          "Method subclass. Subclass sparse_attn.selectors.BlockSelector (write block_scores) "
          "or Selector (write select) and decode with Method(selector=YourSelector(budget=0.1))"
          "; selectors.register(YourSelector) makes its name a spec string")

  def __post_init__(self):
    if self.selector is not None and not isinstance(self.selector, Selector):
      raise TypeError(f"selector must be a sparse_attn.selectors.Selector, got "
                      f"{type(self.selector).__name__}")
    if self.block_size is None:
      object.__setattr__(self, "block_size", self.selector.block_size if self.selector else 16)
    if not self.spec:
      object.__setattr__(self, "spec", self.selector.label if self.selector else "dense")
    if self.selector is None and parse_spec(self.spec)[0][0] != "dense":  # a custom method must not run dense unasked
      raise ValueError(f"{type(self).__name__}(spec={self.spec!r}) has no selector, so it "
                       f"would decode as dense attention; give selector=... (or spec='dense')")
    if self.selector is not None and self.selector.block_size != self.block_size:
      raise ValueError(f"selector block_size {self.selector.block_size} != the method's "
                       f"{self.block_size}")
    if self.selector is None and (self.resa or self.rect or self.retro):
      raise ValueError(f"enhancers need a selector, not dense attention ({self.spec!r})")
    n = self.dense_layers
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
      raise ValueError(f"dense_layers must be an int >= 0, got {n!r}")
    if n and self.selector is None:
      raise ValueError(f"dense_layers needs a selector: dense attention is dense in every "
                       f"layer ({self.spec!r})")
    if n and (self.resa or self.retro):
      raise ValueError(f"{self.spec!r}: dense_layers takes no RESA or retro (their per-layer "
                       "state and window are the selector layers'); use a plain selector or "
                       "+rect")

  # ---- schedule flags the decode loop obeys ----
  @property
  def window(self) -> int:
    """Queries per head in a decode step (RetroAttention's window; 1 otherwise)."""
    return self.retro.w if self.retro else 1

  @property
  def rect_interval(self) -> int:
    """Re-encode densely every this many generated tokens (0 = never)."""
    return self.rect.f if self.rect else 0

  @property
  def enhanced(self) -> bool:
    """RESA or retro on (the method keeps a per-layer state)."""
    return bool(self.resa or self.retro)

  @property
  def is_dense(self) -> bool:
    return self.selector is None

  @property
  def name(self) -> str:
    """``"dense"`` or the selector's name."""
    return "dense" if self.selector is None else self.selector.label

  @property
  def budget(self) -> Budget | None:
    """The selector's budget rule (None for dense)."""
    return None if self.selector is None else self.selector.budget

  @property
  def granularity(self) -> int:
    """Tokens per selected entry: the block size, or 1 for token-level selectors."""
    return self.block_size if self.selector is None else self.selector.granularity

  def selection_heads(self, num_q_heads: int, num_kv_heads: int) -> int:
    """Heads of a selection (see ``Selector.selection_heads``; dense: per query head)."""
    if self.selector is None:
      return num_q_heads
    return self.selector.selection_heads(num_q_heads, num_kv_heads)

  def memory_access(self, context: int | None = None) -> float:
    """ReSA's per-step memory-access model ``1/b + p + 1/f`` of dense (Sun et al., Sec. 2.3).

    ``p`` is ReSA's ratio, or the budget as a fraction of ``context`` (needed for token budgets).
    """
    bud = self.budget
    if bud is None:
      return 1.0
    if bud.budget is None:
      p = bud.p
    elif isinstance(bud.budget, float):
      p = bud.budget
    elif context:
      p = min(1.0, bud.budget / context)
    else:
      raise ValueError("a token budget needs the context length for the memory-access model")
    return rect_lib.memory_access(self.block_size, p, self.rect_interval)

  def attended_tokens(self, context: int, num_layers: int | None = None) -> dict | None:
    """Tokens attended per selection head at ``context`` tokens in a sparse layer, split into
    forced and chosen (``Selector.accounting``: ``Budget.accounting`` plus what the selector
    attends on top of its budget); None for dense.

    With ``num_layers`` (the model's decoder layers) it adds ``layers``, ``full_layers`` (how
    many of them attend the whole cache) and ``layer_mean``, the tokens one step reads per head
    averaged over the layers (``Budget.over_layers``)."""
    if self.selector is None:
      return None
    acc = self.selector.accounting(context)
    if num_layers is None:
      return acc
    return Budget.over_layers(acc, num_layers, self.full_layers(num_layers))

  def full_layers(self, num_layers: int) -> int:
    """How many of ``num_layers`` decoder layers attend the whole cache (``dense_layers``)."""
    return sum(self.for_layer(i, num_layers).is_dense for i in range(num_layers))

  def for_layer(self, layer: int, num_layers: int | None = None) -> "Method":
    """The method decoder layer ``layer`` runs (``models.steps.per_layer``): ``dense_twin``
    below ``dense_layers``, else this method."""
    del num_layers
    return self.dense_twin() if layer < self.dense_layers else self

  def dense_twin(self) -> "Method":
    """Dense attention over this method's cache (same block size, digests, window, cap): what
    a layer that attends everything runs, keeping the digests the selector layers read."""
    return Method(spec="dense", block_size=self.block_size, impl=self.impl,
                  interpret=self.interpret, sliding_window=self.sliding_window,
                  digests=self.cache_digests, softcap=self.softcap)

  def check_context(self, context: int):
    """Raises ValueError when a score-based selector would choose nothing by score at
    ``context`` tokens (it would silently be StreamingLLM)."""
    if self.selector is not None:
      self.selector.check_context(context, self.spec)

  def round_capacity(self, n: int) -> int:
    """The smallest valid capacity (a multiple of ``block_size``) holding ``n`` tokens."""
    return max(1, -(-int(n) // self.block_size)) * self.block_size

  def with_sliding_window(self, window: int) -> "Method":
    """This method under a sliding-window mask of ``window`` tokens (Mistral)."""
    if self.enhanced:
      raise NotImplementedError(
          f"{self.spec}: RESA and retro have no sliding-window mask; with a windowed model use "
          "dense, a selector (quest, arkvale, topk, streaming) or +rect")
    return dataclasses.replace(self, sliding_window=sliding_window.check_window(window))

  def with_softcap(self, softcap: float) -> "Method":
    """This method on a model whose attention logits are soft-capped (Gemma 2): every
    attention path it runs (prefill, dense and sparse decode, rectification, retro's window)
    caps the scaled logits, ``cap * tanh(s / cap)`` (``pallas_kernels.soft_cap``), before the
    softmax. Its selection is unchanged: tanh is monotone, so Quest's and ArkVale's bounds and
    the token top-k rank blocks and tokens alike with or without the cap.

    Raises:
      NotImplementedError: rules that read attention mass from uncapped logits: RESA (its prior
        and online bias estimate the unselected mass as ``e^{P_j + b}``, a linear estimate the
        cap does not preserve), the adaptive ``topp`` / ``adakv`` rules and Twilight (softmax
        mass of estimated scores), the token top-k of a group's mean logit (``gqa="group"``:
        a mean of capped logits ranks unlike a mean of uncapped ones), and a subclass with a
        decode of its own (it would not pass the cap on).
    """
    cap = _check_softcap(softcap)
    refused = None
    if cap is None:
      return dataclasses.replace(self, softcap=None)
    if self.resa:
      refused = "RESA's residual estimate (a linear estimate of uncapped logits)"
    elif type(self).decode is not Method.decode:
      refused = f"{type(self).__name__}'s own decode (it does not pass the cap on)"
    elif getattr(self.selector, "topp", None) is not None:
      refused = "a top-p rule (the mass of uncapped scores)"
    elif getattr(self.selector, "adakv", None) is not None:
      refused = "the Ada-KV rule (the mass of uncapped scores)"
    elif (self.selector is not None and self.selector.token_level
          and self.selector.group_shared and self.selector.score_based):
      refused = "a group's mean of uncapped logits (the top-k ranking of gqa='group')"
    if refused:
      raise NotImplementedError(
          f"{self.spec}: the model soft-caps its attention logits (softcap={cap:g}), which "
          f"{refused} does not model; use dense, a selector (quest, arkvale, topk, "
          "streaming), +rect or +retro")
    return dataclasses.replace(self, softcap=cap)

  def with_rope(self, inv_freq) -> "Method":
    """Selectors read post-RoPE keys only: the model's RoPE frequencies change nothing."""
    del inv_freq
    return self

  def decode_capacity(self, context: int, decode_room: int) -> int:
    """Cache slots while decoding ``decode_room`` tokens after a ``context``-token prompt
    (selectors keep every token)."""
    return self.round_capacity(context)

  # ---- per-layer functions: the pipeline of ``enhancers.compose`` ----
  @property
  def cache_digests(self) -> tuple[str, ...]:
    """The digest kinds this method's cache keeps: ``digests``, else the box digests (kmin,
    kmax: part of every cache, docs/architecture.md) and the ones the selector reads."""
    if self.digests is not None:
      return self.digests
    reads = self.selector.digests if self.selector else ()
    return tuple(k for k in DIGEST_KINDS if k == "box" or k in reads)

  def init_cache(self, batch, num_kv_heads, capacity, head_dim, dtype=jnp.float32) -> KVCache:
    """An empty cache keeping the box digests and those the selector reads."""
    return init_cache(batch, num_kv_heads, capacity, head_dim, self.block_size, dtype,
                      self.cache_digests)

  def init_state(self, batch, num_q_heads, num_kv_heads, head_dim, capacity,
                 dtype=jnp.float32) -> compose.MethodState:
    del dtype
    return compose.init_state(self, batch, num_q_heads, num_kv_heads, head_dim, capacity)

  def prefill(self, q, k, v, cache: KVCache, state, positions, *, scale=None):
    """Writes the chunk and attends it densely and causally over the cache.

    Returns ``(out [B, Hq, S, D], cache, state)``.
    """
    return compose.prefill(self, q, k, v, cache, state, positions, scale)

  def end_prefill(self, cache: KVCache, state, *, scale=None, place=placement.ONE_DEVICE):
    """RESA forms its prior; ``place``: where the cache lives (``sparse_attn.placement``)."""
    return compose.end_prefill(self, cache, state, scale, place)

  def rectify(self, q, k, v, cache: KVCache, state, positions, *, scale=None):
    """Dense re-encoding of recent tokens (overwrites their K/V); same contract as prefill."""
    return compose.rectify(self, q, k, v, cache, state, positions, scale)

  def decode(self, q, k, v, cache: KVCache, state, positions, *, scale=None,
             place=placement.ONE_DEVICE):
    """Appends the new token's K/V and attends. ``q [B, Hq, W, D]`` -> ``out [B, Hq, W, D]``.

    ``W == window``: with RetroAttention the window's past tokens are re-embedded (their K/V
    overwritten) and their outputs updated; otherwise ``W == 1``. ``place``: where the cache
    lives (``sparse_attn.placement``; ``context_parallel`` passes a shard's).
    """
    if q.shape[2] != self.window:
      raise ValueError(f"{self.spec} decodes {self.window} query per step, got {q.shape[2]}")
    return compose.decode(self, q, k, v, cache, state, positions, scale, place)

  def extend(self, q, k, v, cache: KVCache, state, positions, *, scale=None):
    """Reads a chunk after ``end_prefill`` (a query-agnostic question): dense only.

    Dense keeps slot = position, so this is ``prefill``'s write and causal attention. A
    selector's state is fixed at ``end_prefill`` (RESA's prior, retro's ring) and would not
    follow a chunk: those read tokens one ``decode`` step at a time.
    """
    if not self.is_dense:
      raise NotImplementedError(
          f"{self.spec!r}: only dense and compression methods read a chunk after the prompt "
          "(extend); a selector reads it one decode step at a time")
    return compose.prefill(self, q, k, v, cache, state, positions, scale)

  def select(self, q, cache: KVCache, scale=None) -> selection.Selection:
    """The selection of the current queries ``q [B, Hq, D]`` (the selector's ``select``)."""
    return compose.select(self, q, cache, scale)

  def attend(self, q, cache: KVCache, positions, scale=None):
    """Decode attention of ``q [B, Hq, D]`` at ``positions [B]`` -> ``(out, lse)`` (no RESA)."""
    return compose.attend(self, q, cache, positions, scale)
