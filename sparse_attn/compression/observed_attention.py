"""Observed attention (kvpress's ``ObservedAttentionPress``, after H2O): a key's mean attention.

kvpress's ``ObservedAttentionPress`` (NVIDIA kvpress 0.5.5, ``presses/observed_attention_press
.py``; its leaderboard's ``observed_attention`` row), "related to H2O" (Zhang et al., NeurIPS
2023, arXiv 2306.14048). Over the prompt's causal attention ``A [N, L, L]`` (eager attention in
kvpress), the score of key ``j`` is

    s_j = mean_{g in group} (sum_i A[g, i, j]) / (L - j)

the attention it received summed over every query, divided by the number of queries that can
see it (``L - j`` for a causal prompt of ``L`` tokens), then averaged over the query heads of
its kv group; each kv head keeps its top ``(1 - ratio) L`` (kvpress's ``ScorerPress``). Where
H2O (Alg. 1, ``compression.h2o``) sums without dividing, so early keys, seen by more queries,
score higher, and reserves half of the budget for the most recent tokens, this score is a
mean and reserves nothing (``recent_frac = 0``; set it to reserve a recent share as H2O does).

The sums come from each prefill chunk's ``lse`` as for H2O (``observe.column_sums``) and the
counts from the chunk's query positions (``observe.column_counts``), both kept per cache slot in
the state, so the ``L x L`` matrix is never materialised, chunked prefills and ragged rows count
exactly, and on a sliding-window layer a key is divided by the queries whose window holds it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sparse_attn.compression import compact, observe
from sparse_attn.compression.h2o import H2O


@dataclasses.dataclass(frozen=True)
class ObservedAttention(H2O):
  """kvpress's observed attention (see the module docstring).

  Attributes:
    recent_frac: fraction of the kept tokens reserved for the most recent ones (kvpress: 0).
    query_block: queries scored at a time when summing prefill attention.
  """

  recent_frac: float = 0.0

  name = "observed_attention"

  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity):
    extra = super().init_extra(batch, num_q_heads, num_kv_heads, head_dim, capacity)
    return dict(extra, seen=jnp.zeros((batch, num_kv_heads, capacity), jnp.float32))

  def observe(self, q, cache, state, positions, lse, scale):
    """H2O's column sums, and how many of the chunk's queries saw each key."""
    state = super().observe(q, cache, state, positions, lse, scale)
    seen = state["seen"] + observe.column_counts(positions, cache.pos, cache.valid,
                                                 self.sliding_window)
    return dict(state, seen=seen)

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: summed attention / queries that saw the key (``+inf``: the recent share)."""
    mean = state["acc"] / jnp.maximum(state["seen"], 1.0)
    return super().scores(cache, dict(state, acc=mean), scale, n)

  def compact_state(self, state, idx):
    state = super().compact_state(state, idx)
    return dict(state, seen=compact.gather_slots(state["seen"], idx))
