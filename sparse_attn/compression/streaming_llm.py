"""StreamingLLM: attention sinks plus a recent window (Xiao et al., 2024).

"Efficient Streaming Language Models with Attention Sinks" (ICLR 2024), Sec. 3.2: keep the first
``n_sink`` tokens (default 4) and the most recent ones; everything in between is evicted. The
score of a slot is its token position (recent = high); the sinks are forced by the base class.
At decode time (``phase="decode"|"both"``, ``interval=1``) this is the rolling cache of the paper.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sparse_attn.compression.base import CompressionMethod, builder


@dataclasses.dataclass(frozen=True)
class StreamingLLM(CompressionMethod):
  """Sinks + recent window (Xiao et al. 2024, Sec. 3.2, Fig. 1d)."""

  name = "streaming_llm"
  DEFAULTS = {"n_sink": 4, "interval": 1}

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: the token position (the most recent tokens are kept)."""
    del state, scale, n
    return cache.pos.astype(jnp.float32)


build = builder(StreamingLLM)
