"""Jitted per-step functions of the decode loop (prefill chunk, decode, rectify, end_prefill).

Letters: B batch, S tokens in a step, W decode window, E hidden, V vocab, T capacity, L layers.
Caches and method states are in layout ``"stacked"`` (a leading ``[L]`` axis) during prefill and
``"per_layer"`` (lists) from ``end_prefill`` on (``llama.run_layers`` says why); every step
names its layout and donates them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models import llama, sharding
from models.sampling import sample

def init_caches(config, method, batch: int, capacity: int):
  """Per-layer caches and method states stacked on a leading ``[L]`` axis (created sharded
  for a ``sharding.ShardedMethod``)."""
  dt = llama.compute_dtype(config)

  def init():
    cache = method.init_cache(batch, config.num_kv_heads, capacity, config.head_dim, dt)
    state = method.init_state(batch, config.num_heads, config.num_kv_heads, config.head_dim,
                              capacity, dt)
    return cache, state

  if isinstance(method, sharding.ShardedMethod):
    return method.init_caches(config.num_layers, init)
  stack = lambda x: jnp.repeat(jnp.asarray(x)[None], config.num_layers, axis=0)
  return jax.tree.map(stack, init())


def _apply(params, config, tokens, positions, caches, states, layer_fn, layout):
  """Runs all layers with ``layer_fn`` (a method's prefill/decode/rectify) as attention, the
  caches and states held in ``layout`` (``llama.run_layers``).

  Returns ``(hidden [B, S, E] before the final norm, caches, states)``.
  """
  scale = llama.softmax_scale(config)

  def attend(q, k, v, inp):
    cache, state = inp
    out, cache, state = layer_fn(q, k, v, cache, state, positions, scale=scale)
    return out, (cache, state)

  x = llama.embed(params, config, tokens)
  h, (caches, states) = llama.run_layers(params, config, x, positions, attend, (caches, states),
                                         layout=layout)
  return h, caches, states


_STATIC = ("config", "method")
_DONATE = ("caches", "states")


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=_DONATE)
def prefill_step(params, tokens, positions, caches, states, *, config, method):
  """One prompt chunk: ``tokens, positions [B, S]`` -> ``(hidden [B, S, E], caches, states)``."""
  return _apply(params, config, tokens, positions, caches, states, method.prefill, "stacked")


def end_prefill(caches, states, *, config, method):
  """Calls ``method.end_prefill`` layer by layer, eagerly (outside jit); returns per-layer lists.

  Eager on purpose: compression methods size their compacted cache from the concrete prompt
  lengths, so the returned cache may be smaller than the one passed in (decode steps are then
  compiled for that smaller capacity).

  The result is in the decode layout ``"per_layer"`` of ``llama.run_layers`` (see there why):
  ``([cache_0, ..., cache_{L-1}], [state_0, ...])``, one donated buffer per layer.
  """
  scale = llama.softmax_scale(config)
  outs = []
  for i in range(config.num_layers):
    c, s = jax.tree.map(lambda a: a[i], (caches, states))
    outs.append(method.end_prefill(c, s, scale=scale))
  return [c for c, _ in outs], [s for _, s in outs]


def stack_layers(tree):
  """A per-layer list (the decode layout) stacked on a leading ``[L]`` axis, for inspection;
  a tree that is already stacked is returned as is. Layers of different sizes cannot stack."""
  if isinstance(tree, list):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *tree)
  return tree


def _window_tokens(history, positions):
  """``history [B, T]`` read at ``positions [B, S]`` (negative -> token 0)."""
  tok = jnp.take_along_axis(history, jnp.maximum(positions, 0), axis=1)
  return jnp.where(positions >= 0, tok, 0)


@functools.partial(jax.jit, static_argnames=_STATIC + ("sampling",),
                   donate_argnames=_DONATE + ("history",))
def decode_step(params, history, positions, caches, states, key, *, config, method, sampling):
  """One decode step over the last ``W`` tokens; samples the next token.

  Args:
    history: ``[B, T]`` int32 tokens by position.
    positions: ``[B, W]`` int32 positions of the window (newest last; negative = none).
    key: PRNG key of this step.

  Returns:
    ``(next_token [B], logits [B, V] float32, history (next token written), caches, states)``.
  """
  tokens = _window_tokens(history, positions)
  h, caches, states = _apply(params, config, tokens, positions, caches, states, method.decode,
                             "per_layer")
  logits = llama.logits_from_hidden(params, config, h[:, -1])
  nxt = sample(logits, key, sampling)
  b = jnp.arange(history.shape[0])
  history = history.at[b, positions[:, -1] + 1].set(nxt, mode="drop")
  return nxt, logits, history, caches, states


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=_DONATE)
def rectify_step(params, history, positions, caches, states, *, config, method):
  """Dense re-encoding of ``positions [B, f]`` (``method.rectify``); outputs are discarded."""
  tokens = _window_tokens(history, positions)
  _, caches, states = _apply(params, config, tokens, positions, caches, states, method.rectify,
                             "per_layer")
  return caches, states


@functools.partial(jax.jit, static_argnames=("config", "sampling"))
def sample_from_hidden(params, h, key, *, config, sampling):
  """``h [B, E]`` -> ``(token [B], logits [B, V])``."""
  logits = llama.logits_from_hidden(params, config, h)
  return sample(logits, key, sampling), logits
