"""FINCH: the question's attention over the prompt, normalised, kept per chunk (TACL 2024).

"FINCH: Prompt-guided Key-Value Cache Compression for Large Language Models" (Corallo &
Papotti, TACL 2024, arXiv 2409.00716), Sec. 3: the prompt is ``context + question``; the
question's queries attend the context and every context token is scored by the attention it
receives, each question query's weights normalised by the number of keys it sees (Eq. 2:
causal rows of different lengths weigh alike), averaged over the question's queries and a kv
head's query group; the context is read in chunks and each chunk keeps its top share, the
question's own tokens always kept.

As kvpress's ``FinchPress`` (its leaderboard's ``finch``, query-aware): the question is the
last ``question`` tokens of the prompt (kvpress finds it at a delimiter token; here it is the
state's ``question [B]``: in a model run the question's token count per sample, which the run
passes as ``question_length`` (``models.decode.prefill``; the accuracy harness's query-aware
protocol does) and ``layer_state`` puts in every layer's state; without one, ``window_size``),
a query at position ``p`` is
weighted by ``p`` (kvpress's count, one less than the ``p + 1`` keys it sees), the question's
tokens score the largest vote + 1 (kept first), and ``chunk_length`` (None: one chunk,
kvpress's default) cuts the whole prompt from its first token into chunks that keep
``ceil((1 - ratio) s)`` of their ``s`` tokens each (kvpress: ``max(1, floor(..))``).
The chunk quotas are a first tier: the head's top ``ceil((1 - ratio) L)`` takes every chunk's
share, then the best of the rest (or the best shares when the quotas sum to more).

The whole question is observed, as kvpress does: the ring buffers ``window_size`` queries (a
static size), so a run sizes it to its longest question first (``with_question_room``, through
``sparse_attn.layer_inputs.sized_for``: the accuracy harness over its samples, ``generate``
for its prompt), and a question longer than the ring is refused (``set_question_length``),
never cut to its last ``window_size`` tokens. RULER's questions with Qwen2.5's chat template
run 34-104 tokens at 4k and 8k (``niah_multikey_3``'s UUID keys 88-104, ``niah_multiquery``
63-79, the other ten tasks at most 61), so the harness's ring is 128 there.

Key re-rotation (``rerotate_keys``, on by default, as kvpress's ``FinchPress``; the authors'
implementation is kvpress's, and kvpress's ``KeyRerotationPress`` cites FINCH for it): after the
prompt is compacted, each kv head's kept keys are re-rotated to consecutive positions, so the
model reads the compressed prompt as a contiguous text. kvpress puts the kept keys at ``0 ..
n-1`` and continues at ``n``; here they end just before the next token's position
(``rope.rerotate_kept``), which gives every query the same distances, so the attention is the
same while positions and decode steps stay the library's. It needs the model's RoPE frequencies
(``with_rope``, ``rope_theta``): every model run gives them (``models.decode``,
``experiments.common.specs``); on bare arrays without them the keys keep their positions.
``rerotate_keys=False`` keeps the original positions, as every other method does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sparse_attn.compression import chunks, observe, order, rope
from sparse_attn.compression.base import CompressionMethod


QUESTION_ROUND = 64  # ring sizes from ``with_question_room``: multiples of this (few shapes)


def set_question_length(states, n):
  """Every layer's FINCH state with the question's length ``n`` (int or ``[B]``) tokens: the
  last ``n`` prompt tokens form the window.

  Raises:
    ValueError: a concrete ``n`` longer than the ring (``window_size``): it would observe only
      the question's last tokens (``FINCH.with_question_room`` sizes the ring first). A traced
      ``n`` (under jit) is not checked.
  """
  ring = (states[0] if isinstance(states, list) else states)["obs"]["buf"].shape[1]
  if not isinstance(n, jax.core.Tracer) and np.size(n) and int(np.max(n)) > ring:
    raise ValueError(
        f"FINCH observes at most window_size={ring} question tokens, but a question has "
        f"{int(np.max(n))}: size it first (sparse_attn.layer_inputs.sized_for(method, "
        f"{int(np.max(n))}), or finch:window_size=N with N >= the longest question)")

  def one(state):
    q = jnp.broadcast_to(jnp.asarray(n, jnp.int32), state["question"].shape)
    return dict(state, question=q)
  return [one(s) for s in states] if isinstance(states, list) else one(states)


@dataclasses.dataclass(frozen=True)
class FINCH(rope.RopeOptions, CompressionMethod):
  """FINCH eviction (Corallo & Papotti 2024), as kvpress's ``FinchPress``.

  Attributes:
    window_size: the most question tokens it buffers (the question's default length when the
      run does not give one; ``with_question_room`` raises it to a run's longest question).
    chunk_length: tokens per selection chunk (None: the whole prompt is one chunk).
    normalize_scores: weight each question query by its position (Eq. 2's normalisation).
    rerotate_keys: re-rotate the kept keys to consecutive positions after the compaction
      (module docstring; needs the model's RoPE).
    rope_theta, rope_inv_freq: the model's RoPE (``with_rope`` sets the frequencies).
  """

  window_size: int = 64
  chunk_length: int | None = None
  normalize_scores: bool = True
  rerotate_keys: bool = True

  name = "finch"
  SIGNAL = "attention"  # the question's attention
  PANELS = ("query_aware",)  # kvpress runs it with the question compressed (catalog)

  def __post_init__(self):
    super().__post_init__()
    if isinstance(self.window_size, bool) or not isinstance(self.window_size, int) or (
        self.window_size < 1):
      raise ValueError(f"window_size must be an int >= 1, got {self.window_size!r}")
    c = self.chunk_length
    if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
      raise ValueError(f"chunk_length must be None or an int >= 1, got {c!r}")
    for f in ("normalize_scores", "rerotate_keys"):
      if not isinstance(getattr(self, f), bool):
        raise ValueError(f"{f} must be a bool, got {getattr(self, f)!r}")
    if self.rerotate_keys and self.phase.at_decode:
      raise ValueError(f"finch re-rotates the kept keys once, after the prompt's compaction; "
                       f"phase={self.phase!s} compresses while decoding too: give "
                       "rerotate_keys=False")
    self._check_rope()

  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity):
    return {"obs": observe.init_ring(batch, num_q_heads, self.window_size, head_dim),
            "question": jnp.full((batch,), self.window_size, jnp.int32)}

  def with_question_room(self, n: int) -> "FINCH":
    """FINCH whose ring holds a question of ``n`` tokens (``window_size`` rounded up to a
    multiple of ``QUESTION_ROUND``; never smaller than it was)."""
    room = -(-int(n) // QUESTION_ROUND) * QUESTION_ROUND
    return self if room <= self.window_size else dataclasses.replace(self, window_size=room)

  def layer_state(self, state, layer: int, inputs=None):
    """The state with the run's question length (``sparse_attn.layer_inputs``), if known."""
    del layer
    if inputs is None or inputs.question_length is None:
      return state
    return set_question_length(state, inputs.question_length)

  def end_prefill(self, cache, state, *, scale=None):
    """Compacts the prompt (``CompressionMethod.end_prefill``), then re-rotates each head's kept
    keys to consecutive positions (``rerotate_keys`` with the model's RoPE known)."""
    cache, state = super().end_prefill(cache, state, scale=scale)
    inv = self.inv_freq(cache.head_dim)
    if not (self.rerotate_keys and self.compresses_prefill) or inv is None:
      return cache, state
    return rope.rerotate_kept(cache, state["next_pos"], inv), state

  def observe(self, q, cache, state, positions, lse, scale):
    return dict(state, obs=observe.ring_push(state["obs"], q, positions, positions >= 0))

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: the question's normalised attention (the question's tokens: the largest
    vote + 1); with ``chunk_length``, each chunk's share first (module docstring)."""
    del n
    ring = state["obs"]
    start = state["next_pos"] - state["question"]  # [B] (set_question_length: <= the ring)
    asks = observe.ring_filled(ring) & (ring["pos"] >= start[:, None])  # [B, W]
    p = observe.window_probs(ring["buf"], ring["pos"], asks, cache.k, cache.pos, cache.valid,
                             scale, self.softcap, self.sliding_window)  # [B, K, G, W, T]
    weight = ring["pos"].astype(jnp.float32) if self.normalize_scores else jnp.ones(
        ring["pos"].shape)
    votes = jnp.einsum("bkgwt,bw->bkt", p, jnp.where(asks, weight, 0.0)) / (
        p.shape[2] * jnp.maximum(jnp.sum(asks, axis=-1), 1)[:, None, None])
    question = cache.valid & (cache.pos >= start[:, None, None])
    votes = jnp.where(question | ~cache.valid, -jnp.inf, votes)
    top = jnp.max(votes, axis=(1, 2), keepdims=True)
    votes = jnp.where(question, jnp.where(jnp.isfinite(top), top, 0.0) + 1.0, votes)
    if self.chunk_length is None:
      return votes
    idx, inv = order.position_order(cache.pos, cache.valid)
    v, valid = order.take(votes, idx), order.take(cache.valid, idx)
    share = chunks.within_chunk_quota(v, valid, self.chunk_length, self.ratio)
    return order.take(chunks.tiered(share.astype(jnp.float32), v), inv)
