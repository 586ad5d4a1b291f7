"""A layer cache filled with random keys and values: the latency runs time decoding over a
context without paying for its prefill."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sparse_attn.cache import write


@functools.partial(jax.jit, static_argnames=("context",), donate_argnums=(0,))
def fill(cache, key, *, context):
  """Random K/V at slots ``0..context-1`` of every row of one layer's ``[B, K, T, D]`` cache
  (generated in the jit; the input cache is donated)."""
  b, hkv, _, d = cache.k.shape
  k1, k2 = jax.random.split(key)
  shape = (b, hkv, context, d)
  pos = jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), (b, context))
  return write(cache, jax.random.normal(k1, shape, cache.k.dtype),
               jax.random.normal(k2, shape, cache.k.dtype), pos)
