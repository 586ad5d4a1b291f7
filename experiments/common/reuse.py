"""Top-k reuse baseline and adjacent-query selection overlap (RetroAttention, Table 4 / Fig. 2b).

``TrackedMethod`` wraps a plain selector (``quest``, ``arkvale``, ``topk``; no enhancers) and
keeps, per layer, the previous step's selection in its state:

* ``overlap [B, H]``: ``|S_t & S_{t-1}| / |S_t|`` of the fresh selection of this step against the
  previous one (entries: blocks, or tokens for ``topk``), i.e. how much adjacent queries share;
* with ``reuse_every = k > 0``, only every ``k``-th step selects afresh; the other steps attend
  the previous step's entries (plus the entry holding the new token), the "top-k reuse"
  baseline of Retro Table 4 (``k = 2``: reuse every other step).

Spec strings (``experiments.common.specs``): ``quest+track`` (overlap only) and
``quest+reuse`` / ``quest+reuse:every=3``. This lives with the experiments, not in
``sparse_attn.methods``, because it is a measurement baseline rather than a method to ship.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from sparse_attn import kernels, methods
from sparse_attn.cache import write
from sparse_attn.protocol import PrefillGroup
from sparse_attn.selection import Selection


@dataclasses.dataclass(frozen=True)
class TrackedMethod(methods.Method):
  """A plain selector that records selection overlap and can reuse the previous selection.

  Attributes:
    reuse_every: select afresh every ``reuse_every`` steps and reuse in between (0 = never).
  """

  reuse_every: int = 0
  prefill_group: ClassVar[PrefillGroup | None] = None  # its own state: never shares a prefill
  context_parallel: ClassVar[bool] = False  # its own decode: not the shared pipeline

  @classmethod
  def wrap(cls, base: methods.Method, spec: str, reuse_every: int = 0) -> "TrackedMethod":
    if (base.prefill_group != PrefillGroup.DENSE or base.is_dense or base.enhanced  # a plain Method
        or base.rect_interval):
      raise ValueError(f"+track/+reuse wrap a plain selector (quest, arkvale, topk), got "
                       f"{base.spec!r}")
    if reuse_every < 0:
      raise ValueError(f"reuse every must be >= 0, got {reuse_every}")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return cls(**{**fields, "spec": spec}, reuse_every=reuse_every)

  def init_state(self, batch, num_q_heads, num_kv_heads, head_dim, capacity, dtype=jnp.float32):
    del head_dim, dtype
    h = self.selection_heads(num_q_heads, num_kv_heads)
    ne = capacity // self.granularity
    n = min(self.budget.max_count(capacity, self.granularity), ne)
    return dict(idx=jnp.zeros((batch, h, n), jnp.int32), n_valid=jnp.zeros((batch, h), jnp.int32),
                mask=jnp.zeros((batch, h, ne), bool), step=jnp.zeros((batch,), jnp.int32),
                overlap=jnp.zeros((batch, h), jnp.float32))

  def decode(self, q, k, v, cache, state, positions, *, scale=None):
    """One decode step (window 1); see the module docstring. ``q [B, N, 1, D]``."""
    cache = write(cache, k.astype(cache.k.dtype), v.astype(cache.v.dtype), positions)
    fresh = self.select(q[:, :, 0], cache, scale)
    ne = state["mask"].shape[-1]
    mask = _entry_mask(fresh.idx, fresh.n_valid, ne)  # [B, H, E]
    shared = jnp.sum(mask & state["mask"], axis=-1)
    overlap = shared / jnp.maximum(jnp.sum(mask, axis=-1), 1)
    step = state["step"]
    if self.reuse_every > 0:
      reuse = (step > 0) & (step % self.reuse_every != 0)  # [B]
      idx, n_valid = _with_entry(state["idx"], state["n_valid"],
                                 positions[:, 0] // self.granularity)
      pick = reuse[:, None]
      idx = jnp.where(pick[..., None], idx, fresh.idx)
      n_valid = jnp.where(pick, n_valid, fresh.n_valid)
      sel = Selection(idx=idx, n_valid=n_valid, granularity=fresh.granularity)
    else:
      sel = fresh
    out, _ = kernels.sparse_decode(q[:, :, 0], cache, sel, scale, impl=self.impl,
                                   interpret=self.interpret, positions=positions[:, 0])
    state = dict(idx=sel.idx, n_valid=sel.n_valid,
                 mask=_entry_mask(sel.idx, sel.n_valid, ne) if self.reuse_every else mask,
                 step=step + 1, overlap=jnp.where((step > 0)[:, None], overlap, jnp.nan))
    return out[:, :, None].astype(q.dtype), cache, state


def _entry_mask(idx, n_valid, num_entries):
  """``[B, H, E]`` bool of the valid listed entries."""
  b, h, n = idx.shape
  ok = jnp.arange(n)[None, None, :] < n_valid[..., None]
  hit = jnp.zeros((b, h, num_entries + 1), bool)
  hit = hit.at[jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None],
               jnp.where(ok, idx, num_entries)].set(True)
  return hit[..., :num_entries]


def _with_entry(idx, n_valid, entry):
  """The list ``idx [B, H, n]`` with ``entry [B]`` appended where it is missing (and room)."""
  b, h, n = idx.shape
  ok = jnp.arange(n)[None, None, :] < n_valid[..., None]
  present = jnp.any(ok & (idx == entry[:, None, None]), axis=-1)  # [B, H]
  slot = jnp.where(present | (n_valid >= n), n, n_valid)
  idx = idx.at[jnp.arange(b)[:, None], jnp.arange(h)[None, :], slot].set(
      jnp.broadcast_to(entry[:, None], (b, h)).astype(idx.dtype), mode="drop")
  return idx, jnp.where(present, n_valid, jnp.minimum(n_valid + 1, n))
