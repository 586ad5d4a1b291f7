"""TOVA: evict the token the current query attends least (Oren et al., 2024).

"Transformers are Multi-State RNNs" (EMNLP 2024), Sec. 3.3 (Token Omission Via Attention): when
the cache is over its budget, drop the key with the lowest attention weight of the current query.
The policy is applied per layer with the attention weights averaged over all of the layer's
heads, so a layer keeps one set of tokens for every head (``scope="layer"``, the paper's; a
head-wise policy is the paper's ablation). ``scope="group"`` is the per-KV-group variant: the
attention of each kv head's query heads averaged (Expected Attention Sec. 3's GQA rule), one kept
set per kv head; it is the one that composes with Ada-KV's ``head_budget="adakv"``.

At prefill (one shot) the current query is the last prompt token's; during decoding
(``phase="decode"|"both"``, ``interval=1``) one token is evicted per step. The state holds the
last query and its position (a one-slot ring), so the score is one softmax row, not a matrix.

With ``scope="layer"`` every kv head holds the same tokens in the same slots (uniform top-``n``
of identical scores, ties broken alike, and decode appends at one slot for all heads), so the
head average is taken slot by slot.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sparse_attn.compression import observe
from sparse_attn.compression.base import CompressionMethod
from sparse_attn.compression.head_budget import HeadBudget

SCOPES = ("layer", "group")


@dataclasses.dataclass(frozen=True)
class TOVA(CompressionMethod):
  """TOVA eviction (Oren et al. 2024, Sec. 3.3): score = the current query's attention.

  Attributes:
    scope: ``"layer"`` (the paper's: one kept set per layer from the attention averaged over all
      heads) or ``"group"`` (one kept set per kv head from its query group's average attention).
  """

  scope: str = "layer"

  name = "tova"
  SIGNAL = "attention"  # the last query's attention
  DEFAULTS = {"interval": 1}

  def __post_init__(self):
    super().__post_init__()
    if self.scope not in SCOPES:
      raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
    if self.scope == "layer" and self.head_budget is not HeadBudget.UNIFORM:
      raise ValueError("tova scope='layer' keeps one token set for all heads; head_budget="
                       f"{self.head_budget!r} needs scope='group'")

  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity):
    return {"last_q": observe.init_ring(batch, num_q_heads, 1, head_dim)}

  def observe(self, q, cache, state, positions, lse, scale):
    return dict(state, last_q=observe.ring_push(state["last_q"], q, positions, positions >= 0))

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: the last query's softmax over the cache, averaged over the layer's heads
    (``scope="layer"``, the same row for every kv head) or over each kv head's group."""
    del n
    ring = state["last_q"]
    p = observe.window_probs(ring["buf"], ring["pos"], observe.ring_filled(ring), cache.k,
                             cache.pos, cache.valid, scale, self.softcap,
                             self.sliding_window)[:, :, :, 0]  # [B, K, G, T]
    if self.scope == "group":
      return jnp.mean(p, axis=2)
    layer = jnp.mean(p, axis=(1, 2), keepdims=True)[:, :, 0]  # [B, 1, T]
    return jnp.broadcast_to(layer, p.shape[:2] + p.shape[3:])
