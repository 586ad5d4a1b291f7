"""Which prompt tokens a compression method keeps, and whether the needle is among them.

Letters: B batch, L layers, K kv heads, T cache slots, S context tokens.

A diagnostic for the needle grid (Expected Attention Fig. 3): after a method's ``end_prefill``
the cache holds, per layer and kv head, the positions it kept. ``kept_mask`` turns one layer's
cache (per-head ``KVCache`` or Ada-KV's flat buffer) into ``[B, K, S]`` booleans;
``keep_summary`` reduces the layers to the numbers the report plots: how much of the needle
survives, in which layers, and how the kept tokens spread over the context (a recency profile).
``question_attention`` says where it matters: the share of the dense model's attention from the
question's tokens that falls on the needle, per layer and kv head, so a method's recall can be
weighted by the heads that actually read the needle.
"""

from __future__ import annotations

import numpy as np

from sparse_attn.compression import flat

POSITION_BINS = 10


def kept_mask(cache, num_positions: int) -> np.ndarray:
  """``[B, K, S]`` bool: the positions ``< S`` each kv head's cache holds after eviction.

  Args:
    cache: one layer's ``KVCache`` (``pos [B, K, T]``) or ``flat.FlatKVCache`` (``pos [B, T]``
      with a kv-head id per slot).
    num_positions: ``S``, the context positions to report.
  """
  view = flat.heads_view(cache) if isinstance(cache, flat.FlatKVCache) else cache
  pos, valid = np.asarray(view.pos), np.asarray(view.valid)
  idx = np.where(valid & (pos < num_positions), pos, num_positions)  # the rest: a dump column
  out = np.zeros(pos.shape[:-1] + (num_positions + 1,), bool)
  np.put_along_axis(out, idx.astype(np.int64), True, axis=-1)
  return out[..., :num_positions]


def needle_token_span(ids_of, prompt: str, context: str, char_span, num_context: int):
  """``(start, end)`` token positions of a needle given by its character span in ``context``.

  Args:
    ids_of: ``str -> list[int]``, the tokenizer the prompt was encoded with.
    prompt: the whole prompt; ``context`` is a substring of it.
    char_span: ``(a, b)`` characters of the needle inside ``context``.
    num_context: tokens of the prompt's context part (the span is clipped to it).

  The token index of a character is the token count of the prompt up to it, so a token that
  straddles the needle's edge counts as the needle's.
  """
  base = prompt.index(context)
  a, b = (base + int(c) for c in char_span)
  start = len(ids_of(prompt[:a]))
  end = max(len(ids_of(prompt[:b])), start + 1)
  if start >= num_context:
    raise ValueError(f"needle tokens [{start}, {end}) lie past the context ({num_context} tokens)")
  return start, min(end, num_context)


def keep_summary(kept: np.ndarray, length: int, span) -> dict:
  """Summary of one sample's kept positions.

  Args:
    kept: ``[L, K, S]`` bool (one batch row of every layer's ``kept_mask``).
    length: the sample's context tokens (positions ``>= length`` are padding).
    span: ``(start, end)`` needle token positions.

  Returns:
    ``needle_recall`` (kept share of the needle's tokens over layers x heads x tokens),
    ``needle_recall_per_layer [L]``, ``needle_recall_per_head [L, K]``, ``heads_with_needle``
    (share of layer x head pairs keeping at least half of the needle's tokens),
    ``kept_fraction`` (of the context), and
    ``position_profile [POSITION_BINS]`` (kept share of each tenth of the context).
  """
  kept = np.asarray(kept[..., :length], bool)
  a, b = span
  needle = kept[..., a:b].astype(np.float64)  # [L, K, n]
  per_head = needle.mean(-1)  # [L, K]
  edges = np.linspace(0, length, POSITION_BINS + 1).round().astype(int)
  profile = [float(kept[..., lo:hi].mean()) if hi > lo else float("nan")
             for lo, hi in zip(edges[:-1], edges[1:])]
  return dict(needle_recall=float(needle.mean()),
              needle_recall_per_layer=[float(x) for x in needle.mean(axis=(1, 2))],
              needle_recall_per_head=per_head.round(4).tolist(),
              heads_with_needle=float((per_head >= 0.5).mean()),
              kept_fraction=float(kept.mean()),
              position_profile=profile)


def question_attention(q, k, scale: float, num_context: int, span) -> np.ndarray:
  """``[L, K]``: the share of dense attention from the question's queries that lands on the
  needle, averaged over the question's positions and each kv head's query heads.

  Args:
    q: ``[L, N, S, D]`` post-RoPE queries of the whole prompt (``capture.Captured.q``).
    k: ``[L, K, S, D]`` post-RoPE keys.
    scale: softmax scale.
    num_context: positions before the question (queries at ``>= num_context`` are the question's).
    span: ``(start, end)`` needle token positions.
  """
  num_layers, n, s, _ = q.shape
  kv = k.shape[1]
  a, b = span
  t = np.arange(num_context, s)
  out = np.zeros((num_layers, kv))
  for layer in range(num_layers):
    keys = np.repeat(k[layer], n // kv, axis=0)  # [N, S, D]
    logits = scale * np.einsum("nqd,nsd->nqs", q[layer, :, num_context:], keys)
    logits = np.where(np.arange(s)[None, None, :] <= t[None, :, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    mass = p[..., a:b].sum(-1).mean(-1)  # [N]
    out[layer] = mass.reshape(kv, n // kv).mean(-1)
  return out


def weighted_recall(per_head, attention) -> float:
  """Needle recall weighted by the question's attention on the needle per (layer, kv head)."""
  w = np.asarray(attention, np.float64)
  return float((w * np.asarray(per_head, np.float64)).sum() / max(w.sum(), 1e-30))
