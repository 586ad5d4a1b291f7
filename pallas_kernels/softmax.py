"""Safe-softmax numerics shared by every jnp path (the kernels' references and ``sparse_attn``).

``scaled_logits`` is the one ``q . k`` product of the jnp paths (with Gemma 2's soft-cap,
``soft_cap``, when given), ``softmax_sum`` attends masked
logits exactly and returns ``(out, lse)``, ``grouped_attention`` is the two together for GQA
query groups, and ``lse_combine`` merges partials over disjoint key sets (the flash-decoding
combine). Empty rows and all-empty parts give ``out = 0, lse = -inf``, never NaN
(docs/architecture.md, "The method protocol"). The Pallas kernels run the same recurrences on
chip; this module is their reference and is written once.

Letters: B batch, P program heads (kv or selection heads), R query rows of a head, L keys,
K kv heads, G query heads per kv head, S queries, T keys, D head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def default_scale(head_dim: int, scale: float | None = None) -> float:
  """The softmax scale: ``1/sqrt(D)`` unless given."""
  return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def check_softcap(softcap) -> float | None:
  """``softcap`` as a positive float, or None; a ValueError otherwise."""
  if softcap is None:
    return None
  if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0:
    raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
  return float(softcap)


def soft_cap(logits, softcap: float | None):
  """Attention-logit soft-capping (Gemma 2, Team et al. 2024): ``s -> cap * tanh(s / cap)``.

  Applied to the scaled logits, before the mask and the softmax: a soft-capped score is what
  the softmax sees, in every attention path (this reference, ``chunk_attention`` and the
  decode kernel). ``tanh`` is monotone, so a rule that only ranks scores (top-k, Quest's
  upper bound, ArkVale's) ranks alike with or without the cap; a rule that reads attention
  mass (softmax weights, log-sum-exps) must see capped logits. None: ``logits`` unchanged.
  """
  if softcap is None:
    return logits
  return softcap * jnp.tanh(logits * (1.0 / softcap))


def scaled_logits(q, k, scale: float, softcap: float | None = None):
  """``scale * q . k`` of ``q [B, P, R, D]`` and ``k [B, P, L, D]`` -> ``[B, P, R, L]`` float32,
  soft-capped (``soft_cap``) when ``softcap`` is given.

  The operands keep their dtype (bf16 x bf16 products are exact in float32) and accumulate in
  float32; ``HIGHEST`` keeps XLA:GPU off TF32 for float32 inputs (XLA:CPU computes float32 dots
  exactly either way). The query rows of a head are one axis: XLA:CPU runs a (B P)-batched
  matmul ~5x faster than an einsum with several free row axes.
  """
  return soft_cap(jnp.einsum("bprd,bpld->bprl", q, k, preferred_element_type=jnp.float32,
                             precision=jax.lax.Precision.HIGHEST) * scale, softcap)


def grouped_attention(q, k, v, mask=None, scale=None, softcap: float | None = None):
  """Masked attention with the query heads grouped by kv head.

  Args:
    q: ``[B, K, G, S, D]`` queries.
    k, v: ``[B, K, T, D]`` keys and values.
    mask: optional bool broadcastable to ``[B, K, G, S, T]``; True = attend.
    scale: softmax scale, default ``1/sqrt(D)``.
    softcap: attention-logit soft-cap (``soft_cap``), None = none.

  Returns:
    ``out [B, K, G, S, D]`` in ``q.dtype`` and ``lse [B, K, G, S]`` float32.
  """
  b, kh, g, s, d = q.shape
  # [B, K, G, S, T]
  logits = scaled_logits(q.reshape(b, kh, g * s, d), k, default_scale(d, scale), softcap)
  out, lse = softmax_sum(logits.reshape(b, kh, g, s, -1), v, ok=mask)
  return out.astype(q.dtype), lse


def softmax_sum(logits, v, ok=None):
  """Safe softmax over the last axis of ``logits [B, P, *rows, L]`` applied to ``v [B, P, L, D]``.

  Args:
    logits: scores (``-inf`` = masked); any number of row axes between ``P`` and ``L``.
    v: values, shared by every row of a ``(B, P)`` pair.
    ok: optional bool mask broadcastable to ``logits`` (False = masked).

  Returns:
    ``out [B, P, *rows, D]`` float32 and ``lse [B, P, *rows]`` float32.
  """
  logits = logits.astype(jnp.float32)
  if ok is not None:
    logits = jnp.where(ok, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)  # L = 0: an empty row
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(logits - m_safe)  # exp(-inf) = 0 for masked keys
  denom = jnp.sum(p, axis=-1)
  b, h = p.shape[:2]
  # Row axes merged into one: XLA:CPU runs a (B P)-batched matmul ~5x faster than an einsum
  # with several free row axes. [B, P, R, D]
  num = jnp.einsum("bprl,bpld->bprd", p.reshape(b, h, math.prod(p.shape[2:-1]), p.shape[-1]),
                   v.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  num = num.reshape(*p.shape[:-1], -1)
  safe = jnp.where(denom > 0, denom, 1.0)
  out = jnp.where((denom > 0)[..., None], num / safe[..., None], 0.0)
  lse = jnp.where(denom > 0, m_safe[..., 0] + jnp.log(safe), -jnp.inf)
  return out, lse


def lse_combine(out, lse, axis: int = 0):
  """Exact merge of partials over disjoint key sets stacked along ``axis``.

  Args:
    out: ``[..., n, ..., D]`` partial outputs, each normalised over its own keys.
    lse: the matching ``[..., n, ...]`` log-sum-exps (``-inf`` for an empty part).
    axis: the parts axis of ``lse`` (the same axis of ``out``).

  Returns:
    ``(out [..., D] f32, lse [...] f32)`` with the parts axis removed: ``lse = log sum e^lse_i``,
    ``out = sum e^(lse_i - lse) out_i``; ``0`` and ``-inf`` when every part is empty.
  """
  axis = axis % lse.ndim
  lse = lse.astype(jnp.float32)
  m = jnp.max(lse, axis=axis, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lse - m_safe)  # 0 for empty parts
  denom = jnp.sum(w, axis=axis)
  safe = jnp.where(denom > 0, denom, 1.0)
  o = jnp.sum(w[..., None] * out.astype(jnp.float32), axis=axis) / safe[..., None]
  o = jnp.where((denom > 0)[..., None], o, 0.0)
  l = jnp.where(denom > 0, jnp.squeeze(m_safe, axis) + jnp.log(safe), -jnp.inf)
  return o, l
