"""Jitted per-step functions of the decode loop (prefill chunk, decode, rectify, end_prefill).

Letters: B batch, S tokens in a step, W decode window, E hidden, V vocab, T capacity, L layers.
Caches and method states are per-layer lists (layout ``"per_layer"`` of ``llama.run_layers``)
from ``init_caches`` on, and every step (a prefill chunk, a decode or a rectify step) calls one
jitted layer per layer (compiled once: see ``_layer``) with the weights in the decode layout
(``Model.decode_params``). Each layer's cache and state are donated to its call. One layout
from prefill to decode means no cache is ever copied between them, and only one copy of the
weights is needed.

On a GPU a decode step is instead one device program (``_decode_program``: embedding, every
layer and the sampling in one jit, caches and states donated), so the host dispatches one call
per token rather than one per layer; on a CPU the per-layer calls compile much faster and run
as fast. ``decode_step(fused=None)`` picks by backend (``fused_by_default``).

Every layer runs ``layer_method(method, config, local)``: the method given, with what the
model's layer adds to its attention (Gemma: the window of a local layer, the attention-logit
soft-cap of every layer), so one method spec serves a model of local and global layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models import llama, sharding
from models import rope as model_rope
from models.sampling import sample
from sparse_attn import layer_inputs
from sparse_attn.compression import cross_layer
from sparse_attn.protocol import AttentionMethod

@functools.lru_cache(maxsize=256)
def layer_method(method: AttentionMethod, config, local: bool) -> AttentionMethod:
  """The method a layer of ``config`` runs: ``method`` with the layer's window where the
  model's layers have windows of their own (``config.per_layer_windows``: Gemma's local
  layers; a Mistral-style window on every layer is the caller's, ``decode.with_model_window``),
  the layer's RoPE where local layers have their own (``config.local_rope``, Gemma 3: through
  ``with_rope``, so a method that models RoPE gets it unless the caller set its own) and the
  model's attention-logit soft-cap (``config.attn_softcap``, Gemma 2).

  ``config`` is the run's (``ModelConfig.for_context``: no window a cache of its capacity never
  outgrows). Cached: the same (method, config, kind) gives the same object, so the jitted layer
  compiles once per kind.

  Raises:
    NotImplementedError: the method has no sliding-window mask (RESA, retro, Expected
      Attention) and the layer has a window; or it cannot soft-cap (``with_softcap``).
    ValueError: a method with a window of its own on a model whose layers have their own.
  """
  if config.per_layer_windows:
    want = config.sliding_window if local else None
    if method.sliding_window != want:
      if method.sliding_window is not None:
        raise ValueError(f"{method.spec!r} has sliding_window={method.sliding_window}, but "
                         "this model's layers have windows of their own (local / global): "
                         "pass the method without one")
      method = method.with_sliding_window(want)
  if config.local_rope is not None:
    method = method.with_rope(model_rope.model_inv_freq(config, local))
  cap = config.attn_softcap
  if cap is not None and getattr(method, "softcap", None) != cap:
    with_cap = getattr(method, "with_softcap", None)
    if with_cap is None:
      raise NotImplementedError(f"{method.spec!r} has no attention-logit soft-cap, which this "
                                f"model applies (softcap={cap:g})")
    method = with_cap(cap)
  return method


# Phases after the prompt's end, where a method whose layers differ only in the prompt's cut
# (``layer_free_decode``: PyramidKV's layer budgets) runs as one method on every layer.
AFTER_PROMPT = ("decode", "extend")


def per_layer(method: AttentionMethod, index: int, num_layers: int,
              phase: str | None = None) -> AttentionMethod:
  """The method decoder layer ``index`` of ``num_layers`` runs in ``phase``:
  ``method.for_layer(index, num_layers)`` where the method's layers differ (TidalDecode: dense,
  selection and reuse layers, ``sparse_attn.tidal``; PyramidKV's layer budgets), else
  ``method``; in ``AFTER_PROMPT`` phases ``method`` itself when its ``layer_free_decode`` says
  the layers decode alike (one compiled step serves them all). Its decode step may take the
  step's *relay* (``decode_relay``): a value one layer hands to the next (``_layer_body``);
  None for every other method."""
  for_layer = getattr(method, "for_layer", None)
  if for_layer is None or (phase in AFTER_PROMPT and getattr(method, "layer_free_decode", False)):
    return method
  return for_layer(index, num_layers)


def check_layer_methods(method: AttentionMethod, config):
  """Raises now (before anything compiles) what ``layer_method`` would raise on any layer."""
  n = config.num_layers
  for m, local in {(per_layer(method, i, n), config.is_local(i)) for i in range(n)}:
    layer_method(m, config, local)


def init_caches(config, method: AttentionMethod, batch: int, capacity: int, params=None,
                question_length=None):
  """``(caches, states)``: per-layer lists of empty caches and method states, one buffer per
  layer (created sharded for a ``sharding.ShardedMethod``).

  A method's ``layer_state`` hook (``sparse_attn.layer_inputs``) then gets each layer's index
  and inputs: its output projection from ``params`` (the weights, when given) and
  ``question_length [B]`` (the question ending each prompt, when known)."""
  dt = llama.compute_dtype(config)

  def init():
    cache = method.init_cache(batch, config.num_kv_heads, capacity, config.head_dim, dt)
    state = method.init_state(batch, config.num_heads, config.num_kv_heads, config.head_dim,
                              capacity, dt)
    return cache, state

  if isinstance(method, sharding.ShardedMethod):
    made = method.init_caches(config.num_layers, init)
  else:
    made = [init() for _ in range(config.num_layers)]
  layers = [None] * config.num_layers if params is None else llama.split_layers(params)["layers"]
  # On the host: each layer's state makes its own device copy (states are donated per layer).
  question = None if question_length is None else np.asarray(question_length, np.int32)
  inputs = [layer_inputs.LayerInputs(
      out_proj=None if p is None else p["o_proj"]["kernel"], question_length=question)
            for p in layers]
  states = layer_inputs.apply(method, [s for _, s in made], inputs)
  return [c for c, _ in made], states


def prefill_step(params, tokens, positions, caches, states, *, config, method: AttentionMethod):
  """One prompt chunk through every layer (``method.prefill`` as attention).

  Args:
    params: the decode layout of the weights (``Model.decode_params``).
    tokens, positions: ``[B, S]`` int32 (negative positions: padding, attends nothing).
    caches, states: per-layer lists (donated layer by layer).

  Returns:
    ``(hidden [B, S, E] before the final norm, caches, states)``.
  """
  return _chunk_step(params, tokens, positions, caches, states, config=config, method=method,
                     phase="prefill")


def extend_step(params, tokens, positions, caches, states, *, config, method: AttentionMethod):
  """A chunk read after ``end_prefill`` (``method.extend``: a query-agnostic question read
  through a compressed cache); arguments and result as ``prefill_step``'s."""
  return _chunk_step(params, tokens, positions, caches, states, config=config, method=method,
                     phase="extend")


def replay_step(params, tokens, positions, caches, states, *, config, method: AttentionMethod):
  """A chunk that attends the prompt's cache and itself without being written
  (``method.replay``: KVzip's context reconstruction, ``models.kvzip_replay``); arguments and
  result as ``prefill_step``'s."""
  return _chunk_step(params, tokens, positions, caches, states, config=config, method=method,
                     phase="replay")


def _chunk_step(params, tokens, positions, caches, states, *, config, method: AttentionMethod,
                phase):
  x = _embed(_head(params), jnp.asarray(tokens, jnp.int32), config=config)
  return _layers(params, x, positions, caches, states, config=config, method=method,
                 phase=phase)


def end_prefill(caches, states, *, config, method: AttentionMethod):
  """Calls ``method.end_prefill`` layer by layer, eagerly (outside jit), on per-layer lists.

  Eager on purpose: compression methods size their compacted cache from the concrete prompt
  lengths, so the returned cache may be smaller than the one passed in (decode steps are then
  compiled for that smaller capacity).
  """
  scale = llama.softmax_scale(config)
  n = config.num_layers
  states = cross_layer.apply(method, caches, states, scale)  # KVzip, ChunkKV's reuse
  outs = [layer_method(per_layer(method, i, n), config, config.is_local(i)).end_prefill(
      c, s, scale=scale)
          for i, (c, s) in enumerate(zip(caches, states, strict=True))]
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


# ---- prefill, decode and rectify: one jitted layer, called once per layer ----
# A step is an embedding (``_embed`` / ``_embed_window``), then ``_layer`` for every layer (the
# same compiled executable: the layers differ only in their weights), then (decode) ``_finish``.
# Compiling one layer instead of the unrolled stack takes a decode step's compilation from
# seconds to a fraction of one; each layer call donates that layer's cache and state, so they
# are still updated in place.


def _head(params):
  """The parameters the embedding and the LM head read (not the layers)."""
  return {k: v for k, v in params.items() if k != "layers"}


@functools.partial(jax.jit, static_argnames=("config",))
def _embed(head, tokens, *, config):
  return llama.embed(head, config, tokens)


@functools.partial(jax.jit, static_argnames=("config",))
def _embed_window(head, history, positions, *, config):
  return llama.embed(head, config, _window_tokens(history, positions))


def _layer_body(layer_params, x, positions, cache, state, relay=None, *, config,
                method: AttentionMethod, phase, local: bool = False):
  """One decoder layer with ``method.prefill``, ``.extend``, ``.decode`` or ``.rectify``
  (``phase``) as attention; ``local``: a local layer (``config.is_local``), whose method is
  ``layer_method``'s. ``relay``: what the layers before handed on (``per_layer``), returned
  as this layer leaves it -> ``(x, cache, state, relay)``."""
  m = layer_method(method, config, local)
  relays = phase == "decode" and hasattr(m, "decode_relay")
  fn = m.decode_relay if relays else getattr(m, phase)
  scale = llama.softmax_scale(config)
  extra = {}
  if phase == "replay" and getattr(m, "reads_hidden_norm", False):  # KVzip+
    extra["hidden_norm"] = _attention_input_norms(layer_params, config, x)

  def attend(q, k, v):
    if relays:
      out, c, s, r = fn(q, k, v, cache, state, relay, positions, scale=scale)
      return out, (c, s, r)
    out, c, s = fn(q, k, v, cache, state, positions, scale=scale, **extra)
    return out, (c, s, relay)

  x, (cache, state, relay) = llama.apply_layer(layer_params, config, x, positions, attend,
                                               local)
  return x, cache, state, relay


def _attention_input_norms(layer_params, config, x):
  """``[B, S]`` float32 ``||h_s||_2`` of a layer's attention input ``h`` (``x [B, S, E]`` after
  the layer's input norm, as ``llama.Block`` computes it): KVzip+'s query weights."""
  h = llama.RMSNorm(config.rms_norm_eps, llama.compute_dtype(config), config.norm_plus_one).apply(
      {"params": layer_params["attn_norm"]}, x)
  return jnp.linalg.norm(h.astype(jnp.float32), axis=-1)


_layer = jax.jit(_layer_body, static_argnames=("config", "method", "phase", "local"),
                 donate_argnames=("cache", "state"))


def _layers(params, x, positions, caches, states, *, config, method: AttentionMethod, phase):
  """Every layer, one ``_layer`` call each, over the per-layer caches and states."""
  new_caches, new_states, relay = [], [], None
  for i, (p, c, s) in enumerate(zip(llama.split_layers(params)["layers"], caches, states,
                                    strict=True)):
    x, c, s, relay = _layer(p, x, positions, c, s, relay, config=config,
                            method=per_layer(method, i, config.num_layers, phase), phase=phase,
                            local=config.is_local(i))
    new_caches.append(c)
    new_states.append(s)
  return x, new_caches, new_states


def _finish_body(head, h, history, positions, key, *, config, sampling):
  logits = llama.logits_from_hidden(head, config, h[:, -1])
  nxt = sample(logits, key, sampling)
  b = jnp.arange(history.shape[0])
  return nxt, logits, history.at[b, positions[:, -1] + 1].set(nxt, mode="drop")


_finish = jax.jit(_finish_body, static_argnames=("config", "sampling"),
                  donate_argnames=("history",))


@functools.partial(jax.jit, static_argnames=("config", "method", "sampling"),
                   donate_argnames=("history", "caches", "states"))
def _decode_program(params, history, positions, caches, states, key, *, config,
                    method: AttentionMethod, sampling):
  """``decode_step`` as one device program (the layers unrolled inside one jit).

  Returns ``(history, caches, states, next_token, logits)``: the donated buffers first, in their
  argument order. JAX pairs donated inputs with outputs of the same shape in output order, so
  a ``[B]`` int32 token ahead of the caches would take the first cache length's buffer and
  shift every later ``[B]`` int32 leaf (lengths, RESA's ``qlast_pos``) onto its neighbour's:
  one device copy each per step (31 for dense on Llama-3.1-8B, 95 with RESA, seen in the
  H100 program)."""
  head = _head(params)
  x = llama.embed(head, config, _window_tokens(history, positions))
  new_caches, new_states, relay = [], [], None
  for i, (p, c, s) in enumerate(zip(llama.split_layers(params)["layers"], caches, states,
                                    strict=True)):
    x, c, s, relay = _layer_body(p, x, positions, c, s, relay, config=config,
                                 method=per_layer(method, i, config.num_layers, "decode"),
                                 phase="decode",
                                 local=config.is_local(i))
    new_caches.append(c)
    new_states.append(s)
  nxt, logits, history = _finish_body(head, x, history, positions, key, config=config,
                                      sampling=sampling)
  return history, new_caches, new_states, nxt, logits


def fused_by_default() -> bool:
  """Whether a decode step runs as one device program: on a GPU, where the host would set the
  pace dispatching one call per layer; not on a CPU, where compiling the unrolled layers costs
  seconds and per-layer calls run as fast."""
  return jax.default_backend() == "gpu"


def decode_step(params, history, positions, caches, states, key, *, config,
                method: AttentionMethod, sampling, fused: bool | None = None):
  """One decode step over the last ``W`` tokens; samples the next token.

  Args:
    params: the decode layout of the weights (``Model.decode_params``).
    history: ``[B, T]`` int32 tokens by position (donated).
    positions: ``[B, W]`` int32 positions of the window (newest last; negative = none).
    caches, states: per-layer lists (donated layer by layer).
    key: PRNG key of this step.
    fused: one device program for the whole step (None: ``fused_by_default()``); the same
      result either way.

  Returns:
    ``(next_token [B], logits [B, V] float32, history (next token written), caches, states)``.
  """
  if fused_by_default() if fused is None else fused:
    history, caches, states, nxt, logits = _decode_program(
        params, history, positions, caches, states, key, config=config, method=method,
        sampling=sampling)
    return nxt, logits, history, caches, states
  head = _head(params)
  x = _embed_window(head, history, positions, config=config)
  x, caches, states = _layers(params, x, positions, caches, states, config=config,
                              method=method, phase="decode")
  nxt, logits, history = _finish(head, x, history, positions, key, config=config,
                                 sampling=sampling)
  return nxt, logits, history, caches, states


def rectify_step(params, history, positions, caches, states, *, config, method: AttentionMethod):
  """Dense re-encoding of ``positions [B, f]`` (``method.rectify``); outputs are discarded."""
  x = _embed_window(_head(params), history, positions, config=config)
  _, caches, states = _layers(params, x, positions, caches, states, config=config,
                              method=method, phase="rectify")
  return caches, states


@functools.partial(jax.jit, static_argnames=("config", "sampling"))
def sample_from_hidden(params, h, key, *, config, sampling):
  """``h [B, E]`` -> ``(token [B], logits [B, V])``."""
  logits = llama.logits_from_hidden(params, config, h)
  return sample(logits, key, sampling), logits
