"""H2O: heavy hitters (accumulated attention) plus a recent window (Zhang et al., 2023).

"H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models"
(NeurIPS 2023), Sec. 3-4 and Alg. 1: the score of a key is the attention it has received,
summed over every query so far (prompt and generated); the cache keeps the heavy hitters and the
most recent tokens, half of the budget each in the paper's experiments (``recent_frac=0.5``).
With ``phase="decode"|"both"`` and ``interval=1`` it is the paper's greedy one-token-per-step
eviction.

The accumulated attention lives in the state, aligned with the cache slots (``acc [B, K, T]``,
the group's query heads averaged, Expected Attention Sec. 3's GQA rule) and compacted with them.
It is computed from each chunk's ``lse`` over blocks of queries (``observe.column_sums``), so the
full ``L x L`` attention matrix is never materialised.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sparse_attn.compression import compact, observe
from sparse_attn.compression.base import CompressionMethod


@dataclasses.dataclass(frozen=True)
class H2O(CompressionMethod):
  """H2O eviction (Zhang et al. 2023, Alg. 1).

  Attributes:
    recent_frac: fraction of the kept tokens reserved for the most recent ones.
    query_block: queries scored at a time when accumulating prefill attention.
  """

  recent_frac: float = 0.5
  query_block: int = 256

  name = "h2o"
  SIGNAL = "attention"  # accumulated attention
  DEFAULTS = {"interval": 1}

  def __post_init__(self):
    super().__post_init__()
    if not 0.0 <= self.recent_frac <= 1.0:
      raise ValueError(f"recent_frac must be in [0, 1], got {self.recent_frac}")
    if self.query_block < 1:
      raise ValueError(f"query_block must be >= 1, got {self.query_block}")

  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity):
    return {"acc": jnp.zeros((batch, num_kv_heads, capacity), jnp.float32)}

  def observe(self, q, cache, state, positions, lse, scale):
    """Adds the chunk's attention column sums (H2O Alg. 1's accumulated score)."""
    block = min(self.query_block, q.shape[2])
    acc = state["acc"] + observe.column_sums(q, positions, lse, cache.k, cache.pos, cache.valid,
                                             scale, block, softcap=self.softcap,
                                             window=self.sliding_window)
    return dict(state, acc=acc)

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: accumulated attention, ``+inf`` for the ``recent_frac * n`` newest."""
    del scale
    recent = jnp.floor(self.recent_frac * n.astype(jnp.float32)).astype(jnp.int32)
    newest = compact.rank_desc(jnp.where(cache.valid, cache.pos, -1).astype(jnp.float32))
    return jnp.where(newest < recent[:, None, None], jnp.inf, state["acc"])

  def compact_state(self, state, idx):
    return dict(state, acc=compact.gather_slots(state["acc"], idx))
