"""Token-level selectors: the oracle top-k and StreamingLLM's sinks + recent window.

Both choose single slots (granularity 1) and decode on one device.

* ``topk``: the exact logits ``q . k`` of every cached token, the best ``budget`` of them (the
  oracle that Quest, RESA and ReSA compare against; ``selection.topk``).
* ``streaming``: StreamingLLM (Xiao et al., ICLR 2024, Sec. 3.3) as a selector: the sink
  tokens and the most recent ones, one list per kv head (``selection.streaming``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pallas_kernels import Impl
from sparse_attn import placement, selection
from sparse_attn.selectors.base import Selector


@dataclasses.dataclass(frozen=True)
class TopK(Selector):
  """The oracle token top-k (see the module docstring)."""

  name: ClassVar[str] = "topk"
  token_level: ClassVar[bool] = True

  def select(self, q, cache, scale=None, *, impl: Impl = "auto", interpret: bool = False,
             windowed: bool = False, place=placement.ONE_DEVICE) -> selection.Selection:
    del impl, interpret, windowed, place  # a windowed view holds no out-of-window key
    return selection.topk(q, cache, self.budget, self.gqa, scale)


@dataclasses.dataclass(frozen=True)
class Streaming(Selector):
  """StreamingLLM's sinks + recent tokens (see the module docstring)."""

  name: ClassVar[str] = "streaming"
  token_level: ClassVar[bool] = True
  score_based: ClassVar[bool] = False

  @property
  def group_shared(self) -> bool:
    return True

  def select(self, q, cache, scale=None, *, impl: Impl = "auto", interpret: bool = False,
             windowed: bool = False, place=placement.ONE_DEVICE) -> selection.Selection:
    del scale, impl, interpret, windowed, place
    return selection.streaming(q, cache, self.budget)
