"""The per-layer method interface every attention method implements (a ``typing.Protocol``).

Dense and the selector methods (``methods.Method``), the compression methods
(``compression.base.CompressionMethod``), experiment wrappers (``experiments.common.reuse``) and
the sharded wrapper (``models.sharding.ShardedMethod``) all implement it, so the decode loop
(``models.steps``, ``models.driver``) calls these and nothing else: no type or attribute probes.

Shapes (the letters of ``sparse_attn``'s package docstring): post-RoPE ``q [B, Hq, S, D]``,
``k, v [B, Hkv, S, D]``, token ``positions [B, S]`` (-1 = padding, never written). In
``decode`` ``S == window``.

Closed sets of option values are :class:`Choice` enums (string-valued, so a spec string's
``"adakv"`` and the member ``HeadBudget.ADAKV`` compare and hash alike), parsed once when a
method is built: a bad value is a ``ValueError`` naming the valid ones.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar, Protocol, runtime_checkable


class Choice(enum.StrEnum):
  """A closed set of string option values (``PrefillGroup``, ``compression.Phase``, ...)."""

  @classmethod
  def _missing_(cls, value):
    raise ValueError(f"{cls.__name__} must be one of {cls.values()}, got {value!r}")

  @classmethod
  def values(cls) -> tuple[str, ...]:
    """The valid values, in definition order."""
    return tuple(m.value for m in cls)

  @classmethod
  def parse(cls, value, option: str):
    """``value`` (a member or its string) as a member; ValueError naming ``option`` and the
    valid values otherwise."""
    try:
      return cls(value)
    except ValueError:
      raise ValueError(f"{option} must be one of {cls.values()}, got {value!r}") from None


class PrefillGroup(Choice):
  """Methods of one group (same block size and capacity) end the prompt with identical caches,
  so experiments may share one prefill among them (a method of no group has ``None``)."""

  DENSE = "dense"  # dense causal prefill into a block cache: ``methods.Method``
  COMPRESSION = "compression"  # dense prefill, then eviction: ``compression.CompressionMethod``


@runtime_checkable
class AttentionMethod(Protocol):
  """A decoding attention method: static configuration (hashable) with pure per-layer functions."""

  spec: str
  # Methods of one group end the prompt with identical caches (``PrefillGroup``); None = never
  # shared.
  prefill_group: ClassVar[PrefillGroup | None]

  @property
  def window(self) -> int:
    """Queries per head in a decode step (RetroAttention's window; 1 otherwise)."""

  @property
  def rect_interval(self) -> int:
    """Re-encode densely every this many generated tokens (0 = never; ReSA)."""

  @property
  def sliding_window(self) -> int | None:
    """The attention window the method masks to (Mistral), None = unlimited."""

  def with_sliding_window(self, window: int) -> "AttentionMethod":
    """This method under a sliding-window mask; raises NotImplementedError if it has none."""

  @property
  def softcap(self) -> float | None:
    """The attention-logit soft-cap its attention applies (Gemma 2), None = none."""

  def with_softcap(self, softcap: float) -> "AttentionMethod":
    """This method on a model that soft-caps its attention logits, ``cap * tanh(s / cap)``
    before the softmax (every attention path and every rule reading attention weights sees
    capped logits); raises NotImplementedError where the method cannot."""

  @property
  def budget(self) -> Any:
    """The selection budget rule (``sparse_attn.budget.Budget``), None where there is none."""

  def with_rope(self, inv_freq) -> "AttentionMethod":
    """This method given the model's ``[D/2]`` RoPE frequencies (unchanged if it needs none)."""

  def round_capacity(self, n: int) -> int:
    """The smallest valid cache capacity holding ``n`` tokens."""

  def decode_capacity(self, context: int, decode_room: int) -> int:
    """Cache slots while decoding a ``context``-token sequence whose last ``decode_room``
    tokens are generated (compression keeps part of the prompt)."""

  def memory_access(self, context: int | None = None) -> float:
    """KV read per decode step relative to dense attention at ``context`` tokens."""

  def check_context(self, context: int) -> None:
    """Raises ValueError when the method cannot work at ``context`` prompt tokens."""

  def attended_tokens(self, context: int, num_layers: int | None = None) -> dict | None:
    """Tokens attended per head at ``context`` tokens (``Budget.accounting``), None if n/a;
    with ``num_layers``, also their mean over the layers (``Budget.over_layers``)."""

  def init_cache(self, batch, num_kv_heads, capacity, head_dim, dtype=...) -> Any:
    """The empty layer cache."""

  def init_state(self, batch, num_q_heads, num_kv_heads, head_dim, capacity, dtype=...) -> Any:
    """The empty per-layer method state (a fixed-shape pytree)."""

  def prefill(self, q, k, v, cache, state, positions, *, scale=None):
    """Writes the chunk, attends densely and causally -> ``(out [B, Hq, S, D], cache, state)``."""

  def end_prefill(self, cache, state, *, scale=None):
    """After the prompt -> ``(cache, state)`` (compression may shrink the cache)."""

  def decode(self, q, k, v, cache, state, positions, *, scale=None):
    """Appends the window's K/V and attends -> ``(out [B, Hq, W, D], cache, state)``."""

  def extend(self, q, k, v, cache, state, positions, *, scale=None):
    """Reads a chunk after ``end_prefill`` (a query-agnostic question) in one pass, as ``S``
    decode steps would -> ``(out [B, Hq, S, D], cache, state)``; NotImplementedError where
    the method's decode state cannot follow a chunk."""

  def rectify(self, q, k, v, cache, state, positions, *, scale=None):
    """Dense re-encoding of recent tokens (same contract as ``prefill``)."""
