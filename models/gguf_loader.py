"""GGUF (llama.cpp) checkpoints -> HF-named float32 tensors, config and tokenizer.

Tensors are dequantised with ``gguf.quants.dequantize`` (Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K/...,
F16/F32), renamed to Hugging Face names and handed to ``hf_loader.convert_state_dict``, so a
GGUF takes the same path as a safetensors checkpoint.

llama.cpp's converter permutes the rows of Llama's Q and K projections so each head's two
rotary halves are interleaved (``convert_hf_to_gguf.py``, ``LlamaModel.permute``); we invert it
to get back Hugging Face's half-split layout. Qwen2 and Qwen3 files are written without the
permutation.

Llama-3.x files carry their llama3 RoPE scaling as a ``rope_freqs`` tensor ``[D/2]``: per
frequency, the divisor llama.cpp applies to ``theta^(-2i/D)`` (``ggml_rope_ext``'s
``freq_factors``; ``LlamaModel.generate_extra_tensors`` computes it from the HF config's
``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``). It
becomes ``RopeConfig.freq_factors``, so the file's own numbers are used.
"""

from __future__ import annotations

import os
import re

import numpy as np

from models import hf_loader
from models import tokenizer as tokenizer_lib
from models.config import ModelConfig

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
for _p in "qkv":
  for _s in ("weight", "bias"):
    _LAYER[f"attn_{_p}.{_s}"] = f"self_attn.{_p}_proj.{_s}"
_LAYER["attn_output.weight"] = "self_attn.o_proj.weight"
_LAYER["attn_q_norm.weight"] = "self_attn.q_norm.weight"
_LAYER["attn_k_norm.weight"] = "self_attn.k_norm.weight"
_PERMUTED_ARCHS = ("llama",)
_SUPPORTED_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
ROPE_FREQS = "rope_freqs.weight"


def hf_name(gguf_name: str) -> str:
  """llama.cpp tensor name -> Hugging Face name (raises on unknown names)."""
  if gguf_name in _GLOBAL:
    return _GLOBAL[gguf_name]
  m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
  if m and m.group(2) in _LAYER:
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
  raise hf_loader.CheckpointError(f"GGUF tensor {gguf_name!r} has no known HF equivalent")


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverts llama.cpp's Q/K row permutation.

  Args:
    w: ``[n_heads * D, ...]`` projection rows (or a bias ``[n_heads * D]``) in llama.cpp order:
      within a head, rotary pairs interleaved ``(x0, y0, x1, y1, ...)``.
    n_heads: query heads for Q, kv heads for K.

  Returns:
    The rows in half-split order ``(x0, x1, ..., y0, y1, ...)`` per head.
  """
  d = w.shape[0] // n_heads
  rest = w.shape[1:]
  return w.reshape(n_heads, d // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def read_metadata(reader) -> dict:
  """All key/value fields of a ``gguf.GGUFReader`` as Python values."""
  out = {}
  for key, field in reader.fields.items():
    if key.startswith("GGUF."):
      continue
    out[key] = field.contents()
  return out


def config_from_metadata(meta: dict, has_output: bool, has_qkv_bias: bool,
                         dtype: str = "float32", rope_freqs=None) -> ModelConfig:
  """The ``ModelConfig`` a GGUF file describes (raises on unsupported architectures).

  ``rope_freqs``: the file's ``rope_freqs`` tensor ``[D/2]`` (RoPE frequency divisors), or None.
  """
  arch = meta.get("general.architecture")
  if arch not in _SUPPORTED_ARCHS:
    raise ValueError(f"GGUF architecture {arch!r} is not supported "
                     f"(supported: {', '.join(_SUPPORTED_ARCHS)})")
  g = lambda k, default=None: meta.get(f"{arch}.{k}", default)
  heads = int(g("attention.head_count"))
  hidden = int(g("embedding_length"))
  head_dim = int(g("attention.key_length", hidden // heads))
  if int(g("rope.dimension_count", head_dim)) != head_dim:
    raise ValueError("partial rotary embeddings are not supported")
  rope = {"rope_theta": float(g("rope.freq_base", 10000.0)), "rope_type": "default"}
  scaling = g("rope.scaling.type", "none")
  if scaling == "linear":
    rope.update(rope_type="linear", factor=float(g("rope.scaling.factor")))
  elif scaling not in ("none", None):
    raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
  if rope_freqs is not None:
    rope["freq_factors"] = [float(f) for f in np.asarray(rope_freqs).reshape(-1)]
  vocab = int(g("vocab_size", len(meta["tokenizer.ggml.tokens"])))
  eos = meta.get("tokenizer.ggml.eos_token_id")
  cfg = {
      "model_type": _SUPPORTED_ARCHS[arch], "vocab_size": vocab, "hidden_size": hidden,
      "intermediate_size": int(g("feed_forward_length")),
      "num_hidden_layers": int(g("block_count")), "num_attention_heads": heads,
      "num_key_value_heads": int(g("attention.head_count_kv", heads)), "head_dim": head_dim,
      "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")), "rope_parameters": rope,
      "max_position_embeddings": int(g("context_length", 2048)),
      "tie_word_embeddings": not has_output,
      "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
      "eos_token_id": None if eos is None else int(eos),
  }
  if arch in ("llama", "qwen3"):
    cfg["attention_bias"] = has_qkv_bias
  elif not has_qkv_bias:
    raise ValueError("qwen2 GGUF without q/k/v biases")
  return ModelConfig.from_hf_config(cfg, dtype=dtype)


def load_gguf(path: str, dtype: str = "float32"):
  """Reads a GGUF file.

  Returns:
    ``(config, params, tokenizer)`` with numpy params (float32 unless ``dtype`` says otherwise).
  """
  import gguf
  from gguf import quants

  if not os.path.exists(path):
    raise FileNotFoundError(f"GGUF file {path} does not exist")
  reader = gguf.GGUFReader(path)
  meta = read_metadata(reader)
  by_name = {t.name: t for t in reader.tensors}
  freqs = by_name.pop(ROPE_FREQS, None)
  if freqs is not None:
    freqs = quants.dequantize(freqs.data, freqs.tensor_type).astype(np.float32)
  config = config_from_metadata(meta, "output.weight" in by_name,
                                "blk.0.attn_q.bias" in by_name, dtype, freqs)
  hf_to_gguf = {hf_name(n): n for n in by_name}
  permute = meta["general.architecture"] in _PERMUTED_ARCHS

  def get(name):
    t = by_name[hf_to_gguf[name]]
    # [out, in] (numpy order of GGUF dims), float32
    w = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    w = w.reshape(tuple(int(x) for x in reversed(t.shape)))
    if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
      w = unpermute_rows(w, config.num_heads)
    elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
      w = unpermute_rows(w, config.num_kv_heads)
    return w

  params = hf_loader.convert_state_dict(config, get, list(hf_to_gguf))
  tok = tokenizer_lib.from_gguf_metadata(meta)
  return config, params, tok
