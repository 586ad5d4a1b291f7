"""Flax (Linen) Llama-family decoder: RMSNorm, RoPE, GQA, SwiGLU, optional biases and
per-head q/k RMSNorms (Qwen3); and what Gemma 2 / Gemma 3 add to the same block (config
flags, ``models.config.ModelConfig``): ``1 + weight`` RMSNorms, norms after attention and the
MLP, a GELU-tanh gated MLP, embeddings scaled by ``sqrt(hidden)``, ``query_pre_attn_scalar``,
attention- and final-logit soft-capping, local (sliding-window) and global layers side by side
with Gemma 3's own RoPE base for the local ones.

Letters: B batch, S tokens in the step, E hidden size, F MLP size, V vocab, L layers,
N query heads, K kv heads, D head dim.

One ``Block`` module holds a decoder layer; the stack is a ``jax.lax.scan`` over layer
parameters stacked on a leading ``[L]`` axis (one compiled layer, fast compiles). Attention is
not part of the module: ``Block.__call__`` hands post-RoPE ``q, k, v`` to an ``attend`` callable,
which is how the decode loop plugs in a ``sparse_attn`` method (cache and method state travel
through the scan as per-layer inputs/outputs) and how ``forward`` runs exact causal attention.

Params pytree::

  {"embed": [V, E], "layers": Block params with a leading [L] axis,
   "final_norm": {"scale": [E]}, "lm_head": [E, V] (absent when embeddings are tied)}

Gemma layers hold two more norms, ``post_attn_norm`` and ``post_mlp_norm`` (``mlp_norm`` is
its ``pre_feedforward_layernorm``), and every Gemma norm scale is stored as the checkpoint's
zero-centred weight (the norm multiplies by ``1 + scale``).

A layer's projections that read the same input may be held fused (``fuse_projections``:
``qkv_proj`` for q/k/v, ``gate_up_proj`` for gate/up), the GPU decode layout; ``Block`` reads
either form (``is_fused``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models import rope as rope_lib
from models.config import ModelConfig
from sparse_attn import reference

Params = dict[str, Any]


def compute_dtype(config: ModelConfig):
  return jnp.dtype(config.dtype)


class RMSNorm(nn.Module):
  """``x / rms(x) * scale``, normalised in float32 (as Llama's reference); with ``plus_one``
  (Gemma) ``x / rms(x) * (1 + scale)``, all in float32 and cast once at the end (as
  transformers' ``Gemma2RMSNorm``)."""

  eps: float
  dtype: Any = jnp.float32
  plus_one: bool = False

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
    scale = self.param("scale", init, (x.shape[-1],), jnp.float32)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    if self.plus_one:
      return (xf * (1.0 + scale)).astype(self.dtype)
    return (scale.astype(self.dtype) * xf.astype(self.dtype)).astype(self.dtype)


def activation(config: ModelConfig, gate):
  """The gated MLP's activation: SiLU, or Gemma's tanh-approximated GELU (in float32, as
  PyTorch's ``gelu(approximate="tanh")`` computes it)."""
  if config.hidden_act == "gelu_pytorch_tanh":
    return jax.nn.gelu(gate.astype(jnp.float32), approximate=True).astype(gate.dtype)
  return nn.silu(gate)


class Block(nn.Module):
  """One decoder layer; attention itself is the ``attend`` callable."""

  config: ModelConfig
  fused: bool = False  # projections held as ``fuse_projections`` makes them
  local: bool = False  # a local layer (``config.is_local``): its RoPE when tables are not given

  @nn.compact
  def __call__(self, x, positions, attend: Callable, rope_tables=None):
    """Runs the layer.

    Args:
      x: ``[B, S, E]`` residual stream.
      positions: ``[B, S]`` int32 RoPE positions (negative = padding).
      attend: ``(q [B, N, S, D], k [B, K, S, D], v [B, K, S, D]) -> (out [B, N, S, D], aux)``.
      rope_tables: ``rope_tables_for(config, positions, local)``, when the caller computed them
        once for every layer (default: computed here for ``self.local``).

    Returns:
      ``(x [B, S, E], aux)``.
    """
    c = self.config
    dt = compute_dtype(c)
    dense = lambda f, bias, name: nn.Dense(f, use_bias=bias, dtype=dt, param_dtype=dt,
                                           name=name)
    b, s, _ = x.shape
    norm = lambda name: RMSNorm(c.rms_norm_eps, dt, c.norm_plus_one, name=name)
    h = norm("attn_norm")(x)
    heads = lambda y, n: y.reshape(b, s, n, c.head_dim).transpose(0, 2, 1, 3)
    # [B, N, S, D] / [B, K, S, D]
    if self.fused:
      qkv = dense(c.q_size + 2 * c.kv_size, c.qkv_bias, "qkv_proj")(h)
      q, k, v = jnp.split(qkv, [c.q_size, c.q_size + c.kv_size], axis=-1)
    else:
      q = dense(c.q_size, c.qkv_bias, "q_proj")(h)
      k = dense(c.kv_size, c.qkv_bias, "k_proj")(h)
      v = dense(c.kv_size, c.qkv_bias, "v_proj")(h)
    q, k, v = heads(q, c.num_heads), heads(k, c.num_kv_heads), heads(v, c.num_kv_heads)
    if c.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each head's D channels, before RoPE
      q = norm("q_norm")(q)
      k = norm("k_norm")(k)
    cos, sin = (rope_tables if rope_tables is not None
                else rope_tables_for(c, positions, self.local))
    q, k = rope_lib.rotate(q, cos, sin), rope_lib.rotate(k, cos, sin)
    out, aux = attend(q, k, v)
    out = out.astype(dt).transpose(0, 2, 1, 3).reshape(b, s, c.q_size)  # [B, S, N*D]
    out = dense(c.hidden_size, c.o_bias, "o_proj")(out)
    if c.sandwich_norms:  # Gemma: post_attention_layernorm
      out = norm("post_attn_norm")(out)
    x = x + out
    h = norm("mlp_norm")(x)
    if self.fused:  # [B, S, F] each
      gate, up = jnp.split(dense(2 * c.intermediate_size, c.mlp_bias, "gate_up_proj")(h), 2, -1)
    else:
      gate = dense(c.intermediate_size, c.mlp_bias, "gate_proj")(h)
      up = dense(c.intermediate_size, c.mlp_bias, "up_proj")(h)
    out = dense(c.hidden_size, c.mlp_bias, "down_proj")(activation(c, gate) * up)
    if c.sandwich_norms:  # Gemma: post_feedforward_layernorm
      out = norm("post_mlp_norm")(out)
    return x + out, aux


def rope_tables_for(config: ModelConfig, positions, local: bool = False):
  """RoPE ``cos, sin [B, 1, S, D/2]`` of ``positions [B, S]`` (``models.rope.tables``) for a
  global or a ``local`` layer (``ModelConfig.rope_of``: Gemma 3's local base).

  A layer stack computes them once, outside its layer loop: inside one layer, XLA:CPU fuses the
  ``cos``/``sin`` into each head's rotation and evaluates them once per head (a 2k-token prefill
  chunk spent ~10x longer in RoPE than in the rotation itself).
  """
  return rope_lib.scaled_tables(config.rope_of(local), config.head_dim, positions)


def softmax_scale(config: ModelConfig) -> float:
  """``head_dim ** -0.5``, or Gemma's ``query_pre_attn_scalar ** -0.5``."""
  return config.softmax_scale


def init_params(config: ModelConfig, key: jax.Array) -> Params:
  """Random parameters (for tests and tiny models)."""
  k_emb, k_layers, k_head = jax.random.split(key, 3)
  block = Block(config)
  x = jnp.zeros((1, 1, config.hidden_size), compute_dtype(config))
  pos = jnp.zeros((1, 1), jnp.int32)
  dummy = lambda q, k, v: (q, None)
  init_one = lambda k: block.init(k, x, pos, dummy)["params"]
  layers = jax.vmap(init_one)(jax.random.split(k_layers, config.num_layers))
  dt = compute_dtype(config)
  params = {
      "embed": (jax.random.normal(k_emb, (config.vocab_size, config.hidden_size)) * 0.5
               ).astype(dt),
      "layers": layers,
      "final_norm": {"scale": (jnp.zeros if config.norm_plus_one else jnp.ones)(
          (config.hidden_size,), jnp.float32)},
  }
  if not config.tie_word_embeddings:
    params["lm_head"] = (jax.random.normal(k_head, (config.hidden_size, config.vocab_size))
                         / math.sqrt(config.hidden_size)).astype(dt)
  return params


def embed(params: Params, config: ModelConfig, tokens):
  """``tokens [B, S]`` -> ``[B, S, E]``; Gemma's are times ``sqrt(E)`` rounded to the table's
  dtype, the product in that dtype (transformers' ``Gemma2TextScaledWordEmbedding``)."""
  x = jnp.take(params["embed"], tokens, axis=0)
  if config.scale_embeddings:
    x = x * jnp.asarray(np.float32(math.sqrt(config.hidden_size)), x.dtype)
  return x.astype(compute_dtype(config))


LAYOUTS = ("stacked", "per_layer")


def run_layers(params: Params, config: ModelConfig, x, positions, attend, per_layer=None, *,
               layout: str = "stacked"):
  """Applies every layer with ``attend`` as the attention; ``layout`` says how ``per_layer``
  (caches, method states) is held.

  * ``"stacked"`` (full forward passes, analysis captures): leaves with a leading ``[L]`` axis; a
    ``lax.scan`` over the layers carries them and layer ``i`` updates its slice in place
    (``dynamic_update_index_in_dim``). One layer is compiled once.
  * ``"per_layer"`` (the decode loop's layout, ``models.steps``): a tuple of per-layer
    lists, one donated buffer per layer, and the layer loop is unrolled. A decode step writes
    one token per layer, and only separate buffers are written in place: a stacked cache in a
    scan carry has its layer slice copied out and back every step (the whole cache, twice, per
    token: ~2x slower decode at 32k on CPU), and as scan inputs/outputs it is copied whole
    (~4x at 8k). The price is compile time (all layers unrolled).

  Args:
    x: ``[B, S, E]`` embeddings.
    positions: ``[B, S]`` int32.
    attend: ``(q, k, v, layer_input) -> (out, new_layer_input)`` (same structure and dtypes).
    per_layer: the per-layer inputs in ``layout``, or None.

  Returns:
    ``(x [B, S, E], updated per_layer)``.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  block = Block(config, is_fused(params["layers"]))
  tables = rope_tables_for(config, positions)
  local_tables = (tables if config.local_rope is None
                  else rope_tables_for(config, positions, local=True))
  if layout == "per_layer":
    return _run_layers_unrolled(block, params, x, positions, attend, per_layer,
                                (tables, local_tables), config)
  if isinstance(params["layers"], list):  # split_layers' form: stack them for the scan
    params = {**params, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *params["layers"])}
  local_flags = jnp.asarray([config.is_local(i) for i in range(config.num_layers)])

  def body(carry, xs):
    h, stacked = carry
    p, i = xs
    inp = jax.tree.map(lambda a: a[i], stacked)
    here = tables
    if local_tables is not tables:  # Gemma 3: the local layers' RoPE base, picked per layer
      here = jax.tree.map(lambda a, b: jnp.where(local_flags[i], a, b), local_tables, tables)
    h, out = block.apply({"params": p}, h, positions, lambda q, k, v: attend(q, k, v, inp),
                         here)
    stacked = jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b, i, 0),
                           stacked, out)
    return (h, stacked), None

  layer_ids = jnp.arange(config.num_layers)
  (x, per_layer), _ = jax.lax.scan(body, (x, per_layer), (params["layers"], layer_ids))
  return x, per_layer


def split_layers(params: Params) -> Params:
  """``params`` with ``"layers"`` as a list of per-layer trees (one copy of the weights).

  For the unrolled layer loop of decoding: slicing layer ``i`` out of the stacked weights
  inside a jitted step copies it, every step (~60 ms per token for SmolLM2 on CPU).
  """
  layers = params["layers"]
  if isinstance(layers, list):
    return params
  num = jax.tree.leaves(layers)[0].shape[0]
  return {**params, "layers": [jax.tree.map(lambda a: a[i], layers) for i in range(num)]}


# Fused name -> the projections it concatenates on the output axis, in order.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                     "gate_up_proj": ("gate_proj", "up_proj")}


def is_fused(layers) -> bool:
  """Whether layer params (one layer's, stacked ``[L]`` ones or a per-layer list) hold the
  fused projections."""
  first = layers[0] if isinstance(layers, list) else layers
  return "qkv_proj" in first


def fuse_projections(layer: Params) -> Params:
  """One layer's params with q/k/v as one ``qkv_proj`` (kernel ``[E, N*D + 2*K*D]``) and
  gate/up as one ``gate_up_proj`` (``[E, 2F]``), kernels and biases concatenated on the output
  axis; params already fused are returned as they are. Works on stacked ``[L]`` layers too.

  Why: at batch 1 every projection is a matrix-vector product. XLA:GPU strength-reduces one
  whose operands hold under 10M elements (Llama-3.1-8B's k and v projections, 4096 x 1024) into
  an elementwise multiply and a reduction, which ran at ~1/4 of the bandwidth on an H100, where
  a wider fused matrix stays a GEMM; one launch also replaces three (two).
  """
  if is_fused(layer):
    return layer
  out = {k: v for k, v in layer.items()
         if not any(k in parts for parts in FUSED_PROJECTIONS.values())}
  for fused, parts in FUSED_PROJECTIONS.items():
    out[fused] = {leaf: jnp.concatenate([layer[p][leaf] for p in parts], axis=-1)
                  for leaf in layer[parts[0]]}
  return out


def fuse_by_default(params: Params | None = None) -> bool:
  """Whether the decode layout fuses projections: on a GPU (``fuse_projections``' why), for
  params on one device (a sharded model keeps its per-projection shardings). On a CPU the
  layout keeps the projections as loaded, and the pinned logits bit for bit (the fused form
  was not timed there)."""
  one_device = lambda x: getattr(x, "sharding", None) is None or len(x.sharding.device_set) == 1
  return jax.default_backend() == "gpu" and all(map(one_device, jax.tree.leaves(params or {})))


_fuse_one = jax.jit(fuse_projections)


@jax.jit
def _fused_layer(layers, i):
  """Layer ``i`` of stacked layer params, fused (one compilation for every ``i``)."""
  return fuse_projections(jax.tree.map(lambda a: a[i], layers))


def decode_layout(params: Params, fuse: bool | None = None) -> Params:
  """``split_layers(params)``, each layer fused by ``fuse_projections`` when ``fuse`` (None:
  ``fuse_by_default(params)``), one layer at a time: no unfused per-layer copy of every
  layer is made on the way (the caller's ``params`` stay as they are)."""
  fuse = fuse_by_default(params) if fuse is None else fuse
  layers = params["layers"]
  if not fuse or is_fused(layers):
    return split_layers(params)
  if isinstance(layers, list):
    return {**params, "layers": [_fuse_one(layer) for layer in layers]}
  num = jax.tree.leaves(layers)[0].shape[0]
  return {**params, "layers": [_fused_layer(layers, i) for i in range(num)]}


def apply_layer(layer_params: Params, config: ModelConfig, x, positions, attend,
                local: bool = False):
  """One decoder layer: ``x [B, S, E]`` -> ``(x, aux)`` with ``attend(q, k, v) -> (out, aux)``;
  ``local``: a local layer (``config.is_local``: its RoPE)."""
  return Block(config, is_fused(layer_params), local).apply({"params": layer_params}, x,
                                                            positions, attend)


def _run_layers_unrolled(block, params, x, positions, attend, per_layer, tables, config):
  """``run_layers`` for per-layer inputs given as lists (the decode layout); ``tables``: the
  global and the local layers' RoPE tables."""
  outs = []
  layers = params["layers"]
  for i, inp in enumerate(zip(*per_layer)):
    p = layers[i] if isinstance(layers, list) else jax.tree.map(lambda a: a[i], layers)
    x, out = block.apply({"params": p}, x, positions,
                         lambda q, k, v, inp=inp: attend(q, k, v, inp),
                         tables[config.is_local(i)])
    outs.append(out)
  return x, tuple(list(o) for o in zip(*outs))


def logits_from_hidden(params: Params, config: ModelConfig, h):
  """Final norm + LM head: ``h [..., E]`` -> float32 logits ``[..., V]``, soft-capped
  (``final_softcap``: ``cap * tanh(logits / cap)``, Gemma 2) when the config says so."""
  dt = compute_dtype(config)
  h = RMSNorm(config.rms_norm_eps, dt, config.norm_plus_one).apply(
      {"params": params["final_norm"]}, h)
  if config.tie_word_embeddings:
    out = jnp.einsum("...e,ve->...v", h, params["embed"].astype(dt),
                     preferred_element_type=jnp.float32)
  else:
    out = jnp.einsum("...e,ev->...v", h, params["lm_head"].astype(dt),
                     preferred_element_type=jnp.float32)
  return reference.soft_cap(out.astype(jnp.float32), config.final_softcap)


def causal_attend(config: ModelConfig, positions):
  """Exact causal attention of a whole sequence over itself (no cache), for ``forward``: the
  window of a local layer, every layer's soft-cap. Its layer input is ``{"local": bool}`` (the
  layer's ``config.is_local``, traced under the layer scan)."""
  scale = softmax_scale(config)

  def attend(q, k, v, inp):
    mask = None
    if config.sliding_window is not None:
      # [B, 1, S, T]: key within the window of the query (or a global layer)
      dist = positions[:, :, None] - positions[:, None, :]
      mask = (dist < config.sliding_window)[:, None] | ~inp["local"]
    out, _ = reference.attention(q, k, v, mask, scale, q_positions=positions,
                                 k_positions=positions, softcap=config.attn_softcap)
    return out, inp

  return attend


def forward(params: Params, config: ModelConfig, tokens, positions=None):
  """Full-sequence forward pass with exact causal attention (the parity reference).

  Args:
    tokens: ``[B, S]`` int32.
    positions: ``[B, S]`` int32 (default ``0..S-1``; negative = padding).

  Returns:
    float32 logits ``[B, S, V]``.
  """
  b, s = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  x = embed(params, config, tokens)
  local = {"local": jnp.asarray([config.is_local(i) for i in range(config.num_layers)])}
  x, _ = run_layers(params, config, x, positions, causal_attend(config, positions), local)
  return logits_from_hidden(params, config, x)
