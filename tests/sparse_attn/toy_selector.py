"""A selector added the way docs/architecture.md says: this one file and one registry line.

``Centroid`` scores a block by its queries' dot product with the block's key centroid (the
``"sphere"`` digest's ``kcen``): a toy, not a paper's method, chosen because it ranks blocks
otherwise than Quest, so a path that silently scored it as Quest (or ran dense) would show.
"""

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from sparse_attn import selectors


@selectors.register  # the registry line: "centroid" is now a spec name
@dataclasses.dataclass(frozen=True)
class Centroid(selectors.BlockSelector):
  """Blocks ranked by ``q . centroid`` (``qs [B, H, D]`` -> ``[B, H, NB]``)."""

  name: ClassVar[str] = "centroid"

  @property
  def digests(self) -> tuple[str, ...]:
    return ("sphere",)

  def block_scores(self, qs, cache, *, impl="auto", interpret=False):
    del impl, interpret
    b, h, d = qs.shape
    qg = qs.astype(jnp.float32).reshape(b, cache.num_kv_heads, h // cache.num_kv_heads, d)
    s = jnp.einsum("bkrd,bknd->bkrn", qg, cache.kcen.astype(jnp.float32))
    return s.reshape(b, h, -1)
