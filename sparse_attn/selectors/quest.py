"""Quest (Tang et al., ICML 2024): query-aware page selection by an upper bound.

Each page keeps the element-wise min and max of its keys (the ``"box"`` digest); a page's score
is the bound ``sum_d max(q_d kmin_d, q_d kmax_d) >= max_j q . k_j`` (Sec. 3.2, Eq. 1), computed
by the Pallas ``block_score`` kernel on a GPU (``kernels.quest_scores``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pallas_kernels import Impl
from sparse_attn import kernels
from sparse_attn.selectors.base import BlockSelector


@dataclasses.dataclass(frozen=True)
class Quest(BlockSelector):
  """Quest's page selection (see the module docstring)."""

  name: ClassVar[str] = "quest"

  @property
  def digests(self) -> tuple[str, ...]:
    return ("box",)

  def block_scores(self, qs, cache, *, impl: Impl = "auto", interpret: bool = False):
    """Quest's bound ``[B, H, NB]`` (blocks past the context ``-inf``)."""
    return kernels.quest_scores(qs, cache, impl=impl, interpret=interpret)
