"""Writes a tiny transformers model as a llama.cpp-style GGUF (for loader tests).

Gemma 2 / 3 and Phi-3 files follow llama.cpp's converter (``convert_hf_to_gguf.py``:
``Gemma2Model``, ``Gemma3Model``, ``Phi3MiniModel``): tensor names from gguf-py's own
``TensorNameMap``, RMSNorm weights stored as ``1 + w`` for Gemma, no ``lm_head`` for Gemma, the
converter's metadata keys, Phi-3's LongRoPE factors as ``rope_factors_long`` / ``_short``.
"""

from __future__ import annotations

import json
import math
import os
import types

import gguf
import numpy as np
import safetensors.numpy

from models import tokenizer as tokenizer_lib

_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "self_attn.o_proj.weight": "attn_output.weight",
}
for _p in "qkv":
  for _s in ("weight", "bias"):
    _NAMES[f"self_attn.{_p}_proj.{_s}"] = f"attn_{_p}.{_s}"
_NAMES["self_attn.q_norm.weight"] = "attn_q_norm.weight"
_NAMES["self_attn.k_norm.weight"] = "attn_k_norm.weight"


def _permute(w, heads):
  """llama.cpp's converter: interleave each head's rotary halves."""
  d = w.shape[0] // heads
  return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
  """llama.cpp's ``rope_freqs`` ``[D/2]`` of a llama3-scaled config (``convert_hf_to_gguf.py``,
  ``LlamaModel.generate_extra_tensors``): 1 for high frequencies, ``factor`` for low ones, a
  smooth ramp between."""
  freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
  factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
  old = rope["original_max_position_embeddings"]
  out = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < old / high:
      out.append(1.0)
    elif wavelen > old / low:
      out.append(factor)
    else:
      smooth = (old / wavelen - low) / (high - low)
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.asarray(out, np.float32)


def write_gguf(hf_dir, path, arch: str = "llama", q8_mlp: bool = False) -> None:
  """Writes the transformers Llama/Qwen2/Qwen3/Gemma 2/Gemma 3/Phi-3 (``arch``: llama.cpp's
  name) saved in ``hf_dir`` (vocab >= 258) to ``path`` (read with ``safetensors.numpy``: no
  PyTorch in the test process); a llama3 rope scaling is written as a ``rope_freqs`` tensor, as
  llama.cpp's converter does."""
  with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
    cfg = types.SimpleNamespace(**json.load(f))
  rope = getattr(cfg, "rope_parameters", None) or {}
  rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' (rope.freq_base)
  theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
  head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(cfg.num_hidden_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_attention_heads)
  w.add_head_count_kv(cfg.num_key_value_heads)
  if arch != "gemma2" or theta != 10000.0:  # Gemma2Model writes no base: llama.cpp's 10000
    w.add_rope_freq_base(float(theta))
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_key_length(head_dim)
  w.add_value_length(head_dim)
  extra = _FAMILY_METADATA[arch](w, cfg, head_dim) if arch in _FAMILY_METADATA else {}
  for name, a in extra.items():
    w.add_tensor(name, a)
  if rope.get("rope_type") == "llama3":
    w.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, head_dim))
  tokens = sorted(tokenizer_lib._byte_alphabet()) + ["Ġt", "<|endoftext|>"]
  tokens += [f"<unused{i}>" for i in range(cfg.vocab_size - len(tokens))]
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("default")
  w.add_token_list(tokens)
  w.add_token_types([3 if t.startswith("<") else 1 for t in tokens])
  w.add_token_merges(["Ġ t"])
  w.add_eos_token_id(257)
  tensors = safetensors.numpy.load_file(os.path.join(hf_dir, "model.safetensors"))
  names = gguf.get_tensor_name_map(_FAMILIES[arch], cfg.num_hidden_layers) if (
      arch in _FAMILIES) else None
  for name, t in tensors.items():
    a = np.asarray(t, np.float32)
    if name == "lm_head.weight" and (getattr(cfg, "tie_word_embeddings", False)
                                     or arch.startswith("gemma")):
      continue
    if names is not None:  # llama.cpp's own HF -> GGUF table
      out = names.get_name(name, try_suffixes=(".weight", ".bias"))
      if arch.startswith("gemma") and name.endswith("norm.weight"):
        a = a + np.float32(1.0)  # Gemma*Model.modify_tensors: llama.cpp's norm is x * w
    elif name.startswith("model.layers."):
      i, rest = name[len("model.layers."):].split(".", 1)
      if arch == "llama" and rest.startswith("self_attn.q_proj"):
        a = _permute(a, cfg.num_attention_heads)
      elif arch == "llama" and rest.startswith("self_attn.k_proj"):
        a = _permute(a, cfg.num_key_value_heads)
      out = f"blk.{i}.{_NAMES[rest]}"
    else:
      out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}[name]
    if q8_mlp and "ffn_" in out and a.ndim == 2 and a.shape[-1] % 32 == 0:
      q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
      w.add_tensor(out, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
      w.add_tensor(out, np.ascontiguousarray(a, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


_FAMILIES = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3,
             "phi3": gguf.MODEL_ARCH.PHI3}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_metadata(w, cfg, head_dim, arch):
  """``Gemma2Model`` / ``Gemma3Model.set_gguf_parameters``, plus the keys llama.cpp reads for
  what the converter leaves at llama.cpp's defaults (Gemma 3's pattern 6, local base 10000)."""
  big = cfg.num_hidden_layers == _GEMMA_27B_LAYERS[arch]
  implied = cfg.hidden_size // cfg.num_attention_heads if big else head_dim
  if cfg.query_pre_attn_scalar != implied:
    raise ValueError(f"llama.cpp implies query_pre_attn_scalar={implied}, the checkpoint has "
                     f"{cfg.query_pre_attn_scalar}: not expressible in a GGUF")
  local = [t == "sliding_attention" for t in cfg.layer_types]
  if arch == "gemma2":
    assert local == [i % 2 == 0 for i in range(len(local))], "llama.cpp's fixed pattern 2"
    w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)
    return {}
  if cfg.final_logit_softcapping:
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
  full = cfg.rope_parameters["full_attention"]
  if full.get("rope_type") == "linear":
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(full["factor"])
  if any(local):
    w.add_sliding_window(cfg.sliding_window)
    period = next((p for p in range(1, len(local) + 2)
                   if local == [i % p < p - 1 for i in range(len(local))]), None)
    if period != 6:
      w.add_sliding_window_pattern(local if period is None else period)
    base = cfg.rope_parameters["sliding_attention"]["rope_theta"]
    if base != 10000.0:
      w.add_rope_freq_base_swa(base)
  return {}


def _phi3_metadata(w, cfg, head_dim):
  """``Phi3MiniModel.set_gguf_parameters`` / ``generate_extra_tensors``: the LongRoPE factor
  tensors and attention factor."""
  orig = cfg.original_max_position_embeddings
  w.add_rope_scaling_orig_ctx_len(orig)
  w.add_rope_dimension_count(head_dim)
  w.add_sliding_window(cfg.sliding_window or 0)
  rope = cfg.rope_parameters
  if rope.get("rope_type") != "longrope":
    return {}
  scale = cfg.max_position_embeddings / orig
  w.add_rope_scaling_attn_factors(
      math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
  return {"rope_factors_long.weight": np.asarray(rope["long_factor"], np.float32),
          "rope_factors_short.weight": np.asarray(rope["short_factor"], np.float32)}


_FAMILY_METADATA = {"gemma2": lambda w, c, d: _gemma_metadata(w, c, d, "gemma2"),
                    "gemma3": lambda w, c, d: _gemma_metadata(w, c, d, "gemma3"),
                    "phi3": _phi3_metadata}
