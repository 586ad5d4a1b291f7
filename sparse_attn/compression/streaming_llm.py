"""StreamingLLM: attention sinks plus a recent window (Xiao et al., 2024).

"Efficient Streaming Language Models with Attention Sinks" (ICLR 2024), Sec. 3.2: keep the first
``n_sink`` tokens (default 4) and the most recent ones; everything in between is evicted. The
score of a slot is its token position (recent = high); the sinks are forced by the base class.
At decode time (``phase="decode"|"both"``, ``interval=1``) this is the rolling cache of the paper.

Positions (option ``positions``):
  * ``"original"`` (the default, as in the other compression methods of this library): keys keep
    the RoPE rotation of their original token position, so a query sees the true distance to
    every kept key.
  * ``"rolling"`` (the paper's, Sec. 3.2 "we focus on positions within the cache rather than
    those in the original text"): positions are re-indexed inside the cache, the ``i``-th kept key
    of a head attends as if at position ``i`` and the query at its own cache index. Keys are
    stored post-RoPE, so this re-rotates them by ``cache index - original position`` at attend
    time (RoPE rotations compose) and needs the model's RoPE frequencies (``rope_theta`` or
    ``rope_inv_freq``; ``experiments.common.specs.build`` passes the model's). Valid slots hold
    increasing positions (appends go to ``length``, compaction keeps slot order), so a key's
    cache index is the count of valid slots before it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sparse_attn.compression.base import CompressionMethod
from sparse_attn.compression.head_budget import HeadBudget
from sparse_attn.compression.rope import RopeOptions, contiguous_offsets, rotate_by

POSITION_MODES = ("original", "rolling")


@dataclasses.dataclass(frozen=True)
class StreamingLLM(RopeOptions, CompressionMethod):
  """Sinks + recent window (Xiao et al. 2024, Sec. 3.2, Fig. 1d).

  Attributes:
    positions: ``"original"`` (default) or ``"rolling"`` (the paper's cache-relative positions).
    rope_theta: RoPE base of the model (needed by ``"rolling"``).
    rope_inv_freq: ``D/2`` inverse frequencies (a tuple; scaled RoPE), instead of theta.
  """

  positions: str = "original"

  name = "streaming_llm"
  SIGNAL = "keys"  # position only
  DEFAULTS = {"n_sink": 4, "interval": 1}

  def __post_init__(self):
    super().__post_init__()
    if self.positions not in POSITION_MODES:
      raise ValueError(f"positions must be one of {POSITION_MODES}, got {self.positions!r}")
    if self.positions == "rolling" and self.head_budget is HeadBudget.ADAKV:
      raise ValueError("positions='rolling' re-indexes each head's cache: it needs "
                       "head_budget='uniform' (Ada-KV caches are flat, one buffer per layer)")
    self._check_rope()

  def inv_freq(self, head_dim: int) -> np.ndarray:
    inv = super().inv_freq(head_dim)
    if inv is None:
      raise ValueError("positions='rolling' re-rotates keys: give rope_theta or rope_inv_freq")
    return inv

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: the token position (the most recent tokens are kept)."""
    del state, scale, n
    return cache.pos.astype(jnp.float32)

  def _attend(self, q, cache, state, positions, scale):
    """``"rolling"``: attend with keys and queries at their cache indices (Sec. 3.2)."""
    if self.positions == "original":
      return super()._attend(q, cache, state, positions, scale)
    inv = self.inv_freq(cache.head_dim)
    valid = cache.valid  # [B, K, T]
    # each valid key at its cache index: consecutive, the last at (valid count) - 1
    k = rotate_by(cache.k, contiguous_offsets(cache.pos, valid, jnp.sum(
        valid, axis=-1, keepdims=True, dtype=jnp.int32)), inv)
    # [B, K, S]: the query's cache index = valid keys before its position
    q_index = jnp.sum(valid[:, :, None, :]
                      & (cache.pos[:, :, None, :] < positions[:, None, :, None]), axis=-1)
    g = q.shape[1] // cache.num_kv_heads
    qr = rotate_by(q, jnp.repeat(q_index - positions[:, None, :], g, axis=1), inv)
    return super()._attend(qr, dataclasses.replace(cache, k=k), state, positions, scale)
