"""Per-head RESA lambda calibration (beyond the paper: RESA names task-dependent lambda as its
open limitation).

Letters: L layers, N query heads, n decode steps, D head dim.

RESA's lambda only scales the residual part's mass: the output is
``merge((o_sel, lse_sel), (o_res, lse_res0 + b + log lambda))`` (``errors`` module), so a
per-head ``log lambda [L, N]`` is fitted with optax on the per-step residual summaries of a
calibration text, minimising the relative squared attention-output error vs dense. A per-head
additive bias would be the same parameter as ``log lambda``; the optional second parameter is
instead ``beta [L, N]``, the slope of RESA's online bias (``beta b``, the paper's ``beta = 1``).

``teacher_forced`` decodes a model with those per-head parameters (RESA's Online Aggregator
with ``b' = beta b + log lambda``, lambda folded in), for held-out NLL.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.analysis import errors
from models import decode
from sparse_attn.enhancers import resa as resa_lib


def residual_outputs(parts: dict, log_lam, beta):
  """Outputs ``[L, n, N, D]`` for per-head ``log_lam, beta [L, N]`` from ``simulate`` parts."""
  lse_res = parts["lse_res0"] + beta[:, None] * parts["bias"] + log_lam[:, None]
  return errors.merge_residual(parts["o_sel"], parts["lse_sel"], parts["o_res"], lse_res)


def output_error(parts: dict, log_lam, beta):
  """Mean relative squared output error ``||o - o*||^2 / ||o*||^2`` over layers, steps, heads."""
  o = residual_outputs(parts, log_lam, beta)
  ref = parts["o_dense"]
  num = jnp.sum(jnp.square(o - ref), -1)
  return jnp.mean(num / jnp.maximum(jnp.sum(jnp.square(ref), -1), 1e-30))


def per_layer_error(parts: dict, log_lam, beta) -> np.ndarray:
  """``[L]`` mean relative L2 output error."""
  o = residual_outputs(parts, log_lam, beta)
  ref = parts["o_dense"]
  rel = jnp.linalg.norm(o - ref, axis=-1) / jnp.maximum(jnp.linalg.norm(ref, axis=-1), 1e-30)
  return np.asarray(jnp.mean(rel, (1, 2)))


def fit(parts: dict, *, fit_beta: bool, steps: int = 300, learning_rate: float = 0.05,
        init_lam: float = 1.0, progress=None) -> tuple[dict, list[float]]:
  """Fits ``log_lam`` (and ``beta``) ``[L, N]`` with Adam; returns params and the loss curve."""
  parts = {k: jnp.asarray(v, jnp.float32) for k, v in parts.items()}
  nl, _, n = parts["bias"].shape
  params = dict(log_lam=jnp.full((nl, n), np.log(init_lam), jnp.float32),
                beta=jnp.ones((nl, n), jnp.float32))
  opt = optax.adam(learning_rate)
  mask = dict(log_lam=True, beta=fit_beta)
  state = opt.init(params)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(
        lambda p: output_error(parts, p["log_lam"], p["beta"]))(params)
    grads = {k: g if mask[k] else jnp.zeros_like(g) for k, g in grads.items()}
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  curve = []
  for i in range(steps):
    params, state, loss = step(params, state)
    curve.append(float(loss))
    if progress is not None and (i + 1) % 50 == 0:
      progress.update(50, note=f"loss {curve[-1]:.5f}")
  return {k: np.asarray(v) for k, v in params.items()}, curve


def best_global_lambda(parts: dict, grid) -> tuple[float, float]:
  """The single lambda (shared by all heads) with the lowest output error: ``(lam, err)``."""
  parts = {k: jnp.asarray(v, jnp.float32) for k, v in parts.items()}
  nl, _, n = parts["bias"].shape
  ones = jnp.ones((nl, n), jnp.float32)
  errs = [float(output_error(parts, jnp.log(jnp.maximum(lam, 1e-30)) * ones
                             if lam > 0 else -1e30 * ones, ones)) for lam in grid]
  i = int(np.argmin(errs))
  return float(grid[i]), errs[i]


# ---------------------------------------------------------------- decoding with per-head params


def teacher_forced(model, tokens, prefill_len: int, method, log_lam, beta, *,
                   capacity: int | None = None, prefill_chunk: int = 512) -> np.ndarray:
  """``models.teacher_forced`` for a ``+resa`` method with per-head ``log_lam, beta [L, N]``
  (``resa.set_head_params`` after the prefill; the library's own decode step).

  ``method``'s scalar lambda must be RESA's 1 (the fitted per-head lambda replaces it).
  Returns float32 logits ``[B, S - prefill_len + 1, V]`` (same indexing as the original).
  """
  if not method.resa or method.resa.lam != 1 or method.resa.lam_form != "renormalised":
    raise ValueError(f"{method.spec}: per-head calibration decodes +resa methods with lam = 1 "
                     "in the renormalised form (the fitted lambda replaces the scalar one)")
  return decode.teacher_forced(
      model, tokens, prefill_len, method, capacity=capacity, prefill_chunk=prefill_chunk,
      after_prefill=lambda states: resa_lib.set_head_params(states, log_lam, beta))
