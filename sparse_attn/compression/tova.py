"""TOVA: evict the token the current query attends least (Oren et al., 2024).

"Transformers are Multi-State RNNs" (EMNLP 2024), Sec. 3.3 (Token Omission Via Attention): when
the cache is over its budget, drop the key with the lowest attention weight of the current query.
At prefill (one shot) the current query is the last prompt token's; during decoding
(``phase="decode"|"both"``, ``interval=1``) one token is evicted per step. The state holds the
last query and its position (a one-slot ring), so the score is one softmax row, not a matrix.

Scores are per kv head (the group's query heads averaged, Expected Attention Sec. 3's GQA rule);
the paper averages over all heads of a layer, which ``head_budget="adakv"`` approaches.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sparse_attn.compression import observe
from sparse_attn.compression.base import CompressionMethod, builder


@dataclasses.dataclass(frozen=True)
class TOVA(CompressionMethod):
  """TOVA eviction (Oren et al. 2024, Sec. 3.3): score = the current query's attention."""

  name = "tova"
  DEFAULTS = {"interval": 1}

  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity):
    return {"last_q": observe.init_ring(batch, num_q_heads, 1, head_dim)}

  def observe(self, q, cache, state, positions, lse, scale):
    return dict(state, last_q=observe.ring_push(state["last_q"], q, positions, positions >= 0))

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: softmax of the last query over the cache, averaged over the group."""
    del n
    ring = state["last_q"]
    p = observe.window_probs(ring["buf"], ring["pos"], observe.ring_filled(ring), cache.k,
                             cache.pos, cache.valid, scale)  # [B, K, G, 1, T]
    return jnp.mean(p[:, :, :, 0], axis=2)


build = builder(TOVA)
