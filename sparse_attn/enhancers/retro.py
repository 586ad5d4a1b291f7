"""RetroAttention: retrospective updates of the last ``w - 1`` attention outputs.

Choi et al., "Retrospective Sparse Attention for Efficient Long-Context Generation" (2025). At
step ``t`` a layer processes a window of ``w`` queries (positions ``t-w+1 .. t``): the newest with
its ordinary sparse attention over ``S_t``, and each past query ``t'`` with a supplementary
attention over the entries of ``S_t`` it has not seen yet, keys at positions ``<= t'`` only, merged
into its cached output by the log-sum-exp identity (Eq. 2, 6-9). Which entries a past query has
seen is tracked per selection head and entry by ``block_last_seen`` (Algorithm 2): ``t'`` has seen
entry ``e`` iff ``last_seen[e] >= t'`` (or its output was dense: prefill, rectification), because
every step stamps the entries it selected with its own position; the block of the current token
is stamped ``t - 1`` before the step, so earlier queries never revisit it.

Letters: B batch, N query heads, H selection heads, E entries (blocks, or slots for token-level
selectors), W = w - 1 cached steps, S window / chunk length, L gathered slots, D head dim.

State (fixed shapes):
  ``ring``: the output cache, indexed by ``position % W``: ``pos [B,W]`` (-1 empty), ``out
  [B,N,W,D]`` f32, ``lse [B,N,W]``, ``exposed [B,N,W]`` int32 (keys attended so far), ``full
  [B,W]`` (output was dense), and with RESA ``pout, plse, seen`` (prior partial over the seen keys);
  ``last_seen [B,H,E]`` int32; ``retired_pos [B]``, ``retired_exposed [B,N]``: the query that left
  the window at the last step and its final effective KV budget (Fig. 2c).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MAX_WINDOW = 8
EXPOSED_COUNTS = ("kernel", "xla")  # where the keys each window query attended are counted
NEG_INF = float("-inf")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RetroState:
  """RetroAttention's per-layer state.

  Attributes:
    ring: the output cache of the window's past queries, a dict of ``[B, (N,) w - 1, ...]``
      arrays keyed by entry field (``pos``, ``out``, ``lse``, ``exposed``, ``full``; with RESA
      also ``pout``, ``plse``, ``seen``): ``lookup`` / ``store`` read and write it.
    last_seen: ``[B, H, NE]`` the last step at which each entry was attended (-1 never).
    retired_pos, retired_exposed: ``[B]``, ``[B, N]`` the query that left the window at the
      last step and the keys it attended (``effective_budget``).
  """

  ring: dict
  last_seen: jax.Array
  retired_pos: jax.Array
  retired_exposed: jax.Array


def init_state(batch: int, num_q_heads: int, sel_heads: int, num_entries: int, w: int,
               head_dim: int, with_prior: bool) -> RetroState:
  """An empty retro state for window ``w >= 2``."""
  nw = w - 1
  bnw = (batch, num_q_heads, nw)
  ring = dict(pos=jnp.full((batch, nw), -1, jnp.int32), out=jnp.zeros(bnw + (head_dim,)),
              lse=jnp.full(bnw, NEG_INF), exposed=jnp.zeros(bnw, jnp.int32),
              full=jnp.zeros((batch, nw), bool))
  if with_prior:
    ring.update(pout=jnp.zeros(bnw + (head_dim,)), plse=jnp.full(bnw, NEG_INF),
                seen=jnp.zeros(bnw, jnp.int32))
  return RetroState(ring=ring,
                    last_seen=jnp.full((batch, sel_heads, num_entries), -1, jnp.int32),
                    retired_pos=jnp.full((batch,), -1, jnp.int32),
                    retired_exposed=jnp.zeros((batch, num_q_heads), jnp.int32))


def _take(x, idx):
  """``x [B, N, W, ...]`` or ``[B, W]`` read at ``idx [B, S]`` along the W axis."""
  if x.ndim == 2:
    return jnp.take_along_axis(x, idx, axis=1)
  i = idx[:, None, :].reshape(idx.shape[0], 1, idx.shape[1], *([1] * (x.ndim - 3)))
  return jnp.take_along_axis(x, i, axis=2)


def _empty_like(name, x):
  if name in ("lse", "plse"):
    return jnp.full_like(x, NEG_INF)
  return jnp.zeros_like(x)


def lookup(ring: dict, positions) -> dict:
  """Cached entries of ``positions [B,S]`` (empty entries where not cached), arrays ``[B,N,S,..]``."""
  nw = ring["pos"].shape[1]
  slot = jnp.where(positions >= 0, positions % nw, 0).astype(jnp.int32)
  found = (_take(ring["pos"], slot) == positions) & (positions >= 0)  # [B, S]
  out = {}
  for name, x in ring.items():
    if name == "pos":
      continue
    got = _take(x, slot)
    f = found if got.ndim == 2 else found.reshape(found.shape[0], 1, found.shape[1],
                                                  *([1] * (got.ndim - 3)))
    out[name] = jnp.where(f, got, _empty_like(name, got))
  return out


def store(ring: dict, positions, entries: dict) -> dict:
  """Stores the entries of the latest ``W`` of ``positions [B,S]`` (a window or a chunk).

  Ring slot ``s`` holds the largest position ``p <= max(positions)`` with ``p % W == s``; it is
  replaced when that position is among ``positions``, kept otherwise (chunks shorter than ``W``).
  """
  nw = ring["pos"].shape[1]
  t = jnp.max(positions, axis=-1)  # [B]
  want = t[:, None] - (t[:, None] - jnp.arange(nw)[None, :]) % nw  # [B, W]
  match = (positions[:, None, :] == want[:, :, None]) & (want[:, :, None] >= 0)  # [B, W, S]
  found = jnp.any(match, axis=-1)
  idx = jnp.argmax(match, axis=-1).astype(jnp.int32)
  new = {"pos": jnp.where(found, want, ring["pos"]).astype(jnp.int32)}
  for name, x in ring.items():
    if name == "pos":
      continue
    got = _take(entries[name], idx)
    f = found if got.ndim == 2 else found.reshape(found.shape[0], 1, nw, *([1] * (got.ndim - 3)))
    new[name] = jnp.where(f, got.astype(x.dtype), x)
  return new


def current_entry(t, granularity: int, num_entries: int):
  """``[B]`` the entry holding the current position ``t [B]`` (``num_entries`` where t < 0)."""
  return jnp.where(t >= 0, t // granularity, num_entries).astype(jnp.int32)


def entry_mask(last_seen, sel, positions, full, current):
  """``[B, H, w, n]`` bool: window query ``i`` may use listed entry ``j`` of ``sel``.

  The newest query (last) uses every listed entry; a past query ``t'`` only the entries with
  ``last_seen < t'``, and none when its cached output is dense (``full [B, w]``). The entry
  holding the current position (``current [B]``) reads as stamped ``t - 1`` already
  (Algorithm 2: earlier queries never revisit it); ``stamp`` writes that stamp.
  """
  w = positions.shape[1]
  t = positions[:, -1]
  ids = jnp.clip(sel.idx, 0, last_seen.shape[-1] - 1)  # [B, H, n]
  ls = jnp.take_along_axis(last_seen, ids, axis=-1)
  ls = jnp.where(ids == current[:, None, None], jnp.maximum(ls, (t - 1)[:, None, None]), ls)
  unseen = ls[:, :, None, :] < positions[:, None, :, None]  # [B, H, w, n]
  newest = (jnp.arange(w) == w - 1)[None, None, :, None]
  use = (unseen | newest) & ~full[:, None, :, None] & (positions >= 0)[:, None, :, None]
  return use


def stamp(last_seen, sel, t, current):
  """Algorithm 2's two updates of one step in one scatter: the current entry (``current [B]``)
  stamped ``t - 1`` and every valid entry of ``sel`` stamped with the step position ``t [B]``
  (a stamp never lowers an entry's value)."""
  b, h, ne = last_seen.shape
  n = sel.idx.shape[-1]
  ok = (jnp.arange(n)[None, None, :] < sel.n_valid[..., None]) & (t >= 0)[:, None, None]
  idx = jnp.concatenate([jnp.broadcast_to(current[:, None, None], (b, h, 1)),
                         jnp.where(ok, sel.idx, ne)], axis=-1)  # [B, H, n + 1]; ne: dropped
  val = jnp.concatenate([jnp.broadcast_to((t - 1)[:, None, None], (b, h, 1)),
                         jnp.broadcast_to(t[:, None, None], (b, h, n))], axis=-1)
  return last_seen.at[jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None], idx].max(
      val.astype(jnp.int32), mode="drop")


def effective_budget(state):
  """Fig. 2c: ``(retired_pos [B], retired_exposed [B,N])`` of the query that left the window at
  the last step (keys it attended, the union over its steps), and the ring's running counts
  ``(pos [B,W], exposed [B,N,W])``."""
  state = getattr(state, "retro", state)  # a method's layer state or its retro part
  ring = state.ring
  return (state.retired_pos, state.retired_exposed), (ring["pos"], ring["exposed"])
