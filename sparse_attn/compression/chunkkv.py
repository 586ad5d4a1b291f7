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
kvpress's (the default here): ``chunk_length = 20``, window 64, pooling kernel 5.

Layer-wise index reuse (Sec. 3.3, Algorithm 2): the layers are taken in groups of
``reuse_layers`` consecutive ones; the first layer of a group (``l mod N_reuse = 0``) selects its
chunks and the others keep the same tokens, ``I_l = I_{N_reuse floor(l / N_reuse)}``, so only
``1 / N_reuse`` of the layers score the prompt (the paper's experiments: ``N_reuse = 2``, Table
8's +26.5% throughput at 8k, Table 9's accuracy within 0.6%). ``reuse_layers = 1`` (the
default, kvpress's, which has no reuse) selects in every layer. The leader's order (chunk score,
then its token votes) is handed to the followers by token position before any layer compacts
(``across_layers``, the ``cross_layer`` hook), so a follower keeps exactly the positions its
leader keeps.

Where kvpress keeps ``max(1, floor(C (1 - ratio)))`` whole chunks of ``C``, this keeps
``ceil((1 - ratio) L)`` tokens per head like every method here: the top chunks, and of the
chunk at the cut the tokens with the most votes. Selection happens at the end of the prompt
only (phase ``prefill``: the heads hold the same tokens there). Every head has the same
scores, so Ada-KV's ``head_budget="adakv"`` keeps the same tokens as the uniform rule.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from sparse_attn import reference
from sparse_attn.compression import chunks, observe, order, prefill as prefill_lib
from sparse_attn.compression.decode_phase import Phase
from sparse_attn.compression.snapkv import SnapKV


@dataclasses.dataclass(frozen=True)
class ChunkKV(SnapKV):
  """ChunkKV eviction (Liu et al. 2025, Alg. 1) over SnapKV's votes.

  Attributes:
    chunk_length: tokens per chunk (kvpress's 20; the paper's 10).
    reuse_layers: layers per group sharing the first one's chunks (Algorithm 2's
      ``N_reuse``; 1: none, kvpress's; the paper's runs: 2).
  """

  chunk_length: int = 20
  reuse_layers: int = 1

  name = "chunkkv"
  PANELS = ("query_aware",)  # kvpress runs it with the question compressed (catalog)

  def __post_init__(self):
    super().__post_init__()
    c = self.chunk_length
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
      raise ValueError(f"chunk_length must be an int >= 1, got {c!r}")
    r = self.reuse_layers
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
      raise ValueError(f"reuse_layers must be an int >= 1, got {r!r}")
    if self.phase is not Phase.PREFILL:
      raise ValueError(f"chunkkv selects chunks of the prompt (phase='prefill'), got "
                       f"phase={self.phase!r}")

  @property
  def crosses_layers(self) -> bool:
    return self.reuse_layers > 1

  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity):
    extra = super().init_extra(batch, num_q_heads, num_kv_heads, head_dim, capacity)
    if self.reuse_layers > 1:  # the group leader's order by slot, once ``across_layers`` ran
      extra["chunk_order"] = jnp.zeros((batch, capacity), jnp.float32)
      extra["chunk_reused"] = jnp.zeros((batch,), bool)
    return extra

  def across_layers(self, caches, states, scale=None):
    """Per-layer ``states`` with each group leader's order (``chunk_order [B, T]``) in every
    layer of its group, put at the slots holding the same positions (Algorithm 2); unchanged
    when ``reuse_layers == 1``. caches, states: per-layer lists at the end of the prompt."""
    if not (self.crosses_layers and self.compresses_prefill):
      return states
    if len({c.capacity for c in caches}) > 1:
      raise ValueError("chunkkv:reuse_layers>1 hands chunks between layers by token position "
                       "and needs every layer's prompt cache the same size, got "
                       f"{sorted({c.capacity for c in caches})}")
    out, by_position = [], None
    for layer, (cache, state) in enumerate(zip(caches, states, strict=True)):
      if layer % self.reuse_layers == 0:
        by_position = _leader_order(self, cache, state, scale)
      out.append(dict(state, chunk_order=_at_slots(by_position, cache),
                      chunk_reused=jnp.ones_like(state["chunk_reused"])))
    return out

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: the chunk's score, ties (the chunk at the cut) by the token's layer
    votes; the same order in every head. With ``reuse_layers > 1`` after ``across_layers``:
    the group leader's order (without that pass, as when a layer is compressed alone: its
    own)."""
    if self.reuse_layers == 1:
      return self._own_scores(cache, state, scale, n)
    leader = lambda: jnp.broadcast_to(state["chunk_order"][:, None], cache.valid.shape)
    return jax.lax.cond(jnp.all(state["chunk_reused"]), leader,
                        lambda: self._own_scores(cache, state, scale, n))

  def _own_scores(self, cache, state, scale, n):
    """This layer's chunk order (Algorithm 1), ``[B, K, T]``."""
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


@functools.partial(jax.jit, static_argnums=(0, 3))
def _leader_order(method: ChunkKV, cache, state, scale):
  """A group leader's own chunk order in token order, ``[B, 1, T]`` (every head has it)."""
  idx, _ = order.position_order(cache.pos, cache.valid)
  n = prefill_lib.prompt_tokens(cache)
  scale = reference.default_scale(cache.head_dim, scale)
  own = method._own_scores(cache, state, scale, n)  # pylint: disable=protected-access
  return order.take(own, idx)[:, :1]


@jax.jit
def _at_slots(by_position, cache):
  """``[B, T]``: an order in token order (``[B, 1, T]``) put at ``cache``'s slots."""
  _, inv = order.position_order(cache.pos, cache.valid)
  return order.take(jnp.broadcast_to(by_position, inv.shape), inv)[:, 0]
