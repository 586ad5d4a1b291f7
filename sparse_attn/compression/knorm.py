"""KNorm: keep the keys with the lowest L2 norm (Devoto et al., 2024).

"A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression" (EMNLP 2024), Sec. 3:
keys with a low norm receive high attention, so the score of a key is ``-||k||_2`` and the
``ceil((1 - ratio) L)`` lowest-norm keys of each kv head are kept. Needs no queries.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sparse_attn.compression.base import CompressionMethod
from sparse_attn.compression.block_prompt import BlockPrompt


@dataclasses.dataclass(frozen=True)
class KNorm(BlockPrompt, CompressionMethod):
  """KNorm eviction (Devoto et al. 2024, Sec. 3): score ``-||k||_2``."""

  name = "knorm"
  SIGNAL = "keys"  # key norms

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: ``-||k_t||_2`` (Devoto et al. 2024, Sec. 3)."""
    del state, scale, n
    return -jnp.linalg.norm(cache.k.astype(jnp.float32), axis=-1)
