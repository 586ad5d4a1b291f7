"""Compression while generating: a head-budget rule kept to a token budget every few steps.

Letters: B batch, K kv heads, T slots.

``Phase`` says when a method compresses: once after the prompt (``prefill``), while generating
(``decode``) or both. The decode phase is a wrapper, as kvpress's ``DecodingPress`` wraps any
scoring press: given the method's head-budget rule (``head_budget.Uniform`` / ``AdaKV``, itself
around the method's scorer), :class:`DecodePhase` counts the tokens a row added since it was
last compressed (``state["since"] [B]``) and, once ``interval`` were added or its buffer is full,
cuts the row back to its budget (``state["budget"] [B]`` tokens per head, ``-1`` = none yet)
by the same rule and compacts it in place. Shapes stay static under jit: the buffer is sized
``budget + interval`` slots per head (``slots``) and a compression only moves slots.

The budget is ``max_tokens`` when given, else the prompt's kept count ``ceil((1 - ratio) L)``
(H2O, TOVA and StreamingLLM with ``interval=1`` are then the papers' one-token-per-step caches).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparse_attn.compression import compact as compact_lib
from sparse_attn.compression import head_budget, layout
from sparse_attn.protocol import Choice


class Phase(Choice):
  """When a compression method evicts (option ``phase``)."""

  PREFILL = "prefill"  # once, at end_prefill
  DECODE = "decode"  # keep the cache within a budget while generating
  BOTH = "both"

  @property
  def at_prefill(self) -> bool:
    return self is not Phase.DECODE

  @property
  def at_decode(self) -> bool:
    return self is not Phase.PREFILL


def token_budget(n, kept, max_tokens: int | None):
  """The decode-phase budget ``[B]`` in tokens per head.

  Args:
    n: ``[B]`` int32 prompt tokens per head.
    kept: ``[B]`` int32 tokens per head the prompt keeps, ``ceil((1 - ratio) n)``.
    max_tokens: static explicit budget, or None.

  ``kept`` is floored at 1 so an empty prompt row still keeps its newest token.
  """
  return jnp.full_like(n, max_tokens) if max_tokens is not None else jnp.maximum(kept, 1)


@dataclasses.dataclass(frozen=True)
class DecodePhase:
  """Keeps each row within its budget while decoding, by ``rule``'s choice.

  Attributes:
    rule: the head-budget rule around the method's scorer (``head_budget.Uniform``/``AdaKV``).
    interval: compress a row every this many added tokens (or when its buffer is full).
    max_tokens: the budget in tokens per head (None: the prompt's kept count).
  """

  rule: head_budget.Uniform | head_budget.AdaKV
  interval: int = 512
  max_tokens: int | None = None

  def static_budget(self, kept: int) -> int:
    """The budget of a prompt keeping ``kept`` tokens per head, as a Python int (sizing)."""
    return self.max_tokens if self.max_tokens is not None else kept

  def slots(self, kept: int, budget: int, heads: int) -> int:
    """Buffer slots: the larger of the kept prompt and the budget, plus ``interval`` appends.

    Args:
      kept: most slots the compacted prompt needs (per head, or the layer's for flat).
      budget: most tokens per head of the decode budget.
      heads: heads sharing one buffer (``layout.heads``: 1 or ``K``).
    """
    return max(kept, heads * budget) + heads * self.interval

  def start(self, state: dict, budget, per_head) -> dict:
    """Sets the counters after the prompt: ``budget [B]`` and the excess ``since [B]`` of the
    fullest head ``per_head [B]`` over it (so an over-budget row compresses soon)."""
    return dict(state, budget=budget.astype(jnp.int32),
                since=jnp.maximum(per_head - budget, 0).astype(jnp.int32))

  def maybe_compress(self, cache, state: dict, scale):
    """Compresses the rows that added ``interval`` tokens (or filled up) back to their budget.

    Args:
      cache: the layer cache after the step's append (either layout).
      state: the method's state with ``budget``, ``since`` ``[B]``.
      scale: softmax scale or None.

    Returns:
      ``(cache, state)``, the due rows compacted and their ``since`` reset, others unchanged.
    """
    lay = layout.of(cache)
    full = lay.full(cache)
    ceiling = lay.ceiling(cache.capacity, self.interval)
    due = (state["budget"] >= 0) & ((state["since"] >= self.interval) | full)

    def run(operands):
      c, s = operands
      n = jnp.maximum(s["budget"], 0)
      new, idx = lay.compact(c, self.rule.keep(lay.view(c), s, scale, n, ceiling))
      ns = dict(self.rule.scorer.compact_state(s, idx), since=jnp.zeros_like(s["since"]))
      return compact_lib.select_rows(due, new, c), compact_lib.select_rows(due, ns, s)

    return jax.lax.cond(jnp.any(due), run, lambda operands: operands, (cache, state))
