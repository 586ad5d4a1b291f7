"""The method registry: spec strings -> frozen method configs with pure per-layer functions.

``make("quest", budget=0.05)`` returns a :class:`Method`, a frozen hashable dataclass (a static
argument under ``jax.jit``). Per layer the model calls, with post-RoPE ``q [B, Hq, S, D]``,
``k, v [B, Hkv, S, D]`` and token ``positions [B, S]`` (-1 = padding, not written):

  cache = m.init_cache(batch, num_kv_heads, capacity, head_dim, dtype)
  state = m.init_state(batch, num_q_heads, num_kv_heads, head_dim, capacity, dtype)
  out, cache, state = m.prefill(q, k, v, cache, state, positions, scale=s)   # dense, causal
  cache, state = m.end_prefill(cache, state, scale=s)                         # after the prompt
  out, cache, state = m.decode(q, k, v, cache, state, positions, scale=s)    # S == m.window
  out, cache, state = m.rectify(q, k, v, cache, state, positions, scale=s)   # every rect_interval

``make("dense")`` is exact attention, the reference every other method is tested against.

Enhancers compose with any selector (``sparse_attn.enhancers``): ``"quest+resa"`` (RESA residual
estimation, option ``lam``, ``typical_query``, ``prior_update``), ``"quest+rect"`` (ReSA dense
rectification every ``f`` tokens), ``"quest+retro"`` (RetroAttention, window ``w``), in any
combination, e.g. ``"quest:gqa=group+resa:lam=0.5+rect:f=32+retro:w=4"``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax.numpy as jnp

from sparse_attn import adaptive, kernels, scoring, selection, sliding_window, sparse
from sparse_attn.budget import Budget
from sparse_attn.cache import KVCache, init_cache
from sparse_attn.cache_attention import dense_over_cache
from sparse_attn.enhancers import compose
from sparse_attn.enhancers import options as enhancer_options
from sparse_attn.enhancers import rectify as rect_lib
from sparse_attn.presets import PRESETS
from sparse_attn.spec import parse_spec

# name -> fn(method, q [B, Hq, D], cache, scale) -> Selection
SELECTORS: dict[str, Callable[..., selection.Selection]] = {
    "quest": lambda m, q, c, s: m.select_blocks(q, c, s),
    "arkvale": lambda m, q, c, s: m.select_blocks(q, c, s),
    "topk": lambda m, q, c, s: selection.topk(q, c, m.budget, m.gqa, s),
    "streaming": lambda m, q, c, s: selection.streaming(q, c, m.budget),
}
BASE_NAMES = ("dense",) + tuple(SELECTORS)

COMMON_OPTIONS = ("block_size", "impl", "interpret")
BUDGET_OPTIONS = ("budget", "p", "n_min", "n_local", "n_sink", "local_window", "forced_count",
                  "min_tokens")
SELECTOR_OPTIONS = BUDGET_OPTIONS + ("gqa", "variant", "topp", "adakv")
BLOCK_SELECTORS = ("quest", "arkvale")  # digest-scored; adaptive budget rules apply to these
ENHANCER_OPTIONS = enhancer_options.OPTIONS
TOKEN_SELECTORS = ("topk", "streaming")  # selections of single slots (granularity 1)
SCORE_SELECTORS = ("quest", "arkvale", "topk")  # choose entries by score (StreamingLLM does not)

@dataclasses.dataclass(frozen=True)
class Method:
  """A decoding attention method (static configuration; all functions are pure).

  Attributes:
    spec: the canonical spec string.
    selector: ``"dense"`` or a key of ``SELECTORS``.
    budget: the selector's budget rule (None for dense).
    block_size: cache block (page) size.
    gqa: ``"head"`` (per query head selection) or ``"group"`` (shared by the kv group).
    variant: ArkVale bounding volume (``"sphere"`` or ``"cuboid"``).
    impl: ``"auto" | "pallas" | "xla"`` for the attention ops.
    interpret: run Pallas kernels in interpret mode.
    resa: RESA residual estimation (``enhancers.options.Resa``: lam, lam_form, typical_query,
      prior_update; Yang et al., ICLR 2026), or None.
    rect: ReSA dense rectification (``enhancers.options.Rectify``: every ``f`` generated
      tokens; Sun et al. 2025), or None.
    retro: RetroAttention (``enhancers.options.Retro``: window ``w``; Choi et al. 2025), or None.
    topp: adaptive top-p rule: the fewest blocks with estimated mass >= ``topp`` per head,
      capped by the budget (Twilight / PSA; ``sparse_attn.adaptive.topp``).
    adakv: Ada-KV head-adaptive allocation of the layer's block budget with this per-head floor
      fraction (Feng et al. 2024; ``sparse_attn.adaptive.adakv``).
    sliding_window: Mistral's attention window (None = unlimited); set from the model by
      ``with_sliding_window`` (``models.generate`` does it), see ``sparse_attn.sliding_window``.
  """

  spec: str = "dense"
  selector: str = "dense"
  budget: Budget | None = None
  block_size: int = 16
  gqa: str = "head"
  variant: str = "sphere"
  impl: str = "auto"
  interpret: bool = False
  resa: enhancer_options.Resa | None = None
  rect: enhancer_options.Rectify | None = None
  retro: enhancer_options.Retro | None = None
  topp: float | None = None
  adakv: float | None = None
  sliding_window: int | None = None

  # Methods of one prefill group (with the same block size and capacity) end the prompt with
  # identical caches, so experiments share one prefill among them (dense prefill: every Method).
  prefill_group: ClassVar[str | None] = "dense"

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
  def granularity(self) -> int:
    """Tokens per selected entry: the block size, or 1 for token-level selectors."""
    return 1 if self.selector in TOKEN_SELECTORS else self.block_size

  def selection_heads(self, num_q_heads: int, num_kv_heads: int) -> int:
    """Heads of a selection: one list per kv head (group-shared, streaming) or per query head."""
    return num_kv_heads if (self.gqa == "group" or self.selector == "streaming") else num_q_heads

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

  @property
  def is_dense(self) -> bool:
    return self.selector == "dense"

  def attended_tokens(self, context: int) -> dict | None:
    """Tokens attended per selection head at ``context`` tokens, split into forced and chosen
    (``Budget.accounting``); None for dense."""
    return None if self.budget is None else self.budget.accounting(context, self.granularity)

  def check_context(self, context: int):
    """Raises ValueError when a score-based selector would choose nothing by score at
    ``context`` tokens (it would silently be StreamingLLM)."""
    if self.selector in SCORE_SELECTORS:
      self.budget.check(context, self.granularity, name=f"{self.spec!r}")

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

  # ---- per-layer functions: the pipeline of ``enhancers.compose`` ----
  def init_cache(self, batch, num_kv_heads, capacity, head_dim, dtype=jnp.float32) -> KVCache:
    return init_cache(batch, num_kv_heads, capacity, head_dim, self.block_size, dtype)

  def init_state(self, batch, num_q_heads, num_kv_heads, head_dim, capacity,
                 dtype=jnp.float32) -> Any:
    del dtype
    return compose.init_state(self, batch, num_q_heads, num_kv_heads, head_dim, capacity)

  def prefill(self, q, k, v, cache: KVCache, state, positions, *, scale=None):
    """Writes the chunk and attends it densely and causally over the cache.

    Returns ``(out [B, Hq, S, D], cache, state)``.
    """
    return compose.prefill(self, q, k, v, cache, state, positions, scale)

  def end_prefill(self, cache: KVCache, state, *, scale=None):
    return compose.end_prefill(self, cache, state, scale)

  def rectify(self, q, k, v, cache: KVCache, state, positions, *, scale=None):
    """Dense re-encoding of recent tokens (overwrites their K/V); same contract as prefill."""
    return compose.rectify(self, q, k, v, cache, state, positions, scale)

  def decode(self, q, k, v, cache: KVCache, state, positions, *, scale=None):
    """Appends the new token's K/V and attends. ``q [B, Hq, W, D]`` -> ``out [B, Hq, W, D]``.

    ``W == window``: with RetroAttention the window's past tokens are re-embedded (their K/V
    overwritten) and their outputs updated; otherwise ``W == 1``.
    """
    if q.shape[2] != self.window:
      raise ValueError(f"{self.spec} decodes {self.window} query per step, got {q.shape[2]}")
    return compose.decode(self, q, k, v, cache, state, positions, scale)

  def select(self, q, cache: KVCache, scale=None) -> selection.Selection:
    """The selection of the current queries ``q [B, Hq, D]``."""
    return SELECTORS[self.selector](self, q, cache, scale)

  def block_scores(self, q, cache: KVCache):
    """Digest scores ``[B, H, NB]`` of the block selectors (Pallas ``block_score`` for Quest)."""
    qs = scoring.scoring_queries(q, cache.num_kv_heads, self.gqa)
    if self.selector == "quest":
      return kernels.quest_scores(qs, cache, impl=self.impl, interpret=self.interpret)
    return scoring.arkvale_scores(qs, cache.kcen, cache.krad, cache.kmin, cache.kmax,
                                  self.variant)

  def select_blocks(self, q, cache: KVCache, scale=None) -> selection.Selection:
    """Block selection under the fixed budget or an adaptive rule (``topp`` / ``adakv``)."""
    scores = self.block_scores(q, cache)
    if self.sliding_window is not None:  # `cache` is the windowed view (see `attend`)
      scores = sliding_window.mask_block_scores(scores, cache)
    if self.topp is not None:
      return adaptive.topp(scores, cache, self.budget, self.topp, scale)
    if self.adakv is not None:
      return adaptive.adakv(scores, cache, self.budget, scale, floor=self.adakv)
    return selection.select_blocks(scores, cache, self.budget)

  def attend(self, q, cache: KVCache, positions, scale=None):
    """Decode attention of ``q [B, Hq, D]`` at ``positions [B]`` -> ``(out, lse)`` (no RESA)."""
    impl = self.impl
    if self.sliding_window is not None:
      cache = sliding_window.visible(cache, positions, self.sliding_window)
      impl = "xla"  # the Pallas kernels bound keys by `length`, not by position
    if self.is_dense:
      out, lse = dense_over_cache(q[:, :, None], cache, positions[:, None], scale)
      return out[:, :, 0], lse[:, :, 0]
    sel = self.select(q, cache, scale)
    out, lse = kernels.sparse_decode(q, cache, sel, scale, impl=impl, interpret=self.interpret)
    return sparse.mask_rows(out, lse, positions)


def _check_options(name: str, options: dict, valid: tuple[str, ...]):
  bad = sorted(set(options) - set(valid))
  if bad:
    raise ValueError(f"unknown option(s) {bad} for {name!r}; valid options: {sorted(valid)}")


def _budget_from(options: dict) -> Budget:
  kw = {k: options[k] for k in BUDGET_OPTIONS if k in options}
  if "p" in kw and kw["p"] is not None:
    if kw.get("budget") is not None:
      raise ValueError("give either budget or ReSA's p, not both")
    kw["budget"] = None
    kw.setdefault("n_local", 1)  # ReSA's defaults (Sec. 3): n_min=16, n_local=1
  return Budget(**kw)


def make(spec: str = "dense", **options) -> Method:
  """Builds a method from a spec string and options.

  Args:
    spec: ``"dense"``, ``"quest"``, ``"arkvale"``, ``"topk"``, ``"streaming"`` (options may
      also be given inline: ``"quest:gqa=group"``), a compression method, or a paper preset
      name (``PRESETS``: ``"resa-quest"``, ``"rectified"``, ``"retro"``, ...).
    **options: ``budget`` (float fraction in (0, 1] or int token count), ``p`` / ``n_min`` /
      ``n_local`` (ReSA's dynamic rule), ``n_sink``, ``local_window``, ``forced_count``
      (``extra``/``inside``, see ``sparse_attn.budget``), ``min_tokens``, ``gqa``, ``variant``,
      ``topp`` (adaptive top-p mass threshold) or ``adakv`` (Ada-KV per-head floor) for
      ``quest``/``arkvale``, ``block_size``, ``impl``, ``interpret``; with enhancers (``"quest+resa+rect+retro"``, each
      at most once, in any order, options inline ``"quest+resa:lam=0.5"`` or as keywords):
      ``lam`` (in [0, 1], default 1), ``lam_form`` (``renormalised``/``literal``),
      ``typical_query`` (``mean``/``last``), ``prior_update`` (``prefill_only``, the paper's
      default, or ``incremental``) for ``resa``; ``f`` (default 32; 0 or ``inf`` = never)
      for ``rect``; ``w`` (1..8, default 2) for ``retro``.

  Raises:
    ValueError: unknown names or options, or invalid values (the message lists valid ones).
  """
  from sparse_attn import compression  # pylint: disable=g-import-not-at-top (registry cycle)
  if isinstance(spec, str) and spec.strip().lower() in PRESETS:
    spec = PRESETS[spec.strip().lower()]
  parts = parse_spec(spec)
  (name, inline), rest = parts[0], parts[1:]
  if name in compression.BUILDERS:
    return compression.BUILDERS[name](spec, parts, options)
  if name not in BASE_NAMES:
    valid = sorted(BASE_NAMES + tuple(compression.BUILDERS))
    raise ValueError(f"unknown method {name!r} in {spec!r}; valid: {valid}; presets: "
                     f"{sorted(PRESETS)}")
  enh, enh_opts = _parse_enhancers(spec, name, rest, options)
  opts = {**inline, **{k: v for k, v in options.items() if k not in enh_opts}}
  valid = COMMON_OPTIONS + (() if name == "dense" else SELECTOR_OPTIONS)
  valid += tuple(o for e in enh for o in ENHANCER_OPTIONS[e])
  _check_options(name, opts, valid)
  impl = opts.get("impl", "auto")
  kernels.resolve_impl(impl)
  block_size = int(opts.get("block_size", 16))
  if block_size <= 0:
    raise ValueError(f"block_size must be positive, got {block_size}")
  common = dict(spec=spec, selector=name, block_size=block_size, impl=impl,
                interpret=bool(opts.get("interpret", False)))
  if name == "dense":
    return Method(**common)
  gqa = opts.get("gqa", "head")
  if gqa not in scoring.GQA_MODES:
    raise ValueError(f"gqa must be one of {scoring.GQA_MODES}, got {gqa!r}")
  variant = opts.get("variant", "sphere")
  if variant not in scoring.ARKVALE_VARIANTS:
    raise ValueError(f"variant must be one of {scoring.ARKVALE_VARIANTS}, got {variant!r}")
  return Method(**common, budget=_budget_from(opts), gqa=gqa, variant=variant,
                **_adaptive_fields(name, opts), **enhancer_options.configs(enh, enh_opts))


def _adaptive_fields(name: str, opts: dict) -> dict:
  topp, floor = opts.get("topp"), opts.get("adakv")
  if topp is None and floor is None:
    return {}
  if name not in BLOCK_SELECTORS:
    raise ValueError(f"topp/adakv apply to the block selectors {BLOCK_SELECTORS}, not {name!r}")
  if topp is not None and floor is not None:
    raise ValueError("give either topp or adakv, not both")
  if topp is not None and (isinstance(topp, bool) or not 0.0 < float(topp) <= 1.0):
    raise ValueError(f"topp must be in (0, 1], got {topp!r}")
  if floor is not None and (isinstance(floor, bool) or not 0.0 <= float(floor) <= 1.0):
    raise ValueError(f"adakv floor must be in [0, 1], got {floor!r}")
  return dict(topp=None if topp is None else float(topp),
              adakv=None if floor is None else float(floor))


def _parse_enhancers(spec: str, name: str, rest, options: dict):
  """``[(enhancer, inline), ...]`` -> (enhancer names, their merged options)."""
  enh, enh_opts = [], {}
  for e, inline in rest:
    if e not in ENHANCER_OPTIONS:
      raise ValueError(f"unknown enhancer {e!r} in {spec!r}; valid: {sorted(ENHANCER_OPTIONS)}")
    if e in enh:
      raise ValueError(f"enhancer {e!r} given twice in {spec!r}")
    _check_options(e, inline, ENHANCER_OPTIONS[e])
    enh.append(e)
    enh_opts.update(inline)
  if enh and name == "dense":
    raise ValueError(f"enhancers {enh} need a selector, not 'dense' ({spec!r}); valid "
                     f"selectors: {sorted(SELECTORS)}")
  for e in enh:  # keyword options of a present enhancer override inline ones, as for selectors
    for o in ENHANCER_OPTIONS[e]:
      if o in options:
        enh_opts[o] = options[o]
  return tuple(enh), enh_opts
