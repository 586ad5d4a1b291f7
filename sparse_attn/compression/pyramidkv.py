"""PyramidKV: SnapKV's scores with a budget that shrinks layer by layer (arXiv 2406.02069).

"PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling" (Cai et al.,
2024), Sec. 3.2: attention is spread in the lower layers and concentrates in the upper ones,
so the lower layers keep more tokens. The budgets form an arithmetic sequence from
``k_max`` at layer 0 to ``k_min = k_total / beta`` at the top (Eq. 3-4), with the same total
as a uniform budget; within a layer the tokens are SnapKV's (``snapkv``: the observation
window's pooled votes, the window kept).

As kvpress's ``PyramidKVPress`` (its leaderboard's ``pyramidkv``, KVCache-Factory's formula),
for ``L`` prompt tokens, window ``w``, ``r = ratio`` and ``N`` layers:

  k_min = L (1 - r) / beta,   k_max = 2 L (1 - r) - k_min,
  if k_max >= L - w:  k_max = L - w,  k_min = 2 L (1 - r) - k_max,
  budget(l) = round(k_max - l (k_max - k_min) / (N - 1)),

so the layers' mean is ``L (1 - r)``; when ``L >= k_max >= k_min >= w`` fails (a short prompt,
or ``k_min`` below the window) every layer keeps SnapKV's ``max(1, round(L (1 - r)))``.
Defaults: ``beta = 20``, window 64, kernel 5 (kvpress's and the paper's). kvpress always
compresses; the authors' code keeps a short prompt whole (not followed).

``for_layer(l, N)`` gives the layer's method (``models.steps.per_layer`` asks it for every
layer). Without a layer (a method used outside a model) it keeps ``ceil((1 - r) L)``, the
pyramid's mean. The layers share one compiled keep step (the layer is its traced operand,
``keep_program``); each layer's compacted buffer holds its own budget (the cache of a lower
layer is larger), so the compaction compiles once per distinct buffer size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sparse_attn.compression import compact as compact_lib
from sparse_attn.compression.snapkv import SnapKV


def layer_budget(n, ratio: float, window: int, beta: float, layer: int, num_layers: int):
  """PyramidKV's kept tokens of an ``n``-token prompt at ``layer`` (int, or int array on the
  array module of ``n``): kvpress's ``get_layer_budget`` (module docstring)."""
  xp = jnp if isinstance(n, jnp.ndarray) else np
  q = xp.asarray(n).astype(xp.float32 if xp is jnp else np.float64)
  total = q * (1 - ratio)
  k_min = total / beta
  k_max = 2 * total - k_min
  clamp = k_max >= q - window
  k_max = xp.where(clamp, q - window, k_max)
  k_min = xp.where(clamp, 2 * total - k_max, k_min)
  ok = (q >= k_max) & (k_max >= k_min) & (k_min >= window)
  step = (k_max - k_min) / (num_layers - 1) if num_layers > 1 else 0.0
  pyramid = xp.round(k_max - layer * step)
  out = xp.where(ok, pyramid, xp.maximum(1, xp.round(total))).astype(xp.int32)
  return int(out) if xp is np and np.ndim(out) == 0 else out


@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
  """PyramidKV eviction (Cai et al. 2024): SnapKV's scores, pyramidal layer budgets.

  Attributes:
    beta: the pyramid's steepness (``k_min = L (1 - r) / beta``).
    layer, num_layers: the layer this method compresses (``for_layer``; None: no pyramid).
  """

  beta: float = 20
  layer: int | None = None
  num_layers: int | None = None

  name = "pyramidkv"
  PANELS = ("query_agnostic",)  # kvpress's leaderboard runs it query-agnostic only

  def __post_init__(self):
    super().__post_init__()
    if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or self.beta < 1:
      raise ValueError(f"beta must be a number >= 1, got {self.beta!r}")
    if (self.layer is None) != (self.num_layers is None):
      raise ValueError("layer and num_layers are given together (for_layer), got "
                       f"layer={self.layer!r}, num_layers={self.num_layers!r}")
    # (a traced layer, ``with_keep_operand``'s, was checked as an int by ``for_layer``)
    traced = isinstance(self.layer, jax.Array)
    if self.layer is not None and not traced and not 0 <= self.layer < self.num_layers:
      raise ValueError(f"layer must be in [0, {self.num_layers}), got {self.layer}")

  def for_layer(self, layer: int, num_layers: int):
    return dataclasses.replace(self, layer=int(layer), num_layers=int(num_layers))

  def keep_program(self):
    """Layer 0's method with the layer as a traced operand: one keep program serves every
    layer (the layer enters only ``prompt_keep``'s arithmetic)."""
    if self.layer is None:
      return self, None
    return dataclasses.replace(self, layer=0), jnp.int32(self.layer)

  def with_keep_operand(self, operand):
    return self if operand is None else dataclasses.replace(self, layer=operand)

  def prompt_keep(self, n):
    """The layer's pyramid budget (``layer_budget``), never more than the ``n`` tokens;
    ``ceil((1 - ratio) n)`` without a layer or at ratio 0."""
    if self.layer is None or self.ratio == 0:
      return compact_lib.keep_count(n, self.ratio)
    kept = layer_budget(n, self.ratio, self.window_size, self.beta, self.layer,
                        self.num_layers)
    if isinstance(kept, jnp.ndarray):
      return jnp.minimum(kept, n)
    return min(kept, int(n))
