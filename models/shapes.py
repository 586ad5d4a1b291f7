"""Named Hugging Face model shapes: each checkpoint's ``config.json`` without its weights.

``SHAPES`` holds each shape as the ``config.json`` dict of the checkpoint (no weights: benchmarks
and GPU runs time random weights of that shape, which cost what the real ones cost), read by
``ModelConfig.from_hf_config`` for ours and by ``transformers.AutoConfig.for_model`` for a peer.
``random_model`` gives a ``loading.Model`` of a shape with random weights.
"""

from __future__ import annotations

import math

_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)

SHAPES = {
    # meta-llama/Llama-3.1-8B config.json (the shape; bos/eos ids dropped).
    "llama-3.1-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0),
        max_position_embeddings=131072, tie_word_embeddings=False),
    # meta-llama/Llama-3.2-1B: the same attention shape per layer at 1/7 of the weights (a
    # cheaper GPU run of the same code paths).
    "llama-3.2-1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
        max_position_embeddings=131072, tie_word_embeddings=True),
    # Qwen/Qwen3-8B config.json (the shape): per-head q/k RMSNorm, GQA 32:8, 36 layers.
    "qwen3-8b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        attention_bias=False, use_sliding_window=False, tie_word_embeddings=False),
    # google/gemma-3-12b-it text_config (the shape): 5 local layers (window 1024, RoPE base 1e4)
    # per global one (base 1e6, linear x8), q/k norms, GQA 16:8, D = 256, tied 262k vocab.
    "gemma-3-12b": dict(
        model_type="gemma3_text", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling=dict(rope_type="linear", factor=8.0), sliding_window=1024,
        sliding_window_pattern=6, query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=None,
        final_logit_softcapping=None, max_position_embeddings=131072, tie_word_embeddings=True),
    # deepseek-ai/DeepSeek-R1-Distill-Qwen-7B config.json (the shape): ReSA's model (Sec. 3.1:
    # 28 q / 4 kv heads, 28 layers, hidden 3584), Qwen2 with q/k/v biases.
    "r1-distill-qwen-7b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=131072,
        sliding_window=4096, use_sliding_window=False, max_window_layers=28,
        tie_word_embeddings=False),
    # Qwen/Qwen3-1.7B config.json (the shape): the model of ReSA's efficiency section (Sec. 3.4).
    "qwen3-1.7b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        attention_bias=False, use_sliding_window=False, tie_word_embeddings=True),
    # CI: every code path in milliseconds (GQA group 2, untied head, Llama-3 RoPE).
    "tiny": dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0),
        max_position_embeddings=131072, tie_word_embeddings=False),
}


def hf_config(name: str) -> dict:
  """The ``config.json`` dict of shape ``name`` (a copy)."""
  if name not in SHAPES:
    raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
  return {k: (dict(v) if isinstance(v, dict) else v) for k, v in SHAPES[name].items()}


def model_config(name: str, dtype: str):
  """``models.config.ModelConfig`` of shape ``name`` with ``dtype`` params and compute."""
  from models.config import ModelConfig  # pylint: disable=g-import-not-at-top
  return ModelConfig.from_hf_config(hf_config(name), dtype=dtype)


def random_model(config, seed: int = 0):
  """A ``models.loading.Model`` of ``config`` with random weights in the decode layout
  (``llama.decode_layout``: projections fused on a GPU).

  Each layer is initialised by its own jitted call (``llama.Block.init``, one compilation for
  all layers), so the device never holds the weights twice (``llama.init_params`` stacks the
  layers, and the decode layout would copy them out again: 32 GB at peak for an 8B model).

  Args:
    config: a ``ModelConfig``.
    seed: PRNG seed.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from models import llama  # pylint: disable=g-import-not-at-top
  from models.loading import Model  # pylint: disable=g-import-not-at-top

  dt = llama.compute_dtype(config)
  e, v = config.hidden_size, config.vocab_size
  x = jnp.zeros((1, 1, e), dt)
  pos = jnp.zeros((1, 1), jnp.int32)
  block = llama.Block(config)
  fuse = llama.fuse_projections if llama.fuse_by_default() else (lambda p: p)
  init_layer = jax.jit(lambda k: fuse(block.init(k, x, pos, lambda q, kk, vv: (q, None))["params"]))
  k_emb, k_head, k_layers = jax.random.split(jax.random.key(seed), 3)

  @jax.jit
  def head():
    out = {"embed": (jax.random.normal(k_emb, (v, e), jnp.float32) * 0.5).astype(dt),
           "final_norm": {"scale": (jnp.zeros if config.norm_plus_one else jnp.ones)(
               (e,), jnp.float32)}}  # Gemma's norms scale by 1 + w
    if not config.tie_word_embeddings:  # [E, V]
      out["lm_head"] = (jax.random.normal(k_head, (e, v), jnp.float32) / math.sqrt(e)).astype(dt)
    return out

  params = head()
  params["layers"] = [init_layer(k) for k in jax.random.split(k_layers, config.num_layers)]
  return Model(config, params, None, "random")
