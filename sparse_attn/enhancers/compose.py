"""The per-layer pipeline of every ``methods.Method``: a selector with its optional enhancers.

One decode step is ``write -> select -> attend (kernels) -> RESA aggregate -> retro merge``; a
stage runs only when its enhancer config (``m.resa``, ``m.retro``) is set, and dense is the
pipeline without a selector. Each function has the contract of the matching ``Method`` method
(``sparse_attn.protocol``); ``decode`` and ``end_prefill`` also take a placement
(``sparse_attn.placement``): on one device the identity, under context parallelism one shard of
the cache (``context_parallel.SeqShards``), so the same pipeline runs on a shard's local cache
with the exact cross-shard merge. The functions read the method's configuration (selector,
enhancer options) and never call back into it. The state is a ``MethodState`` with an optional ``resa`` part
(``resa.ResaState``) and an optional ``retro`` part (``retro.RetroState``), both fixed-shape
pytrees; both are None for dense and a plain selector.

Letters: B batch, K kv heads, N query heads, H selection heads, S queries per head (the retro
window ``w`` in decode), T slots, D head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparse_attn import kernels, placement, reference, sliding_window, sparse
from sparse_attn.cache import KVCache
from sparse_attn.enhancers import resa, retro


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MethodState:
  """A ``methods.Method``'s per-layer state: its enhancers' parts (None when off)."""

  resa: resa.ResaState | None = None
  retro: retro.RetroState | None = None


def _typed(state):
  """``state``; an empty dict (the stateless methods' old spelling) is ``MethodState()``.

  The pipeline reads a part of the state only when the method's configuration says it has
  one (``m.resa``, ``m.window > 1``), so a subclass keeping a state of its own (an experiment
  wrapper with its own ``decode``) passes through prefill untouched.
  """
  return MethodState() if isinstance(state, dict) and not state else state


def init_state(m, batch, num_q_heads, num_kv_heads, head_dim, capacity) -> MethodState:
  return MethodState(
      resa=resa.init_state(batch, num_q_heads, num_kv_heads, head_dim, capacity)
      if m.resa else None,
      retro=retro.init_state(batch, num_q_heads, m.selection_heads(num_q_heads, num_kv_heads),
                             capacity // m.granularity, m.window, head_dim, m.resa)
      if m.window > 1 else None)


def _dense_entries(m, cache: KVCache, out, lse, positions):
  """Retro ring entries of dense outputs ``[B,N,S,..]`` (seen everything at or before them)."""
  n = out.shape[1]
  # [B, K, S]: keys at or before each query
  cnt = jnp.sum(cache.valid[:, :, None, :]
                & (cache.pos[:, :, None, :] <= positions[:, None, :, None]), axis=-1)
  exposed = jnp.repeat(cnt, n // cache.num_kv_heads, axis=1).astype(jnp.int32)
  e = dict(out=out.astype(jnp.float32), lse=lse, exposed=exposed, full=positions >= 0)
  if m.resa:
    e.update(pout=jnp.zeros_like(e["out"]), plse=jnp.full_like(lse, -jnp.inf),
             seen=jnp.zeros_like(exposed))
  return e


def _write(m, cache: KVCache, state, k, v, positions, scale, prior_formed: bool,
           place=placement.ONE_DEVICE):
  """Writes the new K/V where ``place`` keeps their slots; RESA's prior follows them."""
  k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
  cache, slots = place.view(cache), place.slots(positions)
  reads = ()
  if m.resa and prior_formed:
    st = state.resa
    incremental = m.resa.prior_update == "incremental"
    new = None
    if m.resa.fused and place is placement.ONE_DEVICE and k.shape[2] == 1:  # one launch
      new = kernels.resa_prior_update(st, cache, k[:, :, 0], v[:, :, 0], slots[:, 0], scale,
                                      incremental, impl=m.impl, interpret=m.interpret)
    launched = new is not None
    if not launched:
      new = resa.update_prior(st, cache, k, v, slots, scale, incremental)
    state = dataclasses.replace(state, resa=place.share(st, new, slots, positions))
    # The prior update read the overwritten slots: order that read before the write (the
    # kernel's outputs all come from its one launch: its smallest one orders it; an operand
    # of the cache write's kernel, or ``ordering.after`` on the rows where XLA writes).
    reads = (state.resa.kcount,) if launched else (state.resa.osum, state.resa.ksum)
  return place.store(cache, k, v, slots, positions, impl=m.impl, interpret=m.interpret,
                     after=reads), state


def _dense_pass(m, q, k, v, cache, state, positions, scale, prior_formed):
  scale = reference.default_scale(q.shape[-1], scale)
  cache, state = _write(m, cache, state, k, v, positions, scale, prior_formed)
  out, lse = kernels.dense_attention(q, cache, positions, scale, window=m.sliding_window,
                                     softcap=m.softcap, impl=m.impl, interpret=m.interpret)
  if m.window > 1:
    ring = retro.store(state.retro.ring, positions,
                       _dense_entries(m, cache, out, lse, positions))
    state = dataclasses.replace(state, retro=dataclasses.replace(state.retro, ring=ring))
  return out, cache, state


def prefill(m, q, k, v, cache, state, positions, scale=None):
  """Dense causal prefill; RESA accumulates the prompt's queries (chunk by chunk)."""
  state = _typed(state)
  if m.resa:
    state = dataclasses.replace(state, resa=resa.accumulate_queries(state.resa, q, positions))
  return _dense_pass(m, q, k, v, cache, state, positions, scale, prior_formed=False)


def end_prefill(m, cache, state, scale=None, place=placement.ONE_DEVICE):
  """RESA forms its prior (statistics reduced over ``place``'s devices); nothing else."""
  state = _typed(state)
  if m.resa:
    scale = reference.default_scale(cache.head_dim, scale)
    prior = resa.form_prior(state.resa, place.view(cache), scale, m.resa.typical_query,
                            seq_axis=place.seq_axis)
    state = dataclasses.replace(state, resa=prior)
  return cache, state


def rectify(m, q, k, v, cache, state, positions, scale=None):
  """ReSA dense rectification (Sun et al. 2025, Sec. 2.2): overwrite K/V, attend densely.

  The RESA prior follows the overwritten keys; the retro output cache takes the dense outputs
  (marked ``full``: nothing left to add retrospectively).
  """
  state = _typed(state)
  return _dense_pass(m, q, k, v, cache, state, positions, scale, prior_formed=True)


def select(m, q, cache, scale=None, place=placement.ONE_DEVICE):
  """The selector's choice for the current queries ``q [B, Hq, D]``."""
  return m.selector.select(q, cache, scale, impl=m.impl, interpret=m.interpret,
                           windowed=m.sliding_window is not None, place=place)


def attend(m, q, cache: KVCache, positions, scale=None, place=placement.ONE_DEVICE):
  """Decode attention of ``q [B, Hq, D]`` at ``positions [B]`` -> ``(out, lse)`` (no RESA);
  padding rows (position < 0) give 0."""
  impl = m.impl
  if m.sliding_window is not None:
    cache = sliding_window.visible(cache, positions, m.sliding_window)
    impl = "xla"  # the Pallas kernels bound keys by `length`, not by position
  if m.selector is None:
    return kernels.dense_decode(q, cache, positions, scale, impl=impl, interpret=m.interpret,
                                softcap=m.softcap)
  sel = select(m, q, cache, scale, place)
  # padding rows attend nothing inside the kernel (no masking op after it); merged across
  # devices their partials stay empty
  return place.merge(*kernels.sparse_decode(q, cache, sel, scale, impl=impl,
                                            interpret=m.interpret, softcap=m.softcap,
                                            positions=positions))


def decode(m, q, k, v, cache, state, positions, scale=None, place=placement.ONE_DEVICE):
  """One decode step over the window ``positions [B, w]`` (newest last)."""
  state = _typed(state)
  scale = reference.default_scale(q.shape[-1], scale)
  cache, state = _write(m, cache, state, k, v, positions, scale, prior_formed=True,
                        place=place)
  if m.window == 1:
    out = _single(m, q[:, :, 0], cache, state, positions[:, 0], scale, place)
    return out[:, :, None].astype(q.dtype), place.finish(cache), state
  out, state = _retro_step(m, q, cache, state, positions, scale)
  return out.astype(q.dtype), cache, state


def _single(m, q, cache, state, positions, scale, place):
  """Sparse attention of the newest query at ``positions [B]``, RESA-completed when on (RESA
  Eq. 3-5); padding rows (position < 0) return 0."""
  if not m.resa:
    return attend(m, q, cache, positions, scale, place)[0]
  sel = select(m, q, cache, scale, place)
  st = state.resa
  bias = lambda: resa.online_bias(st, q, scale, m.resa.lam_form)
  if place.fused:  # the aggregator (and its inputs: m.resa.fused) is the combine's epilogue
    agg, extras = (resa.StateAggregator(m.resa.lam, m.resa.lam_form, scale),
                   resa.aggregator_inputs(st, q)) if m.resa.fused else (
        resa.Aggregator(m.resa.lam, m.resa.lam_form),
        (*resa.total(st), bias(), resa.prior_count(st, q.shape[1])))
    # padding rows come out empty: the split combine applies it after the aggregator
    return kernels.resa_attend(q, cache, sel, st.prior, scale, agg, extras, impl=m.impl,
                               interpret=m.interpret, positions=positions)[0]
  # partials over this device's keys, merged, then aggregated
  true, prior_seen, seen = kernels.resa_partials(q, cache, sel, st.prior, scale, impl=m.impl,
                                                 interpret=m.interpret)
  covered = place.sum(seen) >= resa.prior_count(st, q.shape[1])
  out, lse = resa.aggregate(place.merge(*true), place.merge(*prior_seen), resa.total(st),
                            bias(), m.resa.lam, covered, m.resa.lam_form)
  return sparse.mask_rows(out, lse, positions)[0]


def _window_priors(st, cache: KVCache, positions):
  """Prior totals of each window query, excluding the window keys after it (causality).

  Returns ``(O_est [B,N,w,D], log Z [B,N,w], count [B,N,w])`` over the prior-set keys at or
  before each query (the window holds the only keys after a past query).
  """
  b, n, t = st.prior.shape
  w = positions.shape[1]
  g = n // cache.num_kv_heads
  slot = jnp.clip(positions, 0, t - 1)
  # [B, N, w]
  pw = jnp.take_along_axis(st.prior, jnp.broadcast_to(slot[:, None], (b, n, w)), axis=-1)
  pw = jnp.where((positions >= 0)[:, None], pw, -jnp.inf)
  bi, ki = jnp.arange(b)[:, None, None], jnp.arange(cache.num_kv_heads)[None, :, None]
  vw = jnp.repeat(cache.v[bi, ki, slot[:, None, :]].astype(jnp.float32), g, axis=1)
  ew = jnp.where(jnp.isfinite(pw), jnp.exp(pw - st.pmax[..., None]), 0.0)  # [B, N, w]
  after = jnp.arange(w)[None, :] > jnp.arange(w)[:, None]  # [i, j]: key j after query i
  zf = jnp.einsum("bnj,ij->bni", ew, after.astype(jnp.float32))
  of = jnp.einsum("bnj,bnjd,ij->bnid", ew, vw, after.astype(jnp.float32))
  cf = jnp.einsum("bnj,ij->bni", jnp.isfinite(pw).astype(jnp.int32), after.astype(jnp.int32))
  z = jnp.maximum(st.zsum[..., None] - zf, 0.0)
  pos = z > 0
  o_est = jnp.where(pos[..., None], (st.osum[:, :, None] - of)
                    / jnp.where(pos, z, 1.0)[..., None], 0.0)
  log_z = jnp.where(pos, st.pmax[..., None] + jnp.log(jnp.where(pos, z, 1.0)), -jnp.inf)
  count = resa.prior_count(st, n)[..., None] - cf
  return o_est, log_z, count


def _retro_step(m, q, cache, state, positions, scale):
  """RetroAttention (Choi et al. 2025, Eq. 2, 6-9, Algorithm 2) over the window of ``w`` queries."""
  rs = state.retro
  b, n, w, d = q.shape
  t = positions[:, -1]
  last_seen = rs.last_seen
  current = retro.current_entry(t, m.granularity, last_seen.shape[-1])
  sel = select(m, q[:, :, -1], cache, scale)
  cached = retro.lookup(rs.ring, positions[:, :-1])
  full = jnp.concatenate([cached["full"], jnp.zeros((b, 1), bool)], axis=1)  # [B, w]
  use = retro.entry_mask(last_seen, sel, positions, full, current)  # [B, H, w, n]
  st = state.resa
  pad = lambda x, fill=0: jnp.concatenate([x, jnp.full_like(x[:, :, :1], fill)], axis=2)
  # Past queries: the supplementary part merged into the cached output (Eq. 2), in the kernel's
  # split combine; the newest query has no cached part (-inf).
  carry = [(pad(cached["out"]), pad(cached["lse"], -jnp.inf))]
  if m.resa:
    carry.append((pad(cached["pout"]), pad(cached["plse"], -jnp.inf)))
  true, prior_part, seen, exposed = kernels.window_partials(
      q, cache, sel, use, positions, st.prior if m.resa else None, scale, impl=m.impl,
      interpret=m.interpret, softcap=m.softcap, exposed=m.retro.exposed, carry_in=carry)
  entries = dict(out=true[0], lse=true[1], exposed=exposed + pad(cached["exposed"]), full=full)
  out = true[0]
  if m.resa:
    seen = seen + pad(cached["seen"])
    entries.update(pout=prior_part[0], plse=prior_part[1], seen=seen)
    o_est, log_z, count = _window_priors(st, cache, positions)
    covered = full[:, None, :] | (seen >= count)
    b = resa.online_bias(st, q, scale, m.resa.lam_form)
    out, _ = resa.aggregate(true, prior_part, (o_est, log_z), b, m.resa.lam, covered,
                            m.resa.lam_form)
  out = jnp.where((positions >= 0)[:, None, :, None], out, 0.0)
  rs = retro.RetroState(ring=retro.store(rs.ring, positions, entries),
                        last_seen=retro.stamp(last_seen, sel, t, current),
                        retired_pos=positions[:, 0],
                        retired_exposed=entries["exposed"][:, :, 0])
  return out, dataclasses.replace(state, retro=rs)
