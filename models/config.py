"""Model configuration for the Llama family (Llama, SmolLM2, Qwen2, Qwen3, Mistral, Phi-3) and
Gemma 2 / Gemma 3 (text).

``ModelConfig`` is a frozen, hashable dataclass (pass it as a static argument to ``jax.jit``).
``from_hf_config`` reads a Hugging Face ``config.json`` dict; an option that would change the
model and that this port does not implement raises ``ValueError`` instead of being ignored.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# RopeConfig is re-exported: models.config.RopeConfig is its public name.
from models.rope_config import ROPE_TYPES, RopeConfig, rope_from_hf, rope_to_hf

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text")
GEMMA_TYPES = ("gemma2", "gemma3_text")
# Gemma's config.json keys (read by ``_gemma_fields``; refused for the other families).
_GEMMA_KEYS = frozenset({
    "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
    "final_logit_softcapping", "use_bidirectional_attention", "sliding_window_pattern",
    "_sliding_window_pattern", "rope_local_base_freq", "cache_implementation"})

# Keys that never change the forward pass (bookkeeping, generation defaults, training-only).
_INERT_KEYS = frozenset({
    "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype",
    "transformers_version", "use_cache", "initializer_range", "_name_or_path", "model_type",
    "attention_dropout", "output_hidden_states", "output_attentions", "return_dict",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "tokenizer_class", "max_position_embeddings", "head_dim", "pretraining_tp", "hidden_act",
    "rope_theta", "rope_scaling", "rope_parameters", "sliding_window", "use_sliding_window",
    "max_window_layers", "layer_types", "attention_bias", "mlp_bias", "tie_word_embeddings",
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "rms_norm_eps", "embd_pdrop", "resid_pdrop", "unsloth_version",
    "quantization_config_ignored", "task_specific_params", "finetuning_task", "prefix",
    "decoder_start_token_id", "sep_token_id", "tf_legacy_loss", "use_bfloat16", "bad_words_ids",
    "begin_suppress_tokens", "suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
    "num_beams", "temperature", "top_p", "top_k", "max_length", "min_length", "do_sample",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "early_stopping",
    "cross_attention_hidden_size", "add_cross_attention", "tie_encoder_decoder", "is_decoder",
    "pruned_heads", "torchscript", "return_dict_in_generate", "output_scores",
    "num_return_sequences", "diversity_penalty", "num_beam_groups", "typical_p",
    "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty", "remove_invalid_values",
    "output_router_logits", "original_max_position_embeddings", "partial_rotary_factor",
})
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a Llama-family decoder.

  Attributes:
    vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim:
      sizes (``num_heads % num_kv_heads == 0``).
    rms_norm_eps: RMSNorm epsilon.
    rope: rotary embedding parameters.
    tie_word_embeddings: the LM head reuses the input embedding.
    qkv_bias: q/k/v projections have a bias (Qwen2, Llama ``attention_bias``).
    qk_norm: per-head RMSNorm of q and k (weights ``[D]``) before RoPE (Qwen3).
    o_bias: the output projection has a bias (Llama ``attention_bias``).
    mlp_bias: gate/up/down have biases (Llama ``mlp_bias``).
    sliding_window: Mistral-style attention window (None = full attention): on every layer, or
      on the layers ``sliding_layers`` marks.
    sliding_layers: per layer, whether it is a local (sliding-window) layer (Gemma 2 / 3's
      alternation); None: every layer is (when ``sliding_window`` is set). A local layer of
      Gemma 3 also uses ``local_rope``.
    max_position_embeddings: the trained context length (informational).
    model_type: one of ``SUPPORTED_MODEL_TYPES`` (Phi-3's fused ``qkv_proj`` / ``gate_up_proj``
      are split on load, ``hf_loader``).
    bos_token_id, eos_token_ids: special ids from the checkpoint (may be empty).
    dtype: compute/param dtype name (``float32`` or ``bfloat16``).
    hidden_act: the gated MLP's activation: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh``
      (Gemma's GELU, tanh approximation).
    norm_plus_one: RMSNorms scale by ``1 + weight``, in float32 before the cast (Gemma).
    sandwich_norms: norms after attention and after the MLP too (Gemma:
      ``post_attention_layernorm``, ``pre_feedforward_layernorm`` before the MLP,
      ``post_feedforward_layernorm``).
    scale_embeddings: embeddings times ``sqrt(hidden_size)`` in the embedding dtype (Gemma).
    query_pre_attn_scalar: softmax scale ``query_pre_attn_scalar ** -0.5`` (Gemma); None:
      ``head_dim ** -0.5``.
    attn_softcap: attention-logit soft-cap ``s -> cap * tanh(s / cap)`` of the scaled logits
      (Gemma 2's ``attn_logit_softcapping``), None = none.
    final_softcap: the same of the output logits (``final_logit_softcapping``), None = none.
    local_rope: the RoPE of local layers (Gemma 3's ``rope_local_base_freq``), None: ``rope``.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-5
  rope: RopeConfig = RopeConfig()
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  sliding_window: int | None = None
  max_position_embeddings: int = 2048
  model_type: str = "llama"
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  dtype: str = "float32"
  hidden_act: str = "silu"
  norm_plus_one: bool = False
  sandwich_norms: bool = False
  scale_embeddings: bool = False
  query_pre_attn_scalar: float | None = None
  attn_softcap: float | None = None
  final_softcap: float | None = None
  sliding_layers: tuple[bool, ...] | None = None
  local_rope: RopeConfig | None = None

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    if self.dtype not in ("float32", "bfloat16", "float16"):
      raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
    if self.rope.rope_type not in ROPE_TYPES:
      raise ValueError(f"unsupported rope_type {self.rope.rope_type!r} "
                       f"(supported: {', '.join(ROPE_TYPES)})")
    for rope in (self.rope, self.local_rope or self.rope):
      if rope.rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope.rope_type!r} "
                         f"(supported: {', '.join(ROPE_TYPES)})")
      for name in ("short_factor", "long_factor", "freq_factors"):
        got = getattr(rope, name)
        if got is not None and 2 * len(got) != self.head_dim:
          raise ValueError(f"rope {name} has {len(got)} entries, head_dim {self.head_dim} "
                           f"needs {self.head_dim // 2}")
    if self.hidden_act not in ACTIVATIONS:
      raise ValueError(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
    if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
      raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for "
                       f"{self.num_layers} layers")
    for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
      val = getattr(self, name)
      if val is not None and not val > 0:
        raise ValueError(f"{name} must be positive or None, got {val!r}")

  def is_local(self, layer: int) -> bool:
    """Whether layer ``layer`` is a local layer (``sliding_layers``; every layer of a
    Mistral-style window; none without a window): it uses ``local_rope`` and, while
    ``sliding_window`` is set, the window."""
    if self.sliding_layers is not None:
      return self.sliding_layers[layer]
    return self.sliding_window is not None

  def layer_window(self, layer: int) -> int | None:
    """The attention window of layer ``layer`` (None = full attention)."""
    return self.sliding_window if self.is_local(layer) else None

  @property
  def per_layer_windows(self) -> bool:
    """Local and global layers side by side (Gemma): the decode steps give each layer its own
    window (``models.steps.layer_method``) rather than one for the whole model."""
    return self.sliding_layers is not None and self.sliding_window is not None

  def rope_of(self, local: bool) -> RopeConfig:
    """The RoPE of a local (``local_rope``) or a global layer."""
    return self.local_rope if local and self.local_rope is not None else self.rope

  @property
  def softmax_scale(self) -> float:
    """``query_pre_attn_scalar ** -0.5`` (Gemma), else ``head_dim ** -0.5``."""
    return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

  @property
  def group_size(self) -> int:
    """Query heads per kv head (G)."""
    return self.num_heads // self.num_kv_heads

  @property
  def q_size(self) -> int:
    return self.num_heads * self.head_dim

  @property
  def kv_size(self) -> int:
    return self.num_kv_heads * self.head_dim

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def for_context(self, capacity: int) -> "ModelConfig":
    """The config a decode run with a cache of ``capacity`` positions uses
    (``RopeConfig.for_context``: one LongRoPE factor set for every step; no ``sliding_window``
    when the cache never holds more than it, so no method is asked for a mask that never
    hides a key)."""
    kw = {}
    rope = self.rope.for_context(capacity)
    if rope != self.rope:
      kw["rope"] = rope
    if self.sliding_window is not None and capacity <= self.sliding_window:
      kw["sliding_window"] = None  # sliding_layers stay: Gemma 3's local RoPE
    return self.replace(**kw) if kw else self

  @classmethod
  def from_hf_config(cls, cfg: dict[str, Any], dtype: str = "float32") -> "ModelConfig":
    """Builds a config from a Hugging Face ``config.json`` dict.

    Raises:
      ValueError: unsupported ``model_type`` or an option this port does not implement.
    """
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                       f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    known = _INERT_KEYS | (_GEMMA_KEYS if model_type in GEMMA_TYPES else frozenset())
    unknown = sorted(k for k in cfg if k not in known)
    if unknown:
      raise ValueError(f"config.json has options this port does not implement: {unknown}")
    if model_type in GEMMA_TYPES:
      act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
      if act != "gelu_pytorch_tanh":
        raise ValueError(f"{model_type} with hidden_activation={act!r} is not supported "
                         "(only 'gelu_pytorch_tanh')")
    else:
      act = cfg.get("hidden_act", "silu")
      if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
    if cfg.get("pretraining_tp", 1) != 1:
      raise ValueError("pretraining_tp != 1 is not supported")
    if cfg.get("attention_dropout", 0.0):
      raise ValueError("attention_dropout must be 0 for inference")
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    window = None
    if model_type in ("mistral", "phi3"):
      window = cfg.get("sliding_window")
    elif model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window", False):
      raise ValueError(f"{model_type} with use_sliding_window=True is not supported")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
      if model_type not in ("mistral", "phi3") + GEMMA_TYPES:
        raise ValueError(f"per-layer attention types {sorted(set(layer_types))} not supported")
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
      raise ValueError("partial_rotary_factor != 1 (RoPE on part of each head, e.g. "
                       "Phi-4-mini) is not supported")
    if model_type == "phi3" and cfg.get("attention_bias", False):
      raise ValueError("phi3 with attention_bias=True is not supported")
    eos = cfg.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    bias = bool(cfg.get("attention_bias", False))
    rope = rope_from_hf(cfg) if model_type not in GEMMA_TYPES else None
    gemma = {}
    if model_type in GEMMA_TYPES:
      window, gemma = _gemma_fields(cfg, model_type)
      rope = gemma.pop("rope")
    tied_default = model_type in GEMMA_TYPES  # Gemma's config classes tie by default
    return cls(
        vocab_size=cfg["vocab_size"], hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope=rope,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tied_default)),
        qkv_bias=bias or model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "gemma3_text"), o_bias=bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)), sliding_window=window,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        model_type=model_type, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos,
        dtype=dtype, hidden_act=act, **gemma)

  def to_hf_config(self) -> dict[str, Any]:
    """The equivalent ``config.json`` dict (used to cache converted GGUF models, and to build
    the transformers peer of a benchmark shape)."""
    rope = rope_to_hf(self.rope)
    if self.model_type == "gemma3_text":
      rope = {"full_attention": rope, "sliding_attention": rope_to_hf(self.rope_of(True))}
    out = {
        "model_type": self.model_type, "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
        "rms_norm_eps": self.rms_norm_eps, "rope_parameters": rope,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "bos_token_id": self.bos_token_id, "eos_token_id": list(self.eos_token_ids),
        "hidden_act": "silu", "mlp_bias": self.mlp_bias,
    }
    if self.model_type != "qwen2":
      out["attention_bias"] = self.qkv_bias
    if self.model_type in ("mistral", "phi3"):
      out["sliding_window"] = self.sliding_window
    if self.model_type in GEMMA_TYPES:
      del out["hidden_act"], out["mlp_bias"]
      out.update(
          hidden_activation=self.hidden_act, query_pre_attn_scalar=self.query_pre_attn_scalar,
          attn_logit_softcapping=self.attn_softcap,
          final_logit_softcapping=self.final_softcap, sliding_window=self.sliding_window,
          layer_types=["sliding_attention" if self.is_local(i) else "full_attention"
                       for i in range(self.num_layers)])
    return out


def _gemma_fields(cfg: dict[str, Any], model_type: str):
  """``(sliding_window, fields)``: what a Gemma 2 / Gemma 3 (text) ``config.json`` adds to the
  block, as transformers' ``Gemma2Config`` / ``Gemma3TextConfig`` read it.

  * local layers: ``layer_types`` (``sliding_attention`` / ``full_attention``), else Gemma 2's
    every other layer (layer ``i`` local iff ``i`` is even) or Gemma 3's
    ``sliding_window_pattern`` (default 6: layer ``i`` global iff ``(i + 1) % 6 == 0``);
  * RoPE: Gemma 2 one (``rope_parameters`` or ``rope_theta``); Gemma 3 one per layer type,
    ``rope_parameters["full_attention" | "sliding_attention"]`` (transformers 5), or the older
    ``rope_theta`` (default 1e6) + ``rope_scaling`` for global layers and
    ``rope_local_base_freq`` (default 1e4) for local ones;
  * ``query_pre_attn_scalar`` (default 256), ``attn_logit_softcapping`` (Gemma 2's default
    50; Gemma 3's None) and ``final_logit_softcapping`` (30; None).

  Refused: ``use_bidirectional_attention``; Gemma 3 with ``attn_logit_softcapping`` set
  (transformers' ``Gemma3Attention`` does not apply it: Gemma 3 replaced the cap by the q/k
  norms, so the intended model is not defined).
  """
  gemma2 = model_type == "gemma2"
  if cfg.get("use_bidirectional_attention"):
    raise ValueError(f"{model_type} with use_bidirectional_attention=True is not supported "
                     "(a causal decoder only)")
  layers = int(cfg["num_hidden_layers"])
  types = cfg.get("layer_types")
  if types is None:
    if gemma2:
      types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    else:
      pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
      types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
               for i in range(layers)]
  bad = sorted(set(types) - {"sliding_attention", "full_attention"})
  if bad or len(types) != layers:
    raise ValueError(f"layer_types {bad or types} not supported (want {layers} entries of "
                     "'sliding_attention' / 'full_attention')")
  window = cfg.get("sliding_window", 4096)
  window = None if window is None else int(window)
  params = cfg.get("rope_parameters") or {}
  if gemma2:
    rope, local = rope_from_hf(cfg), None
  else:
    nested = isinstance(params.get("full_attention"), dict)
    full = dict(params["full_attention"]) if nested else {
        "rope_theta": cfg.get("rope_theta", 1e6), **(cfg.get("rope_scaling") or {})}
    slide = dict(params["sliding_attention"]) if nested and params.get(
        "sliding_attention") else {"rope_theta": cfg.get("rope_local_base_freq", 1e4)}
    full.setdefault("rope_theta", 1e6)
    slide.setdefault("rope_theta", 1e4)
    rope = rope_from_hf({"rope_parameters": full})
    local = rope_from_hf({"rope_parameters": slide})
  attn_cap = cfg.get("attn_logit_softcapping", 50.0 if gemma2 else None)
  if attn_cap is not None and not gemma2:
    raise ValueError("gemma3_text with attn_logit_softcapping set is not supported: "
                     "transformers' Gemma3Attention does not apply it (Gemma 3 replaced the "
                     "soft-cap by q/k norms), so the model it describes is not defined")
  final_cap = cfg.get("final_logit_softcapping", 30.0 if gemma2 else None)
  scalar = cfg.get("query_pre_attn_scalar", 256)
  return window, dict(
      rope=rope, local_rope=None if local == rope else local, norm_plus_one=True,
      sandwich_norms=True, scale_embeddings=True,
      query_pre_attn_scalar=float(scalar),
      attn_softcap=None if attn_cap is None else float(attn_cap),
      final_softcap=None if final_cap is None else float(final_cap),
      sliding_layers=tuple(t == "sliding_attention" for t in types))
