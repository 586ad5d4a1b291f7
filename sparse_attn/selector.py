"""Selectors: which cache entries a sparse decode step attends (a frozen, validated config).

A :class:`Selector` is the selection half of a ``methods.Method``: its name (Quest, ArkVale,
token top-k, StreamingLLM), its :class:`~sparse_attn.budget.Budget` and the options that shape
the choice (GQA sharing, ArkVale's bounding volume, an adaptive top-p or Ada-KV rule). It is
built and validated once by :meth:`Selector.from_options`; ``select`` then maps the current
queries ``q [B, Hq, D]`` and a cache to a ``selection.Selection``.

* ``quest``: page digests (element-wise min/max keys), upper-bound scores (Tang et al. 2024,
  Eq. 1); ``arkvale``: bounding-volume page digests, cuboid-mean by default (Chen et al. 2024,
  Sec. 5.2). Both choose blocks.
* ``topk``: exact token scores, the oracle top-k; ``streaming``: sinks + recent tokens only
  (StreamingLLM, Xiao et al. 2024). Both choose single slots (granularity 1).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

from pallas_kernels import Impl
from sparse_attn import adaptive, kernels, scoring, selection, sliding_window
from sparse_attn.budget import Budget

NAMES = ("quest", "arkvale", "topk", "streaming")
BLOCK_SELECTORS = ("quest", "arkvale")  # digest-scored; the adaptive budget rules apply to these
TOKEN_SELECTORS = ("topk", "streaming")  # selections of single slots (granularity 1)
SCORE_SELECTORS = ("quest", "arkvale", "topk")  # choose entries by score (StreamingLLM does not)
BUDGET_OPTIONS = ("budget", "p", "n_min", "n_local", "n_sink", "local_window", "forced_count",
                  "min_tokens")
OPTIONS = BUDGET_OPTIONS + ("gqa", "variant", "topp", "adakv")


@dataclasses.dataclass(frozen=True)
class Selector:
  """A selection rule (static; hashable).

  Attributes:
    name: one of ``NAMES``.
    budget: how many entries are attended (forced sinks / local window plus chosen ones).
    block_size: cache block (page) size; the entry size of the block selectors.
    gqa: ``"head"`` (one selection per query head) or ``"group"`` (shared by the kv group).
    variant: ArkVale bounding volume (``scoring.ARKVALE_VARIANTS``: ``"cuboid-mean"``,
      ``"cuboid"``, ``"sphere"``).
    topp: adaptive top-p rule: the fewest blocks with estimated mass >= ``topp`` per head,
      capped by the budget (Twilight / PSA; ``sparse_attn.adaptive.topp``).
    adakv: Ada-KV head-adaptive allocation of the layer's block budget with this per-head
      floor fraction (Feng et al. 2024; ``sparse_attn.adaptive.adakv``).
  """

  name: Literal["quest", "arkvale", "topk", "streaming"]
  budget: Budget
  block_size: int = 16
  gqa: scoring.GQA = "head"
  variant: Literal["cuboid-mean", "cuboid", "sphere"] = "cuboid-mean"
  topp: float | None = None
  adakv: float | None = None

  def __post_init__(self):
    if self.name not in NAMES:
      raise ValueError(f"unknown selector {self.name!r}; valid: {NAMES}")
    scoring.check_gqa(self.gqa)
    if self.variant not in scoring.ARKVALE_VARIANTS:
      raise ValueError(f"variant must be one of {scoring.ARKVALE_VARIANTS}, got {self.variant!r}")
    if self.topp is None and self.adakv is None:
      return
    if self.name not in BLOCK_SELECTORS:
      raise ValueError(f"topp/adakv apply to the block selectors {BLOCK_SELECTORS}, "
                       f"not {self.name!r}")
    if self.topp is not None and self.adakv is not None:
      raise ValueError("give either topp or adakv, not both")
    if self.topp is not None and not 0.0 < self.topp <= 1.0:
      raise ValueError(f"topp must be in (0, 1], got {self.topp!r}")
    if self.adakv is not None and not 0.0 <= self.adakv <= 1.0:
      raise ValueError(f"adakv floor must be in [0, 1], got {self.adakv!r}")

  @classmethod
  def from_options(cls, name: str, options: dict, block_size: int) -> "Selector":
    """The selector ``name`` from spec options (keys of ``OPTIONS``; others are ignored)."""
    kw = {k: options[k] for k in BUDGET_OPTIONS if k in options}
    if kw.get("p") is not None:
      if kw.get("budget") is not None:
        raise ValueError("give either budget or ReSA's p, not both")
      kw["budget"] = None
      kw.setdefault("n_local", 1)  # ReSA's defaults (Sec. 3): n_min=16, n_local=1
    return cls(name=name, budget=Budget(**kw), block_size=block_size,
               gqa=options.get("gqa", "head"), variant=options.get("variant", "cuboid-mean"),
               topp=_fraction("topp", options.get("topp")),
               adakv=_fraction("adakv floor", options.get("adakv")))

  @property
  def granularity(self) -> int:
    """Tokens per selected entry: the block size, or 1 for the token selectors."""
    return 1 if self.name in TOKEN_SELECTORS else self.block_size

  @property
  def digests(self) -> tuple[str, ...]:
    """The block digest kinds this selector reads (``cache.init_cache``): Quest's box,
    ArkVale's variant's (``scoring.ARKVALE_DIGESTS``), none for the token selectors."""
    if self.name not in BLOCK_SELECTORS:
      return ()
    return ("box",) if self.name == "quest" else scoring.ARKVALE_DIGESTS[self.variant]

  @property
  def group_shared(self) -> bool:
    """One selection per kv head (``gqa="group"``, StreamingLLM), not per query head."""
    return self.gqa == "group" or self.name == "streaming"

  def selection_heads(self, num_q_heads: int, num_kv_heads: int) -> int:
    """Heads of a selection: one list per kv head (group-shared) or per query head."""
    return num_kv_heads if self.group_shared else num_q_heads

  def check_context(self, context: int, spec: str):
    """Raises ValueError when a score-based selector would choose nothing by score at
    ``context`` tokens (it would silently be StreamingLLM)."""
    if self.name in SCORE_SELECTORS:
      self.budget.check(context, self.granularity, name=f"{spec!r}")

  def block_scores(self, q, cache, *, impl: Impl = "auto", interpret: bool = False):
    """Digest scores ``[B, H, NB]`` of the block selectors (Pallas ``block_score`` for Quest)."""
    missing = [k for k in self.digests if not cache.has_digests(k)]
    if missing:  # static shapes: a clear error instead of a broadcasting one
      raise ValueError(f"{self.name} reads the {missing} block digests, which this cache does "
                       "not keep: make it with the method's init_cache (or a Method with "
                       f"digests={self.digests!r})")
    qs = scoring.scoring_queries(q, cache.num_kv_heads, self.gqa)
    if self.name == "quest":
      return kernels.quest_scores(qs, cache, impl=impl, interpret=interpret)
    return scoring.arkvale_scores(qs, cache, self.variant)

  def select(self, q, cache, scale=None, *, impl: Impl = "auto", interpret: bool = False,
             windowed: bool = False) -> selection.Selection:
    """The selection of the current queries ``q [B, Hq, D]`` over ``cache``.

    ``windowed``: ``cache`` is a sliding-window view (``sliding_window.visible``), whose
    out-of-window blocks must not be chosen by their stale digests.
    """
    if self.name == "topk":
      return selection.topk(q, cache, self.budget, self.gqa, scale)
    if self.name == "streaming":
      return selection.streaming(q, cache, self.budget)
    scores = self.block_scores(q, cache, impl=impl, interpret=interpret)
    if windowed:
      scores = sliding_window.mask_block_scores(scores, cache)
    if self.topp is not None:
      return adaptive.topp(scores, cache, self.budget, self.topp, scale)
    if self.adakv is not None:
      return adaptive.adakv(scores, cache, self.budget, scale, floor=self.adakv)
    pick = functools.partial(kernels.top_ids, impl=impl, interpret=interpret)
    return selection.select_blocks(scores, cache, self.budget, pick)


def _fraction(name: str, value) -> float | None:
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float, str)):
    raise ValueError(f"{name} must be a number, got {value!r}")
  return float(value)
