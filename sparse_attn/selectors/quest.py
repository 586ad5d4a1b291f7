"""Quest (Tang et al., ICML 2024): query-aware page selection by an upper bound.

Each page keeps the element-wise min and max of its keys (the ``"box"`` digest); a page's score
is the bound ``sum_d max(q_d kmin_d, q_d kmax_d) >= max_j q . k_j`` (Sec. 3.2, Eq. 1), computed
by the Pallas ``block_score`` kernel on a GPU (``kernels.quest_scores``). Group-shared
selection (``gqa="group"``, ReSA's sharing) on the Pallas path can score and select in one
kernel (``fused=True``: ``kernels.quest_select``, the same blocks, no scores in HBM); it is off
by default until a GPU measures it faster (its roofline predicts 8 programs streaming the
digests at batch 1, slower than the two kernels' ~264).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pallas_kernels import Impl
from sparse_attn import kernels, placement, selection
from sparse_attn.selectors.base import BlockSelector


@dataclasses.dataclass(frozen=True)
class Quest(BlockSelector):
  """Quest's page selection (see the module docstring).

  Attributes:
    fused: group-shared selection on one device through ``kernels.quest_select`` (one launch)
      where it runs; False (default, the measured path) keeps ``block_score`` then
      ``block_select`` (the GPU benchmark times both). Either picks the same blocks.
  """

  name: ClassVar[str] = "quest"
  fused: bool = False

  @property
  def digests(self) -> tuple[str, ...]:
    return ("box",)

  def block_scores(self, qs, cache, *, impl: Impl = "auto", interpret: bool = False):
    """Quest's bound ``[B, H, NB]`` (blocks past the context ``-inf``)."""
    return kernels.quest_scores(qs, cache, impl=impl, interpret=interpret)

  def scores(self, q, cache, *, impl: Impl = "auto", interpret: bool = False):
    """``BlockSelector.scores``; group-shared, the group's mean query is formed inside the
    scoring kernel (``kernels.quest_scores(pool=True)``), not by an XLA op before it."""
    if not self.group_shared:
      return super().scores(q, cache, impl=impl, interpret=interpret)
    self.check_digests(cache)
    return kernels.quest_scores(q, cache, impl=impl, interpret=interpret, pool=True)

  def select(self, q, cache, scale=None, *, impl: Impl = "auto", interpret: bool = False,
             windowed: bool = False, place=placement.ONE_DEVICE) -> selection.Selection:
    """``BlockSelector.select``; group-shared with the fixed budget rule on one device (no
    window, top-p or Ada-KV) first tries the one-kernel path (``kernels.quest_select``)."""
    if (self.fused and self.group_shared and not windowed and self.topp is None
        and self.adakv is None and type(place) is placement.OneDevice
        and cache.has_digests("box")):
      sel = kernels.quest_select(q, cache, self.budget, impl=impl, interpret=interpret)
      if sel is not None:
        return sel
    return super().select(q, cache, scale, impl=impl, interpret=interpret, windowed=windowed,
                          place=place)
