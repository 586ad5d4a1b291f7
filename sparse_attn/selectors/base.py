"""The selector base classes: which cache entries a sparse decode step attends.

A selector is the selection half of a ``methods.Method``: a frozen, hashable dataclass holding
its :class:`~sparse_attn.budget.Budget` and the options that shape its choice. Two kinds:

* :class:`BlockSelector` scores cache blocks (pages) from their digests; a subclass writes only
  ``block_scores(qs [B, H, D], cache) -> [B, H, NB]`` (and lists the digest kinds it reads).
  The budget rule, GQA pooling, sliding windows, the adaptive rules (``topp``, ``adakv``) and
  context-parallel decoding (each shard scores its local blocks, one global top-k) come with it.
* :class:`Selector` itself: a subclass writes ``select(q, cache, scale, ...) -> Selection``
  (token-level rules such as the oracle top-k or StreamingLLM). It decodes on one device.

Built the same way in a notebook and in the library: ``Quest(budget=0.1)``,
``MySelector(budget=0.1, gqa="group")``; ``methods.Method(selector=...)`` decodes with it and
``selectors.register`` makes its ``name`` a spec string (``methods.make("mine:budget=0.1")``).

Letters: B batch, K kv heads, Hq query heads, H selection heads (K or Hq), NB blocks, D head dim.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

from pallas_kernels import Impl
from sparse_attn import adaptive, placement, scoring, selection, sliding_window
from sparse_attn.budget import Budget


@dataclasses.dataclass(frozen=True)
class Selector(abc.ABC):
  """A selection rule (static; hashable).

  Attributes:
    budget: how many entries are attended: a ``Budget``, or a fraction of the context (float in
      (0, 1]) / token count (int), taken as ``Budget(budget=...)`` with its defaults (4 sinks
      and a 64-token local window on top).
    block_size: cache block (page) size; the entry size of block selectors.
    gqa: ``"head"`` (one selection per query head) or ``"group"`` (one per kv group, from the
      group's mean query: ReSA's sharing, ``scoring.pool_group``).

  Class attributes: ``name`` (the spec name ``selectors.register`` gives it), ``token_level``
  (entries are single slots, granularity 1), ``score_based`` (chooses entries by score; False
  for position-only rules, which then need no score budget check).
  """

  budget: Budget | float | int | None = None
  block_size: int = 16
  gqa: scoring.GQA = "head"

  name: ClassVar[str] = ""
  token_level: ClassVar[bool] = False
  score_based: ClassVar[bool] = True

  def __post_init__(self):
    if self.budget is None:
      raise TypeError(f"{type(self).__name__} needs a budget: a fraction of the context "
                      "(budget=0.1), a token count (budget=256) or a sparse_attn.budget.Budget")
    if not isinstance(self.budget, Budget):
      object.__setattr__(self, "budget", Budget(budget=self.budget))
    if int(self.block_size) <= 0:
      raise ValueError(f"block_size must be positive, got {self.block_size}")
    scoring.check_gqa(self.gqa)

  @property
  def label(self) -> str:
    """The spec name (``name``), or the class name for an unregistered subclass."""
    return self.name or type(self).__name__.lower()

  @property
  def granularity(self) -> int:
    """Tokens per selected entry: the block size, or 1 for token-level selectors."""
    return 1 if self.token_level else self.block_size

  @property
  def digests(self) -> tuple[str, ...]:
    """The block digest kinds this selector reads (``cache.DIGEST_KINDS``)."""
    return ()

  @property
  def group_shared(self) -> bool:
    """One selection per kv head (``gqa="group"``), not per query head."""
    return self.gqa == "group"

  @property
  def context_parallel(self) -> bool:
    """Whether it decodes with the cache's slots split over a mesh axis (block selectors with
    a fixed budget rule)."""
    return False

  def selection_heads(self, num_q_heads: int, num_kv_heads: int) -> int:
    """Heads of a selection: one list per kv head (group-shared) or per query head."""
    return num_kv_heads if self.group_shared else num_q_heads

  def accounting(self, context: int) -> dict:
    """Tokens one decode step attends per selection head at ``context`` tokens, as host ints:
    ``dict(forced=, chosen=, total=, context=)`` (``Budget.accounting`` in entries of
    ``granularity`` tokens). A selector that attends more than its budget's entries (ShadowKV's
    outlier blocks) counts them here; ``Method.attended_tokens`` reports this."""
    return self.budget.accounting(context, self.granularity)

  def check_context(self, context: int, spec: str):
    """Raises ValueError when a score-based selector would choose nothing by score at
    ``context`` tokens (it would silently be StreamingLLM)."""
    if self.score_based:
      self.budget.check(context, self.granularity, name=f"{spec!r}")

  @abc.abstractmethod
  def select(self, q, cache, scale=None, *, impl: Impl = "auto", interpret: bool = False,
             windowed: bool = False, place=placement.ONE_DEVICE) -> selection.Selection:
    """The selection of the current queries ``q [B, Hq, D]`` over ``cache``.

    ``windowed``: ``cache`` is a sliding-window view (``sliding_window.visible``) whose
    out-of-window entries must not be chosen. ``place``: where the cache lives
    (``placement.OneDevice``, or a shard of it: ``context_parallel.SeqShards``).
    """


@dataclasses.dataclass(frozen=True)
class BlockSelector(Selector):
  """A selector of cache blocks by a score per block (Quest, ArkVale, yours).

  Attributes:
    topp: adaptive top-p rule: the fewest blocks with estimated mass >= ``topp`` per head,
      capped by the budget (Twilight / PSA; ``sparse_attn.adaptive.topp``).
    adakv: Ada-KV head-adaptive allocation of the layer's block budget with this per-head
      floor fraction (Feng et al. 2024; ``sparse_attn.adaptive.adakv``).
  """

  topp: float | None = None
  adakv: float | None = None

  def __post_init__(self):
    super().__post_init__()
    for field in ("topp", "adakv"):
      object.__setattr__(self, field, _fraction(field, getattr(self, field)))
    if self.topp is not None and self.adakv is not None:
      raise ValueError("give either topp or adakv, not both")
    if self.topp is not None and not 0.0 < self.topp <= 1.0:
      raise ValueError(f"topp must be in (0, 1], got {self.topp!r}")
    if self.adakv is not None and not 0.0 <= self.adakv <= 1.0:
      raise ValueError(f"adakv floor must be in [0, 1], got {self.adakv!r}")

  @property
  def context_parallel(self) -> bool:
    return self.topp is None and self.adakv is None

  @abc.abstractmethod
  def block_scores(self, qs, cache, *, impl: Impl = "auto", interpret: bool = False):
    """Scores ``[B, H, NB]`` (float32, higher = more important) of every block of ``cache``
    for the scoring queries ``qs [B, H, D]`` (already pooled by ``gqa``). Blocks past the
    context may score anything: the budget rule never picks them."""

  def scores(self, q, cache, *, impl: Impl = "auto", interpret: bool = False):
    """``block_scores`` of the current queries ``q [B, Hq, D]`` -> ``[B, H, NB]``."""
    self.check_digests(cache)
    qs = scoring.scoring_queries(q, cache.num_kv_heads, self.gqa)
    return self.block_scores(qs, cache, impl=impl, interpret=interpret)

  def check_digests(self, cache):
    """A ValueError where ``cache`` lacks a digest this selector reads (static shapes: a clear
    error instead of a broadcasting one)."""
    missing = [k for k in self.digests if not cache.has_digests(k)]
    if missing:
      raise ValueError(f"{self.label} reads the {missing} block digests, which this cache "
                       "does not keep: make it with the method's init_cache (or a Method "
                       f"with digests={self.digests!r})")

  def select(self, q, cache, scale=None, *, impl: Impl = "auto", interpret: bool = False,
             windowed: bool = False, place=placement.ONE_DEVICE) -> selection.Selection:
    """Scores the blocks, then applies the budget: forced blocks (sinks, local window) first,
    then the best scores; or the ``topp`` / ``adakv`` rule."""
    scores = self.scores(q, cache, impl=impl, interpret=interpret)
    if windowed:
      scores = sliding_window.mask_block_scores(scores, cache)
    if self.topp is not None:
      return adaptive.topp(scores, cache, self.budget, self.topp, scale)
    if self.adakv is not None:
      return adaptive.adakv(scores, cache, self.budget, scale, floor=self.adakv)
    return place.select_blocks(scores, cache, self.budget, impl=impl, interpret=interpret)


def _fraction(name: str, value) -> float | None:
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ValueError(f"{name} must be a number, got {value!r}")
  return float(value)
