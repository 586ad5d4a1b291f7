"""Writes a tiny transformers model as a llama.cpp-style GGUF (for loader tests)."""

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
  """Writes the transformers Llama/Qwen2/Qwen3 saved in ``hf_dir`` (vocab >= 258) to ``path``
  (read with ``safetensors.numpy``: no PyTorch in the test process); a llama3 rope scaling is
  written as a ``rope_freqs`` tensor, as llama.cpp's converter does."""
  with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
    cfg = types.SimpleNamespace(**json.load(f))
  rope = getattr(cfg, "rope_parameters", None) or {}
  theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
  head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(cfg.num_hidden_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_attention_heads)
  w.add_head_count_kv(cfg.num_key_value_heads)
  w.add_rope_freq_base(float(theta))
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_key_length(head_dim)
  w.add_value_length(head_dim)
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
  for name, t in tensors.items():
    a = np.asarray(t, np.float32)
    if name == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
      continue
    if name.startswith("model.layers."):
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
