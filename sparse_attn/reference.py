"""Exact (dense) GQA attention returning ``(out, lse)``.

Einsum letters used throughout the package:
  B batch, K kv heads, G query heads per kv head, S query length, T key length, D head dim.

Every attention primitive in the library returns ``(out, lse)`` with
``lse = log sum_j exp(scale * q . k_j)`` over the attended keys (natural log, float32).
A row that attends nothing returns ``out = 0`` and ``lse = -inf`` and never NaN. With a
``softcap`` (Gemma 2) the scaled logits are soft-capped, ``s -> cap * tanh(s / cap)``
(``soft_cap``), before the mask: ``lse`` is then over the capped logits, which is what every
attention path of a soft-capped model computes.
"""

from __future__ import annotations

import jax.numpy as jnp

# The masked-attention core of every jnp path (the kernels' references use it too), re-exported
# as the library's dense reference.
from pallas_kernels.softmax import (  # pylint: disable=unused-import
    check_softcap, default_scale, grouped_attention, soft_cap, softmax_sum)

NEG_INF = float("-inf")


def attention_mask(batch, q_len, kv_len, *, kv_length=None, q_positions=None,
                   k_positions=None, window=None):
  """Builds a boolean mask ``[B, 1|K, 1, S, T]`` from lengths and positions.

  Args:
    batch, q_len, kv_len: static sizes.
    kv_length: ``[B]`` int, keys at slots ``>= kv_length`` are masked.
    q_positions: ``[B, S]`` int, the token position of each query; when given the mask is
      causal (key position ``<= `` query position). Negative positions mask the query row.
    k_positions: ``[B, T]`` or ``[B, K, T]`` int token position of each key slot
      (default: the slot index); negative entries are empty slots.
    window: Mistral's sliding window (static int, needs ``q_positions``): a query at position
      ``p`` attends only keys at positions ``> p - window`` (None = unlimited).
  """
  slots = jnp.arange(kv_len, dtype=jnp.int32)
  mask = jnp.ones((batch, 1, 1, q_len, kv_len), dtype=bool)
  if kv_length is not None:
    mask &= (slots[None, :] < kv_length[:, None])[:, None, None, None, :]
  if k_positions is None:
    kpos = jnp.broadcast_to(slots, (batch, 1, kv_len))
  else:
    kpos = k_positions if k_positions.ndim == 3 else k_positions[:, None, :]
    mask &= (kpos >= 0)[:, :, None, None, :]
  if q_positions is not None:
    qpos = q_positions[:, None, None, :, None]
    mask &= (kpos[:, :, None, None, :] <= qpos) & (qpos >= 0)
    if window is not None:
      mask &= kpos[:, :, None, None, :] > qpos - window
  elif window is not None:
    raise ValueError("a sliding window needs q_positions")
  return mask


def attention(q, k, v, mask=None, scale=None, *, kv_length=None, q_positions=None,
              k_positions=None, window=None, softcap=None):
  """Exact GQA attention. Query head ``h`` reads kv head ``h // G``.

  Args:
    q: ``[B, Hq, S, D]`` queries.
    k: ``[B, Hkv, T, D]`` keys (post-RoPE).
    v: ``[B, Hkv, T, D]`` values.
    mask: optional boolean broadcastable to ``[B, Hq, S, T]``; True = attend.
    scale: softmax scale, default ``1/sqrt(D)``.
    kv_length: optional ``[B]`` valid key count (length mask).
    q_positions: optional ``[B, S]`` query token positions (makes the mask causal).
    k_positions: optional ``[B, T]`` or ``[B, Hkv, T]`` key token positions.
    window: optional sliding window (see ``attention_mask``).
    softcap: optional attention-logit soft-cap (``soft_cap``; Gemma 2).

  Returns:
    ``out [B, Hq, S, D]`` (``q.dtype``) and ``lse [B, Hq, S]`` (float32).
  """
  b, hq, s, d = q.shape
  hkv, t = k.shape[1], k.shape[2]
  if hq % hkv:
    raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}")
  g = hq // hkv
  full = attention_mask(b, s, t, kv_length=kv_length, q_positions=q_positions,
                        k_positions=k_positions, window=window)
  if mask is not None:
    mask = jnp.broadcast_to(mask, (b, hq, s, t)).reshape(b, hkv, g, s, t)
    full = full & mask
  out, lse = grouped_attention(q.reshape(b, hkv, g, s, d), k, v, full, scale,
                               check_softcap(softcap))
  return out.reshape(b, hq, s, d), lse.reshape(b, hq, s)


def logits(q, k, scale=None, softcap=None):
  """Scaled GQA logits ``[B, Hq, S, T]`` (float32) for analysis and oracles, soft-capped
  (``soft_cap``) when ``softcap`` is given."""
  b, hq, s, d = q.shape
  hkv = k.shape[1]
  scale = default_scale(d, scale)
  qg = q.reshape(b, hkv, hq // hkv, s, d)
  out = jnp.einsum("bkgsd,bktd->bkgst", qg, k, preferred_element_type=jnp.float32)
  return soft_cap(out * scale, check_softcap(softcap)).reshape(b, hq, s, -1)


__all__ = ["attention", "grouped_attention", "softmax_sum", "attention_mask",
           "default_scale", "logits", "soft_cap", "check_softcap", "NEG_INF"]
