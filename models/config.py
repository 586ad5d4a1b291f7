"""Model configuration for the Llama family (Llama, SmolLM2, Qwen2, Mistral).

``ModelConfig`` is a frozen, hashable dataclass (pass it as a static argument to ``jax.jit``).
``from_hf_config`` reads a Hugging Face ``config.json`` dict; an option that would change the
model and that this port does not implement raises ``ValueError`` instead of being ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")

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
    "output_router_logits",
})


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Rotary embedding parameters (``rope_type`` in default | linear | llama3)."""

  theta: float = 10000.0
  rope_type: str = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


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
    o_bias: the output projection has a bias (Llama ``attention_bias``).
    mlp_bias: gate/up/down have biases (Llama ``mlp_bias``).
    sliding_window: Mistral-style attention window (None = full attention).
    max_position_embeddings: the trained context length (informational).
    model_type: ``llama`` | ``qwen2`` | ``mistral``.
    bos_token_id, eos_token_ids: special ids from the checkpoint (may be empty).
    dtype: compute/param dtype name (``float32`` or ``bfloat16``).
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
  o_bias: bool = False
  mlp_bias: bool = False
  sliding_window: int | None = None
  max_position_embeddings: int = 2048
  model_type: str = "llama"
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  dtype: str = "float32"

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    if self.dtype not in ("float32", "bfloat16", "float16"):
      raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
    if self.rope.rope_type not in ("default", "linear", "llama3"):
      raise ValueError(f"unsupported rope_type {self.rope.rope_type!r} "
                       "(supported: default, linear, llama3)")

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
    unknown = sorted(k for k in cfg if k not in _INERT_KEYS)
    if unknown:
      raise ValueError(f"config.json has options this port does not implement: {unknown}")
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
    if model_type == "mistral":
      window = cfg.get("sliding_window")
    elif model_type == "qwen2" and cfg.get("use_sliding_window", False):
      raise ValueError("qwen2 with use_sliding_window=True is not supported")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
      if model_type != "mistral":
        raise ValueError(f"per-layer attention types {sorted(set(layer_types))} not supported")
    eos = cfg.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    bias = bool(cfg.get("attention_bias", False))
    return cls(
        vocab_size=cfg["vocab_size"], hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(cfg), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bias or model_type == "qwen2", o_bias=bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)), sliding_window=window,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        model_type=model_type, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos,
        dtype=dtype)

  def to_hf_config(self) -> dict[str, Any]:
    """The equivalent ``config.json`` dict (used to cache converted GGUF models)."""
    rope: dict[str, Any] = {"rope_theta": self.rope.theta, "rope_type": self.rope.rope_type}
    if self.rope.rope_type != "default":
      rope["factor"] = self.rope.factor
    if self.rope.rope_type == "llama3":
      rope.update(low_freq_factor=self.rope.low_freq_factor,
                  high_freq_factor=self.rope.high_freq_factor,
                  original_max_position_embeddings=self.rope.original_max_position_embeddings)
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
    if self.model_type == "mistral":
      out["sliding_window"] = self.sliding_window
    return out


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
  """Reads ``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling``."""
  params = dict(cfg.get("rope_parameters") or {})
  scaling = cfg.get("rope_scaling")
  if scaling:
    params.update(scaling)
  theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
  rope_type = params.pop("rope_type", params.pop("type", "default"))
  known = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
  extra = sorted(set(params) - known)
  if extra:
    raise ValueError(f"rope options {extra} are not supported (rope_type={rope_type!r})")
  if rope_type not in ("default", "linear", "llama3"):
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")
  kw = {k: params[k] for k in known if k in params}
  if rope_type == "default":
    kw = {}
  return RopeConfig(theta=theta, rope_type=rope_type,
                    **{k: (int(v) if k.startswith("original") else float(v))
                       for k, v in kw.items()})
