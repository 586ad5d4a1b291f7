"""llama.cpp's GGUF architectures: metadata -> the Hugging Face ``config.json`` it describes, and
llama.cpp tensor names -> Hugging Face names, one ``Arch`` per architecture.

What llama.cpp's converter (``convert_hf_to_gguf.py``) writes and its loader
(``llama-model.cpp``, per-architecture ``load_hparams``) assumes, as read here:

=========  ===================================================================================
llama      ``attn_norm``/``ffn_norm`` are ``input_layernorm``/``post_attention_layernorm``; Q/K
           rows permuted (undone by ``gguf_loader.unpermute_rows``); Llama-3.x's llama3 RoPE
           scaling as a ``rope_freqs`` tensor ``[D/2]`` of frequency divisors.
qwen2/3    llama's names, no permutation; Qwen2 q/k/v biases; Qwen3 ``attn_q_norm``/
           ``attn_k_norm``.
gemma2     four norms per layer: ``attn_norm`` (HF ``input_layernorm``), ``post_attention_norm``
           (``post_attention_layernorm``), ``ffn_norm`` (``pre_feedforward_layernorm``),
           ``post_ffw_norm`` (``post_feedforward_layernorm``); every RMSNorm weight stored as
           ``1 + w`` (the converter adds 1 to each ``*norm.weight``: Gemma's ``x * (1 + w)``),
           so 1 is subtracted on load; no ``output`` (tied). Local layers alternate from layer 0
           (llama.cpp's fixed pattern 2); ``attention.sliding_window`` (default 4096),
           ``attn_logit_softcapping`` (default 50) and ``final_logit_softcapping`` (default
           30): llama.cpp's defaults where a key is absent. No ``rope.freq_base`` is written:
           llama.cpp's 10000.
gemma3     gemma2's names and ``1 + w`` norms plus ``attn_q_norm``/``attn_k_norm`` (``1 + w``
           too); no attention soft-cap (refused); ``final_logit_softcapping`` optional.
           ``attention.sliding_window`` absent or 0: every layer global; else local layers by
           ``attention.sliding_window_pattern`` (a period ``p``, default 6: layer ``i`` local
           iff ``i % p < p - 1``; or one bool per layer), with their own unscaled RoPE of base
           ``rope.freq_base_swa`` (default 10000) beside the global layers' ``rope.freq_base``
           and ``rope.scaling`` (linear).
phi3       fused ``attn_qkv`` (rows ``[q | k | v]``) and ``ffn_up`` (rows ``[gate | up]``,
           llama.cpp's SwiGLU on the fused up projection) read as transformers' ``qkv_proj`` /
           ``gate_up_proj`` and split by ``hf_loader.split_fused``; LongRoPE as
           ``rope_factors_long``/``rope_factors_short`` tensors ``[D/2]`` with
           ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor``;
           ``attention.sliding_window`` 0 = none. (llama.cpp currently runs Phi-3 without its
           window; transformers applies it, and so does this port.)
=========  ===================================================================================

Gemma's softmax scale is not in the file: llama.cpp uses ``head_dim ** -0.5``, and
``(hidden / heads) ** -0.5`` for the 27B shapes (Gemma 2 with 46 layers, Gemma 3 with 62), as
Google's reference config does; that is read as ``query_pre_attn_scalar``.

Every ``{arch}.*`` metadata key must be one this module reads: an unknown key (a feature this
port would otherwise ignore) raises ``ValueError`` naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PROJ = {f"attn_{p}.weight": f"self_attn.{p}_proj.weight" for p in "qkv"}
_PROJ.update({"attn_output.weight": "self_attn.o_proj.weight",
              "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
              "ffn_down.weight": "mlp.down_proj.weight"})
_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight",
            "attn_k_norm.weight": "self_attn.k_norm.weight"}
_LLAMA_LAYER = {**_PROJ, **_QK_NORM, **{f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"},
                "attn_norm.weight": "input_layernorm.weight",
                "ffn_norm.weight": "post_attention_layernorm.weight"}
_GEMMA_LAYER = {**_PROJ, "attn_norm.weight": "input_layernorm.weight",
                "post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_PHI3_LAYER = {**{k: v for k, v in _PROJ.items() if not k.startswith("ffn_gate")},
               "attn_qkv.weight": "self_attn.qkv_proj.weight",
               "ffn_up.weight": "mlp.gate_up_proj.weight",
               "attn_norm.weight": "input_layernorm.weight",
               "ffn_norm.weight": "post_attention_layernorm.weight"}

ROPE_FREQS = "rope_freqs.weight"
ROPE_LONG, ROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
# Keys every architecture may carry (under its own prefix).
_COMMON_KEYS = frozenset({
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
    "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor"})


@dataclasses.dataclass(frozen=True)
class Arch:
  """One llama.cpp architecture.

  Attributes:
    model_type: the Hugging Face ``model_type`` it loads as.
    layer: llama.cpp per-layer tensor name (after ``blk.{i}.``) -> HF name (after
      ``model.layers.{i}.``).
    keys: metadata keys (after ``{arch}.``) read besides ``_COMMON_KEYS``.
    side_tensors: tensors that are RoPE data, not weights (read into the config).
    permuted: Q/K rows in llama.cpp's interleaved rotary order.
    norm_plus_one: RMSNorm weights stored as ``1 + w``.
  """

  model_type: str
  layer: dict
  keys: frozenset = frozenset()
  side_tensors: tuple = ()
  permuted: bool = False
  norm_plus_one: bool = False

  def hf_name(self, gguf_name: str) -> str:
    """llama.cpp tensor name -> Hugging Face name (raises on unknown names)."""
    if gguf_name in GLOBAL_NAMES:
      return GLOBAL_NAMES[gguf_name]
    blk, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if blk == "blk" and layer.isdigit() and suffix in self.layer:
      return f"model.layers.{layer}.{self.layer[suffix]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF equivalent in a "
                     f"{self.model_type} model")


_GEMMA_KEYS = frozenset({"attention.sliding_window", "final_logit_softcapping",
                         "attn_logit_softcapping"})
ARCHS = {
    "llama": Arch("llama", _LLAMA_LAYER, side_tensors=(ROPE_FREQS,), permuted=True),
    "qwen2": Arch("qwen2", _LLAMA_LAYER),
    "qwen3": Arch("qwen3", _LLAMA_LAYER),
    "gemma2": Arch("gemma2", _GEMMA_LAYER, _GEMMA_KEYS, norm_plus_one=True),
    "gemma3": Arch("gemma3_text", {**_GEMMA_LAYER, **_QK_NORM}, _GEMMA_KEYS | {
        "attention.sliding_window_pattern", "rope.freq_base_swa"}, norm_plus_one=True),
    "phi3": Arch("phi3", _PHI3_LAYER, frozenset({
        "attention.sliding_window", "rope.scaling.original_context_length",
        "rope.scaling.attn_factor"}), side_tensors=(ROPE_LONG, ROPE_SHORT)),
}
# llama.cpp's layer count of the 27B shapes, whose softmax scale is (hidden / heads) ** -0.5.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def arch_of(meta: dict) -> tuple[str, Arch]:
  """``(name, Arch)`` of the file's ``general.architecture`` (raises if unsupported)."""
  name = meta.get("general.architecture")
  if name not in ARCHS:
    raise ValueError(f"GGUF architecture {name!r} is not supported "
                     f"(supported: {', '.join(ARCHS)})")
  return name, ARCHS[name]


_REQUIRED = object()


def hf_config(meta: dict, names, side: dict) -> dict[str, Any]:
  """The ``config.json`` dict a GGUF file describes.

  Args:
    meta: the file's metadata (``gguf_file.read_metadata``).
    names: the file's tensor names (side tensors included or not).
    side: the file's side tensors (``Arch.side_tensors``) present, as float32 arrays.

  Raises:
    ValueError: an unsupported architecture, option or combination, an unknown
      ``{arch}.*`` key, or a missing required key.
  """
  arch, spec = arch_of(meta)
  known = _COMMON_KEYS | spec.keys

  def g(key, default=_REQUIRED):
    assert key in known, key
    full = f"{arch}.{key}"
    if full in meta:
      return meta[full]
    if default is _REQUIRED:
      raise ValueError(f"GGUF file lacks the required key {full!r}")
    return default

  heads = int(g("attention.head_count"))
  hidden = int(g("embedding_length"))
  head_dim = int(g("attention.key_length", hidden // heads))
  if int(g("attention.value_length", head_dim)) != head_dim:
    raise ValueError(f"{arch}.attention.value_length != key_length ({head_dim}) is not supported")
  if int(g("rope.dimension_count", head_dim)) != head_dim:
    raise ValueError("partial rotary embeddings are not supported")
  layers = int(g("block_count"))
  rope = {"rope_theta": float(g("rope.freq_base", 10000.0)), "rope_type": "default"}
  scaling = g("rope.scaling.type", "none")
  if scaling == "linear":
    rope.update(rope_type="linear", factor=float(g("rope.scaling.factor")))
  elif scaling not in ("none", None):
    raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
  eos = meta.get("tokenizer.ggml.eos_token_id")
  names = set(names)
  cfg = {
      "model_type": spec.model_type,
      "vocab_size": int(g("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
      "hidden_size": hidden, "intermediate_size": int(g("feed_forward_length")),
      "num_hidden_layers": layers, "num_attention_heads": heads,
      "num_key_value_heads": int(g("attention.head_count_kv", heads)), "head_dim": head_dim,
      "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
      "max_position_embeddings": int(g("context_length", 2048)),
      "tie_word_embeddings": "output.weight" not in names,
      "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
      "eos_token_id": None if eos is None else int(eos),
  }
  has_bias = "blk.0.attn_q.bias" in names
  if arch in ("llama", "qwen3"):
    cfg["attention_bias"] = has_bias
  elif arch == "qwen2" and not has_bias:
    raise ValueError("qwen2 GGUF without q/k/v biases")
  if ROPE_FREQS in side:
    rope["freq_factors"] = [float(f) for f in np.asarray(side[ROPE_FREQS]).reshape(-1)]
  if arch in _GEMMA_27B_LAYERS:
    cfg.update(_gemma(arch, g, rope, layers, hidden // heads if layers == _GEMMA_27B_LAYERS[arch]
                      else head_dim))
  elif arch == "phi3":
    cfg.update(_phi3(g, rope, side))
  else:
    cfg["rope_parameters"] = rope
  unknown = sorted(k for k in meta if k.startswith(f"{arch}.")
                   and k[len(arch) + 1:] not in known)
  if unknown:
    raise ValueError(f"GGUF metadata keys this port does not implement: {unknown}")
  return cfg


def _gemma(arch, g, rope, layers, scalar) -> dict[str, Any]:
  """Gemma 2 / 3's own config keys (see the module docstring)."""
  out = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar}
  final = g("final_logit_softcapping", 30.0 if arch == "gemma2" else None)
  out["final_logit_softcapping"] = float(final) if final else None
  if arch == "gemma2":
    window = int(g("attention.sliding_window", 4096))
    local = [i % 2 == 0 for i in range(layers)]
    out["attn_logit_softcapping"] = float(g("attn_logit_softcapping", 50.0))
    out["rope_parameters"] = rope
  else:
    cap = g("attn_logit_softcapping", None)  # ModelConfig refuses it on gemma3_text
    out["attn_logit_softcapping"] = None if cap is None else float(cap)
    window = int(g("attention.sliding_window", 0))
    pattern = g("attention.sliding_window_pattern", 6)
    if window <= 0:
      local = [False] * layers
    elif isinstance(pattern, (list, tuple)):
      if len(pattern) != layers:
        raise ValueError(f"gemma3.attention.sliding_window_pattern has {len(pattern)} entries "
                         f"for {layers} layers")
      local = [bool(p) for p in pattern]
    else:
      p = int(pattern)
      local = [p == 0 or i % p < p - 1 for i in range(layers)]
    swa = {"rope_theta": float(g("rope.freq_base_swa", 10000.0)), "rope_type": "default"}
    out["rope_parameters"] = {"full_attention": rope, "sliding_attention": swa}
  if window <= 0 and any(local):
    raise ValueError(f"{arch}.attention.sliding_window must be positive, got {window}")
  out["sliding_window"] = window if any(local) else None
  out["layer_types"] = ["sliding_attention" if x else "full_attention" for x in local]
  return out


def _phi3(g, rope, side) -> dict[str, Any]:
  """Phi-3's own config keys: window, LongRoPE from the factor tensors."""
  window = int(g("attention.sliding_window", 0))
  original = g("rope.scaling.original_context_length", None)
  attn = g("rope.scaling.attn_factor", None)
  out = {"sliding_window": window if window > 0 else None}
  if original is not None:
    out["original_max_position_embeddings"] = int(original)
  if (ROPE_LONG in side) != (ROPE_SHORT in side):
    raise ValueError("phi3 GGUF with only one of rope_factors_long / rope_factors_short")
  if ROPE_LONG in side:
    if rope["rope_type"] != "default" or original is None:
      raise ValueError("phi3 GGUF LongRoPE factors need rope.scaling.original_context_length "
                       "and no rope.scaling.type")
    rope = {**rope, "rope_type": "longrope", "original_max_position_embeddings": int(original),
            "long_factor": [float(f) for f in np.asarray(side[ROPE_LONG]).reshape(-1)],
            "short_factor": [float(f) for f in np.asarray(side[ROPE_SHORT]).reshape(-1)]}
    if attn is not None:
      rope["attention_factor"] = float(attn)
  elif attn is not None and float(attn) != 1.0:
    raise ValueError("phi3 GGUF with rope.scaling.attn_factor but no LongRoPE factors")
  out["rope_parameters"] = rope
  return out
