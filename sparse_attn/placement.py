"""Where a layer's cache lives during a decode step: whole on one device, or one shard of it.

The decode pipeline (``enhancers.compose``) is written once; the steps that differ when the
cache's slots are split over a mesh axis are the methods of a placement:

* ``view(cache)``: the cache as this device holds it; ``slots(positions)``: where the new
  tokens go in it (-1: another device's slot);
* ``store(cache, k, v, slots, positions)``: the write; ``share(old, new, slots, positions)``:
  RESA's running statistics after it, the same on every device;
* ``select_blocks(scores, cache, budget)``: the budget rule over block scores (one global top-k);
* ``merge(out, lse)`` and ``sum(x)``: exact combination of partial results over the devices;
  ``fused``: the RESA aggregator may run inside the attention kernel (nothing to merge first);
* ``finish(cache)``: the cache as the caller sees it; ``seq_axis``: the mesh axis (or None).

:class:`OneDevice` is the identity placement; ``context_parallel.SeqShards`` is the other.
"""

from __future__ import annotations

import dataclasses

from sparse_attn import kernels, selection
from sparse_attn.cache import write


@dataclasses.dataclass(frozen=True)
class OneDevice:
  """The whole cache on one device (or sharded under GSPMD, which needs nothing here)."""

  seq_axis = None
  fused = True

  def view(self, cache):
    return cache

  def slots(self, positions):
    return positions

  def store(self, cache, k, v, slots, positions, *, impl, interpret, after=()):
    del positions  # slot = position
    return write(cache, k, v, slots, impl=impl, interpret=interpret, after=after)

  def share(self, old, new, slots, positions):
    del old, slots, positions
    return new

  def select_blocks(self, scores, cache, budget, *, impl, interpret) -> selection.Selection:
    return kernels.select_blocks(scores, cache, budget, impl=impl, interpret=interpret)

  def merge(self, out, lse):
    return out, lse

  def sum(self, x):
    return x

  def finish(self, cache):
    return cache


ONE_DEVICE = OneDevice()
