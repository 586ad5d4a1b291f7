"""CriticalKV and CriticalAdaKV: scores re-weighted by what a value adds to the output.

"Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective" (Feng et
al., 2025, arXiv 2502.03805), Sec. 3-4: evicting entry ``i`` perturbs the attention output
by at most its attention weight times the norm of its projected value, so the critical entries
are ranked by ``A_i ||v_i W^O_h||_1`` (Theorem 1's bound) rather than by ``A_i`` alone. Since
the bound is loose, selection has two stages (Alg. 1): the top ``first_stage_ratio`` of the
budget by the base scores alone, then the rest of the budget by

  s'_i = (s_i + epsilon) * mean_{h in group} ||v_i W^O_h||_1,

``W^O_h [D, E]`` the rows of the output projection that read query head ``h``. Both are
wrappers around a scorer (here SnapKV's, kvpress's ``critical_snapkv``); CriticalAdaKV first
allocates the layer's budget over the heads by Ada-KV on the base scores (with its floor), then
runs the two stages inside each head's allocation. Defaults as kvpress's ``CriticalKVPress``
and ``CriticalAdaKVPress``: ``epsilon = 1e-4``, ``first_stage_ratio = 0.5``, ``floor = 0.2``.

The projection is the model's: in a model run, ``layer_state`` puts each layer's ``W^O`` (the
model's ``o_proj`` weights, ``sparse_attn.layer_inputs``) in its state at ``init_caches``;
by hand, ``set_out_proj(states, [w_o of each layer])``. It is held once per layer, ``out_proj
[N, D, E]`` in the weights' dtype with no batch axis (``models.sharding.STATE_AXES``: heads
over ``model``), and dropped at ``end_prefill`` unless a decode phase scores again (a prefill
-only press needs it once); ``||v_i W^O_h||_1`` is computed in float32 over tiles of
``NORM_TILE`` slots, so the ``[B, N, tile, E]`` projection never spans the whole prompt.
Without it (a method used outside a
model) the projection is the identity, ``||v_i||_1``: the same ranking only for an
orthogonal-by-head ``W^O`` up to scale. kvpress's stage-1 count is ``max(1, floor((1 - r) L f))``; here it is
``floor(n f)`` of the ``n = ceil((1 - r) L)`` kept.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparse_attn.compression import compact as compact_lib
from sparse_attn.compression import observe
from sparse_attn.compression import head_budget as head_budget_lib
from sparse_attn.compression.head_budget import HeadBudget
from sparse_attn.compression.snapkv import SnapKV


NORM_TILE = 512  # cache slots projected at a time by ``projected_norm``


def set_out_proj(states, out_proj):
  """Each layer's state with its output projection as ``out_proj [N, D, E]`` (given as
  ``[N, D, E]`` or ``[N D, E]``, a checkpoint's transposed ``o_proj``): one copy per layer in
  its own dtype, no batch axis (the copy is the state's: states are donated per step).

  Args:
    states: per-layer list of states (or one state); out_proj: the matching list (or one).
  """
  def one(state, wo):
    n = state["obs"]["buf"].shape[2]
    wo = jnp.array(wo, copy=True)
    return dict(state, out_proj=wo.reshape(n, -1, wo.shape[-1]))
  if isinstance(states, list):
    return [one(s, w) for s, w in zip(states, out_proj, strict=True)]
  return one(states, out_proj)


def projected_norm(cache, state):
  """``[B, K, T]``: ``||v_i W^O_h||_1`` averaged over each kv head's query heads (``||v_i||_1``
  without an ``out_proj`` in the state), in float32, ``NORM_TILE`` slots at a time."""
  v = cache.v  # [B, K, T, D]
  wo = state.get("out_proj")  # [N, D, E]
  if wo is None:
    return jnp.sum(jnp.abs(v.astype(jnp.float32)), axis=-1)
  b, k, t, d = v.shape
  n, _, e = wo.shape
  wo = wo.reshape(k, n // k, d, e).astype(jnp.float32)  # [K, G, D, E]

  def norm(vt):  # [B, K, t, D] -> [B, K, t]
    proj = jnp.einsum("bktd,kgde->bkgte", vt.astype(jnp.float32), wo)  # [B, K, G, t, E]
    return jnp.mean(jnp.sum(jnp.abs(proj), axis=-1), axis=2)

  if t <= NORM_TILE:
    return norm(v)
  nt = -(-t // NORM_TILE)
  vp = jnp.pad(v, ((0, 0), (0, 0), (0, nt * NORM_TILE - t), (0, 0)))
  # [nt, B, K, tile, D] -> [nt, B, K, tile]
  parts = jax.lax.map(norm, jnp.moveaxis(vp.reshape(b, k, nt, NORM_TILE, d), 2, 0))
  return jnp.moveaxis(parts, 0, 2).reshape(b, k, nt * NORM_TILE)[..., :t]


def two_stage(raw, valid, norm, first, epsilon: float):
  """Alg. 1: the top ``first [B, K | 1, 1]`` of ``raw [B, K, T]`` forced (``+inf``), the rest
  ``(raw + epsilon) * norm``; ``+inf`` (window, sinks) stays forced, empty slots ``-inf``."""
  raw = jnp.where(valid, raw, -jnp.inf)
  forced = (compact_lib.rank_desc(raw) < first) | (raw == jnp.inf)
  out = jnp.where(forced, jnp.inf, (jnp.where(forced, 0.0, raw) + epsilon) * norm)
  return jnp.where(valid, out, -jnp.inf)


@dataclasses.dataclass(frozen=True)
class _Critical(SnapKV):
  """The options both wrappers share (see the module docstring)."""

  epsilon: float = 1e-4
  first_stage_ratio: float = 0.5

  def __post_init__(self):
    super().__post_init__()
    if not 0.0 <= self.first_stage_ratio <= 1.0:
      raise ValueError(f"first_stage_ratio must be in [0, 1], got {self.first_stage_ratio}")
    if not self.epsilon >= 0:
      raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")

  def scores(self, cache, state, scale, n):
    """SnapKV's votes as kvpress scales them, the mean over the window's queries (``epsilon``
    is added to them, so their scale matters)."""
    votes = super().scores(cache, state, scale, n)
    filled = jnp.sum(observe.ring_filled(state["obs"]), axis=-1)  # [B]
    return votes / jnp.maximum(filled, 1)[:, None, None]

  def layer_state(self, state, layer: int, inputs=None):
    """The state with the layer's output projection (``sparse_attn.layer_inputs``), if given."""
    del layer
    if inputs is None or inputs.out_proj is None:
      return state
    return set_out_proj(state, inputs.out_proj)

  def compact_state(self, state, idx):
    """The state after ``end_prefill``: ``out_proj`` dropped unless a decode phase scores."""
    state = super().compact_state(state, idx)
    if self.decode_phase is None:
      state = {key: x for key, x in state.items() if key != "out_proj"}
    return state

  def stage_one(self, n):
    """Tokens chosen by the base scores alone out of a head's ``n`` (int array)."""
    return jnp.floor(n.astype(jnp.float32) * self.first_stage_ratio).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class CriticalKV(_Critical):
  """CriticalKV (Feng et al. 2025, Alg. 1) around SnapKV's scores; with
  ``head_budget="adakv"`` it is CriticalAdaKV (``CriticalAdaKVRule``)."""

  name = "criticalkv"

  @property
  def head_rule(self):
    if self.head_budget is HeadBudget.ADAKV:
      return CriticalAdaKVRule(self, self.floor)
    return head_budget_lib.Uniform(self)

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: the two stages' scores for a budget of ``n [B]`` per head (uniform);
    SnapKV's own under Ada-KV, whose rule runs the stages per head."""
    raw = super().scores(cache, state, scale, n)
    if self.head_budget is HeadBudget.ADAKV:
      return raw
    raw = jnp.where(cache.pos < self.n_sink, jnp.inf, raw)  # sinks count in stage one
    first = self.stage_one(n)[:, None, None]
    return two_stage(raw, cache.valid, projected_norm(cache, state), first, self.epsilon)


@dataclasses.dataclass(frozen=True)
class CriticalAdaKV(CriticalKV):
  """CriticalAdaKV (Feng et al. 2025): ``criticalkv`` with Ada-KV's allocation by default."""

  name = "criticaladakv"
  DEFAULTS = {"head_budget": "adakv"}


@dataclasses.dataclass(frozen=True)
class CriticalAdaKVRule(head_budget_lib.AdaKV):
  """Ada-KV's per-head counts from the base scores, then the two stages within each head."""

  def keep(self, cache, state, scale, n, ceiling: int | None = None):
    raw = self.scorer.slot_scores(cache, state, scale, n)  # SnapKV's, sinks in
    alloc = head_budget_lib.adakv_keep(raw, n.astype(jnp.int32), self.floor, ceiling)
    share = jnp.sum(alloc, axis=-1, keepdims=True, dtype=jnp.int32)  # [B, K, 1]
    score = two_stage(raw, cache.valid, projected_norm(cache, state),
                      self.scorer.stage_one(share), self.scorer.epsilon)
    return (compact_lib.rank_desc(score) < share) & cache.valid
