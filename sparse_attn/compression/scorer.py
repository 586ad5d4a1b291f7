"""The scoring contract: what one compression method says, and all it says.

Letters: B batch, K kv heads, N query heads, S chunk length, T cache slots, D head dim.

A compression method (H2O, TOVA, SnapKV, KeyDiff, KNorm, StreamingLLM, Expected Attention) is
one scorer: it records what it needs of the queries that attended (``observe``), rates every
cached slot (``scores``), and carries its slot-aligned records along when the cache is
compacted (``compact_state``). Everything else is shared and composed around it, in the manner
of kvpress, where a scoring press only implements its score and the selection rule, the
head-adaptive allocation (``AdaKVPress``) and the decoding-time schedule (``DecodingPress``)
wrap it:

* which slots a budget keeps, per head or over the layer: ``head_budget.Uniform`` /
  ``head_budget.AdaKV`` around the scorer;
* how the prompt is cut and re-allocated at ``end_prefill``: ``prefill``;
* keeping the cache within a budget while generating: ``decode_phase.DecodePhase`` around the
  head-budget rule;
* the per-layer interface, which strings these together: ``base.CompressionMethod``.

``slot_scores`` is the contract the rules read: the method's ``scores`` with the attention
sinks (token position ``< n_sink``, StreamingLLM's) forced in and empty slots forced out.
"""

from __future__ import annotations

import jax.numpy as jnp

from sparse_attn import reference


class Scorer:
  """The hooks a compression method overrides (mixed into ``base.CompressionMethod``).

  Reads ``self.n_sink`` (leading token positions never evicted).
  """

  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity) -> dict:
    """Method-specific state (every leaf leads with the batch axis)."""
    del batch, num_q_heads, num_kv_heads, head_dim, capacity
    return {}

  def observe(self, q, cache, state, positions, lse, scale):
    """Records what scoring needs of the queries that just attended.

    Args:
      q: ``[B, N, S, D]`` post-RoPE queries; positions: ``[B, S]`` (-1 = padding).
      cache: the ``[B, K, T]`` rows they attended (a ``KVCache`` or ``flat.HeadsView``).
      state: the method's state; lse: ``[B, N, S]`` their log-sum-exp; scale: softmax scale.

    Returns:
      The updated state.
    """
    del q, cache, positions, lse, scale
    return state

  def scores(self, cache, state, scale, n):
    """``[B, K, T]`` float32 importance of every slot (higher = keep; ``+inf`` = forced).

    ``n [B]`` is the number of tokens per head about to be kept (H2O's recent window uses it).
    Every registered method overrides this; the base class only defines the contract.
    """
    raise TypeError(f"{type(self).__name__} does not define scores(); every compression "
                    "method must (see sparse_attn/compression/*.py)")

  def compact_state(self, state, idx):
    """Moves slot-aligned state along with a compaction ``idx [B, K, C]`` (old slot per slot)."""
    del idx
    return state

  def slot_scores(self, cache, state, scale, n):
    """``scores`` with the sinks forced in (``+inf``) and empty slots out (``-inf``).

    Args:
      cache: ``[B, K, T]`` rows (``pos``, ``valid``, ``k``, ``v``, ``head_dim``).
      state: the method's state; scale: softmax scale or None (``1/sqrt(D)``).
      n: ``[B]`` tokens per head about to be kept.

    Returns:
      ``[B, K, T]`` float32.
    """
    scale = reference.default_scale(cache.head_dim, scale)
    valid = cache.valid
    score = self.scores(cache, state, scale, n).astype(jnp.float32)
    score = jnp.where(valid & (cache.pos < self.n_sink), jnp.inf, score)
    return jnp.where(valid, score, -jnp.inf)
