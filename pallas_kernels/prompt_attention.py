"""Chunk attention over an in-order cache, through ``jax.nn.dot_product_attention`` (cuDNN).

A prefill chunk usually meets the cache in its simplest state: slot ``j`` holds position ``j``
for every filled slot (nothing compacted or overwritten yet) and the chunk's queries are the
positions ``start .. start + S - 1`` (negative = padding), their keys just written at those
slots. ``chunk_attention``'s rule by position then splits into two standard attentions: the
chunk's queries over the prefix slots ``[0, start)`` with no mask (every prefix position is
before every query), and over the chunk's own ``S`` slots with the index-aligned causal mask;
their ``(out, lse)`` pairs merge exactly (``lse_combine``). Both are calls of
``jax.nn.dot_product_attention``, which on a GPU runs cuDNN's fused flash attention
(``implementation="cudnn"``: 16-bit inputs, causal tiles skipped, key lengths per row), the
dense attention PyTorch's SDPA and transformers use for a prompt.

``in_order_start`` checks the state on the traced arrays, so ``chunk_attention`` can choose this
path or its own kernel with one ``lax.cond`` per call (under ``vmap`` both run and one is kept).

Letters: B batch, N query heads, K kv heads, S queries, T slots, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.softmax import default_scale, lse_combine

# Queries a chunk needs before ``chunk_attention`` tries this path on a GPU (a decode step or a
# short rectification chunk stays in the kernel, whose grid is sized for it).
MIN_QUERIES = 128


@functools.lru_cache(maxsize=None)
def cudnn_compiles(dtype: str, head_dim: int) -> bool:
  """Whether ``jax.nn.dot_product_attention(implementation="cudnn")`` compiles here for this
  dtype and head dim, on a small grouped-query problem shaped like ``in_order_attention``'s
  two calls (it checks the cuDNN version and the GPU when traced; XLA builds the cuDNN graph
  when compiling). Once per process."""
  # shapes only: this runs while chunk_attention is being traced
  q = jax.ShapeDtypeStruct((1, 128, 2, head_dim), jnp.dtype(dtype))
  kv = jax.ShapeDtypeStruct((1, 256, 1, head_dim), jnp.dtype(dtype))

  def both(q, kv, n):
    call = lambda keys, causal: jax.nn.dot_product_attention(
        q, keys, keys, is_causal=causal, key_value_seq_lengths=n, implementation="cudnn",
        return_residual=True)
    return call(kv, False), call(kv[:, :128], True)
  try:
    jax.jit(both).lower(q, kv, jax.ShapeDtypeStruct((1,), jnp.int32)).compile()
  except Exception:  # pylint: disable=broad-except (no GPU, no or an old cuDNN, the shape)
    return False
  return True


def in_order_start(q_pos, k_pos, length, capacity: int):
  """Whether a chunk meets an in-order cache (module docstring), and where it starts.

  Args:
    q_pos: ``[B, S]`` int32 query positions (negative = padding).
    k_pos: ``[B, K, T]`` int32 position held by each slot.
    length: ``[B]`` int32 filled slots.
    capacity: ``T`` (static).

  Returns:
    ``(ok, start)``: scalar bool and int32. ``ok`` when some query is valid, every valid query
    ``i`` of every row sits at ``start + i``, ``start + S <= T``, and every filled slot ``j < length``
    holds position ``j``.
  """
  s = q_pos.shape[-1]
  offset = jnp.where(q_pos >= 0, q_pos - jnp.arange(s, dtype=q_pos.dtype), -1)
  start = jnp.max(offset)
  same = jnp.all((q_pos < 0) | (offset == start))
  filled = jnp.arange(capacity)[None, None, :] < length[:, None, None]
  slots_in_order = jnp.all(~filled | (k_pos == jnp.arange(capacity)[None, None, :]))
  return (start >= 0) & same & (start + s <= capacity) & slots_in_order, start.astype(jnp.int32)


def in_order_attention(q, k, v, q_pos, length, start, *, scale: float | None = None,
                       implementation: str | None = None):
  """``chunk_attention``'s result for a chunk that meets an in-order cache at ``start``.

  Args:
    q: ``[B, N, S, D]`` queries at ``start + i`` (negative ``q_pos``: padding).
    k, v: ``[B, K, T, D]`` cache, slot ``j`` holding position ``j`` below ``length``.
    q_pos: ``[B, S]`` int32 (only its sign is read).
    length: ``[B]`` int32 filled slots.
    start: int32 scalar, the chunk's first position (``in_order_start``).
    scale: softmax scale, default ``1/sqrt(D)``.
    implementation: ``jax.nn.dot_product_attention``'s (``"cudnn"``, ``"xla"`` or None).

  Returns:
    ``out [B, N, S, D]`` in ``q.dtype`` and ``lse [B, N, S]`` float32 (``0`` and ``-inf`` for a
    query that sees nothing).
  """
  b, n, s, d = q.shape
  scale = default_scale(d, scale)
  # cuDNN takes 16-bit inputs and accumulates in f32; XLA's implementation would round 16-bit
  # logits, so it gets f32 inputs (the reference's precision)
  dtype = q.dtype if implementation == "cudnn" else jnp.float32
  qt = q.astype(dtype).transpose(0, 2, 1, 3)  # [B, S, N, D]: dot_product_attention's layout
  attend = lambda keys, values, kv_len, causal: jax.nn.dot_product_attention(
      qt, keys.astype(dtype).transpose(0, 2, 1, 3), values.astype(dtype).transpose(0, 2, 1, 3),
      scale=scale,
      is_causal=causal, key_value_seq_lengths=kv_len, implementation=implementation,
      return_residual=True)
  prefix_len = jnp.minimum(length, start).astype(jnp.int32)
  own_len = jnp.clip(length - start, 0, s).astype(jnp.int32)
  own_k = jax.lax.dynamic_slice_in_dim(k, start, s, axis=2)
  own_v = jax.lax.dynamic_slice_in_dim(v, start, s, axis=2)
  parts = [attend(k, v, prefix_len, False), attend(own_k, own_v, own_len, True)]
  outs, lses = [], []
  for (out, lse), kv_len in zip(parts, (prefix_len, own_len)):
    # A row with no key in a part (every query of it sees key 0 of the part otherwise): its
    # output there is undefined (cuDNN: 0 / 0), so the part is dropped.
    seen = (kv_len > 0)[:, None, None]
    outs.append(jnp.where(seen[..., None], out.astype(jnp.float32), 0.0))
    lses.append(jnp.where(seen, lse.astype(jnp.float32), -jnp.inf))
  out, lse = lse_combine(jnp.stack(outs), jnp.stack(lses))  # [B, S, N, D], [B, S, N]
  valid = (q_pos >= 0)[:, :, None]
  out = jnp.where(valid[..., None], out, 0.0).transpose(0, 2, 1, 3)
  lse = jnp.where(valid, lse, -jnp.inf).transpose(0, 2, 1)
  return out.astype(q.dtype), lse
