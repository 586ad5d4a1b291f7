"""DuoAttention on the fly: retrieval heads keep every token, streaming heads sinks + recent.

Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming
Heads" (arXiv 2410.10819), as kvpress's ``DuoAttentionPress(on_the_fly_scoring=True)`` (its
leaderboard's ``duo_attention_on_the_fly``) scores the heads without the paper's trained gates.
Letters: B batch, L layers, K kv heads, G group, N = K G query heads, P synthetic positions,
T slots, D head dim.

The paper splits the heads of a model into *retrieval* heads (full cache) and *streaming* heads
(``sink_size`` attention sinks + ``recent_size`` recent tokens, StreamingLLM's pattern), and
learns which is which by optimising a gate per head (Sec. 3.2). kvpress replaces the training by
a score from the model's mean pre-RoPE query ``q_h`` and key ``k_j`` of a calibration text
(per layer; ``j = h // G``): both repeated at ``P = 500`` positions and rotated there,

  w_h = softmax_i( <R_{P-1} q_h, R_i k_j> / sqrt(D) ),   i = 0 .. P-1
  s_h = (1/P) sum_p sum_{i <= p} w_{h,i} = sum_i w_{h,i} (P - i) / P,

the area under the last position's cumulative attention curve (high when the head looks far
back, low when it looks at its neighbours), averaged over the group (``s_j``) and over the
calibration samples. The ``round(L K ratio)`` lowest-scored (layer, kv head) pairs over *all*
layers stream; the others keep the whole prompt. So ``ratio`` is the fraction of heads that
stream (kvpress's ``head_compression_ratio``), and the tokens evicted are
``ratio (1 - (sink_size + recent_size) / n)`` of an ``n``-token prompt (kvpress's
``compression_ratio_``): not ``ceil((1 - ratio) n)`` per head, and the heads keep different
counts, so the compacted cache is Ada-KV's flat buffer (``flat``) with exactly the kept tokens.

Where the head scores come from (option ``calibration``):

* ``"text"``: a table ``[L][K]`` (``with_head_scores``;
  ``experiments.common.calibration.duo_head_scores`` computes it from the model and the offline
  Austen novels); each layer's state carries its streaming mask (``layer_state``, which the
  model's ``init_caches`` calls with the layer index). kvpress's protocol.
* ``"prompt"`` (the fallback without a table): the same score from the prompt's own mean
  pre-RoPE query and key of the layer, the ``round(K ratio)`` lowest heads of each layer
  streaming (a layer cannot see the others). No calibration pass, at the cost of the
  cross-layer ranking.

Defaults (kvpress's): ``n_sink = 128`` sinks, ``recent_size = 256``, ``P = 500``, prefill only
(kvpress masks the prompt once; every generated token is kept by every head).

Differences from kvpress, by design: the calibration text is the offline Austen novels
(kvpress samples 50 BookSum chapters, which cannot be downloaded here); kvpress masks the
evicted keys in attention, we drop them from a smaller buffer; ties in the head ranking keep
the lower (layer, head) index streaming (a stable sort; numpy's default sort in kvpress). Without
the model's RoPE (``with_rope``) the prompt fallback uses base 10,000.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from sparse_attn.compression import layout
from sparse_attn.compression.base import CompressionMethod
from sparse_attn.compression.head_budget import HeadBudget
from sparse_attn.compression.rope import RopeOptions, inverse_frequencies, rotate_by

CALIBRATIONS = ("text", "prompt")


def head_scores(q_mean, k_mean, inv_freq, num_positions: int = 500, scale=None):
  """``[..., K]`` on-the-fly DuoAttention scores (module docstring) of mean pre-RoPE queries
  ``q_mean [..., N, D]`` and keys ``k_mean [..., K, D]`` (jnp; float32)."""
  n, d = q_mean.shape[-2:]
  kh = k_mean.shape[-2]
  scale = d ** -0.5 if scale is None else scale
  p = num_positions
  # the last position's query against every position's key: the offset is all RoPE sees
  q = rotate_by(jnp.asarray(q_mean, jnp.float32)[..., None, :], jnp.asarray(p - 1), inv_freq)
  k = rotate_by(jnp.asarray(k_mean, jnp.float32)[..., None, :], jnp.arange(p), inv_freq)
  q = q.reshape(q.shape[:-3] + (kh, n // kh, d))  # [..., K, G, D]
  logits = jnp.einsum("...kgd,...kpd->...kgp", q, k) * scale  # [..., K, G, P]
  w = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
  w = w / jnp.sum(w, axis=-1, keepdims=True)
  area = jnp.sum(w * (p - jnp.arange(p)) / p, axis=-1)  # mean of the cumulative sum
  return jnp.mean(area, axis=-1)


def streaming_heads(table, ratio: float):
  """``[L, K]`` bool: the ``round(L K ratio)`` lowest of ``table [L, K]`` (numpy; stable)."""
  table = np.asarray(table, np.float64)
  n = round(table.size * ratio)
  mask = np.zeros(table.size, bool)
  mask[np.argsort(table, axis=None, kind="stable")[:n]] = True
  return mask.reshape(table.shape)


@dataclasses.dataclass(frozen=True)
class _StreamingRule:
  """The head-budget rule of DuoAttention: streaming heads keep their sinks and recent tokens,
  retrieval heads everything; the heads keep different counts (the flat layout)."""

  method: "DuoAttention"
  layout: ClassVar[layout.Flat] = layout.FLAT

  def keep(self, cache, state, scale, n, ceiling=None):
    """``[B, K, T]`` bool (``n``, ``ceiling``: unused; the pattern fixes the counts)."""
    del scale, n, ceiling
    m = self.method
    stream = m.streaming(cache, state)  # [B, K]
    last = jnp.max(jnp.where(cache.valid, cache.pos, -1), axis=(1, 2))  # [B]
    window = (cache.pos < m.n_sink) | (cache.pos > (last - m.recent_size)[:, None, None])
    return cache.valid & (~stream[:, :, None] | window)


@dataclasses.dataclass(frozen=True)
class DuoAttention(RopeOptions, CompressionMethod):
  """DuoAttention with on-the-fly head scores (arXiv 2410.10819; kvpress's on-the-fly press).

  Attributes:
    recent_size: recent prompt tokens a streaming head keeps (256); ``n_sink`` its sinks (128).
    num_positions: synthetic positions ``P`` of the score (500).
    calibration: ``"text"`` (a head-score table, ``with_head_scores``) or ``"prompt"``; None:
      ``"text"`` when a table is given, else ``"prompt"``.
    table: ``[L][K]`` nested tuple of the calibration text's head scores (static; hashable).
    rope_theta, rope_inv_freq: the model's RoPE (the prompt fallback's pre-RoPE statistics).
  """

  recent_size: int = 256
  num_positions: int = 500
  calibration: str | None = None
  table: tuple | None = None

  name = "duo_attention_on_the_fly"
  SIGNAL = "queries"  # a calibration text's mean query and key
  DEFAULTS = {"n_sink": 128}

  def __post_init__(self):
    super().__post_init__()
    self._check_rope()
    for field, lo in (("recent_size", 0), ("num_positions", 1)):
      val = getattr(self, field)
      if isinstance(val, bool) or not isinstance(val, int) or val < lo:
        raise ValueError(f"{field} must be an int >= {lo}, got {val!r}")
    if self.calibration is not None and self.calibration not in CALIBRATIONS:
      raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {self.calibration!r}")
    if self.table is not None:
      object.__setattr__(self, "table", _as_table(self.table))
    if self.source == "text" and self.table is None:
      raise ValueError("duo_attention_on_the_fly calibration='text' needs the head scores: "
                       "experiments.common.calibration.calibrate(method, model)")
    if self.head_budget is not HeadBudget.UNIFORM and self.ratio > 0:
      raise ValueError("duo_attention_on_the_fly fixes each head's count by its pattern "
                       "(retrieval: all, streaming: sinks + recent); head_budget is not used")
    if self.compresses_decode:
      raise ValueError("duo_attention_on_the_fly compresses the prompt only (phase='prefill'), "
                       "as kvpress's press")

  @property
  def source(self) -> str:
    return self.calibration or ("text" if self.table is not None else "prompt")

  def with_head_scores(self, table):
    """This method with the calibration text's head scores ``table [L, K]`` (spec unchanged)."""
    return dataclasses.replace(self, table=_as_table(table))

  @property
  def head_rule(self):
    return _StreamingRule(self)

  def prompt_keep(self, n):
    """The most tokens one head keeps: all ``n`` (a retrieval head); the buffer is sized from
    the measured counts (``prefill.capacity``)."""
    return n

  def memory_access(self, context: int | None = None) -> float:
    """Kept fraction of a ``context``-token prompt, ``1 - ratio (1 - (sinks + recent) / n)``."""
    if context is None:
      return 1.0 - self.ratio
    return 1.0 - self.ratio * max(0.0, 1.0 - (self.n_sink + self.recent_size) / context)

  def inv_freq(self, head_dim: int):
    got = super().inv_freq(head_dim)
    return inverse_frequencies(head_dim, 1e4) if got is None else got

  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity):
    if self.source == "text":
      return {"streaming": jnp.zeros((batch, num_kv_heads), bool)}
    return {"q_sum": jnp.zeros((batch, num_q_heads, head_dim), jnp.float32)}

  def layer_state(self, state, layer: int, inputs=None):
    """The state of layer ``layer``: its row of the streaming mask (``"text"``)."""
    del inputs  # the table is the method's (sparse_attn.layer_inputs)
    if self.source != "text":
      return state
    if not 0 <= layer < len(self.table):
      raise ValueError(f"the head-score table has {len(self.table)} layers, asked for {layer}")
    row = streaming_heads(self.table, self.ratio)[layer]
    if row.shape != state["streaming"].shape[1:]:
      raise ValueError(f"head-score rows have {row.shape[0]} kv heads, the layer has "
                       f"{state['streaming'].shape[1]}")
    return dict(state, streaming=jnp.broadcast_to(jnp.asarray(row), state["streaming"].shape))

  def observe(self, q, cache, state, positions, lse, scale):
    if self.source == "text":
      return state
    pre = rotate_by(q.astype(jnp.float32), -positions[:, None], self.inv_freq(q.shape[-1]))
    pre = jnp.where((positions >= 0)[:, None, :, None], pre, 0.0)
    return dict(state, q_sum=state["q_sum"] + jnp.sum(pre, axis=2))

  def streaming(self, cache, state):
    """``[B, K]`` bool: the layer's streaming heads (the table's, or the prompt's own)."""
    if self.source == "text":
      return state["streaming"]
    d = cache.head_dim
    inv_freq = self.inv_freq(d)
    valid = cache.valid[..., None]
    pre_k = jnp.where(valid, rotate_by(cache.k.astype(jnp.float32), -cache.pos, inv_freq), 0.0)
    count = jnp.maximum(jnp.sum(valid, axis=2), 1)  # [B, K, 1]
    k_mean = jnp.sum(pre_k, axis=2) / count  # [B, K, D]
    tokens = jnp.max(count, axis=(1, 2))  # [B]: each query head saw every prompt token
    q_mean = state["q_sum"] / tokens[:, None, None]
    score = head_scores(q_mean, k_mean, inv_freq, self.num_positions)  # [B, K]
    kh = score.shape[-1]
    rank = jnp.argsort(jnp.argsort(score, axis=-1, stable=True), axis=-1)
    return rank < round(kh * self.ratio)

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: ``+inf`` where the pattern keeps a slot, ``-inf`` elsewhere (for the
    generic scoring contract; the rule reads the pattern directly)."""
    del scale, n
    kept = _StreamingRule(self).keep(cache, state, None, None)
    return jnp.where(kept, jnp.inf, -jnp.inf)

  def compact_state(self, state, idx):
    del idx
    return state


def _as_table(table):
  arr = np.asarray(table, np.float64)
  if arr.ndim != 2:
    raise ValueError(f"the head-score table is [layers, kv heads], got shape {arr.shape}")
  return tuple(tuple(float(x) for x in row) for row in arr)
