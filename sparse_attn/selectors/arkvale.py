"""ArkVale (Chen et al., NeurIPS 2024): pages scored by a bounding volume of their keys.

Sec. 5.2 estimates ``max_j q . k_j`` over a page from a digest; ``variant`` picks the volume
(``scoring.ARKVALE_VARIANTS``): ``cuboid-mean`` (default; the best of their Fig. 7 and the
digest of the authors' code), ``cuboid`` (the box: Quest's bound) or ``sphere``. The formulas
are in ``scoring.arkvale_scores``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from pallas_kernels import Impl
from sparse_attn import scoring
from sparse_attn.selectors.base import BlockSelector


@dataclasses.dataclass(frozen=True)
class ArkVale(BlockSelector):
  """ArkVale's page selection. ``variant``: its bounding volume (see the module docstring)."""

  variant: Literal["cuboid-mean", "cuboid", "sphere"] = "cuboid-mean"

  name: ClassVar[str] = "arkvale"

  def __post_init__(self):
    super().__post_init__()
    if self.variant not in scoring.ARKVALE_VARIANTS:
      raise ValueError(f"variant must be one of {scoring.ARKVALE_VARIANTS}, got "
                       f"{self.variant!r}")

  @property
  def digests(self) -> tuple[str, ...]:
    return scoring.ARKVALE_DIGESTS[self.variant]

  def block_scores(self, qs, cache, *, impl: Impl = "auto", interpret: bool = False):
    del impl, interpret  # no kernel: jnp at HIGHEST precision (scoring's docstring)
    return scoring.arkvale_scores(qs, cache, self.variant)
