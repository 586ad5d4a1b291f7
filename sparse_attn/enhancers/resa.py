"""RESA: residual estimation for the unselected keys of a sparse attention.

Yang et al., "RESA: Residual Estimation for Sparse Attention" (ICLR 2026). A sparse decode step
attends the selected set ``I`` exactly and replaces every unselected logit by a rank-1 estimate:

  * Prior Estimator (Sec. 4.2, Eq. 2), once at the end of prefill, per layer and query head:
    ``mu_Q`` = mean prompt query (or the last one, ``typical_query="last"``), ``mu_K`` = mean key,
    prior logits ``P_j = scale * mu_Q . k_j``, ``Z = sum_j e^{P_j}``, ``O_est = softmax(P) V``.
  * Online Aggregator (Eq. 3-5), every step: bias ``b = scale * (q - mu_Q) . mu_K``; unselected
    keys get the logit ``P_j + b`` (weighted by ``lam``), selected keys their true ``s_j``:
    ``out = [lam e^b (Z O_est - sum_I e^{P_j} v_j) + sum_I e^{s_j} v_j]
           / [lam e^b (Z - sum_I e^{P_j}) + sum_I e^{s_j}]``,
    in log space with max shifts and the unselected mass clamped at 0. Cost O(|I|).
    The printed Eq. 3-5 write the unselected logit as the prior ``P_j`` alone; we implement them
    with the prior logit plus the bias of Eq. 2, ``P_j + b``, as Sec. 4.2 and Appendix A.1
    (point 2) use it: the bias aligns the prior's mean logit with the true one "when merging with
    sparse attention", adjusted online through the query.

Letters: B batch, K kv heads, G query heads per kv head, N = K*G query heads, H selection heads,
R = N // H rows per selection head, S queries per head, T slots, L gathered slots, D head dim.

State (``ResaState``, a pytree of fixed-shape arrays, per layer):
  ``qsum [B,N,D]``, ``qcount [B]``, ``qlast [B,N,D]``, ``qlast_pos [B]``: prompt query statistics
  (accumulated over prefill chunks); ``mu_q [B,N,D]``; ``ksum [B,K,D]``, ``kcount [B,K]``: sum and
  count of the keys in the prior set (``mu_K = ksum / kcount``); ``prior [B,N,T]`` f32 ``P_j``
  (``-inf`` for slots outside the prior set); ``pmax, zsum [B,N]``, ``osum [B,N,D]``: ``Z`` and
  ``Z O_est`` as max-shifted running sums (``Z = e^pmax zsum``, ``O_est = osum / zsum``).

The prior set is the prompt's keys (``prior_update="prefill_only"``, the paper's setting) or every
key written so far (``"incremental"``). Overwriting a slot (rectification, retro re-embedding)
subtracts the old key's contribution and adds the new one, so ``P``, ``Z``, ``O_est`` and ``mu_K``
always describe exactly the keys now in the cache (up to f32 rounding of the running sums).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparse_attn import reference
from sparse_attn.cache import KVCache
from sparse_attn.ordering import after

TYPICAL_QUERIES = ("mean", "last")
PRIOR_UPDATES = ("prefill_only", "incremental")
LAM_FORMS = ("renormalised", "literal")
NEG_INF = float("-inf")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ResaState:
  """RESA's per-layer state (the module docstring gives each field's meaning and shape).

  ``head_log_lam``, ``head_beta``: optional per-query-head aggregator parameters
  ``[B, N]`` (``with_head_params``), None for the paper's scalar lambda.
  """

  qsum: jax.Array
  qcount: jax.Array
  qlast: jax.Array
  qlast_pos: jax.Array
  mu_q: jax.Array
  ksum: jax.Array
  kcount: jax.Array
  prior: jax.Array
  pmax: jax.Array
  zsum: jax.Array
  osum: jax.Array
  head_log_lam: jax.Array | None = None
  head_beta: jax.Array | None = None


def init_state(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
               capacity: int) -> ResaState:
  """An empty RESA state (no prompt seen, empty prior)."""
  f32 = jnp.float32
  bn, bnd = (batch, num_q_heads), (batch, num_q_heads, head_dim)
  return ResaState(
      qsum=jnp.zeros(bnd, f32), qcount=jnp.zeros((batch,), f32), qlast=jnp.zeros(bnd, f32),
      qlast_pos=jnp.full((batch,), -1, jnp.int32), mu_q=jnp.zeros(bnd, f32),
      ksum=jnp.zeros((batch, num_kv_heads, head_dim), f32),
      kcount=jnp.zeros((batch, num_kv_heads), jnp.int32),
      prior=jnp.full((batch, num_q_heads, capacity), NEG_INF, f32),
      pmax=jnp.zeros(bn, f32), zsum=jnp.zeros(bn, f32), osum=jnp.zeros(bnd, f32))


def accumulate_queries(state: ResaState, q, positions) -> ResaState:
  """Adds a prefill chunk's queries ``q [B,N,S,D]`` at ``positions [B,S]`` to the statistics."""
  ok = positions >= 0  # [B, S]
  qf = q.astype(jnp.float32)
  qsum = state.qsum + jnp.einsum("bnsd,bs->bnd", qf, ok.astype(jnp.float32))
  qcount = state.qcount + jnp.sum(ok, axis=-1).astype(jnp.float32)
  last = jnp.argmax(jnp.where(ok, positions, -1), axis=-1)  # [B]
  last_pos = jnp.max(jnp.where(ok, positions, -1), axis=-1)
  newer = last_pos > state.qlast_pos
  # [B, N, D]
  q_at = jnp.take_along_axis(qf, last[:, None, None, None], axis=2)[:, :, 0]
  qlast = jnp.where(newer[:, None, None], q_at, state.qlast)
  return dataclasses.replace(state, qsum=qsum, qcount=qcount, qlast=qlast,
                             qlast_pos=jnp.maximum(last_pos, state.qlast_pos))


def _prior_logits(mu_q, k, scale):
  """``scale * mu_q . k`` -> ``[B, N, T]`` f32 for ``mu_q [B,N,D]``, ``k [B,K,T,D]``."""
  b, n, d = mu_q.shape
  kh = k.shape[1]
  # [B, K, G, T]
  p = jnp.einsum("bkgd,bktd->bkgt", mu_q.reshape(b, kh, n // kh, d), k.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)
  return (p * scale).reshape(b, n, -1)


def form_prior(state: ResaState, cache: KVCache, scale: float, typical_query: str = "mean",
               seq_axis: str | None = None) -> ResaState:
  """The Prior Estimator (RESA Sec. 4.2, Eq. 2) over every valid key of the cache.

  ``seq_axis``: under ``shard_map`` with the cache's slots split over this mesh axis, the max
  shift, ``Z``, ``Z O_est`` and the key sum/count are reduced across the shards (``prior`` stays
  the local slots' logits).
  """
  pmax_all = (lambda x: x) if seq_axis is None else (lambda x: jax.lax.pmax(x, seq_axis))
  sum_all = (lambda x: x) if seq_axis is None else (lambda x: jax.lax.psum(x, seq_axis))
  if typical_query == "mean":
    mu_q = state.qsum / jnp.maximum(state.qcount, 1.0)[:, None, None]
  elif typical_query == "last":
    mu_q = state.qlast
  else:
    raise ValueError(f"typical_query must be one of {TYPICAL_QUERIES}, got {typical_query!r}")
  valid = cache.valid  # [B, K, T]
  b, n, _ = mu_q.shape
  g = n // cache.num_kv_heads
  vq = jnp.repeat(valid, g, axis=1)  # [B, N, T]
  prior = jnp.where(vq, _prior_logits(mu_q, cache.k, scale), NEG_INF)
  pmax = pmax_all(jnp.max(prior, axis=-1))
  pmax = jnp.where(jnp.isfinite(pmax), pmax, 0.0)
  w = jnp.exp(prior - pmax[..., None])  # [B, N, T], 0 outside the prior set
  vf = cache.v.astype(jnp.float32)
  osum = jnp.einsum("bkgt,bktd->bkgd", w.reshape(b, -1, g, w.shape[-1]), vf,
                    precision=jax.lax.Precision.HIGHEST).reshape(b, n, -1)
  ksum = jnp.einsum("bkt,bktd->bkd", valid.astype(jnp.float32), cache.k.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)
  kcount = jnp.sum(valid, axis=-1).astype(jnp.int32)
  return dataclasses.replace(state, mu_q=mu_q, prior=prior, pmax=pmax,
                             zsum=sum_all(jnp.sum(w, axis=-1)), osum=sum_all(osum),
                             ksum=sum_all(ksum), kcount=sum_all(kcount))


def update_prior(state: ResaState, cache: KVCache, k_new, v_new, positions, scale: float,
                 incremental: bool = True) -> ResaState:
  """Keeps the prior exact when keys are written at ``positions [B,S]`` (call before ``write``).

  ``cache`` is the cache *before* the write: an overwritten slot's old prior logit, value and key
  are subtracted from ``Z``, ``Z O_est`` and the key sum, the new key's are added. A new slot joins
  the prior set only when ``incremental``; an overwritten slot keeps its membership.
  """
  b, n, t = state.prior.shape
  kh = cache.num_kv_heads
  g = n // kh
  ok = (positions >= 0) & (positions < t)  # [B, S]
  slot = jnp.clip(positions, 0, t - 1).astype(jnp.int32)
  # [B, N, S]
  old_p = jnp.take_along_axis(state.prior, jnp.broadcast_to(slot[:, None], (b, n, slot.shape[1])),
                              axis=-1)
  old_in = jnp.isfinite(old_p) & ok[:, None]
  new_in = jnp.broadcast_to(ok[:, None], old_in.shape) if incremental else old_in
  # [B, N, S]: the new keys' prior logits (the new keys play the role of the slots)
  new_p = jnp.where(new_in, _prior_logits(state.mu_q, k_new, scale), NEG_INF)
  bi = jnp.arange(b)[:, None, None]
  ki = jnp.arange(kh)[None, :, None]
  si = slot[:, None, :]
  old_v = jnp.repeat(cache.v[bi, ki, si].astype(jnp.float32), g, axis=1)  # [B, N, S, D]
  old_k = cache.k[bi, ki, si].astype(jnp.float32)  # [B, K, S, D]
  new_v = jnp.repeat(v_new.astype(jnp.float32), g, axis=1)
  # Running max shift: rescale the sums when a new logit exceeds it.
  pmax = jnp.maximum(state.pmax, jnp.max(jnp.where(new_in, new_p, NEG_INF), axis=-1))
  pmax = jnp.where(jnp.isfinite(pmax), pmax, 0.0)
  rescale = jnp.exp(state.pmax - pmax)
  w_old = jnp.where(old_in, jnp.exp(old_p - pmax[..., None]), 0.0)  # [B, N, S]
  w_new = jnp.where(new_in, jnp.exp(new_p - pmax[..., None]), 0.0)
  zsum = state.zsum * rescale - jnp.sum(w_old, -1) + jnp.sum(w_new, -1)
  osum = (state.osum * rescale[..., None] - jnp.einsum("bns,bnsd->bnd", w_old, old_v)
          + jnp.einsum("bns,bnsd->bnd", w_new, new_v))
  old_in_k, new_in_k = old_in[:, ::g], new_in[:, ::g]  # membership is shared by a kv group
  ksum = (state.ksum - jnp.einsum("bks,bksd->bkd", old_in_k.astype(jnp.float32), old_k)
          + jnp.einsum("bks,bksd->bkd", new_in_k.astype(jnp.float32), k_new.astype(jnp.float32)))
  kcount = state.kcount - jnp.sum(old_in_k, -1) + jnp.sum(new_in_k, -1)
  ni = jnp.arange(n)[None, :, None]
  put = jnp.where(ok, slot, t)[:, None, :]
  prior = state.prior.at[jnp.arange(b)[:, None, None], ni, put].set(after(new_p, old_p),
                                                                       mode="drop")
  return dataclasses.replace(state, prior=prior, pmax=pmax, zsum=jnp.maximum(zsum, 0.0),
                             osum=osum, ksum=ksum, kcount=kcount.astype(jnp.int32))


def total(state: ResaState):
  """``(O_est [B,N,D], log Z [B,N])`` of the whole prior set (``0, -inf`` when it is empty)."""
  return _total(state.osum, state.zsum, state.pmax)


def _total(osum, zsum, pmax):
  """``total`` from the running sums (``[..., D]``, ``[...]``, ``[...]``), elementwise."""
  pos = zsum > 0
  o_est = jnp.where(pos[..., None], osum / jnp.where(pos, zsum, 1.0)[..., None], 0.0)
  return o_est, jnp.where(pos, pmax + jnp.log(jnp.where(pos, zsum, 1.0)), NEG_INF)


def mu_k(state: ResaState):
  """``[B, K, D]`` mean key of the prior set (0 when empty)."""
  return state.ksum / jnp.maximum(state.kcount, 1)[..., None].astype(jnp.float32)


def bias(state: ResaState, q, scale: float):
  """``b = scale * (q - mu_Q) . mu_K`` (RESA Eq. 4) for ``q [B,N,D]`` or ``[B,N,S,D]``."""
  mk = mu_k(state)
  b, n = q.shape[:2]
  g = n // mk.shape[1]
  mkn = jnp.repeat(mk, g, axis=1)  # [B, N, D]
  dq = q.astype(jnp.float32) - (state.mu_q if q.ndim == 3 else state.mu_q[:, :, None])
  if q.ndim == 3:
    return scale * jnp.einsum("bnd,bnd->bn", dq, mkn, precision=jax.lax.Precision.HIGHEST)
  return scale * jnp.einsum("bnsd,bnd->bns", dq, mkn, precision=jax.lax.Precision.HIGHEST)


def online_bias(state: ResaState, q, scale: float, form: str = "renormalised"):
  """The bias the aggregator adds to every unselected prior logit: Eq. 4's ``b``, or, with
  per-head parameters in the state (``with_head_params``), ``beta_h b + log lam_h``.

  Per-head parameters fold lambda into the residual's log-mass, which is the renormalised
  reading of lambda only; the literal form refuses them.
  """
  b = bias(state, q, scale)
  if state.head_log_lam is None:
    return b
  if form != "renormalised":
    raise ValueError("per-head lambda (head_log_lam) is the renormalised reading of lambda; "
                     f"this method uses lam_form={form!r}")
  expand = (lambda x: x) if q.ndim == 3 else (lambda x: x[..., None])
  beta = None if state.head_beta is None else expand(state.head_beta)
  return _head_bias(b, expand(state.head_log_lam), beta)


def _head_bias(b, log_lam, beta):
  """``beta b + log lam`` (``beta`` None: RESA's 1)."""
  return (b if beta is None else beta * b) + log_lam


def with_head_params(state: ResaState, log_lam, beta=None) -> ResaState:
  """A RESA state whose aggregator uses per-query-head ``log lam [N]`` (and bias slope
  ``beta [N]``, RESA's 1 when None): ``b' = beta_h b + log lam_h`` (``online_bias``).

  Beyond the paper, whose lambda is one number per task (Sec. 4.3, 5.4) that it names as its
  open limitation; ``experiments.resa_calibrate`` fits these per layer and head. The values
  are broadcast over the batch and kept through prefill, decode and rectification.
  """
  b, n = state.mu_q.shape[:2]
  put = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.float32), (b, n))
  return dataclasses.replace(state, head_log_lam=put(log_lam),
                             head_beta=state.head_beta if beta is None else put(beta))


def set_head_params(layer_states, log_lam, beta=None):
  """Every layer's ``with_head_params`` from ``log_lam [L, N]`` (and ``beta [L, N]``).

  ``layer_states``: a ``+resa`` method's states, one per layer (a list, the decode layout on a
  CPU) or stacked on a leading ``[L]`` axis; the same structure is returned.
  """
  stacked = not isinstance(layer_states, list)
  first = layer_states if stacked else (layer_states[0] if layer_states else None)
  if getattr(first, "resa", None) is None:
    raise ValueError("per-head RESA parameters need a +resa method's states (no resa part)")
  log_lam = jnp.asarray(log_lam, jnp.float32)
  beta = None if beta is None else jnp.asarray(beta, jnp.float32)
  n_layers = first.resa.mu_q.shape[0] if stacked else len(layer_states)
  if log_lam.ndim != 2 or log_lam.shape[0] != n_layers or (
      beta is not None and beta.shape != log_lam.shape):
    raise ValueError(f"log_lam (and beta) must be [L={n_layers}, N], got {log_lam.shape}"
                     + ("" if beta is None else f" and {beta.shape}"))
  if stacked:
    put = jax.vmap(lambda st, ll, bt=None: with_head_params(st, ll, bt))
    args = (layer_states.resa, log_lam) + (() if beta is None else (beta,))
    return dataclasses.replace(layer_states, resa=put(*args))
  return [dataclasses.replace(s, resa=with_head_params(s.resa, log_lam[i],
                                                       None if beta is None else beta[i]))
          for i, s in enumerate(layer_states)]


def prior_count(state: ResaState, num_q_heads: int):
  """``[B, N]`` int32 keys in the prior set, per query head."""
  return jnp.repeat(state.kcount, num_q_heads // state.kcount.shape[1], axis=1)


def aggregate(true, prior_seen, prior_total, b, lam: float, covered=None,
              form: str = "renormalised"):
  """RESA's Online Aggregator (Eq. 3-5) in log space.

  Two readings of lambda (Sec. 4.3, "we use alpha' = lam * alpha to replace the alpha in Eq 5"):
  ``"renormalised"`` scales the unselected mass by lam inside the normaliser,
  ``out = (lam W_r o_res + W_s o) / (lam W_r + W_s)``, so lam = 0 is exactly the selector alone
  (the paper's "degenerates to the vanilla SA"); ``"literal"`` scales alpha with beta unchanged,
  ``out = (lam W_r o_res + W_s o) / (W_r + W_s)``, equal at lam = 1 and ``beta * O_SA`` at 0.

  Args:
    true: ``(out [..., D], lse [...])`` exact attention over the seen set ``I``.
    prior_seen: ``(out, lse)`` of the prior logits over the same set (``sum_I e^{P_j} v_j``).
    prior_total: ``(O_est, log Z)`` over the whole prior set.
    b: ``[...]`` the bias ``scale (q - mu_Q) . mu_K``.
    lam: RESA's lambda, the weight of every unselected key (0 = the selector alone).
    covered: optional bool ``[...]``: ``I`` holds the whole prior set (no residual at all).
    form: ``"renormalised"`` or ``"literal"`` (above).

  Returns:
    ``(out [..., D] f32, lse [...] f32)``: the estimated full attention and its log-normaliser
    (with ``"literal"``, the lam = 1 normaliser).
  """
  if form not in LAM_FORMS:
    raise ValueError(f"form must be one of {LAM_FORMS}, got {form!r}")
  o, l = true[0].astype(jnp.float32), true[1]
  if lam == 0 and form == "renormalised":
    return o, l
  po, pl = prior_seen
  oe, lz = prior_total
  has_z = jnp.isfinite(lz)
  r = jnp.where(has_z & jnp.isfinite(pl), jnp.exp(pl - jnp.where(has_z, lz, 0.0)), 0.0)
  rem = 1.0 - r  # unselected fraction of the prior mass, clamped at 0 below
  live = has_z & (rem > 0)
  if covered is not None:
    live &= ~covered
  safe_rem = jnp.where(live, rem, 1.0)
  # Normalised residual output (Z O_est - sum_I e^P v) / (Z - sum_I e^P).
  o_res = (oe - r[..., None] * po) / safe_rem[..., None]
  # Residual log-mass; the renormalised form folds lam into it, the literal one keeps lam = 1
  # in the normaliser and scales only the residual's output weight.
  log_lam = jnp.log(lam) if form == "renormalised" and lam > 0 else 0.0
  l_res = jnp.where(live, lz + jnp.log(safe_rem) + b + log_lam, NEG_INF)
  m = jnp.maximum(l, l_res)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w_s = jnp.where(jnp.isfinite(l), jnp.exp(l - m), 0.0)
  w_r = jnp.where(live, jnp.exp(l_res - m), 0.0)
  den = w_s + w_r
  safe = jnp.where(den > 0, den, 1.0)
  w_out = w_r if form == "renormalised" else lam * w_r
  out = jnp.where((den > 0)[..., None],
                  (w_s[..., None] * o + w_out[..., None] * o_res) / safe[..., None], 0.0)
  return out, jnp.where(den > 0, m + jnp.log(safe), NEG_INF)


@dataclasses.dataclass(frozen=True)
class Aggregator:
  """``aggregate`` as the finishing step of the RESA decode op (hashable: a static argument).

  Called with the op's merged partials and its per-head inputs, on the rows of one kernel
  program inside the split combine (Pallas) or on whole arrays after the reference.
  """

  lam: float
  form: str = "renormalised"

  def __call__(self, true, prior_seen, seen, o_est, log_z, b, count):
    return aggregate(true, prior_seen, (o_est, log_z), b, self.lam, seen >= count, self.form)


@dataclasses.dataclass(frozen=True)
class StateAggregator:
  """``Aggregator`` that also computes its per-head inputs (``total``, ``online_bias``,
  ``prior_count``) from the state's rows (``aggregator_inputs``), elementwise, so the Pallas
  path does it inside the split combine's epilogue instead of in XLA ops before the kernel.

  ``scale``: the softmax scale of the bias (static, like ``lam``).
  """

  lam: float
  form: str = "renormalised"
  scale: float = 1.0

  def __call__(self, true, prior_seen, seen, osum, zsum, pmax, q, mu_q, ksum, count, *head):
    o_est, log_z = _total(osum, zsum, pmax)
    mu_k = ksum / jnp.maximum(count, 1)[..., None].astype(jnp.float32)  # as ``mu_k(state)``
    b = self.scale * jnp.sum((q.astype(jnp.float32) - mu_q) * mu_k, axis=-1)
    if head:  # per-head parameters: the renormalised reading only (``online_bias``)
      if self.form != "renormalised":
        raise ValueError("per-head lambda (head_log_lam) is the renormalised reading of "
                         f"lambda; this method uses lam_form={self.form!r}")
      b = _head_bias(b, head[0], head[1] if len(head) > 1 else None)
    return aggregate(true, prior_seen, (o_est, log_z), b, self.lam, seen >= count, self.form)


def aggregator_inputs(state: ResaState, q):
  """``StateAggregator``'s per-head inputs for ``q [B,N,D]``: the state's rows as they are
  (``osum [B,N,D]``, ``zsum, pmax [B,N]``, ``q``, ``mu_q``) and the kv heads' key sum and prior
  count repeated over their query heads (``[B,N,D]``, ``[B,N]``; the epilogue divides them
  into ``mu_K``), then the per-head parameters when set."""
  n = q.shape[1]
  g = n // state.kcount.shape[1]
  head = () if state.head_log_lam is None else (
      (state.head_log_lam,) + (() if state.head_beta is None else (state.head_beta,)))
  return (state.osum, state.zsum, state.pmax, q, state.mu_q,
          jnp.repeat(state.ksum, g, axis=1), prior_count(state, n)) + head
