"""Per-layer attention error of a sparse method vs dense on captured q/k/v (RESA Sec. 5.3).

Letters: L layers, N query heads, K kv heads, H selection heads, W decode window, T cache slots,
D head dim, n decode steps.

Protocol ("oracle inputs"): every layer sees the dense model's own post-RoPE q/k/v of a real
text (``capture``). The method prefills the first ``prefill_len`` tokens through its public
``prefill`` / ``end_prefill``, then decodes tokens ``prefill_len .. prefill_len + n - 1`` through
``decode`` (and ``rectify`` every ``rect_interval`` steps) exactly as the decode loop calls it.
Each step's output is compared with exact attention over the same cache. Errors do not
propagate between layers here (that is the end-to-end NLL's job), so ``+rect``, whose benefit
is replacing sparse-decoded K/V by dense ones, is a no-op under oracle inputs by construction.
RetroAttention's newest output is its selector's; its gain is in the window's past outputs, so
``out_rel_l2_retired`` measures the oldest window query after its ``w - 1`` updates.

Scores: a selector attends ``a_j = softmax_j(s_j)`` over its selected set ``I`` (0 elsewhere);
RESA (Eq. 3-5) gives every unselected prior key the logit ``P_j + b + log(lam)`` with
``P_j = scale mu_Q . k_j`` and ``b = scale (q - mu_Q) . mu_K``, so its implied distribution is
``softmax`` over ``s_j`` (selected) and ``P_j + b + log lam`` (unselected). ``a @ V`` equals the
method's output (tested), so score and output errors describe the same computation.

RESA with per-head parameters (``calibrate``) only changes how much weight the residual part
gets; each step is summarised by the selected part ``(o_sel, lse_sel)`` and the residual part
``(o_res, lse_res0 = logsumexp_{j not in I} P_j, b)`` so an output for any
``(log lambda, beta)`` is ``merge((o_sel, lse_sel), (o_res, lse_res0 + beta b + log lambda))``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.analysis import resa_decomposition as decomposition
from sparse_attn import reference
from sparse_attn.enhancers import resa as resa_lib

NEG_INF = float("-inf")


def scores_available(method) -> bool:
  """Whether the score distribution of ``method`` is defined here (one query per step)."""
  return not method.is_dense and method.window == 1


def selection_mask(method, q, cache, scale):
  """``[B, N, T]`` bool: slots the method's selector picks for ``q [B, N, D]``."""
  sel = method.select(q, cache, scale)
  m = sel.token_mask(cache.capacity)  # [B, H, T]
  n = q.shape[1]
  return jnp.repeat(m, n // m.shape[1], axis=1) & jnp.repeat(cache.valid, n // cache.num_kv_heads,
                                                             axis=1)


def _lse(x, axis=-1):
  m = jnp.max(x, axis=axis, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  s = jnp.sum(jnp.exp(x - m), axis=axis)
  return jnp.where(s > 0, jnp.log(jnp.where(s > 0, s, 1.0)) + m[..., 0], NEG_INF)


def _softmax(x):
  l = _lse(x)
  ok = jnp.isfinite(l)[..., None]
  return jnp.where(ok, jnp.exp(x - jnp.where(ok, l[..., None], 0.0)), 0.0)


def _weighted_v(logits, v, g):
  """``softmax(logits) @ v``: ``logits [B, N, T]``, ``v [B, K, T, D]`` -> ``[B, N, D]``."""
  return jnp.einsum("bnt,bntd->bnd", _softmax(logits), jnp.repeat(v, g, axis=1),
                    precision=jax.lax.Precision.HIGHEST)


def _dense_reference(q, out, cache, positions, scale):
  """Causal exact logits ``[B, N, T]`` (``-inf`` where invisible), visibility, output, error."""
  g = q.shape[1] // cache.num_kv_heads
  s = reference.logits(q[:, :, None], cache.k, scale)[:, :, 0]  # [B, N, T]
  vis = jnp.repeat(cache.valid & (cache.pos <= positions[:, None, None]), g, axis=1)
  s = jnp.where(vis, s, NEG_INF)
  o_true = _weighted_v(s, cache.v, g)
  err = jnp.linalg.norm(out - o_true, axis=-1) / jnp.maximum(jnp.linalg.norm(o_true, axis=-1),
                                                             1e-30)
  return s, vis, o_true, err


def retired_error(q, out, cache, positions, scale):
  """RetroAttention: error of the window's oldest output ``out [B, N, D]`` (final after its
  ``w - 1`` retrospective updates) vs exact attention at its ``positions [B]``."""
  return _dense_reference(q, out, cache, positions, scale)[3]


def step_metrics(method, q, out, cache, state, positions, scale):
  """Errors of one decode step of the newest query ``q [B, N, D]`` with output ``out``.

  Returns a dict of ``[B, N]`` arrays: ``out_rel_l2``, ``score_l1`` (``sum |a - a*|`` in
  [0, 2]), ``score_rel_l2`` (``||a - a*|| / ||a*||``), ``attended`` (fraction of the context
  the selector attends exactly), ``score_out_gap`` (``||a V - out|| / ||out||``: ~0 when the
  score model describes the method); score entries are NaN when ``scores_available`` is False.
  With RESA on, also the residual summary (``o_sel, lse_sel, o_res, lse_res0, bias``), the
  dense target ``o_dense`` and (when RESA's output is a merge: the renormalised lam form, or
  lam = 1) the split of its error into mass and value (``resa_decomposition.STEP_FIELDS``).
  """
  b, n, d = q.shape
  g = n // cache.num_kv_heads
  s, vis, o_true, err = _dense_reference(q, out, cache, positions, scale)
  a_true = _softmax(s)
  res = dict(out_rel_l2=err, o_dense=o_true)
  nan = jnp.full((b, n), jnp.nan, jnp.float32)
  if not scores_available(method):
    return {**res, "score_l1": nan, "score_rel_l2": nan, "attended": nan, "score_out_gap": nan}
  sel = selection_mask(method, q, cache, scale) & vis
  est = jnp.where(sel, s, NEG_INF)
  res["attended"] = jnp.sum(sel, -1) / jnp.maximum(jnp.sum(vis, -1), 1)
  if method.resa:
    st = state.resa
    bias = resa_lib.bias(st, q, scale)  # [B, N]
    unsel = vis & ~sel & jnp.isfinite(st.prior)
    prior_u = jnp.where(unsel, st.prior, NEG_INF)
    lam = method.resa.lam
    if lam > 0:
      est = jnp.where(unsel, prior_u + bias[..., None] + jnp.log(lam), est)
    res.update(o_sel=_weighted_v(jnp.where(sel, s, NEG_INF), cache.v, g),
               lse_sel=_lse(jnp.where(sel, s, NEG_INF)), o_res=_weighted_v(prior_u, cache.v, g),
               lse_res0=_lse(prior_u), bias=bias)
    if method.resa.lam_form == "renormalised" or lam == 1.0:  # RESA's output is then a merge
      rest = jnp.where(vis & ~sel, s, NEG_INF)  # the truth: dense over the unselected keys
      lse_est = res["lse_res0"] + bias + (jnp.log(lam) if lam > 0 else NEG_INF)
      res.update(decomposition.decompose(res["o_sel"], res["lse_sel"], res["o_res"], lse_est,
                                         _weighted_v(rest, cache.v, g), _lse(rest), o_true))
  a = _softmax(est)
  res["score_l1"] = jnp.sum(jnp.abs(a - a_true), -1)
  res["score_rel_l2"] = jnp.linalg.norm(a - a_true, axis=-1) / jnp.maximum(
      jnp.linalg.norm(a_true, axis=-1), 1e-30)
  o_scores = _weighted_v(est, cache.v, g)
  res["score_out_gap"] = jnp.linalg.norm(o_scores - out, axis=-1) / jnp.maximum(
      jnp.linalg.norm(out, axis=-1), 1e-30)
  return res


def merge_residual(o_sel, lse_sel, o_res, lse_res):
  """``merge`` of the selected and residual parts: ``[..., D]`` outputs, ``[...]`` lse."""
  m = jnp.maximum(lse_sel, lse_res)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  ws = jnp.where(jnp.isfinite(lse_sel), jnp.exp(lse_sel - m), 0.0)
  wr = jnp.where(jnp.isfinite(lse_res), jnp.exp(lse_res - m), 0.0)
  den = jnp.maximum(ws + wr, 1e-30)
  return (ws[..., None] * o_sel + wr[..., None] * o_res) / den[..., None]


# ---------------------------------------------------------------- the per-layer simulation


@functools.partial(jax.jit, static_argnames=("method", "scale"))
def _prefill(q, k, v, cache, state, positions, scale, *, method):
  """One prompt chunk for every layer (vmapped over the leading ``[L]`` axis)."""
  fn = lambda q, k, v, c, s: method.prefill(q, k, v, c, s, positions, scale=scale)[1:]
  return jax.vmap(fn)(q, k, v, cache, state)


@functools.partial(jax.jit, static_argnames=("method", "scale"))
def _end_prefill(cache, state, scale, *, method):
  return jax.vmap(lambda c, s: method.end_prefill(c, s, scale=scale))(cache, state)


@functools.partial(jax.jit, static_argnames=("method", "keep", "scale"))
def _decode_segment(q, k, v, cache, state, positions, scale, *, method, keep):
  """Scans decode steps: ``q [L, n, N, W, D]``, ``positions [n, W]`` -> metrics ``[n, L, N]``."""

  def one_layer(q, k, v, cache, state, pos):
    out, cache, state = method.decode(q[None], k[None], v[None], cache, state, pos[None],
                                      scale=scale)
    met = step_metrics(method, q[None, :, -1], out[:, :, -1].astype(jnp.float32), cache, state,
                       pos[None, -1], scale)
    if method.window > 1:
      met["out_rel_l2_retired"] = retired_error(q[None, :, 0], out[:, :, 0].astype(jnp.float32),
                                                cache, pos[None, 0], scale)
    return cache, state, {name: met[name][0] for name in keep if name in met}

  def body(carry, xs):
    cache, state = carry
    qs, ks, vs, pos = xs
    cache, state, met = jax.vmap(one_layer, in_axes=(0, 0, 0, 0, 0, None))(
        qs, ks, vs, cache, state, pos)
    return (cache, state), met

  xs = (jnp.moveaxis(q, 1, 0), jnp.moveaxis(k, 1, 0), jnp.moveaxis(v, 1, 0), positions)
  (cache, state), met = jax.lax.scan(body, (cache, state), xs)
  return cache, state, met


@functools.partial(jax.jit, static_argnames=("method", "scale"))
def _rectify(q, k, v, cache, state, positions, scale, *, method):
  fn = lambda q, k, v, c, s: method.rectify(q, k, v, c, s, positions, scale=scale)[1:]
  return jax.vmap(fn)(q, k, v, cache, state)


SUMMARY = ("out_rel_l2", "score_l1", "score_rel_l2", "attended", "score_out_gap",
           "out_rel_l2_retired") + decomposition.STEP_FIELDS
RESIDUAL = ("o_sel", "lse_sel", "o_res", "lse_res0", "bias", "o_dense")


def simulate(method, q, k, v, scale: float, prefill_len: int, steps: int, *,
             chunk: int = 256, residual: bool = False, progress=None) -> dict:
  """Runs ``method`` on every layer's captured q/k/v and measures each decode step.

  Args:
    method: a ``sparse_attn.methods.Method``.
    q: ``[L, N, S, D]``; k, v: ``[L, K, S, D]`` (``S >= prefill_len + steps``).
    scale: softmax scale.
    prefill_len: prompt tokens (prefilled densely, in chunks of ``chunk``).
    steps: decode steps measured.
    residual: also return RESA's per-step residual summary (RESA methods only).
    progress: optional object with ``update()``, called per prefill chunk and per segment.

  Returns:
    numpy dict of ``[L, n, N]`` arrays (``SUMMARY`` names; with ``residual`` also ``RESIDUAL``
    names, outputs ``[L, n, N, D]``).
  """
  nl, n, s, d = q.shape
  kh = k.shape[1]
  w = method.window
  if s < prefill_len + steps:
    raise ValueError(f"need {prefill_len + steps} captured tokens, got {s}")
  if prefill_len < w:
    raise ValueError(f"prefill_len {prefill_len} < decode window {w}")
  cap = method.round_capacity(prefill_len + steps)
  chunk = min(chunk, cap)
  stack = lambda a: jnp.repeat(jnp.asarray(a)[None], nl, axis=0)
  cache = jax.tree.map(stack, method.init_cache(1, kh, cap, d, jnp.float32))
  state = jax.tree.map(stack, method.init_state(1, n, kh, d, cap, jnp.float32))
  qj, kj, vj = (jnp.asarray(x, jnp.float32)[:, None] for x in (q, k, v))  # [L, 1, H, S, D]
  for start in range(0, prefill_len, chunk):
    idx = np.arange(start, start + chunk)
    pos = np.where(idx < prefill_len, idx, -1).astype(np.int32)
    take = np.minimum(idx, prefill_len - 1)
    cache, state = _prefill(qj[:, :, :, take], kj[:, :, :, take], vj[:, :, :, take], cache,
                            state, jnp.asarray(pos)[None], scale, method=method)
    if progress is not None:
      progress.update()
  cache, state = _end_prefill(cache, state, scale, method=method)
  keep = SUMMARY + (RESIDUAL if residual and method.resa else ())
  f = method.rect_interval
  seg = f if f else steps
  mets = []
  for t0 in range(prefill_len, prefill_len + steps, seg):
    m = min(seg, prefill_len + steps - t0)
    # [m, W] window positions (newest last)
    pos = (np.arange(t0, t0 + m)[:, None] + np.arange(1 - w, 1)[None]).astype(np.int32)
    # [L, m, N, W, D]
    pick = lambda x: jnp.moveaxis(x[:, 0][:, :, pos], 1, 2)
    cache, state, met = _decode_segment(pick(qj), pick(kj), pick(vj), cache, state,
                                        jnp.asarray(pos), scale, method=method, keep=keep)
    mets.append(met)
    if f and m == f:
      rpos = np.arange(t0 + m - f, t0 + m, dtype=np.int32)
      cache, state = _rectify(qj[:, :, :, rpos], kj[:, :, :, rpos], vj[:, :, :, rpos], cache,
                              state, jnp.asarray(rpos)[None], scale, method=method)
    if progress is not None:
      progress.update()
  # [n, L, N, ...] -> [L, n, N, ...]
  return {name: np.moveaxis(np.concatenate([np.asarray(x[name]) for x in mets], 0), 0, 1)
          for name in mets[0]}
