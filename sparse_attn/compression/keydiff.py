"""KeyDiff: keep the keys least similar to the mean key (Park et al., 2025).

"KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments", Sec. 3 (Eq. 4-5): with the anchor ``a`` the mean of the
normalised keys of a head, the score of key ``k_i`` is ``-cos(k_i, a)``; distinctive keys (far
from the anchor) are kept. Needs no queries.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sparse_attn.compression.base import CompressionMethod
from sparse_attn.compression.block_prompt import BlockPrompt


@dataclasses.dataclass(frozen=True)
class KeyDiff(BlockPrompt, CompressionMethod):
  """KeyDiff eviction (Park et al. 2025, Eq. 4-5): score ``-cos(k, mean normalised key)``."""

  name = "keydiff"
  SIGNAL = "keys"  # key cosine to the mean key

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: ``-cos(k_t, a)``, ``a`` the mean unit key of the head (Park et al., Eq. 5)."""
    del state, scale, n
    k = cache.k.astype(jnp.float32)
    valid = cache.valid[..., None]
    unit = k / jnp.maximum(jnp.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
    count = jnp.maximum(jnp.sum(valid, axis=2), 1)  # [B, K, 1]
    anchor = jnp.sum(jnp.where(valid, unit, 0.0), axis=2) / count  # [B, K, D]
    anchor = anchor / jnp.maximum(jnp.linalg.norm(anchor, axis=-1, keepdims=True), 1e-12)
    return -jnp.einsum("bktd,bkd->bkt", unit, anchor)
