"""ChunkKV: keep whole chunks of tokens, ranked by SnapKV's window votes (arXiv 2502.00299).

"ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference"
(Liu et al., 2025), Sec. 3.1 and Algorithm 1: the observation window's attention (SnapKV's
votes, ``snapkv``) scores every token; the prompt is cut into chunks of ``chunk_length``
consecutive tokens; a chunk's score is the mean over its tokens of the votes summed over the
layer's kv heads,

  s_c = 1/|c| sum_{i in c} sum_h A_h[i],

and the top chunks are kept, the same chunks for every head (the unit of selection is the
chunk, so a kept span reads as a phrase). With the question at the end of the prompt (the
query-aware protocol) the window is the question, so the chunks kept are the ones the
question attends.

As kvpress's ``ChunkKVPress(SnapKVPress(), chunk_length=20)`` (its leaderboard's entry):
chunks start at the first token, the last chunk is partial, and the window's own tokens score
the layer's largest vote + 1 (kvpress's padding of SnapKV's scores), so the chunks holding the
window come first. The paper's defaults: chunk size 10 and the window kept beside the chunks;
kvpress's (the default here): ``chunk_length = 20``, window 64, pooling kernel 5. The paper's
layer-wise index reuse is not implemented (every layer selects its own chunks).

Where kvpress keeps ``max(1, floor(C (1 - ratio)))`` whole chunks of ``C``, this keeps
``ceil((1 - ratio) L)`` tokens per head like every method here: the top chunks, and of the
chunk at the cut the tokens with the most votes. Selection happens at the end of the prompt
only (phase ``prefill``: the heads hold the same tokens there). Every head has the same
scores, so Ada-KV's ``head_budget="adakv"`` keeps the same tokens as the uniform rule.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sparse_attn.compression import chunks, observe, order
from sparse_attn.compression.decode_phase import Phase
from sparse_attn.compression.snapkv import SnapKV


@dataclasses.dataclass(frozen=True)
class ChunkKV(SnapKV):
  """ChunkKV eviction (Liu et al. 2025, Alg. 1) over SnapKV's votes.

  Attributes:
    chunk_length: tokens per chunk (kvpress's 20; the paper's 10).
  """

  chunk_length: int = 20

  name = "chunkkv"
  PANELS = ("query_aware",)  # kvpress runs it with the question compressed (catalog)

  def __post_init__(self):
    super().__post_init__()
    c = self.chunk_length
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
      raise ValueError(f"chunk_length must be an int >= 1, got {c!r}")
    if self.phase is not Phase.PREFILL:
      raise ValueError(f"chunkkv selects chunks of the prompt (phase='prefill'), got "
                       f"phase={self.phase!r}")

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: the chunk's score, ties (the chunk at the cut) by the token's layer
    votes; the same order in every head."""
    votes = super().scores(cache, state, scale, n)  # [B, K, T], +inf: the window
    filled = jnp.sum(observe.ring_filled(state["obs"]), axis=-1)  # [B]
    votes = votes / jnp.maximum(filled, 1)[:, None, None]  # kvpress's mean over the window
    idx, inv = order.position_order(cache.pos, cache.valid)
    v, valid = order.take(votes, idx), order.take(cache.valid, idx)
    finite = valid & jnp.isfinite(v)
    top = jnp.max(jnp.where(finite, v, -jnp.inf), axis=(1, 2), keepdims=True)  # [B, 1, 1]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    v = jnp.where(valid & ~finite, top + 1.0, jnp.where(valid, v, 0.0))
    layer = jnp.sum(v, axis=1, keepdims=True)  # [B, 1, T] heads aligned in token order
    rows = jnp.any(valid, axis=1, keepdims=True)
    score = chunks.tiered(chunks.chunk_means(layer, rows, self.chunk_length), layer)
    return order.take(jnp.broadcast_to(score, votes.shape), inv)
